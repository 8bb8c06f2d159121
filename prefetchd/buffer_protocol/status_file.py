"""status.json as a file: ``write_status`` replaces it (on a full filesystem, writes it over the one there or
touches its mtime), ``read_status`` reads the buffer owner's (every field checked by ``status_fields``; its
heartbeat the later of the document's and the file's mtime) and ``readable_status`` takes one it cannot read
for absent.  The document's types are ``status``'s."""

from __future__ import annotations

import contextlib
import errno
import os
from dataclasses import replace
from pathlib import Path

from prefetchd.buffer_protocol.errors import ProtocolError
from prefetchd.buffer_protocol.json_files import encode_json, read_json_stat, replace_file, rewrite_in_place
from prefetchd.buffer_protocol.layout import STATUS_NAME, Dir, at, check_owned, owning_buffer
from prefetchd.buffer_protocol.status import Status
from prefetchd.buffer_protocol.status_fields import status_from_doc


def write_status(buffer: Dir, status: Status, dir_fd: int | None = None) -> None:
    """Replace ``buffer``'s status.json atomically with ``status`` (through the buffer folder's fd ``dir_fd``
    where given: ``layout.at``).

    On a full filesystem there is no page for a new file: the document is written over the one there, in that
    file's own pages, which a tmpfs overwrites without allocating (``rewrite_in_place``).  So a daemon restarted
    on a full tmpfs says at once that it is the buffer's (its pid, its state, its heartbeat), where the earlier
    daemon's document would have stayed and a waiting trainer taken the new daemon for stuck.  Where it does not
    fit those pages (a document grown past them), or the file is no status document of the daemon's own, the
    file gets the time as its mtime instead, which takes no space and which readers count as the heartbeat (SPEC
    rule 8), and the OSError is raised."""
    path = Path(buffer) / STATUS_NAME
    data = encode_json(status.to_doc())  # once: on a full filesystem it is written over the file there too
    try:
        replace_file(path, data, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        try:
            rewrite_in_place(path, data, "status", dir_fd)
            return
        except OSError:
            pass
        with contextlib.suppress(OSError):
            os.utime(at(path, dir_fd), dir_fd=dir_fd, follow_symlinks=False)
        raise


def read_status(buffer: Dir) -> Status | None:
    """The status of the daemon owning ``buffer`` (a rank's stream directory reads its parent's);
    None before the first is written; ProtocolError when it is malformed, or not the daemon's: only the
    owner of the buffer's folder writes its status.json, and a member of a --group-access buffer's group
    may rename a file of theirs to that name (a pid, a state, a `running_job.submitter` of their choosing).
    Its heartbeat is the later of the document's and the file's mtime (``write_status`` on a full
    filesystem)."""
    path = owning_buffer(Path(buffer)) / STATUS_NAME
    try:
        doc, st = read_json_stat(path, "status")
        check_owned(path, st.st_uid, "status (it writes its own within a second)")
    except FileNotFoundError:
        return None
    status = status_from_doc(doc, path)
    return replace(status, heartbeat=st.st_mtime) if st.st_mtime > status.heartbeat + 1.0 else status


def readable_status(buffer: Dir) -> Status | None:
    """``read_status``, None where it cannot be read (being replaced, or damaged: judged as if absent)."""
    try:
        return read_status(buffer)
    except (OSError, ProtocolError):
        return None
