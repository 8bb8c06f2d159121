"""The daemon's configuration: one frozen dataclass from which the CLI flags and
the TOML keys are derived, and the machine-sized defaults."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # tomllib joined the standard library in 3.11; tomli is the same parser (pyproject: tomli on <3.11)
    import tomli as tomllib

import psutil

from prefetchd.access import nearest_existing
from prefetchd.buffer_protocol import BatchLayout, list_batches, stream_dir
from prefetchd.buffer_protocol.errors import shown
from prefetchd.buffer_protocol.layout import MAX_EPOCH, owning_buffer
from prefetchd.buffer_protocol.manifest import BATCH_SIZES, IMAGE_SIZES, SPLITS, augmentation_text
from prefetchd.buffer_protocol.progress import PROGRESS_REFRESH_SECONDS
from prefetchd.daemon.cgroup_limits import cpu_quota, memory_room, quota_cpus
from prefetchd.daemon.errors import ConfigError
from prefetchd.daemon.decode import DEFAULT_MAX_IMAGE_PIXELS
from prefetchd.daemon.mounts import allocation_unit, filesystem_of, taken_bytes
from prefetchd.daemon.sources.index_cache import UNIT_CACHE_DIRECTORY, default_cache_dir, private_temp
from prefetchd.daemon.sources.storage import URL_READERS
from prefetchd.locations import inside, is_url, normalize
from prefetchd.options import check_value as check_field
from prefetchd.options import setting as _opt
from prefetchd.words import binary_size, counted

# Defaults never plan more than these shares of what is free, so the trainer,
# its pinned memory and the page cache keep the rest.
TMPFS_SHARE = 0.5
RAM_SHARE = 0.25
MAX_DEFAULT_HIGH_WATER = 64
MIN_DEFAULT_HIGH_WATER = 2  # the least a default is, whatever the tmpfs holds (check_capacity judges it)
# Ranks one daemon produces (a box has a few GPUs; each rank is a folder and an fd the daemon holds).
MAX_LOCAL_RANKS = 256
# The free-space floor's default (default_min_free_mb): a share of the buffer's filesystem, at least a few MiB,
# but only a tenth of a filesystem so small that those MiB would be most of it.
MIN_FREE_SHARE, MIN_FREE_MB, SMALL_FS_SHARE = 0.05, 64, 0.1
MIN_FREE_RULE = (f"{MIN_FREE_SHARE:.0%} of the buffer's filesystem, at least {MIN_FREE_MB} MiB, or {SMALL_FS_SHARE:.0%} "
                 f"of a filesystem smaller than {MIN_FREE_MB / SMALL_FS_SHARE:.0f} MiB, at least 1")
# What --ray accepts: a private local cluster, the machine's cluster, a client URL or a head's GCS address.
RAY_ADDRESS = re.compile(r"local|auto|ray://[^\s/:]+:\d{1,5}|[^\s/:]+:\d{1,5}")


@dataclass(frozen=True)
class DaemonConfig:
    """What a daemon produces and how.  ``None`` means "size it from the machine"."""

    # Not readable by click: another user's buffer is refused at start by buffer_dir.check_private_dir, naming its owner.
    buffer: Path = _opt(None, "Buffer directory, on a tmpfs such as /dev/shm.", Path, readable=False, buffer=True)
    # A location, not a Path: Path("s3://b/p") is "s3:/b/p".  Local paths are made absolute, URLs kept verbatim.
    data: str | None = _opt(None, "Dataset: a folder of class folders (as torchvision ImageFolder), a .csv/.tsv/.txt file list of path,label rows, or a folder of shards written by `prefetchd pack`; local, or under an object-storage URL such as s3://bucket/prefix (needs prefetchd[s3]; credentials from the standard AWS environment and files).", str, location=True, metavar="PATH|URL")
    readers: int | None = _opt(None, f"Sample reads each worker keeps in flight [default: {URL_READERS} for a URL, 1 for a local folder].", int, minimum=1, maximum=1024)
    index_cache: Path | None = _opt(None, "Folder for cached dataset indexes, so a restart skips the walk when no folder changed, and never lists a URL again [default: $CACHE_DIRECTORY under systemd, else $XDG_CACHE_HOME/prefetchd, else ~/.cache/prefetchd].", Path)
    refresh_index: bool = _opt(False, "Walk (or list) the dataset again even if the cached index looks current (after replacing files in place, or changing objects under a URL).", bool)
    split: str = _opt("train", "train: random resized crop + flip, shuffled; val: resize + center crop, in order.", str, choices=SPLITS)
    val_fraction: float | None = _opt(None, "Hold out this fraction of --data as validation (a fixed seeded split); --split picks the side.", float, minimum=0.0, maximum=1.0)
    batch_size: int = _opt(128, "Images per batch.", int, minimum=BATCH_SIZES[0], maximum=BATCH_SIZES[1])
    image_size: int = _opt(224, "Output images are IMAGE_SIZE x IMAGE_SIZE.", int, minimum=IMAGE_SIZES[0],
                           maximum=IMAGE_SIZES[1])
    workers: int | None = _opt(None, "Decode/augment processes on this machine; 0 with --ray builds every batch on the cluster [default: usable CPUs - 1].", int, minimum=0, maximum=1024)
    high_water: int | None = _opt(None, "Stop producing when this many batches wait [default: from free tmpfs and RAM].", int, minimum=1)
    low_water: int | None = _opt(None, "Resume producing when waiting batches fall to this [default: high-water / 2].", int, minimum=0)
    max_buffer_bytes: int | None = _opt(None, "Cap on the bytes of batches waiting and being built, all consumers of the buffer together (several trainers sharing it: see --consumer in prefetchd-train); when their windows do not fit, the slowest consumer's shrinks first [default: high-water batches per rank, so one trainer sees no difference].", int, minimum=1,
                                        unit="a number of bytes, 2147483648 for 2 GiB", metavar="BYTES")
    # Above two of a waiting loader's progress rewrites: at one, a trainer waiting for its next batch on a loaded
    # machine counted as gone between two rewrites, and the job finished without it (a flaky test, stop 71).
    consumer_timeout: float = _opt(300.0, f"Seconds without a progress write after which one of several consumers counts as gone and stops holding batches (a gone process is noticed within a second); it may come back. Above {2 * PROGRESS_REFRESH_SECONDS:g}: a trainer waiting for a batch rewrites its progress every {PROGRESS_REFRESH_SECONDS:g} s.", float, minimum=2 * PROGRESS_REFRESH_SECONDS, min_open=True)
    # 600 s: above the longest a healthy image can take, so that only a hang is killed.  The slowest is an object
    # store's read through its retries (locations: 6 tries of up to SAMPLE_READ_SECONDS = 60 s and ~5 s of
    # backoff, ~6 min), which must end in StorageUnavailable and the status's storage_wait, not in a kill.  A
    # tighter bound is the user's to set; a worker's start has a bound of its own (worker_start_timeout).
    task_timeout: float = _opt(600.0, "Seconds a local worker may spend on one image (its read, decode and augmentation, a --transform hook's call included) before it counts as hung: it is then killed, the log names it, the batch and the file, and its task is retried on a new worker; a task that hangs 3 times stops the job. With --ray, a slice that has not come back this long after it began on the cluster is hung alike (its Ray worker killed, the slice queued again). Keep it above the longest one image (on the cluster, one slice) may take: an object store's read through its retries takes up to about 6 minutes.", float, minimum=0, min_open=True)
    # Not --task-timeout: that is set to seconds where images are fast (the tests', the fault harness' 2-5 s), and a
    # worker that imports torch for a hook took over 3 s to get ready on the 2-core box under a test run's load.
    # 600 s as for an image: only a start that hangs is killed (a hook's module that blocks when imported).
    worker_start_timeout: float = _opt(600.0, "Seconds a local worker may take to get ready for its first task (importing torch and the --transform hook's module, opening the dataset's storage) before it counts as hung: it is then killed, the log and the status's message say what it was doing, and another starts in its place; 3 in a row in one place stop the job. The daemon's own import of the hook's module, when a job starts, has as long. With --ray, a slice that has not begun this long after it was submitted to the cluster (its Ray worker's start, its wait in Ray's queue included) is cancelled, its Ray worker killed, and submitted again; 3 of one slice in a row, with no slice built on the cluster in between, stop the job.", float, minimum=0, min_open=True)
    min_free_mb: int | None = _opt(None, f"Never let the buffer's filesystem fall below this many MiB free [default: {MIN_FREE_RULE}].", int, minimum=0, unit="MiB", metavar="MIB")
    seed: int = _opt(0, "Seed of sample order and augmentation.", int, minimum=0, maximum=2**63 - 1)
    epochs: int | None = _opt(None, "Stop after this many epochs [default: run on].", int, minimum=1,
                               maximum=MAX_EPOCH + 1)  # a batch's name holds epochs up to MAX_EPOCH
    drop_last: bool = _opt(False, "Leave out each epoch's last batch where it would be short, as DataLoader(drop_last=True): every batch then holds --batch-size images, and which samples are left out changes from epoch to epoch with the shuffle (with --split val, in order, the same ones every time: each evaluation leaves them out). A model with BatchNorm cannot train on a batch of one image.", bool)
    color_jitter: float | None = _opt(None, "Train only: colour jitter of strength S, as torchvision's ColorJitter(S, S, S): brightness, contrast and saturation factors drawn from [max(0, 1-S), 1+S], applied in a random order; 0.4 in the usual ImageNet recipe [default: off].", float, minimum=0.0,
                                      maximum=1000.0)  # past float32's range, a factor failed every image
    scale_jitter: str | None = _opt(None, "Train only: 'MIN,MAX', ResNet's scale augmentation instead of the random resized crop: the shorter side is resized to a random length in [MIN, MAX] (MIN >= IMAGE_SIZE), then a random IMAGE_SIZE crop is taken and flipped half the time; e.g. '256,480' [default: off].", str)
    transform: str | None = _opt(None, "Your own augmentation 'package.module:callable', applied after the built-in ones: called with a uint8 3 x IMAGE_SIZE x IMAGE_SIZE tensor and the sample's numpy Generator, it returns a uint8 tensor of the same shape [default: off].", str)
    strict: bool = _opt(False, "Fail the job on the first image that cannot be decoded (or read, or is missing), instead of replacing it with the next sample of the split.", bool)
    max_bad_samples: int | None = _opt(None, "Stop the job once more than this many distinct files could not be decoded, or read (missing ones too; they are replaced until then) [default: no limit].", int, minimum=0)
    max_bad_fraction: float | None = _opt(None, "Stop the job once the files that could not be decoded or read exceed this fraction of the split's samples [default: no limit].", float, minimum=0.0, maximum=1.0)
    max_image_pixels: int = _opt(DEFAULT_MAX_IMAGE_PIXELS, "Refuse images whose header declares more pixels than this, as decompression bombs do (both decoders); they count as undecodable.", int, minimum=1)
    world_size: int = _opt(1, "Ranks (trainer processes) in the whole job, over all boxes.", int, minimum=1, maximum=65536)
    ranks: str | None = _opt(None, "Ranks this daemon produces, e.g. 0-7 or 8,9 [default: all of --world-size].", str)
    reset: bool = _opt(False, "Delete what the buffer holds from a different job instead of refusing to start.", bool)
    group_access: bool = _opt(False, "Let the buffer directory's group read batches and write progress (mode 2770 instead of 0700; the group may read what the daemon writes whatever its umask), for trainers running as other users of that group, as under the systemd unit.", bool)
    # Who may ask for what: a job.json owned by another user (the buffer's group, with --group-access)
    # makes the daemon read its data and import its transform with the service's files and credentials.
    allowed_data: tuple[str, ...] = _opt((), "Dataset roots (local folders or URL prefixes) that jobs submitted by other users, such as the buffer's group with --group-access, may read: their `data` must lie inside one (symlinks and '..' resolved). Repeat the flag for several. Jobs of the daemon's own user are not limited [default: none, so such jobs may not name a dataset].", str, multiple=True, location=True, metavar="ROOT|URL")
    allowed_transforms: tuple[str, ...] = _opt((), "Transform hooks ('package.module:callable', exact) that jobs submitted by other users may name, since the daemon imports and runs them as itself. Repeat the flag for several [default: none].", str, multiple=True, metavar="MODULE:CALLABLE")
    ray: str | None = _opt(None, "Also build batches on a Ray cluster (needs prefetchd[ray]): 'local' starts a private one on this machine, 'auto' joins the cluster this machine belongs to, 'ray://HOST:PORT' connects as a Ray client, 'HOST:PORT' joins the cluster whose head (GCS) listens there; local --workers keep working beside it; see docs/SCALE.md [default: off].", str, metavar="local|auto|HOST:PORT|ray://HOST:PORT")
    ray_builds: int | None = _opt(None, "With --ray: at most this many batches are being built on the cluster at once [default: enough to keep two slices queued per cluster CPU].", int, minimum=1, maximum=65536)
    metrics_port: int | None = _opt(None, "Serve Prometheus metrics on this port [default: off].", int, minimum=1, maximum=65535)
    metrics_address: str = _opt("127.0.0.1", "Address the metrics port binds to (0.0.0.0 for every interface).", str)
    metrics_textfile: Path | None = _opt(None, "Also write the metrics to this file (node-exporter textfile collector) [default: off].", Path, path="file")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_value(f.name, getattr(self, f.name))
        if self.data is not None:
            object.__setattr__(self, "data", normalize(self.data))
        for name in LIST_FIELDS:  # a TOML array arrives as a list; the frozen config holds tuples
            items = tuple(getattr(self, name))
            object.__setattr__(self, name, tuple(normalize(v) for v in items) if FIELDS[name].metadata.get("location") else items)
        if self.buffer is None:
            raise ConfigError("no buffer directory: pass --buffer DIR (for example /dev/shm/bf) or set `buffer` in the config")
        if self.high_water is not None and self.low_water is not None and self.low_water >= self.high_water:
            raise ConfigError(f"low_water = {self.low_water} must be below high_water = {self.high_water}")
        check_buffer_outside(self.buffer, self.data)
        check_not_a_stream_folder(self.buffer)
        empty = {"train": 1.0, "val": 0.0}[self.split]  # the fraction that leaves this split no sample of any dataset
        if self.val_fraction == empty:  # `prefetchd config` said "valid" to what start refused (a user's walk)
            raise ConfigError(f"val_fraction = {shown(self.val_fraction)} leaves the {self.split} split empty: hold out "
                              f"a fraction {'below 1' if empty else 'above 0'}, or leave val_fraction out to "
                              f"{'train' if self.split == 'train' else 'validate'} on all of the data")
        self._check_augmentation()
        self._check_ray()
        self.local_ranks  # validates `ranks` against `world_size`

    def _check_augmentation(self) -> None:
        if self.split != "train":
            for name in ("color_jitter", "scale_jitter"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{name} = {shown(getattr(self, name))} applies to the train split only; "
                                      f"leave it out for --split {self.split}")
        bounds = self.scale_jitter_bounds
        if bounds is not None and bounds[0] < self.image_size:
            raise ConfigError(f"scale_jitter = {shown(self.scale_jitter)}: the shorter side must be at least image_size "
                              f"({self.image_size}) for an image_size crop to fit; raise MIN to {self.image_size} or more")
        if self.transform is not None:
            check_hook_name("transform", self.transform)
        for hook in self.allowed_transforms:
            check_hook_name("allowed_transforms", hook)

    def _check_ray(self) -> None:
        if self.ray is not None:
            if not RAY_ADDRESS.fullmatch(self.ray):
                raise ConfigError(f"ray = {shown(self.ray)}: expected 'local', 'auto', 'ray://HOST:PORT' (a Ray client "
                                  "server, port 10001 by default) or 'HOST:PORT' (the head's GCS, port 6379 by default)")
        if self.ray is None:
            if self.workers == 0:
                raise ConfigError("workers = 0 leaves nobody to build batches: pass --ray ADDRESS to build them on a "
                                  "Ray cluster, or --workers 1 or more")
            if self.ray_builds is not None:
                raise ConfigError(f"ray_builds = {self.ray_builds} needs --ray ADDRESS; leave it out without a cluster")

    @property
    def augmentation(self) -> str:
        """The optional augmentations as one canonical string for the manifest ("" when none is on)."""
        bounds = self.scale_jitter_bounds
        options = {
            "color_jitter": self.color_jitter,
            "scale_jitter": f"{bounds[0]},{bounds[1]}" if bounds is not None else None,
            "transform": self.transform,
            # It decides which samples are replaced, so it is part of what a batch holds.
            "max_image_pixels": self.max_image_pixels if self.max_image_pixels != DEFAULT_MAX_IMAGE_PIXELS else None,
        }
        return augmentation_text({name: value for name, value in options.items() if value is not None})

    @property
    def scale_jitter_bounds(self) -> tuple[int, int] | None:
        """``scale_jitter`` as (MIN, MAX) shorter-side lengths, or None when it is off."""
        if self.scale_jitter is None:
            return None
        parts = self.scale_jitter.split(",")
        try:
            lo, hi = (int(v) for v in parts)
        except ValueError:
            raise ConfigError(f"scale_jitter = {shown(self.scale_jitter)}: expected 'MIN,MAX' shorter-side lengths in "
                              "pixels, for example '256,480'") from None
        if not 1 <= lo <= hi:
            raise ConfigError(f"scale_jitter = {shown(self.scale_jitter)}: need MIN <= MAX, both at least the image size, for example '256,480'")
        return (lo, hi)

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks whose streams this daemon produces: at most MAX_LOCAL_RANKS."""
        if self.ranks is None:
            chosen = set(range(min(self.world_size, MAX_LOCAL_RANKS + 1)))
        else:
            chosen = set()
            try:
                for part in self.ranks.split(","):
                    lo, _, hi = part.strip().partition("-")
                    first, last = int(lo), int(hi or lo)
                    if last < first:
                        raise ConfigError(f"ranks = {shown(self.ranks)}: the range {part.strip()} runs backwards; write "
                                          f"{last}-{first}")
                    if first < 0 or last >= self.world_size:  # before the set: 0-999999999 would fill the memory
                        world = (f"world_size {self.world_size}" if self.world_size > 1 else
                                 "world_size 1, the default: set --world-size to the job's number of ranks")
                        raise ConfigError(f"ranks = {shown(self.ranks)}: every rank must be in 0-{self.world_size - 1} "
                                          f"({world})")
                    chosen.update(range(first, min(last, first + MAX_LOCAL_RANKS) + 1))
            except ValueError:
                raise ConfigError(f"ranks = {shown(self.ranks)}: expected ranks and ranges such as 0-3 or 0,2,4") from None
        # Each rank is a folder, an fd and a stream the daemon keeps: a job.json of a group member asking for
        # world_size 65536 made 65,536 folders, and the heartbeat stopped while it did.
        if len(chosen) > MAX_LOCAL_RANKS:
            given = "" if self.ranks is None else f"ranks = {shown(self.ranks)} name more than that; "
            raise ConfigError(f"one daemon produces at most {MAX_LOCAL_RANKS} ranks (a box's): {given}with world_size "
                              f"{self.world_size}, pass --ranks with this box's ranks (for example 0-7) and start a "
                              "daemon on each box")
        return tuple(sorted(chosen))

    @property
    def batch_bytes(self) -> int:
        """The space one batch file takes on the buffer's filesystem: its length, rounded up to the huge page where
        the tmpfs gives files huge pages past their end (``mounts.allocation_unit``)."""
        return taken_bytes(BatchLayout.plan(self.batch_size, self.image_size, self.image_size).file_len,
                           self.space_unit)

    @functools.cached_property
    def space_unit(self) -> int:
        """The bytes by which a file's space grows on the buffer's filesystem (``mounts.allocation_unit``)."""
        return allocation_unit(filesystem_of(Path(self.buffer)))


