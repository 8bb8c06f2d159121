"""The consumer side: map the daemon's batch files and hand them to the trainer.

``BufferLoader`` (in ``loader``) is the reader; ``command`` is the ``prefetchd-train`` command line and
``train`` the reference trainer behind it (its rooms: ``config``,
``preflight``, ``engine``, ``passes``, ``model``, ``checkpoint``, ``spawn``, ``report``, ``ranks``,
``rank_store``, ``collective``).

The names below import their modules when first used: ``loader`` and the rank modules import torch
(~1.5 s), which ``prefetchd-train --help`` and its usage errors (``command``) have no use for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from prefetchd.trainer.errors import (
    AccessLost, CheckpointError, DaemonGone, DaemonStuck, JobEnded, JobReplaced, LoaderError, LoaderTimeout, NoAccess,
    OptionError, SetupError, StateMismatch,
)

if TYPE_CHECKING:
    from prefetchd.trainer.loader import Batch, BufferLoader
    from prefetchd.trainer.rank_state import EveryRank
    from prefetchd.trainer.ranks import rank_stream

_LAZY = {"Batch": "loader", "BufferLoader": "loader", "EveryRank": "rank_state", "rank_stream": "ranks"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


__all__ = [
    "AccessLost", "Batch", "BufferLoader", "CheckpointError", "DaemonGone", "DaemonStuck", "EveryRank", "JobEnded",
    "JobReplaced", "LoaderError", "LoaderTimeout", "NoAccess", "OptionError", "SetupError", "StateMismatch",
    "rank_stream",
]
