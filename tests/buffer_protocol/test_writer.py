"""The batch writer: begin, fill slots (in any order, from other processes), commit or abort."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefetchd.buffer_protocol import (
    BatchLayout,
    PendingBatch,
    SlotFiller,
    SpareFiles,
    batch_name,
    list_batches,
    list_temp_files,
    map_batch,
    write_batch,
)

FIELDS: dict[str, Any] = {"epoch": 3, "step": 1, "seed": 9, "producer": "p", "replaced": 2}


def _arrays(n: int, h: int = 4, w: int = 5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(n)
    return rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8), rng.integers(0, 1000, n), np.arange(n) + 50


@settings(max_examples=40, deadline=1000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(order=st.integers(1, 6).flatmap(lambda n: st.permutations(range(n))))
def test_slots_filled_in_any_order_give_the_bytes_of_write_batch(order: list[int], tmp_path: Path) -> None:
    directory = Path(tempfile.mkdtemp(dir=tmp_path))
    images, labels, indices = _arrays(len(order))
    write_batch(directory / "whole.batch", images, labels, indices, **FIELDS)
    pending = PendingBatch.begin(directory / batch_name(3, 1), BatchLayout.plan(*images.shape))
    with pending.slots() as slots:
        for slot in order:
            slots.fill(slot, memoryview(images[slot].reshape(-1)))
    final = pending.commit(labels, indices, **FIELDS)
    assert final.read_bytes() == (directory / "whole.batch").read_bytes()
    assert list(list_temp_files(directory)) == []


def test_another_process_fills_slots_knowing_only_the_temp_path_and_offsets(tmp_path: Path) -> None:
    images, labels, indices = _arrays(3)
    layout = BatchLayout.plan(*images.shape)
    pending = PendingBatch.begin(tmp_path / batch_name(0, 0), layout)
    assert list_batches(tmp_path) == {} and list(list_temp_files(tmp_path)) == [pending.tmp]
    assert pending.tmp.stat().st_size == layout.file_len
    fill = ("import sys; from prefetchd.buffer_protocol import SlotFiller\n"
            "path, offset, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])\n"
            "with SlotFiller(path, offset, size) as slots:\n"
            "    for slot in (2, 0, 1): slots.fill(slot, memoryview(bytes([slot + 1]) * size))\n")
    subprocess.run([sys.executable, "-c", fill, str(pending.tmp), str(layout.tensors["images"].offset),
                    str(layout.slot_bytes)], check=True, timeout=60)
    pending.commit(labels, indices, **FIELDS)
    batch = map_batch(tmp_path / batch_name(0, 0))
    assert [int(image.max()) for image in batch.images] == [1, 2, 3]
    assert [int(image.min()) for image in batch.images] == [1, 2, 3]
    assert batch.labels.tolist() == labels.tolist() and batch.indices.tolist() == indices.tolist()
    assert (batch.meta.epoch, batch.meta.step, batch.meta.replaced) == (3, 1, 2)


def test_abort_removes_the_temp_file_and_later_fills_fail_instead_of_creating_one(tmp_path: Path) -> None:
    pending = PendingBatch.begin(tmp_path / batch_name(0, 0), BatchLayout.plan(2, 4, 4))
    pending.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError):
        pending.slots()
    with pytest.raises(FileNotFoundError):
        pending.commit(np.zeros(2), np.zeros(2), **FIELDS)
    assert list(tmp_path.iterdir()) == []


def test_a_commit_that_cannot_publish_leaves_nothing_behind(tmp_path: Path) -> None:
    final = tmp_path / batch_name(0, 0)
    final.mkdir()  # rename cannot replace a directory with a file
    pending = PendingBatch.begin(final, BatchLayout.plan(2, 4, 4))
    with pytest.raises(OSError):
        pending.commit(np.zeros(2), np.zeros(2), **FIELDS)
    assert list(list_temp_files(tmp_path)) == [] and final.is_dir()


# -- spares: consumed batch files reused for the next batches ---------------------------------

HOLD = ("import sys; from prefetchd.buffer_protocol import map_batch\n"
        "batch = map_batch(sys.argv[1])\n"  # mapped privately, the file closed, as BufferLoader does
        "print(batch.images.tobytes().hex(), flush=True)\n"
        "sys.stdin.readline()\n"
        "print(batch.images.tobytes().hex(), flush=True)\n")


def _hold(path: Path) -> tuple[subprocess.Popen[str], str]:
    """A process that maps the batch at ``path`` and keeps it until its stdin gets a line; and its images' bytes."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _release(proc: subprocess.Popen[str]) -> str:
    """Let ``proc`` go; the images' bytes it saw last."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("\n")
    proc.stdin.flush()
    last = proc.stdout.readline().strip()
    proc.wait(30)
    return last


def _held_spare(directory: Path, spares: SpareFiles, images: np.ndarray) -> tuple[subprocess.Popen[str], str]:
    """Batch 0 of ``images``, mapped by another process (``_hold``), then retired to ``spares``."""
    batch = _begin_and_commit(directory, 0, spares, images)
    holder, seen = _hold(batch)
    spares.retire(batch)
    return holder, seen


def _begin_and_commit(directory: Path, step: int, spares: SpareFiles, images: np.ndarray,
                      producer: str = "p") -> Path:
    labels, indices = np.arange(len(images)) + step, np.arange(len(images)) * 7 + step
    pending = PendingBatch.begin(directory / batch_name(0, step), BatchLayout.plan(*images.shape), spares)
    with pending.slots() as slots:
        for slot, image in enumerate(images):
            slots.fill(slot, memoryview(image.reshape(-1)))
    return pending.commit(labels, indices, epoch=0, step=step, seed=1, producer=producer)


@pytest.mark.parametrize("first_n, second_n", [(4, 4), (3, 2)])  # (3, 2): another layout, the same file length
def test_a_batch_begun_in_a_spare_has_the_bytes_of_a_fresh_one(first_n: int, second_n: int, tmp_path: Path) -> None:
    spares = SpareFiles()
    first, _, _ = _arrays(first_n)
    # A longer producer name: more metadata in the header page than the next batch writes.
    old = _begin_and_commit(tmp_path, 0, spares, first, producer="a-much-longer-producer-name")
    inode = old.stat().st_ino
    spares.retire(old)
    assert not old.exists() and len(spares) == 1 and len(list(list_temp_files(tmp_path))) == 1  # swept at start
    second = np.random.default_rng(7).integers(0, 256, (second_n, *first.shape[1:]), dtype=np.uint8)
    assert BatchLayout.plan(*second.shape).file_len == list(list_temp_files(tmp_path))[0].stat().st_size
    reused = _begin_and_commit(tmp_path, 1, spares, second)
    assert reused.stat().st_ino == inode and len(spares) == 0  # the same file, its pages rewritten
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert reused.read_bytes() == _begin_and_commit(fresh, 1, SpareFiles(), second).read_bytes()


def test_a_spare_another_process_maps_is_not_reused_until_it_lets_go(tmp_path: Path) -> None:
    spares = SpareFiles()
    images, _, _ = _arrays(3)
    holder, seen = _held_spare(tmp_path, spares, images)
    other = np.full_like(images, 9)
    built = _begin_and_commit(tmp_path, 1, spares, other)  # the spare is mapped: a fresh file instead
    assert len(spares) == 1 and built.stat().st_ino != list(list_temp_files(tmp_path))[0].stat().st_ino
    assert _release(holder) == seen == images.tobytes().hex()  # its pages never changed under it
    assert _begin_and_commit(tmp_path, 2, spares, other) and len(spares) == 0  # let go: reused


def test_a_spare_with_another_name_is_not_reused(tmp_path: Path) -> None:
    # A batch someone hard-linked to keep it (``ln``, a backup tool): writing the next batch into its
    # spare would rewrite the kept copy too, which no lease shows since nobody has it open.
    spares = SpareFiles()
    images, _, _ = _arrays(3)
    old = _begin_and_commit(tmp_path, 0, spares, images)
    kept = tmp_path / "kept-elsewhere"
    os.link(old, kept)
    before = kept.read_bytes()
    spares.retire(old)
    built = _begin_and_commit(tmp_path, 1, spares, np.full_like(images, 9))
    assert built.stat().st_ino != kept.stat().st_ino and kept.read_bytes() == before


def test_the_newest_free_spare_is_taken_first(tmp_path: Path) -> None:
    # Its pages are the likeliest to be in the caches still; the oldest waits.
    spares = SpareFiles()
    images, _, _ = _arrays(3)
    paths = [_begin_and_commit(tmp_path, step, SpareFiles(), images) for step in range(3)]
    inodes = [p.stat().st_ino for p in paths]
    for path in paths:
        spares.retire(path)
    taken = [_begin_and_commit(tmp_path, step, spares, images).stat().st_ino for step in (3, 4)]
    assert taken == [inodes[2], inodes[1]] and len(spares) == 1


def test_a_spare_someone_keeps_is_passed_over_while_newest_then_deleted_and_its_pages_stay(tmp_path: Path) -> None:
    spares = SpareFiles()
    images, _, _ = _arrays(3)

    def spare(step: int, hold: bool) -> tuple[int, subprocess.Popen[str] | None, str]:
        batch = _begin_and_commit(tmp_path, step, SpareFiles(), np.full_like(images, step))
        inode = batch.stat().st_ino
        holder, seen = _hold(batch) if hold else (None, "")
        spares.retire(batch)
        return inode, holder, seen

    free = spare(10, hold=False)  # the oldest spare, nobody maps it
    held = [spare(11, hold=True), spare(12, hold=True)]
    # The two newest are held: passed over and kept (a trainer may let go of them in a moment);
    # the free one is taken.
    assert _begin_and_commit(tmp_path, 0, spares, images).stat().st_ino == free[0]
    assert len(spares) == 2 == len(list(list_temp_files(tmp_path)))
    newer = [spare(13, hold=False), spare(14, hold=False)]
    # Now the held ones are older than the two newest: kept by their trainer, they are deleted,
    # and the newest free spare is taken.
    assert _begin_and_commit(tmp_path, 1, spares, images).stat().st_ino == newer[1][0]
    assert [p.stat().st_ino for p in list_temp_files(tmp_path)] == [newer[0][0]] and len(spares) == 1
    for _inode, holder, seen in held:  # their pages never changed under them
        assert holder is not None and _release(holder) == seen


def test_spares_keep_within_their_room_oldest_first_and_a_batch_takes_one_of_its_size_first(tmp_path: Path) -> None:
    spares = SpareFiles()
    images, _, _ = _arrays(3, 64, 64)  # three pages an image: every count has its own file length
    paths = [_begin_and_commit(tmp_path, step, SpareFiles(), images) for step in range(3)]
    inodes = [p.stat().st_ino for p in paths]
    for path in paths:
        spares.retire(path)
    spares.fit(2)  # room for two files beside the batches: the oldest spare goes
    assert sorted(p.stat().st_ino for p in list_temp_files(tmp_path)) == sorted(inodes[1:])
    # A larger batch: no spare fits, and the fresh file takes a spare's place (the oldest's).
    larger, _, _ = _arrays(4, 64, 64)
    _begin_and_commit(tmp_path, 5, spares, larger)
    assert [p.stat().st_ino for p in list_temp_files(tmp_path)] == [inodes[2]] and len(spares) == 1
    # A smaller one (an epoch's short last batch) is built in a larger spare, cut to its length.
    short = _begin_and_commit(tmp_path, 6, spares, images[:2])
    assert short.stat().st_ino == inodes[2] and len(spares) == 0
    assert short.stat().st_size == BatchLayout.plan(2, 64, 64).file_len < BatchLayout.plan(3, 64, 64).file_len
    spares.retire(short)
    full = _begin_and_commit(tmp_path, 8, SpareFiles(), images)
    spares.fit(2)
    spares.retire(full)  # the newest, and larger: kept for a full batch, which the short one's file no longer fits
    assert _begin_and_commit(tmp_path, 7, spares, images[:2]).stat().st_ino == inodes[2]  # its own size first
    spares.retire(tmp_path / batch_name(0, 7))
    spares.fit(0)
    assert len(spares) == 0 and list(list_temp_files(tmp_path)) == []


# -- filling: through a mapping where the pages exist, else pwrite; errors, never SIGBUS --------

_FILL_ALL = ("import sys; from prefetchd.buffer_protocol import SlotFiller\n"
             "path, offset, size, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])\n"
             "with SlotFiller(path, offset, size, range(n)) as slots:\n"
             "    print('mapped' if slots.slot(0) is not None else 'pwrite', flush=True)\n"
             "    for slot in range(n): slots.fill(slot, memoryview(bytes([slot + 7]) * size))\n")


def _fill_elsewhere(pending: PendingBatch) -> subprocess.CompletedProcess[str]:
    images = pending.layout.tensors["images"]
    return subprocess.run([sys.executable, "-c", _FILL_ALL, str(pending.tmp), str(images.offset),
                           str(pending.layout.slot_bytes), str(images.shape[0])],
                          capture_output=True, text=True, timeout=60)


def _fill_up(directory: Path) -> None:
    """Write into ``directory`` until its file system has no byte left."""
    with open(directory / "filler", "wb", buffering=0) as filler:
        with pytest.raises(OSError) as info:
            while True:
                filler.write(b"\xff" * 4096)
    assert info.value.errno == errno.ENOSPC


def test_a_fresh_batch_on_a_full_file_system_is_an_enospc_not_a_sigbus(small_tmpfs: Path) -> None:
    # A fresh file has no pages yet: written through a mapping, the first page the tmpfs cannot
    # allocate would kill the process that fills (SIGBUS).
    pending = PendingBatch.begin(small_tmpfs / batch_name(0, 0), BatchLayout.plan(4, 48, 48))
    _fill_up(small_tmpfs)
    filled = _fill_elsewhere(pending)
    assert filled.returncode == 1 and filled.stdout.split() == ["pwrite"], (filled.returncode, filled.stderr)
    assert "No space left on device" in filled.stderr


def test_a_batch_begun_in_a_spare_fills_through_its_mapping_on_a_full_file_system(small_tmpfs: Path) -> None:
    spares = SpareFiles()
    images = np.zeros((4, 48, 48, 3), np.uint8)
    spares.retire(_begin_and_commit(small_tmpfs, 0, spares, images))
    pending = PendingBatch.begin(small_tmpfs / batch_name(0, 1), BatchLayout.plan(*images.shape), spares)
    assert pending.reused
    _fill_up(small_tmpfs)
    filled = _fill_elsewhere(pending)
    assert filled.returncode == 0 and filled.stdout.split() == ["mapped"], filled.stderr
    pending.commit(np.arange(4), np.arange(4), **FIELDS)
    batch = map_batch(small_tmpfs / batch_name(0, 1))
    assert [(int(image.min()), int(image.max())) for image in batch.images] == [(7, 7), (8, 8), (9, 9), (10, 10)]


def test_a_file_cut_short_or_not_the_users_is_refused(tmp_path: Path) -> None:
    layout = BatchLayout.plan(3, 8, 8)
    pending = PendingBatch.begin(tmp_path / batch_name(0, 0), layout)
    offset = layout.tensors["images"].offset
    os.truncate(pending.tmp, offset + layout.slot_bytes)  # one slot left of three
    with pytest.raises(OSError, match=r"hold no slots 0-2"):
        SlotFiller(pending.tmp, offset, layout.slot_bytes, range(3))
    with SlotFiller(pending.tmp, offset, layout.slot_bytes) as slots:  # by default: the slots the file holds
        slots.fill(0, memoryview(b"\x01" * layout.slot_bytes))
        with pytest.raises(IndexError, match="slot 1 is not among slots 0-0"):
            slots.fill(1, memoryview(b"\x01" * layout.slot_bytes))
    assert pending.tmp.stat().st_size == offset + layout.slot_bytes  # nothing written past them
    if os.geteuid() != 0:
        return
    os.chown(pending.tmp, 65534, -1)  # planted by another user (a group member, with --group-access)
    with pytest.raises(PermissionError, match="not a regular file of this user"):
        SlotFiller(pending.tmp, offset, layout.slot_bytes)


def test_the_fill_and_the_commit_write_only_the_file_begun_for_the_batch(tmp_path: Path) -> None:
    """A member of a --group-access buffer's group may rename its entries: with the folders of two ranks
    swapped, rank 0's temp path leads to rank 1's file of the same name (the same epoch and step).  Workers
    open by path, so they check the file is the one begun (``file_id``); the commit goes through the
    folder's fd, so it publishes the batch where it was begun."""
    layout = BatchLayout.plan(2, 4, 4)
    offset = layout.tensors["images"].offset
    ranks = [tmp_path / "rank-00000", tmp_path / "rank-00001"]
    fds = []
    for folder in ranks:
        folder.mkdir()
        fds.append(os.open(folder, os.O_RDONLY | os.O_DIRECTORY))
    try:
        pending = [PendingBatch.begin(folder / batch_name(0, 0), layout, dir_fd=fd) for folder, fd in zip(ranks, fds)]
        os.rename(ranks[0], tmp_path / "moving")
        os.rename(ranks[1], ranks[0])
        os.rename(tmp_path / "moving", ranks[1])
        for begun in pending:  # each path now leads to the other rank's file
            with pytest.raises(PermissionError, match="not the file begun for this batch"):
                SlotFiller(begun.tmp, offset, layout.slot_bytes, range(2), begun.file_id)
        final = pending[1].commit(np.array([5, 6]), np.arange(2), **FIELDS)
    finally:
        for fd in fds:
            os.close(fd)
    assert final == tmp_path / "rank-00001" / batch_name(0, 0)  # as shown: the name it was begun under
    published = tmp_path / "rank-00000" / batch_name(0, 0)  # where rank 1's folder is now
    assert map_batch(published).labels.tolist() == [5, 6]
    assert not (tmp_path / "rank-00001" / batch_name(0, 0)).exists()


