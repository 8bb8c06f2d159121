"""Samples that could not be used: the distinct files counted once each (and named in the status,
the first ``MAX_LISTED_BAD_FILES``), how each is said (missing, unreadable, undecodable or fatal to the
workers that decoded it, and what to do about it), and the policy that stops the job over them
(--strict, --max-bad-samples, --max-bad-fraction)."""

from __future__ import annotations

import functools
import logging
import os

from prefetchd.buffer_protocol.status import BadFile
from prefetchd.daemon.config import DaemonConfig
from prefetchd.daemon.dataset import PackedFrom, SampleIndex
from prefetchd.daemon.errors import DatasetError
from prefetchd.daemon.sources import is_url
from prefetchd.daemon.sources.filelist import is_file_list
from prefetchd.daemon.sources.shards import pack_again, read_packed_from
from prefetchd.daemon.tasks import CRASHED_REASON, MISSING_REASONS, UNREADABLE_REASONS

log = logging.getLogger(__name__)

MAX_LISTED_BAD_FILES = 100  # bad files named in status.json; all are counted, and logged once


class BadSamples:
    """The files of one job of a ``split``-sample split of ``index`` that could not be used: undecodable,
    missing or unreadable (the status counts them all as ``undecodable_files``, each with its reason)."""

    def __init__(self, cfg: DaemonConfig, index: SampleIndex, split: int) -> None:
        self.cfg = cfg
        self.index = index
        self.split = split
        self.files: set[str] = set()
        self.listed: tuple[BadFile, ...] = ()  # the first MAX_LISTED_BAD_FILES, for the status

    def count(self, sample: int, reason: str) -> bool:
        """Count ``sample``'s file as bad; False where it was counted already (a list may name a
        file twice: counted by its name, not by sample)."""
        path = self.index.name(sample)
        if path in self.files:
            return False
        self.files.add(path)
        if len(self.listed) < MAX_LISTED_BAD_FILES:
            self.listed += (BadFile(path=self.shown(sample), reason=self.reason(sample, reason)),)
        return True

    def replaced(self, sample: int, reason: str) -> str | None:
        """Count ``sample``'s file as bad (``count``) and say, once, that it is replaced; or why the job must
        stop over it (``verdict``: the file is named there, not as replaced)."""
        if not self.count(sample, reason):
            return None
        verdict = self.verdict(sample, reason)
        if verdict is None:
            log.warning("%s; replacing it with the next sample of the split", self.failure(sample, reason))
        return verdict

    def verdict(self, sample: int, reason: str) -> str | None:
        """Why the job must stop now that ``sample`` (for ``reason``) was counted; None while it may go on."""
        return bad_data_verdict(self.cfg, len(self.files), self.split, self.failure(sample, reason),
                                *self._fixes(sample, reason))

    def failure(self, sample: int, reason: str) -> str:
        """What is wrong with ``sample``'s file, ``reason`` being a worker's ("OSError: ..."), as the log and
        a stop say it: "PATH is missing (...)", "cannot read PATH (...)", "cannot decode PATH (...)" or
        "PATH crashed its worker 2 times (signal SIGSEGV)"."""
        if reason.startswith(MISSING_REASONS):
            return f"{self.shown(sample)} is {self.reason(sample, reason)}"
        if reason.startswith(CRASHED_REASON):
            return f"{self.shown(sample)} {reason}"
        verb = "read" if reason.startswith(UNREADABLE_REASONS) else "decode"
        return f"cannot {verb} {self.shown(sample)} ({reason})"

    def reason(self, sample: int, reason: str) -> str:
        """``reason`` as the status lists it beside the path: a missing file's says where it was named."""
        if not reason.startswith(MISSING_REASONS):
            return reason
        if self.index.member_files is None and not is_url(self.index.root):
            path = self.index.path(sample)
            try:
                return f"a link to {os.readlink(path)}, which is missing"
            except OSError:  # not a link (or gone since): the file itself is missing
                pass
        return f"missing ({self._named_in()}; deleted or moved since?)"

    def _named_in(self) -> str:
        if self.index.member_files is not None:
            return f"in the pack {self.index.root}"
        if self._file_list is not None:
            return f"listed in {self._file_list}"
        return f"indexed under {self.index.root}"

    def _fixes(self, sample: int, reason: str) -> tuple[str, str]:
        """What to do about ``sample``'s file, and about all those counted, for a stop's message."""
        if self.index.member_files is not None:
            # Mending the shard's bytes in place is not a fix the pack supports: the file packed from is.
            packed_from = self._packed_from
            source = (f"mend {packed_from.where(sample)}" if packed_from is not None
                      else "mend the file it was packed from")
            again = f"{pack_again(self.index.root)}, then start with --reset (the buffer's batches are the old pack's)"
            return f"{source} and {again}", f"mend them where they were packed from and {again}"
        if reason.startswith(MISSING_REASONS):
            if self._file_list is not None:
                return f"restore the file or take its row out of {self._file_list}", FIX_FILES
            if is_url(self.index.root):
                return "restore the object, or restart with --refresh-index to list the dataset without it", FIX_FILES
            if os.path.islink(self.index.path(sample)):  # still there: a restart indexes it again
                return "restore the file it links to, or remove the link", FIX_FILES
            return "restore the file, or restart to index the folders without it", FIX_FILES
        return FIX_FILE, FIX_FILES

    def shown(self, sample: int) -> str:
        """``sample`` as a failure is shown to the user: a packed one with the file it was packed from,
        to be mended there, where the pack recorded it.  Those are read at the first failure shown."""
        return self.index.name(sample, self._packed_from)

    @functools.cached_property
    def _file_list(self) -> str | None:
        """The file list the job's samples come from (--data), or None (class folders, a pack)."""
        data = self.cfg.data
        return str(data) if data is not None and is_file_list(data) else None

    @functools.cached_property
    def _packed_from(self) -> PackedFrom | None:
        if self.index.member_files is None:  # not a pack: its samples are named by their own files
            return None
        try:
            return read_packed_from(self.index)
        except DatasetError as exc:  # a name to add, not the job's concern: the shard and bytes remain
            log.debug("not naming the files %s was packed from: %s", self.index.root, exc)
            return None


