"""The consumer side: map the daemon's batch files and hand them to the trainer.

``BufferLoader`` (in ``loader``) is the reader; ``train`` is the reference trainer
behind the ``prefetchd-train`` command.
"""

from prefetchd.trainer.errors import CheckpointError, DaemonGone, DaemonStuck, LoaderError, LoaderTimeout, StateMismatch
from prefetchd.trainer.loader import Batch, BufferLoader
from prefetchd.trainer.rank_state import EveryRank
from prefetchd.trainer.ranks import rank_stream

__all__ = ["Batch", "BufferLoader", "EveryRank", "CheckpointError", "DaemonGone", "DaemonStuck", "LoaderError", "LoaderTimeout", "StateMismatch", "rank_stream"]