def check_not_a_stream_folder(buffer: Path) -> None:
    """A buffer named as a rank's stream folder (rank-NNNNN) inside another daemon's buffer was started on, and
    every other command took it for that daemon's rank: `status` showed the other's pid, `stop` refused to stop
    it, and its trainer was told that daemon serves no such rank (a walk)."""
    owner = owning_buffer(buffer)
    if owner != Path(buffer):
        raise ConfigError(f"buffer {buffer} is named as a rank's stream folder of the buffer {owner}, and every "
                          f"prefetchd command would take it for one: give it another name, or a folder outside {owner}")


def check_buffer_outside(buffer: Path, data: str | None) -> None:
    """A buffer in a local dataset folder was read as one of its classes, one without images, and a refused
    start leaves the buffer there (its status.json says why), so every later start on that dataset failed
    too, whatever its buffer: refused before the buffer is made.  Symlinks are resolved on both sides, and a
    folder above the buffer that is the dataset's folder itself (a bind mount of it elsewhere: a walk) counts."""
    if data is None or is_url(data):
        return
    inside_it = inside(os.path.realpath(buffer), os.path.realpath(data))
    if not inside_it:
        try:
            root = os.stat(data)
        except OSError:  # not there: opening it says so
            return
        # Not only the nearest: the buffer's folder may be there already, whose own folder is the dataset's.
        above = nearest_existing(Path(buffer))
        for folder in (above, *above.parents):
            try:
                st = os.stat(folder)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (root.st_dev, root.st_ino):
                inside_it = True
                break
    if inside_it:
        raise ConfigError(f"buffer {buffer} is inside the dataset {data}, whose folders the daemon reads as "
                          "classes: put the buffer outside it, for example under /dev/shm")


