"""Who may ask the daemon for what.

With ``--group-access`` (the systemd unit's default) every member of the buffer's
group can write ``job.json``.  What a job names, the daemon does as itself: it reads
``data`` with the service's files and object-storage credentials and publishes the
pixels to the group, and it imports and runs the ``transform`` hook.  So a job.json
owned by anyone but the daemon's own user may only name

- ``data`` inside a root of the config's ``allowed_data`` (local roots compared after
  resolving symlinks and ``..``; URLs by whole prefix, and without ``.`` or ``..`` segments,
  which an HTTP client resolves), and every file its index names must resolve inside one
  too (a file list may name any path, a class folder may link out);
- a ``transform`` listed exactly in ``allowed_transforms``.

Both lists are empty by default, so such jobs are refused with the key to set.  Values
the daemon's own configuration already has are the operator's choice and always pass.
The owner is the uid of the job.json the daemon opened (fstat of that file), which is
who created it: writers create a temp file and rename it into place.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from prefetchd.access import user_name
from prefetchd.daemon.config import DaemonConfig
from prefetchd.daemon.dataset import SampleIndex
from prefetchd.daemon.errors import ConfigError
from prefetchd.locations import inside, is_url

TICK_FILES = 4096  # resolving a large index takes seconds: keep the heartbeat going every this many files


def dot_segments(location: str) -> bool:
    """Whether a URL's path, or a relative name, has a ``.`` or ``..`` segment (percent-encoded too): an
    HTTP client resolves them, so ``http://h/pub/../priv`` starts with ``http://h/pub/`` and is not in it."""
    path = urllib.parse.urlsplit(location).path if is_url(location) else location
    return any(urllib.parse.unquote(segment) in (".", "..") for segment in path.replace("\\", "/").split("/"))


@dataclass(frozen=True)
class JobPolicy:
    """The daemon's own configuration, which says what jobs of other users may name."""

    own: DaemonConfig
    uid: int

    @classmethod
    def of(cls, own: DaemonConfig) -> JobPolicy:
        return cls(own, os.geteuid())

    def confine(self, job: DaemonConfig, owner: int | None) -> tuple[DaemonConfig, tuple[str, ...] | None]:
        """Check a job that ``owner`` submitted: raise ConfigError saying why and which key to set
        if it asks for more than that user may, else return the job to run and the roots its files
        must stay inside (resolved local folders, or URLs; None: not confined, it is the daemon's
        user or the daemon's own data).

        A confined local ``data`` is resolved here, once, and the job returned reads it by that path:
        resolved again when the dataset is opened, a link the submitter owns (``data`` itself, or a
        folder on the way to it) could be pointed elsewhere between the check and the read."""
        if owner == self.uid:
            return job, None
        who = (f"job.json belongs to {user_name(owner)}, not to {user_name(self.uid)} who runs the daemon, "
               "so it may use only what the daemon's config allows")
        problems = []  # both said at once: a submitter who fixed one met the other at the next try (a review)
        if job.transform is not None and job.transform != self.own.transform and job.transform not in self.own.allowed_transforms:
            allowed = ", ".join(self.own.allowed_transforms) or "none is set"
            problems.append(f"its transform {job.transform!r} is not in allowed_transforms ({allowed}). The daemon "
                            f"would import and run it as {user_name(self.uid)}; if the buffer's group may run it, add "
                            "it to `allowed_transforms` in the daemon's config (or --allowed-transforms)")
        confined = self._confine_data(job)
        if isinstance(confined, str):
            problems.append(confined)
        if problems:
            raise ConfigError(f"{who}: " + "; and ".join(problems))
        assert not isinstance(confined, str)
        return confined

    def _confine_data(self, job: DaemonConfig) -> tuple[DaemonConfig, tuple[str, ...] | None] | str:
        """``confine``'s answer for the job's ``data`` alone, or why it may not read it."""
        if job.data is None or job.data == self.own.data:
            return job, None
        if is_url(job.data):
            if dot_segments(job.data):
                return (f"its data {job.data!r} has a '.' or '..' segment, which would be resolved past the roots of "
                        "allowed_data; name the data by a plain URL under one of them")
            roots = tuple(root for root in self.own.allowed_data if is_url(root))
            if any(inside(job.data, root) for root in roots):
                return job, roots
        else:
            roots = tuple(os.path.realpath(root) for root in self.own.allowed_data if not is_url(root))
            resolved = os.path.realpath(job.data)
            if any(inside(resolved, root) for root in roots):
                return dataclasses.replace(job, data=resolved), roots
        # Where a link points is not said: the daemon may resolve links in folders the group cannot read.
        shown = f"{job.data!r}" + ("" if is_url(job.data) else " (after resolving symbolic links and '..')")
        allowed = ", ".join(self.own.allowed_data) or "none is set"
        return (f"its data {shown} is not inside a root of allowed_data ({allowed}). The daemon reads it with "
                f"{user_name(self.uid)}'s files and credentials and shows the pixels to the buffer's group; if the "
                "group may read it, add its root to `allowed_data` in the daemon's config (or --allowed-data)")


def check_files_inside(index: SampleIndex, data: str, roots: tuple[str, ...],
                       tick: Callable[[], object] = lambda: None) -> None:
    """Every file of a confined job's index (of its ``data``: the file list or folder the message
    names) resolves inside ``roots``: a file list may name any path and class folders may hold
    links, which the walk follows."""
    url = is_url(index.root)
    for j in range(len(index.path_offsets) - 1):
        if j % TICK_FILES == 0:
            tick()
        name = index.file(j)
        if url:  # relative to the root, or read at a URL that the store's client may resolve past it
            where = index.root.rstrip("/") + "/" + name
            outside = dot_segments(name) or not any(inside(where, root) for root in roots)
        else:  # where it resolves is not said: the link may be in a folder the group cannot read
            outside = not any(inside(os.path.realpath(os.path.join(index.root, name)), root) for root in roots)
        if outside:
            raise ConfigError(f"{data}: sample file {name} is outside allowed_data ({', '.join(roots)}) once its "
                              "symbolic links and '..' are resolved; a job from another user reads only files inside "
                              "`allowed_data` of the daemon's config: add that root there, or drop the file or link")
