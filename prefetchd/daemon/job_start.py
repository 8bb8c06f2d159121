"""Starting a job: index its dataset, take over the buffer for it (its stream folders and manifests) and
make its producer, with a heartbeat all along (``StartupBeat``), since indexing can take minutes."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from prefetchd.buffer_protocol import DaemonLock, JobResult, Manifest, RunningJob, State, Status, stream_dir, write_status
from prefetchd.buffer_protocol.json_files import MAX_MANIFEST_LEN, encode_json
from prefetchd.buffer_protocol.layout import LOCK_NAME, MANIFEST_NAME, STREAM_PREFIX
from prefetchd.buffer_protocol.ownership import lock_file_held
from prefetchd.daemon.buffer_dir import (NO_ROOM_ERRNOS, adopt_manifest, another_jobs, check_capacity, free_bytes,
                                         holds_a_stream, make_stream_dir, remove_stream)
from prefetchd.daemon.config import DaemonConfig, fill_defaults, held_bytes
from prefetchd.daemon.dataset import (hidden_classes, logged_progress, loose_images, split_folders_as_classes,
                                      split_members)
from prefetchd.daemon.errors import ConfigError
from prefetchd.daemon.hook import validate_hook_within
from prefetchd.daemon.job_inbox import JobInbox
from prefetchd.daemon.job_policy import check_files_inside
from prefetchd.daemon.logs import log_once, status_unwritten
from prefetchd.daemon.pool import make_room_for_files
from prefetchd.daemon.producer import Producer, new_producer_id
from prefetchd.daemon.producer_status import STATUS_SECONDS
from prefetchd.daemon.sampler import samples_per_rank, steps_per_epoch
from prefetchd.daemon.sdnotify import Notifier
from prefetchd.daemon.sources import open_dataset
from prefetchd.daemon.wakeup import Wakeup
from prefetchd.daemon.worker_health import STALL_NOTE_SECONDS
from prefetchd.words import all_epochs, binary_size, counted

log = logging.getLogger(__name__)


class StoppedWhileStarting(Exception):
    """A stop signal came while a job started: the start is given up where it was (``StartupBeat``)."""


class StartupBeat:
    """The heartbeat while a job starts: indexing a large dataset takes minutes, and a daemon
    whose status.json does not move in that time would look stuck to trainers (and systemd).
    It is where a stop signal is noticed meanwhile too (``wake``): waited for until the index
    was done, a `systemctl stop` ended in SIGKILL and `prefetchd stop` in its timeout."""

    def __init__(self, buffer: Path, notifier: Notifier, job_result: Callable[[], JobResult | None] = lambda: None,
                 wake: Wakeup | None = None, buffer_fd: int | None = None,
                 running_job: Callable[[], RunningJob | None] = lambda: None) -> None:
        self.buffer = buffer
        self.buffer_fd = buffer_fd  # the locked buffer folder's fd (DaemonLock.dir_fd), which status.json goes into
        self.notifier = notifier
        self.job_result = job_result
        self.running_job = running_job
        self.wake = wake
        self._last: float | None = None

    def __call__(self, message: str, state: State = State.STARTING) -> None:
        """Write a status of ``state`` saying ``message``, at most once per STATUS_SECONDS; cheap to call often.
        StoppedWhileStarting once a stop signal came."""
        if self.wake is not None and self.wake.stop_signal is not None:
            raise StoppedWhileStarting(self.wake.stop_reason)
        self.notifier.watchdog()
        now = time.monotonic()
        if self._last is not None and now - self._last < STATUS_SECONDS:
            return
        self._last = now
        try:
            write_status(self.buffer, Status(pid=os.getpid(), state=state, heartbeat=time.time(),
                                             message=message, job_result=self.job_result(),
                                             running_job=self.running_job()), self.buffer_fd)
        except OSError as exc:
            status_unwritten(self.buffer, exc)


ROOM_RETRY_SECONDS = 1.0  # a write refused for want of space is tried again this often while a job starts


def write_when_room(write: Callable[[], None], path: Path, beat: StartupBeat,
                    meanwhile: Callable[[], None] = lambda: None) -> None:
    """``write`` (the document at ``path``), waited for while the buffer's filesystem has no room for it, as
    production waits at the --min-free-mb floor: a daemon restarted while the tmpfs is full goes on once space
    is freed there, instead of exiting.  ``meanwhile`` runs at each try (``Producer.free_consumed``: the
    batches a trainer consumes meanwhile make the room).  The log says so when the wait begins and when it
    ends, and the status meanwhile, as a pause for space (``State.PAUSED_LOW_SPACE``): with no page free it is
    written over the earlier daemon's, in that file's pages (``write_status``), so a trainer waiting on the
    buffer sees this daemon alive and waiting for room, not stuck.  A stop signal ends the wait (``beat``)."""
    since: float | None = None
    while True:
        try:
            write()
        except OSError as exc:
            if exc.errno not in NO_ROOM_ERRNOS:
                raise
            why = (f"no room to write {path} ({exc.strerror}; {binary_size(free_bytes(path.parent))} free on its "
                   "filesystem)")
            if since is None:
                since = time.monotonic()
                log.warning("waiting for room: %s; free space there, and the daemon goes on by itself", why)
                beat.notifier.status(f"waiting for room to write {path}")
            beat(f"waiting for room: {why}; free space there, and the daemon goes on by itself",
                 State.PAUSED_LOW_SPACE)
            meanwhile()
            time.sleep(ROOM_RETRY_SECONDS)
            continue
        if since is not None:
            log.info("wrote %s after waiting %.0f s for room; going on", path, time.monotonic() - since)
        return


def check_no_daemon_inside(buffer: Path) -> None:
    """Refuse a buffer holding another live daemon's buffer under a rank's stream folder name: this job would take
    it for a rank's stream (world size > 1, its manifest overwritten), or clear it as another job's (a walk: the
    nested daemon's trainer read this job's batches, and `prefetchd stop` of it said none ran, exit 0)."""
    for folder in sorted(buffer.glob(f"{STREAM_PREFIX}*")):
        if folder.is_dir() and not folder.is_symlink() and lock_file_held(folder / LOCK_NAME):
            raise ConfigError(f"{folder} is the buffer of another daemon (its {LOCK_NAME} is held), named as a rank's "
                              f"stream folder of {buffer}, which this daemon makes and clears: stop that daemon and "
                              "start it on a buffer elsewhere, then this one")


def start_job(job: DaemonConfig, reset: bool, wake: Wakeup, inbox: JobInbox,
              publish: Callable[[Status], None], notifier: Notifier, lock: DaemonLock) -> Producer:
    """Index the job's dataset, take over the buffer for it and return its producer."""
    # Its first status, written now, names the job that starts (``running_job``): before its manifests do.
    beat = StartupBeat(Path(job.buffer), notifier, lambda: inbox.result, wake, lock.dir_fd, inbox.running_job)
    beat(f"starting the job on {job.data}")
    held = held_bytes(job)  # one listing of the buffer's batches for both
    job, notes = fill_defaults(job, held)
    for note in notes:  # a later job's where they differ (a value, a reason)
        log_once(log, logging.INFO, "default: %s", note)
    make_room_for_files(job.workers or 0)  # before its workers start; a refusal names the limit and the fix
    short = check_capacity(job, held)
    if short is not None:
        log.warning("%s", short)
    if job.transform is not None:  # a typo fails here, not in every worker; a module that blocks, in bounded time
        validate_hook_within(job.transform, job.worker_start_timeout, beat,
                             note_after=min(STALL_NOTE_SECONDS, job.worker_start_timeout / 4))
    assert job.data is not None
    indexing = f"indexing {job.data}"
    notifier.status(indexing)
    index = open_dataset(job.data, tick=logged_progress(indexing, lambda so_far: beat(f"{indexing}: {so_far}")),
                         index_cache=job.index_cache, refresh_index=job.refresh_index)
    for mistaken in (split_folders_as_classes(index.classes, job.data), hidden_classes(index.classes, job.data),
                     loose_images(job.data)):
        if mistaken is not None:
            log.warning("%s", mistaken)
    if inbox.pending_id is not None and inbox.pending_confinement is not None:
        check_files_inside(index, job.data, inbox.pending_confinement, tick=lambda: beat(f"checking the files of {job.data}"))
    members = split_members(len(index), job.split, job.val_fraction, index.source_index)
    samples = samples_per_rank(len(members), job.world_size)
    if job.drop_last and samples < job.batch_size:
        per_rank = " per rank" if job.world_size > 1 else ""
        raise ConfigError(f"drop_last: the {job.split} split's {samples} samples{per_rank} fill no batch of "
                          f"{job.batch_size}, so every batch would be left out; lower --batch-size or leave out "
                          "--drop-last")
    check_no_daemon_inside(job.buffer)  # before anything here is cleared or taken for a rank's stream
    producer_id = new_producer_id()
    streams = []
    if job.world_size > 1:
        # A flat single-rank job left in the top directory is another job.
        adopt_manifest(job.buffer, None, reset, job.world_size)
    for rank in job.local_ranks:
        directory = stream_dir(job.buffer, rank, job.world_size)
        manifest = Manifest(
            dataset_root=job.data,  # as given (a file list, not its folder), for status and restart hints
            fingerprint=index.fingerprint,
            classes=list(index.classes),
            num_samples=len(index),
            split=job.split,
            seed=job.seed,
            batch_size=job.batch_size,
            image_size=job.image_size,
            samples_per_epoch=samples,
            steps_per_epoch=steps_per_epoch(samples, job.batch_size, job.drop_last),
            epochs=job.epochs,
            producer=producer_id,
            rank=rank,
            world_size=job.world_size,
            val_fraction=job.val_fraction,
            augmentation=job.augmentation,
            drop_last=job.drop_last,
            keyed_batches=True,
        )
        streams.append((directory, manifest))
    if streams and len(encode_json(streams[0][1].to_doc())) > MAX_MANIFEST_LEN:  # its readers would refuse it
        raise ConfigError(f"the {len(index.classes)} classes of {job.data} make a manifest.json of more than "
                          f"{MAX_MANIFEST_LEN >> 20} MiB, which trainers do not read: fewer classes, or shorter names")
    # Streams of ranks this job does not produce that another job wrote (one of a larger world, say): a loader
    # opened there would read that job's batches as if they were served, so they go, but only with --reset (a
    # submitted job is one), as another job's streams of this job's ranks do. Those of this job (a restart with
    # fewer --ranks) are left as they are, as the job's other data is.  (A single-rank job's adopt_manifest
    # looks at them itself.)
    others = [(leftover, differences)
              for leftover in sorted(set(job.buffer.glob(f"{STREAM_PREFIX}*")) - {directory for directory, _ in streams})
              if job.world_size > 1 and holds_a_stream(leftover)
              and (differences := another_jobs(leftover, streams[0][1]))]
    if others and not reset:
        leftover, differences = others[0]
        raise ConfigError(f"buffer {job.buffer} holds batches of a different job in {leftover.name}, a rank this job "
                          f"does not produce ({'; '.join(differences)}); pass --reset (reset = true in a config) to delete them, or use another "
                          "--buffer")
    folders: list[int] = []  # each stream folder's fd, which its Stream keeps (and closes)
    try:
        for directory, manifest in streams:
            folders.append(make_stream_dir(directory, job.group_access))
            adopt_manifest(directory, manifest, reset)
    except BaseException:
        for fd in folders:
            os.close(fd)
        raise
    # Its streams take the fds (and close them, or their finalizers do should the producer not be made).  Made
    # before the manifests are written: waiting for room to write them, it deletes what the trainers consume.
    producer = Producer(job, index, members, [(d, m, fd) for (d, m), fd in zip(streams, folders, strict=True)], wake,
                        poll_jobs=inbox.poll, job_result=lambda: inbox.result, running_job=inbox.running_job,
                        on_status=publish, notifier=notifier,
                        lock_lost=lock.lost, buffer_fd=lock.dir_fd)
    try:
        # The batches an earlier daemon of the job left are judged before its manifests say that its batches name
        # their stream (``Manifest.keyed_batches``): one of a daemon before them, kept until the adoption, would
        # stop a trainer that read it meanwhile as not its stream's.
        producer.take_positions()
        for (directory, manifest), fd in zip(streams, folders, strict=True):
            write_when_room(functools.partial(manifest.write, directory, fd), directory / MANIFEST_NAME, beat,
                            producer.free_consumed)
        for leftover, _differences in others:
            log.info("removing %s: another job's stream, of a rank this job does not produce", leftover)
            remove_stream(leftover)  # logs what it cannot remove: a file of someone else's, a folder put there
        ranks = f", ranks {job.ranks or f'0-{job.world_size - 1}'} of {job.world_size}" if job.world_size > 1 else ""
        log.info(
            "producing %s split of %s into %s: %s, %s of %d at %dpx per epoch%s, "
            "%s, high/low water %d/%d per rank, epochs %s",
            job.split, job.data, job.buffer, counted(samples, "sample"), counted(streams[0][1].steps_per_epoch, "step"),
            job.batch_size, job.image_size,
            ranks, counted(job.workers or 0, "worker"), job.high_water, job.low_water, job.epochs or "unbounded",
        )
        beat(f"starting the workers for {job.data}")  # the last look for a stop signal before they start
    except BaseException:
        producer.shutdown()  # its pool never started; its streams close their folders
        raise
    return producer


def already_consumed(producer: Producer) -> str:
    """Why a submitted job has nothing to produce, and how to have it produced again."""
    epochs = all_epochs(producer.streams[0].manifest.epochs or 0)
    return (f"nothing to produce: this job's trainers already consumed {epochs} (their progress: "
            f"{producer.progress_files}); to produce it again from epoch 0, remove those files and submit it again")