def require_ray() -> None:
    """Refuse --ray, with the command that fixes it, when Ray is not installed (it is imported only by
    the process that talks to the cluster, and only with --ray).  The daemon checks at start, before it
    indexes a dataset; a config naming a cluster stays valid where Ray is not installed."""
    if importlib.util.find_spec("ray") is None:
        raise ConfigError("--ray needs Ray, which is not installed in this environment: pip install 'prefetchd[ray]' "
                          "(on every node of the cluster too), or start without --ray")


def check_value(name: str, value: Any) -> None:
    """Refuse a value of the wrong type or range, naming the key and what is allowed."""
    check_field(FIELDS[name], value, ConfigError)


def check_hook_name(key: str, hook: str) -> None:
    """Refuse a transform hook that is not written 'package.module:callable' (whether it imports is
    ``hook.validate_hook``'s, where it runs)."""
    module, sep, attr = hook.partition(":")
    if not sep or not module.strip() or not attr.strip():
        raise ConfigError(f"{key} = {shown(hook)}: expected 'package.module:callable', "
                          "for example 'mytraining.augment:randaugment'")


def check_job_setting(name: str, value: Any) -> None:
    """What `prefetchd submit` can check of one job setting before it writes the job: the daemon's own
    rules for it alone.  Those that weigh one setting against another (scale_jitter against image_size)
    the daemon checks, since a job takes the settings it leaves out from the daemon's flags."""
    check_value(name, value)
    if name == "transform" and isinstance(value, str):
        check_hook_name(name, value)


