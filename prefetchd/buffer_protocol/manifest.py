"""manifest.json: what a daemon produces into a stream folder (``Manifest``), written once per job and read
by trainers; with the arithmetic of a job's epochs (``steps_per_epoch``, ``batch_len``) and the text of its
augmentations (``augmentation_text``) that the manifest records."""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefetchd.buffer_protocol.batch import VERSION
from prefetchd.buffer_protocol.errors import ProtocolError, shown
from prefetchd.buffer_protocol.json_files import checked_field, read_json_stat, write_json
from prefetchd.buffer_protocol.layout import MANIFEST_NAME, Dir, check_owned


# What a manifest's split and channels may be (SPEC.md's Manifest table); the daemon's --split takes
# SPLITS.  The daemon writes 3 channels (it decodes a grayscale file to three equal ones), but a reader
# takes 1 as well, as SPEC does: the trainer has grayscale defaults for normalize=True.
SPLITS = ("train", "val")
# The batch and image sizes a daemon builds (its --batch-size, --image-size), which prefetchd-train's flags for the
# daemons it starts hold to too: its --image-size 4 started a daemon that refused it (a walk of the docs).
BATCH_SIZES = (1, 65536)
IMAGE_SIZES = (8, 8192)
CHANNELS = (3, 1)


def steps_per_epoch(samples: int, batch_size: int, drop_last: bool = False) -> int:
    """Batches in an epoch of ``samples``: the last one short where they do not divide, or,
    with ``drop_last``, left out (which samples it held changes from epoch to epoch with the
    shuffle)."""
    return samples // batch_size if drop_last else -(-samples // batch_size)


def batch_len(step: int, batch_size: int, samples: int) -> int:
    """Images in batch ``step`` of an epoch of ``samples``: the batch size, except for a short last batch
    (which ``drop_last`` leaves out)."""
    return min(batch_size, samples - step * batch_size)


def _one_of(doc: dict[str, Any], key: str, allowed: tuple[object, ...], path: Path) -> None:
    """Refuse ``doc[key]``, of its type already (``checked_field``), unless it is one of ``allowed``."""
    if doc[key] not in allowed:
        listed = " or ".join(repr(v) for v in allowed)
        raise ProtocolError(f"{path}: field {key!r} is {shown(doc[key])}, expected {listed}; delete it and restart the daemon")


def augmentation_text(options: Mapping[str, object]) -> str:
    """The manifest's ``augmentation``: ``name=value`` of each augmentation a job sets beyond the
    split's defaults, in the order given, joined by ``;`` ("" for none).  The names are `prefetchd
    start`'s options (``color_jitter`` is ``--color-jitter``) and the values as it takes them, so a
    reader can start the same job again (``augmentation_options``); floats are written exactly."""
    parts = []
    for name, value in options.items():
        text = exact_number(value) if isinstance(value, float) else str(value)
        if ";" in text or "=" in name:
            raise ValueError(f"augmentation {name}={text!r}: a name holds no '=' and a value no ';'")
        parts.append(f"{name}={text}")
    return ";".join(parts)


def augmentation_options(text: str) -> dict[str, str]:
    """``augmentation_text``'s options back, by `prefetchd start` option name: "color_jitter=0.4" is
    {"color_jitter": "0.4"}."""
    return dict(part.partition("=")[::2] for part in text.split(";") if part)


def exact_number(value: float) -> str:
    """``value`` as short as ``:g`` writes it where that is exact, else every digit it needs: 0.4 is
    "0.4" and 1.0 "1", but 1/3 "0.3333333333333333", not ``:g``'s "0.333333" (another value)."""
    text = f"{value:g}"
    return text if float(text) == value else repr(value)


