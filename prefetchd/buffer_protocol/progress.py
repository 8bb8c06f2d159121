"""progress.json (progress.NAME.json for a named consumer): the next position a consumer needs, which its
trainer rewrites and the daemon reads (``Progress``); and this process's pid namespace, which a writer
records beside its pid (``pid_namespace``)."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefetchd.buffer_protocol.batch import VERSION
from prefetchd.buffer_protocol.errors import ProtocolError, shown
from prefetchd.buffer_protocol.json_files import checked_field, read_optional, write_json
from prefetchd.buffer_protocol.layout import DEFAULT_CONSUMER, TRAINER_FILE_MODE, Dir, progress_name


# A consumer waiting for a batch rewrites its progress file this often (same position, new
# time), so that a daemon tells a waiting consumer from a silent one (--consumer-timeout).
PROGRESS_REFRESH_SECONDS = 2.0


@dataclass(frozen=True, order=True)
class Progress:
    """The next (epoch, step) a consumer (trainer) needs; everything before it is consumed.

    ``wait_share`` (optional) is the fraction of the trainer's recent time spent
    waiting for batches, which the daemon reports as whether the GPU is fed.
    ``pid`` and ``time`` say which process wrote it and when (``write`` fills them
    in); the daemon tells from them whether the trainer is still there.  ``closed``:
    the consumer left (``BufferLoader.close``) and holds no batches while another
    reads, until it writes again.  ``job``: the ``Manifest.job_key`` of the job the position is in (None
    from writers that predate it); the daemon ignores a position in another job.
    ``read_batches``: the batches its writer consumed by reading them since its loader was made (a move by
    ``load_state_dict`` or ``set_epoch`` adds none), so that the daemon counts a jump over batches as no
    consumption (None from writers that predate it: the daemon counts every move forward).
    ``pid_namespace``: the writer's pid namespace (``pid_namespace()``, filled in by ``write``; None from
    writers that predate it or cannot read it), which says whether ``pid`` means anything to a reader.
    ``locked``: the writer holds the consumer's lock file (SPEC rule 9), by which a reader in another pid
    namespace tells whether it is still there (``ownership.writer_alive``).
    ``consumer`` picks the file (see :func:`progress_name`).
    """

    epoch: int
    step: int
    wait_share: float | None = field(default=None, compare=False)
    pid: int | None = field(default=None, compare=False)
    time: float | None = field(default=None, compare=False)
    closed: bool = field(default=False, compare=False)
    job: str | None = field(default=None, compare=False)
    read_batches: int | None = field(default=None, compare=False)
    pid_namespace: int | None = field(default=None, compare=False)
    locked: bool = field(default=False, compare=False)

    def write(self, buffer: Dir, consumer: str = DEFAULT_CONSUMER) -> Progress:
        """Replace the consumer's progress file with this position; the document as written (``pid``, ``time``
        and ``pid_namespace`` filled in), by which its writer tells that file from one written since."""
        written = dataclasses.replace(self, pid=os.getpid(), time=time.time(), pid_namespace=pid_namespace())
        doc: dict[str, Any] = {"format": "prefetchd.progress", "version": VERSION, "epoch": self.epoch,
                               "step": self.step, "pid": written.pid, "time": written.time}
        if written.pid_namespace is not None:
            doc["pid_namespace"] = written.pid_namespace
        if self.locked:
            doc["locked"] = True
        if self.wait_share is not None:
            doc["wait_share"] = round(self.wait_share, 4)
        if self.closed:
            doc["closed"] = True
        if self.job is not None:
            doc["job"] = self.job
        if self.read_batches is not None:
            doc["read_batches"] = self.read_batches
        write_json(Path(buffer) / progress_name(consumer), doc, mode=TRAINER_FILE_MODE)
        return written

    @classmethod
    def read(cls, buffer: Dir, consumer: str = DEFAULT_CONSUMER, dir_fd: int | None = None) -> Progress | None:
        """The consumer's progress (read through ``buffer``'s fd ``dir_fd`` where given), or None when it has
        not written one yet."""
        path = Path(buffer) / progress_name(consumer)
        doc = read_optional(path, "progress", dir_fd)
        if doc is None:
            return None
        share = doc.get("wait_share")
        if share is not None and not (isinstance(share, (int, float)) and not isinstance(share, bool) and 0 <= share <= 1):
            raise ProtocolError(f"{path}: field 'wait_share' is {shown(share)}, expected a fraction between 0 and 1")
        closed, locked = doc.get("closed", False), doc.get("locked", False)
        for key, flag in (("closed", closed), ("locked", locked)):
            if not isinstance(flag, bool):
                raise ProtocolError(f"{path}: field {key!r} is {shown(flag)}, expected true or false")
        # Optional for readers: documents of older writers have neither.
        pid = checked_field(doc, "pid", int, path) if doc.get("pid") is not None else None
        written = checked_field(doc, "time", float, path) if doc.get("time") is not None else None
        job = checked_field(doc, "job", str, path) if doc.get("job") is not None else None
        read = checked_field(doc, "read_batches", int, path) if doc.get("read_batches") is not None else None
        if read is not None and read < 0:
            raise ProtocolError(f"{path}: field 'read_batches' is {read}, expected a count of batches (0 or more)")
        namespace = checked_field(doc, "pid_namespace", int, path) if doc.get("pid_namespace") is not None else None
        return cls(checked_field(doc, "epoch", int, path), checked_field(doc, "step", int, path), share, pid, written,
                   closed, job, read, namespace, locked)


def pid_namespace() -> int | None:
    """This process's pid namespace: the inode number of ``/proc/self/ns/pid`` (what `lsns` lists); None
    where /proc does not say (no /proc, or one of another namespace that does not show this process).
    Asked at each use: a process may fork into a namespace it unshared (``unshare --pid --fork``)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None