FIELDS = {f.name: f for f in dataclasses.fields(DaemonConfig)}
LIST_FIELDS = tuple(name for name, f in FIELDS.items() if f.metadata.get("multiple"))


# `prefetchd start`'s options that are not DaemonConfig fields, and where they are set instead.
COMMAND_LINE_ONLY = {
    "log_level": "set it with --log-level on the command line (a service's: in its unit's ExecStart)",
    "config": "a config file cannot name another; the one read is the command line's --config",
}


MAX_CONFIG_BYTES = 1 << 20


def load_toml(path: Path) -> dict[str, Any]:
    """Read a config file; keys are the CLI flag names with '-' or '_'."""
    try:
        with open(path, "rb") as fh:
            text = fh.read(MAX_CONFIG_BYTES + 1)  # bounded: --config /dev/zero grew to gigabytes
        if len(text) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {path} is larger than {binary_size(MAX_CONFIG_BYTES)}, which no "
                              "prefetchd configuration is; pass the TOML file of its settings")
        raw = tomllib.loads(text.decode())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML (UTF-8): {exc}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name in COMMAND_LINE_ONLY:
            raise ConfigError(f"{path}: {key!r} is not a config key: {COMMAND_LINE_ONLY[name]}; allowed keys are "
                              f"{', '.join(sorted(FIELDS))}")
        if name not in FIELDS:
            raise ConfigError(f"{path}: unknown key {key!r}{_meant(key)}; allowed keys are {', '.join(sorted(FIELDS))}")
        if name in values:  # batch_size and batch-size: which one was meant?
            raise ConfigError(f"{path}: {name!r} is set twice ({name} and {name.replace('_', '-')}); keep one")
        if FIELDS[name].metadata["kind"] is Path and isinstance(value, str) and value:  # "": check_value says so
            # "~" expanded as data's is (normalize): buffer = "~/b" was a folder named ~ beside the file (a walk).
            value = os.path.expanduser(value)
            value = (path.parent.absolute() / value) if not os.path.isabs(value) else Path(value)
        if FIELDS[name].metadata.get("location"):  # relative to the file, as paths are
            base = path.parent.absolute()
            if isinstance(value, str) and value:  # "": check_value says so (it was the file's folder)
                value = normalize(value, base=base)
            elif isinstance(value, list):
                value = [normalize(v, base=base) if isinstance(v, str) and v else v for v in value]
        try:
            check_value(name, value)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        values[name] = value
    return values


