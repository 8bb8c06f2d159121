"""Telling a loader that the daemon has replaced its job (:class:`JobWatch`), and who did (:func:`submitted_by`)."""

from __future__ import annotations

import os
from pathlib import Path

from prefetchd.access import user_name
from prefetchd.buffer_protocol import Manifest, ProtocolError, readable_status
from prefetchd.buffer_protocol.layout import MANIFEST_NAME, STREAM_PREFIX, owning_buffer
from prefetchd.trainer.daemon_status import served_world
from prefetchd.trainer.errors import JobReplaced
from prefetchd.trainer.job_command import job_command
from prefetchd.words import epochs_flag, moment


class JobWatch:
    """Tells a loader when the daemon has replaced its job (``prefetchd submit --replace``).

    The manifest is rewritten by rename when a job starts, so a change of its inode or mtime
    is what is looked for: one ``stat`` per batch.  A daemon restarted on the same job writes
    a manifest of the same identity, which passes.  The look comes after a batch is mapped: the
    daemon writes the new job's manifest before any of its batches, so a batch mapped before a
    look that finds the old job is the old job's."""

    def __init__(self, buffer: Path, manifest: Manifest) -> None:
        self.buffer = buffer
        self.manifest = manifest
        self._seen: tuple[int, int] | None = None  # the first look reads the file: it may have changed since
        # Whether the job's daemon names the stream in its batches (``Manifest.keyed_batches``), as the manifest
        # last read says: a daemon of another prefetchd restarted on the job may write it otherwise.
        self.keyed = manifest.keyed_batches

    def check(self) -> None:
        path = self.buffer / MANIFEST_NAME
        try:
            st = os.stat(path)
        except OSError:  # being replaced (the daemon clears before it writes), or gone with the daemon
            self._check_world()
            return
        if (st.st_ino, st.st_mtime_ns) == self._seen:
            return
        try:
            current = Manifest.read(self.buffer)
        except (ProtocolError, OSError):
            return  # half-replaced or damaged: the next look decides
        diff = current.identity_diff(self.manifest)
        # An end before this loader's: it would read on past it and wait out its timeout for a batch the daemon,
        # done, never writes.  A later one costs this loader nothing: it ends where its trainer counted on.
        earlier = current.epochs is not None and (self.manifest.epochs is None or current.epochs < self.manifest.epochs)
        again = job_command(self.manifest, self.buffer, "submit") if diff or earlier else ""
        who = submitted_by(self.buffer) if diff or earlier else None
        if diff:
            ends = ([f"epochs: {self.manifest.epochs!r} -> {current.epochs!r}"]
                    if current.epochs != self.manifest.epochs else [])
            replaced = (f"{who[0]} replaced this loader's job ({who[1]})" if who is not None else
                        "someone replaced this loader's job (`prefetchd submit --replace`, or a daemon started with "
                        "--reset)")
            raise JobReplaced(
                f"{self.buffer}: the daemon now serves another job ({'; '.join(diff + ends)}): {replaced}, so the "
                f"batches there are not its own. Start the trainer again for the new job, or submit this one again "
                f"(`{again} --replace`)"
            )
        if earlier:
            # Not the job's identity: its batches stay, and the daemon goes on from this loader's position, to the
            # new end, which comes before this loader's.
            again_by = (f"{who[0]} submitted it again ({who[1]})" if who is not None else
                        "someone submitted it again (`prefetchd submit --replace`) or restarted its daemon so")
            raise JobReplaced(
                f"{self.buffer}: the daemon now serves this loader's job with {epochs_flag(current.epochs)} (this "
                f"loader's had {epochs_flag(self.manifest.epochs)}): {again_by}. Its batches are this job's, kept, "
                "but the daemon ends before this loader does, which would wait for batches never built. To stop at "
                "the new end, start the trainer again from its checkpoint with the new --epochs (the daemon goes on "
                "from its position); "
                f"to keep the old end, submit the job again (`{again} --replace`)"
            )
        self.keyed = current.keyed_batches
        self._seen = (st.st_ino, st.st_mtime_ns)

    def _check_world(self) -> None:
        """A stream without a manifest: a job of another world size took the buffer (its daemon removed
        this rank's stream, or the single-rank job's manifest for the new job's per-rank streams), or
        the stream is being set up again.  Only the first is an error."""
        buffer = owning_buffer(self.buffer)
        try:
            served = served_world(buffer)
        except ProtocolError:
            return  # damaged: the next look decides
        if served is not None and served[0] != self.manifest.world_size:
            removed = ("removed this rank's stream" if buffer != self.buffer else
                       f"keeps one stream per rank in {STREAM_PREFIX}NNNNN directories there")
            who = submitted_by(buffer)
            by = f", which {who[0]} submitted ({who[1]})" if who is not None else ""
            raise JobReplaced(
                f"{self.buffer}: the daemon now serves another job, for --world-size {served[0]} (this loader's "
                f"was {self.manifest.world_size}){by}, and {removed}. Start the trainer again "
                f"for the new job, or submit this one again (`{job_command(self.manifest, self.buffer, 'submit')} "
                "--replace`)"
            )


def submitted_by(buffer: Path) -> tuple[str, str] | None:
    """Who submitted the job the daemon of ``buffer`` (or of its rank's stream) runs now, as its status.json says
    (``running_job``), and which: ("alice (uid 1001)", "job 0123456789ab, submitted 2025-03-01 14:02:07").  None
    where it does not say: the job it was started with, a daemon of an earlier build, a status that cannot be
    read.  The daemon writes it before the manifests of a job that starts, so a loader those stop reads it."""
    status = readable_status(buffer)
    job = status.running_job if status is not None else None
    if job is None or job.submitter is None:
        return None
    return user_name(job.submitter), f"job {job.job_id}, submitted {moment(job.submitted)}"


__all__ = ["JobWatch", "submitted_by"]