# Holds a write lease on argv[1] (its owner may), ignoring the SIGIO of a break, so the kernel keeps a conflicting
# open waiting until lease-break-time (45 s) has passed.
_LEASE_HOLDER = ("import fcntl, os, signal, sys, time\n"
                 "signal.signal(signal.SIGIO, signal.SIG_IGN)\n"
                 "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
                 "fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)\n"
                 "print('held', flush=True)\n"
                 "time.sleep(120)\n")


def test_a_leased_file_renamed_over_the_temp_name_fails_the_fill_and_commit_at_once(tmp_path: Path) -> None:
    """A member of a --group-access buffer's group may rename a file of their own, on which they hold a lease,
    over a batch's temp name: the commit's and the workers' opens then waited for the kernel to break the lease
    (45 s, past the service's 30 s watchdog).  They fail at once now (EWOULDBLOCK), and the build is retried."""
    layout = BatchLayout.plan(2, 4, 4)
    pending = PendingBatch.begin(tmp_path / batch_name(0, 0), layout)
    theirs = tmp_path / "theirs"
    theirs.write_bytes(bytes(layout.file_len))
    holder = subprocess.Popen([sys.executable, "-c", _LEASE_HOLDER, str(theirs)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        os.rename(theirs, pending.tmp)
        with pytest.raises(BlockingIOError):
            SlotFiller(pending.tmp, layout.tensors["images"].offset, layout.slot_bytes, range(2), pending.file_id)
        with pytest.raises(BlockingIOError):
            pending.commit(np.arange(2), np.arange(2), **FIELDS)
    finally:
        holder.kill()
        holder.wait()
    assert not pending.tmp.exists() and not pending.final.exists()  # the commit aborted: nothing published


def test_a_slot_is_written_in_place_and_a_view_kept_past_close_keeps_only_its_own_mapping(tmp_path: Path) -> None:
    layout = BatchLayout.plan(2, 4, 4)
    pending = PendingBatch.begin(tmp_path / batch_name(0, 0), layout)
    with pending.slots() as fresh:
        assert fresh.slot(0) is None  # no pages yet: pwrite
    pending.tmp.write_bytes(bytes(layout.file_len))  # every page there, as in a spare
    slots = pending.slots()
    target = slots.slot(1)
    assert target is not None
    kept = np.frombuffer(target, np.uint8)
    kept[:] = 5
    slots.fill(0, memoryview(b"\x03" * layout.slot_bytes))
    slots.close()  # an array over slot 1 is still alive (as in an error's traceback): no BufferError
    assert kept.max() == 5
    del kept, target
    pending.commit(np.zeros(2), np.zeros(2), **FIELDS)
    assert [int(image.max()) for image in map_batch(tmp_path / batch_name(0, 0)).images] == [3, 5]