def _meant(key: str) -> str:
    """" (did you mean 'batch_size'?)" for the unknown ``key`` 'batch_sise': the closest config key, written
    with '-' where ``key`` is; "" where none is close."""
    close = difflib.get_close_matches(key.replace("-", "_"), FIELDS, n=1)
    if not close:
        return ""
    meant = close[0].replace("_", "-") if "-" in key else close[0]
    return f" (did you mean {meant!r}?)"


def usable_cores() -> set[int]:
    """The cores this process may run on (its affinity: a cgroup's cpuset, taskset, AllowedCPUs=)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    """The cores this process may run on, as many as its cgroup's CPU quota keeps busy (``cpu_quota``)."""
    return quota_cpus(len(usable_cores()), cpu_quota())


def held_bytes(cfg: DaemonConfig) -> int:
    """Bytes of the finished batches in the streams of ``cfg``'s ranks: this buffer's room, not space other files
    hold, since a start keeps them (the same job's) or deletes them (another's, with --reset).  A stream this user
    may not list counts 0 (`prefetchd config` run by another user than the buffer's: `start` says whose).  Only the
    buffer owner's files count, by the pages they hold: a member of a --group-access buffer's group may put a sparse
    file of theirs (`truncate -s 1T`) under a batch's name, which would have raised the default mark."""
    try:
        owner = os.stat(cfg.buffer).st_uid
    except OSError:  # not made yet: nothing held
        return 0
    total = 0
    for rank in cfg.local_ranks:
        try:
            batches = list_batches(stream_dir(cfg.buffer, rank, cfg.world_size))
        except PermissionError:
            continue
        for path in batches.values():
            with contextlib.suppress(FileNotFoundError):  # consumed meanwhile (`config --show` beside a daemon)
                st = path.lstat()
                if st.st_uid == owner:
                    total += st.st_blocks * 512
    return total


