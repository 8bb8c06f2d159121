"""The daemon of a loader's buffer, as the loader's messages tell of it.

Whether a daemon owns the buffer is ``daemon_owner``'s to say, also of one in
another pid namespace (another container sharing the tmpfs), whose heartbeat
counts the same; :func:`owner_status` reads it with the status last written
there.  :func:`status_summary` is the daemon's own account of itself from
status.json, which every wait message carries.  :func:`unserved_rank` and
:func:`check_served` tell a rank the daemon does not produce, :func:`served_world`
the world size it produces for.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefetchd.buffer_protocol import (
    Manifest,
    ProtocolError,
    State,
    Status,
    DaemonOwner,
    daemon_owner,
    read_status,
    readable_status,
)
from prefetchd.buffer_protocol.layout import MANIFEST_NAME, STREAM_PREFIX, owning_buffer
from prefetchd.trainer.errors import LoaderError
from prefetchd.words import counted, rank_ranges


def owner_status(buffer: Path) -> tuple[DaemonOwner | None, Status | None]:
    """The live daemon owning ``buffer`` (a rank's stream: its parent's), and the status last written
    there; None for either that is not there (or, for the status, cannot be read)."""
    status = readable_status(buffer)
    return daemon_owner(buffer, status), status


def check_served(stream: Path, owner: DaemonOwner | None, status: Status | None) -> None:
    """LoaderError where the daemon holding ``stream``'s buffer does not produce it (``unserved_rank``)."""
    unserved = unserved_rank(stream, owner, status)
    if unserved is not None:
        raise LoaderError(f"{unserved}: restart it with --ranks that include this rank")


def unserved_rank(stream: Path, owner: DaemonOwner | None, status: Status | None) -> str | None:
    """Why ``stream``, a rank's stream directory, gets no manifest: the daemon holding its buffer
    (``owner_status``: ``owner`` and ``status``) produces other ranks, says its status, and no other daemon
    can produce this one there while it runs.  None when it does produce it, or while that is not known
    (no daemon, no job yet, a flat buffer)."""
    buffer = owning_buffer(stream)
    if (buffer == stream or owner is None or status is None or not owner.wrote(status) or status.production is None
            or not status.production.streams):
        return None  # starting, or serving no job yet
    rank = int(stream.name.removeprefix(STREAM_PREFIX))
    served = [s.rank for s in status.production.streams]
    if rank in served:
        return None
    produces = f"{'rank' if len(served) == 1 else 'ranks'} {rank_ranges(served)}"
    return (f"the daemon of {buffer} ({owner}) produces {produces}, not rank {rank}, so {stream} "
            "gets no manifest while it runs: every rank of a box reads the box's one daemon")



def served_world(buffer: Path) -> tuple[int, Path] | None:
    """The world size the buffer's daemon produces for, with the manifest that says so; None before any."""
    candidates = [buffer / MANIFEST_NAME]
    try:
        candidates += sorted(d / MANIFEST_NAME for d in buffer.glob(f"{STREAM_PREFIX}*") if d.is_dir())
    except OSError:
        pass
    for path in candidates:
        try:
            return Manifest.read(path.parent).world_size, path
        except (FileNotFoundError, NotADirectoryError):
            continue
    return None


def status_summary(buffer: Path, rank: int | None = None) -> str:
    """The daemon's own account of itself from status.json, for wait messages; ``rank``: the waiting loader's,
    whose batches' builds the daemon may say wait for the dataset's storage (None: any rank's)."""
    try:
        status = read_status(buffer)
    except (ProtocolError, OSError) as exc:
        return f"its status.json is unreadable ({exc})"
    if status is None:
        return "the daemon has written no status.json"
    return "daemon status: " + ", ".join(_summary_parts(status, rank))


def _summary_parts(status: Status, rank: int | None = None) -> list[str]:
    parts = [f"state={short(status.state)}"]
    p = status.production
    wait = p.storage_wait if p is not None else None
    since = (wait.since if rank is None else wait.since_of(rank)) if wait is not None else None
    said: set[str] = set()  # the storage's failure and a stalled worker's note, where said
    if wait is not None and since is not None and status.state != State.FAILED:
        # Said before the errors: the failed builds it counts are then the storage's, not a full tmpfs.  Not of a
        # failed daemon, which resumes nothing: its DaemonGone said it would (an S3 walk; as the stall below).
        whose = f" of rank {rank}'s batches" if rank is not None and p is not None and len(p.streams) > 1 else ""
        said.add(wait.reason)
        parts.append(f"its builds{whose} have waited {max(0.0, time.time() - since):.0f} s for the dataset's "
                     f"storage and resume once it is back ({short(wait.reason)})")
    stall = p.worker_stall if p is not None else None
    if stall is not None and status.state != State.FAILED:
        # Said before the message, which carries the same words last: the bound and its option come first.
        bound, what = (("--worker-start-timeout", "not got ready") if stall.starting else
                       ("--task-timeout", "made no progress"))
        parts.append(f"a worker of it has {what} for {max(0.0, time.time() - stall.since):.0f} s and is killed at "
                     f"its {bound} of {stall.timeout:g} s, its tasks built on another ({short(stall.reason)})")
        said.add(stall.reason)
    if status.message and status.message not in said:
        # A failed daemon's message is why it stopped and what to do, the whole of which the reader needs.
        parts.append(f"message={short(status.message, FAILED_MESSAGE_LIMIT if status.state == State.FAILED else 300)}")
    if p is not None:
        parts.append(f"it sees progress epoch {p.progress.epoch} step {p.progress.step}")
        ranks = f" for its {len(p.streams)} ranks together" if len(p.streams) > 1 else ""
        parts.append(f"{counted(p.waiting, 'batch')} waiting (high water {p.high_water}{ranks})")
        e = p.errors
        # Only what went wrong: zero counters and empty fields are noise in an error message.
        bad = {
            "replaced_samples": e.replaced_samples, "undecodable_files": e.undecodable_files,
            "undecodable": [f"{b.path}: {b.reason}" for b in e.undecodable], "worker_restarts": e.worker_restarts,
            "worker_hangs": e.worker_hangs,
            "write_failures": e.write_failures, "progress_file": e.progress_file,
        }
        shown = {k: v for k, v in bad.items() if v}
        if shown:
            parts.append("errors: " + ", ".join(f"{k}={short(v)}{_MEANING.get(k, '')}" for k, v in shown.items()))
    parts.append(f"last heartbeat {max(0.0, time.time() - status.heartbeat):.1f} s ago")
    return parts


# status.json is the daemon's own (read_status checks its owner), and one document: a failed daemon's message, its
# verdict with the file, the option and the command to run (600 characters and more), is shown whole up to this.
FAILED_MESSAGE_LIMIT = 4000
# What a counter's name does not say: write_failures counts failed reads of the dataset too.
_MEANING = {"write_failures": " (builds retried: a failed write of the batch, or a failed read of the dataset)"}


def short(value: object, limit: int = 300) -> str:
    """``value`` as text, cut at a word before ``limit`` characters (status.json is written by others)."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 4].rsplit(" ", 1)[0] + " ..."


__all__ = ["check_served", "owner_status", "served_world", "short", "status_summary", "unserved_rank"]