@dataclass(frozen=True)
class Manifest:
    """What a daemon produces into a buffer.  Written once per job, read by trainers."""

    dataset_root: str
    fingerprint: str
    classes: list[str]
    num_samples: int
    split: str
    seed: int
    batch_size: int
    image_size: int
    samples_per_epoch: int
    steps_per_epoch: int
    epochs: int | None
    producer: str
    channels: int = 3
    rank: int = 0
    world_size: int = 1
    val_fraction: float | None = None
    # The augmentations beyond the split's defaults, as a canonical string ("" for none).
    augmentation: str = ""
    # Each epoch's short last batch left out: every batch holds batch_size images.
    drop_last: bool = False
    created: float = field(default_factory=time.time)
    # The daemon's batches name their stream (``job`` and ``rank`` in their metadata), and a reader refuses one
    # that does not: ``batch.not_of_stream``.  False where absent: a daemon before them, whose batches it reads
    # as ever (tests and tools that write batches without them leave it so).
    keyed_batches: bool = False

    # Fields whose change makes already written batches wrong for the new job.
    IDENTITY = (
        "fingerprint", "split", "seed", "batch_size", "image_size", "channels",
        "samples_per_epoch", "rank", "world_size", "val_fraction", "augmentation", "drop_last",
    )

    @functools.cached_property  # read at every progress write and read: a manifest never changes
    def job_key(self) -> str:
        """A short digest of the job's identity: the same for every run of one job (a restarted
        daemon), different for any other.  Progress documents carry it (``Progress.job``), so a
        daemon that replaced a job tells its trainer's position from a trainer of the old one."""
        identity = json.dumps([getattr(self, k) for k in self.IDENTITY], sort_keys=True)
        return hashlib.sha256(identity.encode()).hexdigest()[:16]

    def identity_diff(self, other: Manifest) -> list[str]:
        """Human-readable list of identity fields that differ from ``other``."""
        diff = [
            f"{k}: {getattr(other, k)!r} -> {getattr(self, k)!r}"
            for k in self.IDENTITY
            if getattr(self, k) != getattr(other, k)
        ]
        if self.fingerprint != other.fingerprint:  # a digest alone does not say which dataset, or that it changed
            what = (f"dataset {other.dataset_root} -> {self.dataset_root}" if self.dataset_root != other.dataset_root
                    else f"the files of {self.dataset_root} changed")
            diff = [f"{d} ({what})" if d.startswith("fingerprint:") else d for d in diff]
        if self.fingerprint != other.fingerprint and self.classes != other.classes:
            # The fingerprint covers them; said, since a class added or renamed moves the labels of those after it
            # (a restart after a class folder was renamed said only that the files changed: a walk).
            diff.append(f"classes: {_class_changes(other.classes, self.classes)} (a label is its class's place in "
                        "the sorted list: the labels of the classes after it change)")
        return diff

    def to_doc(self) -> dict[str, Any]:
        return {"format": "prefetchd.manifest", "version": VERSION, **asdict(self)}

    @classmethod
    def from_doc(cls, doc: dict[str, Any], path: Path) -> Manifest:
        for key, kind in (
            ("dataset_root", str), ("fingerprint", str), ("classes", list), ("num_samples", int),
            ("split", str), ("seed", int), ("batch_size", int), ("image_size", int),
            ("samples_per_epoch", int), ("steps_per_epoch", int), ("producer", str),
            ("channels", int), ("rank", int), ("world_size", int), ("created", float),
        ):
            checked_field(doc, key, kind, path)
        _one_of(doc, "split", SPLITS, path)
        _one_of(doc, "channels", CHANNELS, path)
        if doc["batch_size"] < 1 or doc["image_size"] < 1 or doc["world_size"] < 1:
            raise ProtocolError(f"{path}: batch_size, image_size and world_size must be at least 1")
        if not all(isinstance(c, str) for c in doc["classes"]):
            raise ProtocolError(f"{path}: field 'classes' must be a list of class names")
        for flag in ("drop_last", "keyed_batches"):  # absent in manifests of daemons before them: False
            if flag in doc:
                checked_field(doc, flag, bool, path)
        samples, size = doc["samples_per_epoch"], doc["batch_size"]
        if doc["steps_per_epoch"] != steps_per_epoch(samples, size, doc.get("drop_last", False)):
            dropping = " with the short last batch left out" if doc.get("drop_last") else ""
            raise ProtocolError(
                f"{path}: steps_per_epoch {doc['steps_per_epoch']} does not match {samples} "
                f"samples in batches of {size}{dropping}; delete it and restart the daemon"
            )
        for key, kind in (("epochs", int), ("val_fraction", float), ("augmentation", str)):
            # null means "none" for epochs and val_fraction; augmentation is a string when present.
            if doc.get(key) is not None or (key == "augmentation" and key in doc):
                doc = {**doc, key: checked_field(doc, key, kind, path)}
        # epochs may be left out as val_fraction may: null, run on (a missing key was a TypeError).
        doc = {"epochs": None, **doc, "created": float(doc["created"])}
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in doc.items() if k in names})

    def write(self, buffer: Dir, dir_fd: int | None = None) -> None:
        """Write the manifest into ``buffer`` (through the folder's fd ``dir_fd`` where given: ``replace_file``)."""
        write_json(Path(buffer) / MANIFEST_NAME, self.to_doc(), dir_fd)

    @classmethod
    def read(cls, buffer: Dir) -> Manifest:
        """The manifest of stream folder ``buffer``: only one of the buffer's owner (``layout.check_owned``)."""
        path = Path(buffer) / MANIFEST_NAME
        doc, st = read_json_stat(path, "manifest")
        check_owned(path, st.st_uid, "manifests")
        return cls.from_doc(doc, path)


def _class_changes(old: Sequence[str], new: Sequence[str], shown: int = 5) -> str:
    """``new`` against ``old`` in words: "added 'hexagon', 'star2'; removed 'star'"."""
    def names(items: list[str]) -> str:
        more = f" and {len(items) - shown} more" if len(items) > shown else ""
        return ", ".join(repr(c) for c in items[:shown]) + more
    before, after = set(old), set(new)
    added, removed = [c for c in new if c not in before], [c for c in old if c not in after]
    said = [f"{word} {names(items)}" for word, items in (("added", added), ("removed", removed)) if items]
    return "; ".join(said) or f"the same {len(new)}, in another order"