def default_min_free_mb(fs_bytes: int) -> int:
    """The free-space floor (``MIN_FREE_RULE``): on a tmpfs so small that MIN_FREE_MB is most of it
    (Docker's /dev/shm is 64 MiB) a share of it, so the defaults still leave room for batches; never 0,
    which would let batches fill it to the last page."""
    return max(1, min(MIN_FREE_MB, int(fs_bytes * SMALL_FS_SHARE) >> 20), int(fs_bytes * MIN_FREE_SHARE) >> 20)


def _min_free_rule_applied(fs_bytes: int, floor: int) -> str:
    """Which part of MIN_FREE_RULE gave ``floor`` MiB on a filesystem of ``fs_bytes``: the whole rule, with
    numbers to work out, left the user of a 64 MiB tmpfs to find why the floor was 6."""
    fs = f"the buffer's {binary_size(fs_bytes)} filesystem"
    if floor > MIN_FREE_MB:
        return f"{MIN_FREE_SHARE:.0%} of {fs}"
    if floor == MIN_FREE_MB:
        return f"at least {MIN_FREE_MB} MiB: {MIN_FREE_SHARE:.0%} of {fs} is less"
    if floor > 1:
        return (f"{SMALL_FS_SHARE:.0%} of {fs}: under {MIN_FREE_MB / SMALL_FS_SHARE:.0f} MiB, {MIN_FREE_MB} MiB "
                "would be most of it")
    return f"at least 1 MiB: {SMALL_FS_SHARE:.0%} of {fs} is less"


