"""Errors the trainer side raises when the buffer does not deliver, or a checkpoint does not fit.

A run that cannot start as configured raises :class:`SetupError`.
A malformed file in the buffer is the protocol's business and raises
:class:`prefetchd.buffer_protocol.ProtocolError`; the loader errors are about
waiting: the daemon is slow, stuck or gone.  Every message names the buffer
(or checkpoint), what was waited for or found, and the command that fixes it.
"""

from __future__ import annotations


class LoaderError(RuntimeError):
    """The buffer loader cannot deliver the batch the trainer needs."""


class LoaderTimeout(LoaderError, TimeoutError):
    """A bounded wait (for the manifest or a batch) ran out."""


class DaemonGone(LoaderError):
    """No daemon owns the buffer and the batch the trainer needs is not there."""


class DaemonStuck(LoaderError):
    """A daemon owns the buffer but has not written its heartbeat for longer than the loader's ``stall_timeout``."""


class DaemonRestartsExhausted(LoaderError):
    """``prefetchd-train --spawn-daemon`` restarted a dead or stuck daemon as often as allowed, and it failed again."""


class JobReplaced(LoaderError):
    """The daemon now serves another job on the loader's buffer (``prefetchd submit --replace``): the
    batches there are not this loader's job's; or the same job for other ``--epochs``, whose end is not
    this loader's.  It names who submitted the job now served, where the daemon's status.json says
    (``running_job``): a job the daemon was started with has no submitter."""


class JobEnded(LoaderError):
    """The daemon is done with the loader's job (it finished it, or stopped producing it) and waits for another:
    the batch the trainer needs will not be built unless the job is submitted again."""


class StateMismatch(LoaderError, ValueError):
    """A loader state (from a checkpoint) does not fit the buffer's job."""


class SetupError(ValueError):
    """The run cannot start as configured: the model, device, environment or the buffers' jobs do not fit.

    ``prefetchd-train`` reports it as ``Error: <message>`` with exit code 1 (EXIT_FAILED)."""


class NoAccess(SetupError):
    """This user may not read a buffer (a --group-access buffer of a group it is not in, say), or a
    :class:`BufferLoader` may not write its progress file in the stream folder it reads (another user's buffer it
    may only read, a read-only mount), raised when the loader is made; the message says whose it is and what to
    do.  ``prefetchd-train`` exits 4 (EXIT_NO_ACCESS), as `prefetchd status` and `show` do.  The same lost
    mid-run is :class:`AccessLost`."""


class AccessLost(NoAccess, LoaderError):
    """A :class:`BufferLoader` lost the right to write its progress file mid-run (the buffer's group lost its write
    bit, the folder was made read-only) and its writes kept failing for ``PROGRESS_WRITE_GRACE`` seconds.  A
    ``NoAccess``, as at the start (``prefetchd-train`` exits 4); a ``LoaderError`` too, raised where the loader
    gives a batch or waits for one, so ``prefetchd-train`` saves the last step's checkpoint first, as for the
    loader's other errors.  The progress file keeps the last position written: the daemon goes by it."""


class OptionError(SetupError):
    """An option's value is refused (an unknown --model, --device cuda without CUDA), or the options contradict
    each other or miss one another; ``prefetchd-train`` shows its usage, exit code 2, as click does for a bad flag."""


class StopRequested(Exception):
    """A wait for a batch ended because the run was asked to stop (``prefetchd-train``'s first SIGTERM).

    Raised between steps, before the batch is handed over: the loader's position is unchanged."""


class PeerFailed(RuntimeError):
    """Under torchrun another rank left (it failed, with its own message) while this one waited on it."""


class CheckpointError(ValueError):
    """A ``prefetchd-train`` checkpoint is unreadable, of another format, or does not fit the run."""


__all__ = [
    "AccessLost", "CheckpointError", "DaemonGone", "DaemonRestartsExhausted", "DaemonStuck", "JobEnded", "JobReplaced",
    "LoaderError",
    "LoaderTimeout",
    "NoAccess", "OptionError", "PeerFailed", "SetupError", "StateMismatch", "StopRequested",
]
