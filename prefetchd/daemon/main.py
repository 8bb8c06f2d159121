"""`prefetchd start`: check the buffer, take it over, index the dataset, run the producer."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import psutil

from prefetchd.buffer_protocol import DaemonLock, Manifest, ProtocolError, list_batches
from prefetchd.buffer_protocol.layout import PROGRESS_NAME
from prefetchd.daemon.config import DaemonConfig, fill_defaults
from prefetchd.daemon.dataset import scan_class_folders, split_members
from prefetchd.daemon.errors import ConfigError
from prefetchd.daemon.producer import Producer, new_producer_id, sweep_leftovers
from prefetchd.daemon.sampler import samples_per_rank, steps_per_epoch

log = logging.getLogger(__name__)

RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def filesystem_of(path: Path) -> tuple[str, str]:
    """(mount point, filesystem type) of the mount holding ``path``."""
    path = path.resolve()
    best = ("/", "unknown")
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        if (path == Path(mount) or Path(mount) in path.parents) and len(mount) >= len(best[0]):
            best = (mount, part.fstype)
    return best


def prepare_buffer(buffer: Path) -> None:
    if buffer.exists() and not buffer.is_dir():
        raise ConfigError(f"buffer {buffer} exists and is not a directory; pick a directory such as /dev/shm/bf")
    try:
        buffer.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create buffer directory {buffer}: {exc.strerror}; pick a writable path such as /dev/shm/bf") from None
    if not os.access(buffer, os.W_OK | os.X_OK):
        raise ConfigError(f"buffer directory {buffer} is not writable by this user; fix its permissions or pick another --buffer")
    mount, fstype = filesystem_of(buffer)
    if fstype not in RAM_FILESYSTEMS:
        log.warning(
            "buffer %s is on %s (mounted at %s), not a RAM disk: every batch goes through that disk; "
            "use a directory under /dev/shm or another tmpfs", buffer, fstype, mount,
        )


def clear_buffer(buffer: Path) -> None:
    for path in list_batches(buffer).values():
        path.unlink(missing_ok=True)
    for name in (PROGRESS_NAME, "manifest.json"):
        (buffer / name).unlink(missing_ok=True)


def adopt_manifest(buffer: Path, manifest: Manifest, reset: bool) -> None:
    """Keep the batches of an earlier run of the same job; refuse (or with ``reset``, clear) others."""
    try:
        old: Manifest | None = Manifest.read(buffer)
    except FileNotFoundError:
        old = None
    except ProtocolError as exc:
        if not reset:
            raise ConfigError(f"{exc}. Pass --reset to clear the buffer, or use another --buffer") from None
        old = None
    if old is not None:
        diff = manifest.identity_diff(old)
        if diff and not reset:
            raise ConfigError(
                f"buffer {buffer} holds batches of a different job ({'; '.join(diff)}); pass --reset to "
                f"delete them, or use another --buffer"
            )
        if not diff:
            return
    if old is not None or list_batches(buffer):
        log.info("clearing %s: it held batches of another job", buffer)
        clear_buffer(buffer)


def check_capacity(cfg: DaemonConfig) -> None:
    """Refuse a high-water mark the filesystem cannot hold, instead of dying of SIGBUS later."""
    assert cfg.high_water is not None and cfg.min_free_mb is not None
    fs = os.statvfs(cfg.buffer)
    held = sum(p.stat().st_size for p in list_batches(cfg.buffer).values())
    available = fs.f_bavail * fs.f_frsize + held
    need = cfg.high_water * cfg.batch_bytes + (cfg.min_free_mb << 20)
    if need > available:
        raise ConfigError(
            f"high_water {cfg.high_water} x {cfg.batch_bytes / 2**20:.1f} MiB batches plus the "
            f"{cfg.min_free_mb} MiB floor need {need / 2**20:.0f} MiB but {cfg.buffer} has "
            f"{available / 2**20:.0f} MiB; lower --high-water or --batch-size, or enlarge the tmpfs "
            "(mount -o remount,size=... /dev/shm)"
        )


def run_daemon(cfg: DaemonConfig) -> int:
    if cfg.data is None:
        raise ConfigError("no dataset: pass --data ROOT (a folder of class folders) or set `data` in the config")
    data = Path(cfg.data)
    buffer = Path(cfg.buffer)
    prepare_buffer(buffer)
    lock = DaemonLock(buffer)
    lock.acquire()
    try:
        swept = sweep_leftovers(buffer)
        if swept:
            log.info("deleted %d half-written files left by an earlier daemon", swept)
        cfg, notes = fill_defaults(cfg)
        for note in notes:
            log.info("default: %s", note)
        check_capacity(cfg)
        index = scan_class_folders(data)
        members = split_members(len(index), cfg.split, cfg.val_fraction)
        samples = samples_per_rank(len(members))
        manifest = Manifest(
            dataset_root=str(index.root),
            fingerprint=index.fingerprint,
            classes=list(index.classes),
            num_samples=len(index),
            split=cfg.split,
            seed=cfg.seed,
            batch_size=cfg.batch_size,
            image_size=cfg.image_size,
            samples_per_epoch=samples,
            steps_per_epoch=steps_per_epoch(samples, cfg.batch_size),
            epochs=cfg.epochs,
            producer=new_producer_id(),
            val_fraction=cfg.val_fraction,
        )
        adopt_manifest(buffer, manifest, cfg.reset)
        manifest.write(buffer)
        log.info(
            "producing %s split of %s into %s: %d samples, %d steps of %d at %dpx per epoch, "
            "%d workers, high/low water %d/%d, epochs %s",
            cfg.split, index.root, buffer, samples, manifest.steps_per_epoch, cfg.batch_size, cfg.image_size,
            cfg.workers, cfg.high_water, cfg.low_water, cfg.epochs or "unbounded",
        )
        return Producer(cfg, index, members, manifest).run()
    finally:
        lock.release()
