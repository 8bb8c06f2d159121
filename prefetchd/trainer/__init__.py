"""The consumer side: map the daemon's batch files and hand them to the trainer.

``BufferLoader`` (in ``loader``) is the reader; ``train`` is the entry point of the
reference trainer behind the ``prefetchd-train`` command (its rooms: ``config``,
``preflight``, ``engine``, ``passes``, ``model``, ``checkpoint``, ``spawn``, ``report``, ``ranks``,
``rank_store``, ``collective``).
"""

from prefetchd.trainer.errors import (
    AccessLost, CheckpointError, DaemonGone, DaemonStuck, JobEnded, JobReplaced, LoaderError, LoaderTimeout, NoAccess,
    OptionError, SetupError, StateMismatch,
)
from prefetchd.trainer.loader import Batch, BufferLoader
from prefetchd.trainer.rank_state import EveryRank
from prefetchd.trainer.ranks import rank_stream

__all__ = [
    "AccessLost", "Batch", "BufferLoader", "CheckpointError", "DaemonGone", "DaemonStuck", "EveryRank", "JobEnded",
    "JobReplaced", "LoaderError", "LoaderTimeout", "NoAccess", "OptionError", "SetupError", "StateMismatch",
    "rank_stream",
]