def fill_defaults(cfg: DaemonConfig, held: int | None = None) -> tuple[DaemonConfig, list[str]]:
    """Size every ``None`` field from this machine; return the config and a note per default.  ``held``:
    ``held_bytes(cfg)`` where the caller has it (it passes the same to ``check_capacity``), else listed here."""
    notes: list[str] = []
    changes: dict[str, Any] = {}
    if cfg.workers is None:
        cores, quota = len(usable_cores()), cpu_quota()  # usable_cpus(), with the parts its note names
        cpus = quota_cpus(cores, quota)
        changes["workers"] = max(1, cpus - 1)
        limited = f": a CPU quota of {quota:g} of the {cores} cores it may run on" if quota and cpus < cores else ""
        notes.append(f"workers = {changes['workers']} ({counted(cpus, 'usable CPU')}{limited}"
                     + (", one left for the trainer)" if cpus > 1 else ")"))
    fs = os.statvfs(nearest_existing(Path(cfg.buffer)))  # the daemon creates the buffer; config --show may not
    fs_total = fs.f_blocks * fs.f_frsize
    if cfg.min_free_mb is None:
        changes["min_free_mb"] = default_min_free_mb(fs_total)
        notes.append(f"min_free_mb = {changes['min_free_mb']} ({_min_free_rule_applied(fs_total, changes['min_free_mb'])})")
    min_free = (changes.get("min_free_mb", cfg.min_free_mb) or 0) << 20
    batch = cfg.batch_bytes
    if cfg.high_water is None:
        # The buffer's own batches are its room: counted as used, a restart sized a lower mark than the start before
        # it and deleted the batches beyond it, on a tmpfs that sizes the mark (Docker's 64 MiB /dev/shm) each time.
        held = held_bytes(cfg) if held is None else held
        fs_free = fs.f_bavail * fs.f_frsize + held
        # A memory cgroup's limit binds first where it is lower: the batches' tmpfs pages count against it (and
        # those the buffer holds already are its room, as above).
        room = memory_room()
        room = None if room is None else room + held
        available = psutil.virtual_memory().available
        ram = available if room is None else min(room, available)
        memory = ("available RAM" if room is None or ram < room else
                  f"the memory this daemon's cgroup may still take ({binary_size(room)})")
        budget = min(TMPFS_SHARE * max(0, fs_free - min_free), RAM_SHARE * ram)
        ranks = len(cfg.local_ranks)  # the mark is each rank's: they share the budget
        sized = int(min(MAX_DEFAULT_HIGH_WATER, budget // (batch * ranks)))
        high = max(MIN_DEFAULT_HIGH_WATER, sized)
        if cfg.low_water is not None and high <= cfg.low_water:
            high = cfg.low_water + 1  # an explicit low-water mark wins; check_capacity still guards the space
        changes["high_water"] = high
        what = f"batches of {binary_size(batch)}{f' for each of {ranks} ranks' if ranks > 1 else ''}"
        if sized < MIN_DEFAULT_HIGH_WATER:  # "at most half the free tmpfs" is not true of this one: say what is
            binding = ("half the free tmpfs above the --min-free-mb floor" if budget < RAM_SHARE * ram
                       else f"a quarter of {memory}")
            notes.append(f"high_water = {high} ({what}: the least a default is, though {binding} holds "
                         f"{counted(sized, 'batch')})")
        else:
            # "above the floor": the free tmpfs alone gave other marks than the note's sums (a walk).
            notes.append(f"high_water = {high} ({what}: at most half the free tmpfs above the --min-free-mb floor, "
                         f"a quarter of {memory}, "
                         f"{MAX_DEFAULT_HIGH_WATER} batches)")
    if cfg.index_cache is None:
        changes["index_cache"] = default_cache_dir()
        # Outside the unit (`config --show` by the admin) the default is the caller's, not the service's: say so.
        unit = (f"the systemd unit's daemon uses $CACHE_DIRECTORY instead, which its CacheDirectory= sets to "
                f"{UNIT_CACHE_DIRECTORY}")
        where = ("$CACHE_DIRECTORY, from systemd" if os.environ.get("CACHE_DIRECTORY") else
                 "a folder of this run's own, removed at its exit: this uid has no account, so no home to keep "
                 f"indexes in; set $XDG_CACHE_HOME or --index-cache to keep them; {unit}"
                 if private_temp(changes["index_cache"]) else f"this user's cache folder; {unit}")
        notes.append(f"index_cache = {changes['index_cache']} ({where})")
    if cfg.readers is None and cfg.data is not None:
        changes["readers"] = URL_READERS if is_url(cfg.data) else 1
        notes.append(f"readers = {changes['readers']} ({'object storage' if is_url(cfg.data) else 'a local folder'})")
    high_water: int = changes["high_water"] if cfg.high_water is None else cfg.high_water
    if cfg.low_water is None:
        changes["low_water"] = high_water // 2
        notes.append(f"low_water = {changes['low_water']} (half the high-water mark)")
    cfg = dataclasses.replace(cfg, **changes)
    return cfg, notes
