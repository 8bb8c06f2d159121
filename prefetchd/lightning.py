"""``prefetchd.lightning.BufferDataModule``: the LightningDataModule over prefetchd buffers.

It lives with the rest of the consumer side in ``prefetchd.trainer.lightning``; this name is the
short one users import.  Needs the ``lightning`` package (``pip install 'prefetchd[lightning]'``).
"""

from prefetchd.trainer.lightning import BufferDataModule

__all__ = ["BufferDataModule"]
