"""job.json: a trainer's request that the daemon produce a job (``JobRequest``) and its refusal where it
breaks the protocol (``BadJobRequest``); and job.accepted.json, the daemon's record of the request it
accepted, which a restarted daemon resumes.  Both are checked against replay: any member of a
--group-access buffer's group may rename the buffer's files.  The daemon's answer is status.json's
(``status.JobResult``, ``status.RunningJob``)."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefetchd.buffer_protocol.batch import VERSION
from prefetchd.buffer_protocol.errors import ProtocolError, shown, user_name
from prefetchd.buffer_protocol.json_files import checked_field, encode_json, read_json_stat, replace_file_kept, write_json
from prefetchd.buffer_protocol.layout import ACCEPTED_JOB_NAME, JOB_NAME, TRAINER_FILE_MODE, Dir


# A malformed job's job_id is echoed in its refusal only when it looks like one (JobRequest's
# are 12 hex digits); anything else could be a megabyte of control characters in a log.
JOB_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,64}", re.ASCII)

# A writer of job.json renames its temp file into place as soon as it has written it (``replace_file``: microseconds
# apart), and a rename sets the file's ctime to the moment, where its mtime, which only its owner (or root) may set,
# stays when it was written.  Any member of a --group-access buffer's group may rename the files there (the folder
# is group-writable and not sticky): one that kept another user's job.json aside and renamed it back had the daemon
# run that old request again, as that user's.  A job.json put in place more than this long after it was written is
# refused (``JobRequest.read``); the margin is for a writer stalled between its write and its rename on a loaded box.
MAX_JOB_RENAME_SECONDS = 10.0
# The daemon's record of the job it accepted (job.accepted.json) is written and renamed into place at once, by the
# daemon (microseconds apart), and is never changed after: one its ctime puts this far past its mtime was renamed since
# (or its mode changed), and is not resumed (``JobRequest.recorded``).  A record replaced while the daemon runs is
# emptied through the fd it keeps (``JobInbox``), so only a record kept aside across a restart needs this check; a
# restart takes longer than this (the daemon's start alone, before it can accept another job to record).
MAX_RECORD_RENAME_SECONDS = 1.0


@dataclass(frozen=True)
class JobRequest:
    """A trainer's request that the daemon produce ``settings``.

    ``settings`` uses the names of `prefetchd start` flags with underscores
    (data, split, batch_size, ...); the daemon validates them and answers in
    status.json under ``job_result`` with the request's ``job_id``.

    ``owner`` is not in the document: it is the uid owning the job.json that was
    read (fstat of the opened file), which says who submitted it, since a writer
    creates its temp file and renames it into place.  None for a request not read
    from a buffer.  The daemon's copy of the request it accepted (``record``,
    ``job.accepted.json``) carries it, the file being the daemon's own.  ``written_ns``, not in the document
    either: that file's mtime (ns), when its owner wrote it, which no one else can set and a rename keeps; the
    daemon refuses a request older than one it answered (``JobInbox``).
    """

    settings: dict[str, Any]
    replace: bool = False
    job_id: str = field(default_factory=lambda: secrets.token_hex(6))
    submitted: float = field(default_factory=time.time)
    owner: int | None = None
    written_ns: int | None = None

    def write(self, buffer: Dir) -> None:
        write_json(Path(buffer) / JOB_NAME, self._doc(), mode=TRAINER_FILE_MODE)

    def _doc(self) -> dict[str, Any]:
        # A path as a Path ({"data": Path(...)}, as a Python caller writes it) was "Object of type PosixPath is not
        # JSON serializable" from inside the write: the document holds it as the str it stands for.
        settings = {key: os.fspath(value) if isinstance(value, os.PathLike) else value
                    for key, value in self.settings.items()}
        return {"format": "prefetchd.job", "version": VERSION, "settings": settings, "replace": self.replace,
                "job_id": self.job_id, "submitted": self.submitted}

    def record(self, buffer: Dir, dir_fd: int | None = None) -> int:
        """Keep this request, which the daemon accepted, as ``job.accepted.json``, with its submitter: the job a
        restarted daemon resumes (``recorded``).  job.json itself is no record of it: the next request, refused
        or not, replaces it.  Its ``owner`` field tells it from a request: this file is the daemon's own, and renamed
        to job.json (a member of the buffer's group may) it would pass for a request of the daemon's user (``read``
        refuses it).

        Returns an fd of the record, open for writing, through which the daemon empties it once it records no running
        job (``JobInbox``): a member may rename the record aside and back over a later one, and a restart then
        resumed the old job."""
        doc = {**self._doc(), "owner": self.owner}
        return replace_file_kept(Path(buffer) / ACCEPTED_JOB_NAME, encode_json(doc), dir_fd=dir_fd)

    @classmethod
    def recorded(cls, buffer: Dir) -> JobRequest | None:
        """The request the daemon last accepted (``record``); None when none is kept.  ProtocolError for a file
        that is not the daemon's own: any member of a --group-access buffer's group may put one there, and would
        have it resumed over the job another member's trainer reads; and for one renamed since it was written (its
        ctime past its mtime, as ``read`` tells a request put back): a member may keep the record of an old job
        aside and rename it back over the newer one."""
        path = Path(buffer) / ACCEPTED_JOB_NAME
        try:
            doc, st = read_json_stat(path, "job")
        except FileNotFoundError:
            return None
        except ProtocolError:
            with contextlib.suppress(OSError):
                if os.lstat(path).st_size == 0:
                    raise ProtocolError(f"{path}: is empty: the daemon empties its record of a job once that job ended "
                                        "or another replaced it, so this one was renamed away and back (any member of "
                                        "the buffer's group may rename the files there); it is not resumed") from None
            raise
        if st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise ProtocolError(f"{path}: belongs to uid {st.st_uid} (or has {st.st_nlink} links), so the daemon "
                                f"(uid {os.geteuid()}) did not write it; remove it")
        # The daemon renames it into place as soon as it is written and never changes it after, but to empty it
        # through the fd it keeps (``JobInbox``), which a member's rename does not escape: one renamed since (kept
        # aside by a member and put back after a restart, which no fd outlives) would resume a job nobody asks for.
        late = (st.st_ctime_ns - st.st_mtime_ns) / 1e9
        if late > MAX_RECORD_RENAME_SECONDS:
            raise ProtocolError(f"{path}: written {when_written(st.st_mtime_ns)}, was renamed or changed {late:.1f} s "
                                "after the daemon wrote it: perhaps an old record put back (any member of the "
                                "buffer's group may rename the files there), which is not resumed; submit the job "
                                f"again: `prefetchd submit --buffer {path.parent} ...`")
        owner = checked_field(doc, "owner", int, path) if doc.get("owner") is not None else None
        return cls._from_doc(doc, path, owner)

    @classmethod
    def read(cls, buffer: Dir) -> JobRequest | None:
        """The request in ``buffer``'s job.json, None when there is none.  A malformed one is a
        ``BadJobRequest`` that carries the document's ``job_id`` where one can be read, so that
        the refusal reaches whoever submitted it.  So is one that others than its owner may have written: with
        more than one hard link, writable by others, or renamed into place long after it was written (an old
        request put back, ``MAX_JOB_RENAME_SECONDS``); and the daemon's record of a job (``record``) renamed there."""
        path = Path(buffer) / JOB_NAME
        try:
            doc, st = read_json_stat(path, "job")
        except FileNotFoundError:
            return None
        except ProtocolError as exc:  # not read at all (a link, not JSON, ...): no job_id to echo
            raise BadJobRequest(str(exc), None) from None
        if st.st_nlink == 0:
            return None  # removed between its open and its stat: taken by the daemon, or withdrawn
        job_id = doc.get("job_id")
        try:
            if st.st_nlink != 1:
                # A hard link to someone else's file would pass for a job that user wrote.
                raise ProtocolError(f"{path}: has {st.st_nlink} links, so its owner (uid {st.st_uid}) need not be "
                                    "who put it there; remove it and submit the job again")
            if st.st_mode & 0o022:  # anyone it is writable by could have written its request, or freshened its mtime
                raise ProtocolError(f"{path}: is writable by others than its owner, {user_name(st.st_uid)} (mode "
                                    f"{stat.S_IMODE(st.st_mode):04o}), so they may have written it; submit the job "
                                    f"with `prefetchd submit --buffer {path.parent} ...`, which writes it 0644")
            if "owner" in doc:  # only the daemon's record has it: a request the daemon's user never made
                raise ProtocolError(f"{path}: is the daemon's record of the job it accepted ({ACCEPTED_JOB_NAME}, "
                                    "which has an 'owner' field) renamed to a request (any member of the buffer's "
                                    "group may rename the files there), not a request; it is not run. Submit the job "
                                    f"with `prefetchd submit --buffer {path.parent} ...`")
            late = (st.st_ctime_ns - st.st_mtime_ns) / 1e9
            if late > MAX_JOB_RENAME_SECONDS:
                raise ProtocolError(put_back(path, st.st_uid, st.st_mtime_ns, f"was put in place {late:.0f} s after "
                                             "it was written (a writer renames it there at once; or it was moved in "
                                             "from elsewhere)"))
            return cls._from_doc(doc, path, st.st_uid, st.st_mtime_ns)
        except ProtocolError as exc:
            echoed = job_id if isinstance(job_id, str) and JOB_ID_RE.fullmatch(job_id) else None
            raise BadJobRequest(str(exc), echoed, st.st_uid if st.st_nlink == 1 else None) from None


    @classmethod
    def _from_doc(cls, doc: dict[str, Any], path: Path, owner: int | None, written_ns: int | None = None) -> JobRequest:
        settings = checked_field(doc, "settings", dict, path)
        for key, value in settings.items():
            if not isinstance(value, (str, int, float, bool)) and value is not None:
                raise ProtocolError(f"{path}: setting {shown(key)} is {shown(value)}; settings are strings, numbers, "
                                    "booleans or null")
        # A JSON boolean or absent: "replace": "no" was true, and replaced a job a trainer was reading.
        replace = checked_field(doc, "replace", bool, path) if doc.get("replace") is not None else False
        return cls(settings, replace, checked_field(doc, "job_id", str, path),
                   checked_field(doc, "submitted", float, path), owner=owner, written_ns=written_ns)


def put_back(path: Path, owner: int | None, mtime_ns: int, how: str) -> str:
    """The refusal of a job.json (``path``) that is an old request renamed back into place: whose it is, when it was
    written, ``how`` that shows, and how to have it run."""
    return (f"{path}: {user_name(owner)}'s request, written {when_written(mtime_ns)}, {how}: an old request renamed back "
            "(any member of the buffer's group may rename the files there), which is not run; to run it, submit it "
            f"again: `prefetchd submit --buffer {path.parent} ...`")


def when_written(mtime_ns: int) -> str:
    """When a file was written, for messages: "2025-03-01 14:02:07 (3725 s ago)"."""
    seconds = mtime_ns / 1e9
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(seconds))} ({time.time() - seconds:.0f} s ago)"


class BadJobRequest(ProtocolError):
    """A job.json that breaks the protocol.  ``job_id`` is the document's own (a short plain
    name: it is echoed in logs and status.json), or None where none could be read; ``owner``: who
    submitted it, as ``JobRequest.owner``, or None where that is not known.  Whoever writes job.json
    may give it another's job_id: its refusal is theirs, not that job's submitter's."""

    def __init__(self, message: str, job_id: str | None, owner: int | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.owner = owner