FIX_FILE = "fix or remove the file"
FIX_FILES = "repair or remove them"


def bad_data_verdict(cfg: DaemonConfig, bad: int, split: int, failure: str, fix_file: str = FIX_FILE,
                     fix_files: str = FIX_FILES) -> str | None:
    """Why the job must stop now that ``bad`` distinct files of a ``split``-sample split could not be
    used, ``failure`` saying what was wrong with the last (``BadSamples.failure``); None while the
    policy lets it replace them.  ``fix_file``, ``fix_files``: what to do about that file, and all."""
    if cfg.strict:
        return (f"--strict: {failure}; {fix_file}, or start without --strict to replace such files with the next "
                "sample of the split")
    exceeded = []
    if cfg.max_bad_samples is not None and bad > cfg.max_bad_samples:
        exceeded.append(f"--max-bad-samples {cfg.max_bad_samples}")
    if cfg.max_bad_fraction is not None and bad > cfg.max_bad_fraction * split:
        exceeded.append(f"--max-bad-fraction {cfg.max_bad_fraction:g} of {split} samples")
    if not exceeded:
        return None
    return (f"{bad} files could not be decoded (or read), more than {' and '.join(exceeded)} allows (the last: "
            f"{failure}); the log names every one and `prefetchd status --json` the first {MAX_LISTED_BAD_FILES}; "
            f"{fix_files}, or raise the limit")


__all__ = ["FIX_FILE", "FIX_FILES", "MAX_LISTED_BAD_FILES", "BadSamples", "bad_data_verdict"]
