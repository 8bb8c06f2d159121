"""Samples that could not be decoded: the distinct files counted once each (and named in the status,
the first ``MAX_LISTED_BAD_FILES``), and the policy that stops the job over them (--strict,
--max-bad-samples, --max-bad-fraction)."""

from __future__ import annotations

import functools
import logging

from prefetchd.buffer_protocol.status import BadFile
from prefetchd.daemon.config import DaemonConfig
from prefetchd.daemon.dataset import PackedFrom, SampleIndex
from prefetchd.daemon.errors import DatasetError
from prefetchd.daemon.sources.shards import read_packed_from

log = logging.getLogger(__name__)

MAX_LISTED_BAD_FILES = 100  # undecodable files named in status.json; all are counted, and logged once


class BadSamples:
    """The undecodable files of one job of a ``split``-sample split of ``index``."""

    def __init__(self, cfg: DaemonConfig, index: SampleIndex, split: int) -> None:
        self.cfg = cfg
        self.index = index
        self.split = split
        self.files: set[str] = set()
        self.listed: tuple[BadFile, ...] = ()  # the first MAX_LISTED_BAD_FILES, for the status

    def count(self, sample: int, reason: str) -> bool:
        """Count ``sample``'s file as undecodable; False where it was counted already (a list may name a
        file twice: counted by its name, not by sample)."""
        path = self.index.name(sample)
        if path in self.files:
            return False
        self.files.add(path)
        if len(self.listed) < MAX_LISTED_BAD_FILES:
            self.listed += (BadFile(path=self.shown(sample), reason=reason),)
        return True

    def verdict(self, sample: int, reason: str) -> str | None:
        """Why the job must stop now that ``sample`` (for ``reason``) was counted; None while it may go on."""
        return bad_data_verdict(self.cfg, len(self.files), self.split, self.shown(sample), reason)

    def shown(self, sample: int) -> str:
        """``sample`` as a failure is shown to the user: a packed one with the file it was packed from,
        to be mended there, where the pack recorded it.  Those are read at the first failure shown."""
        return self.index.name(sample, self._packed_from)

    @functools.cached_property
    def _packed_from(self) -> PackedFrom | None:
        if self.index.member_files is None:  # not a pack: its samples are named by their own files
            return None
        try:
            return read_packed_from(self.index)
        except DatasetError as exc:  # a name to add, not the job's concern: the shard and bytes remain
            log.debug("not naming the files %s was packed from: %s", self.index.root, exc)
            return None


def bad_data_verdict(cfg: DaemonConfig, bad: int, split: int, path: str, reason: str) -> str | None:
    """Why the job must stop now that ``bad`` distinct files of a ``split``-sample split could not be
    decoded, the last being ``path`` (for ``reason``); None while the policy lets it replace them."""
    if cfg.strict:
        return (f"--strict: cannot decode {path} ({reason}); fix or remove the file, or start without "
                "--strict to replace undecodable images with the next sample of the split")
    exceeded = []
    if cfg.max_bad_samples is not None and bad > cfg.max_bad_samples:
        exceeded.append(f"--max-bad-samples {cfg.max_bad_samples}")
    if cfg.max_bad_fraction is not None and bad > cfg.max_bad_fraction * split:
        exceeded.append(f"--max-bad-fraction {cfg.max_bad_fraction:g} of {split} samples")
    if not exceeded:
        return None
    return (f"{bad} files could not be decoded, more than {' and '.join(exceeded)} allows (the last: {path}: "
            f"{reason}); the log names every one and `prefetchd status --json` the first {MAX_LISTED_BAD_FILES}; "
            "repair or remove them, or raise the limit")


__all__ = ["MAX_LISTED_BAD_FILES", "BadSamples", "bad_data_verdict"]
