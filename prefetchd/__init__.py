"""prefetchd: a background preprocessing daemon that feeds image-training GPUs from a RAM-disk buffer."""

__version__ = "0.1.0"
