"""BufferLoader.set_epoch: DistributedSampler's habit, on a fake job (the real daemon's regeneration
is covered in tests/integration/test_dropin.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from prefetchd.buffer_protocol import Progress
from prefetchd.buffer_protocol.layout import MAX_EPOCH
from prefetchd.trainer import BufferLoader, StateMismatch

if TYPE_CHECKING:  # conftest is pytest's to import; only its types are needed here
    from conftest import MakeJob


def progress(buffer: Path) -> tuple[int, int] | None:
    p = Progress.read(buffer)
    return None if p is None else (p.epoch, p.step)


def test_set_epoch_yields_that_epochs_batches_from_its_first(make_job: MakeJob) -> None:
    job = make_job(write=2)
    with BufferLoader(job.buffer, normalize=False, timeout=5) as loader:
        uninterrupted = [[(b.epoch, b.step, b.indices.tolist(), b.images.clone()) for b in loader] for _ in range(2)]
        assert [[x[:2] for x in e] for e in uninterrupted] == [[(0, 0), (0, 1), (0, 2)], [(1, 0), (1, 1), (1, 2)]]
    with BufferLoader(job.buffer, normalize=False, timeout=5) as fresh:
        fresh.set_epoch(1)  # a script resumed with --start-epoch 1
        assert fresh.position == (1, 0)
        batches = iter(fresh)
        assert progress(job.buffer) == (1, 0)  # the daemon is told as the epoch starts, before its first batch
        resumed = [(b.epoch, b.step, b.indices.tolist(), b.images) for b in batches]
    assert [x[:3] for x in resumed] == [x[:3] for x in uninterrupted[1]]
    assert all(torch.equal(a[3], b[3]) for a, b in zip(resumed, uninterrupted[1]))


def test_set_epoch_restarts_a_begun_epoch_and_rewinds(make_job: MakeJob) -> None:
    job = make_job(write=2)
    with BufferLoader(job.buffer, normalize=False, timeout=5) as loader:
        it = iter(loader)
        next(it)
        loader.set_epoch(0)  # like a new DistributedSampler epoch: all of it, from step 0
        assert list(it) == [], "the iterator handed out before ends"
        assert [b.step for b in loader] == [0, 1, 2]
        assert loader.position == (1, 0)
        loader.set_epoch(1)  # at the top of the next epoch of an uninterrupted run: nothing changes
        assert loader.position == (1, 0) and progress(job.buffer) == (1, 0)
        loader.set_epoch(0)  # backwards: the daemon regenerates from there
        iter(loader)
        assert progress(job.buffer) == (0, 0)


def test_mid_epoch_resume_is_set_epoch_then_load_state_dict(make_job: MakeJob) -> None:
    job = make_job(write=2)
    with BufferLoader(job.buffer, normalize=False, timeout=5) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()  # a checkpoint at (0, 1)
    Progress(0, 2).write(job.buffer)  # where the trainer was when it was killed: the daemon keeps batches from there
    with BufferLoader(job.buffer, normalize=False, timeout=5) as resumed:
        resumed.set_epoch(0)
        assert progress(job.buffer) == (0, 2)
        resumed.load_state_dict(state)  # the later call wins: the batch after the checkpoint
        # Never step 0, which the daemon would take for a rewind (deleting what it kept from step 2).
        assert progress(job.buffer) == (0, 1)
        assert [b.step for b in resumed] == [1, 2]


def test_set_epoch_refuses_what_is_no_epoch_of_the_job(make_job: MakeJob) -> None:
    job = make_job(write=1)  # epochs=2
    with BufferLoader(job.buffer, timeout=5) as loader:
        for bad in (-1, 1.0, True, "1"):
            with pytest.raises(ValueError, match="non-negative integer epoch"):
                loader.set_epoch(bad)  # type: ignore[arg-type]
        with pytest.raises(StateMismatch, match=r"^set_epoch\(3\) is past the end of the job .* it has 2 epochs .*"
                                                r"set_epoch\(2\) is its end.*range\(2\).*larger --epochs"):
            loader.set_epoch(3)
        assert loader.position == (0, 0)
        loader.set_epoch(2)  # the job's end: an empty epoch, as iterating past the end is
        assert list(loader) == []


def test_an_epoch_past_what_batch_names_hold_is_refused_at_the_move(make_job: MakeJob) -> None:
    # An unbounded job (no --epochs) has no end to refuse it at: without this check the loader took the
    # epoch, then failed at the batch's name with a ValueError, and the daemon ignored the progress file.
    job = make_job(write=1, epochs=None)
    with BufferLoader(job.buffer, timeout=5) as loader:
        loader.set_epoch(MAX_EPOCH)  # the last epoch a name holds is still an epoch
        assert loader.position == (MAX_EPOCH, 0)
        loader.set_epoch(0)
        for move in (lambda: loader.set_epoch(MAX_EPOCH + 1),
                     lambda: loader.load_state_dict({**loader.state_dict(), "epoch": 2**40})):
            with pytest.raises(StateMismatch, match=rf"past {MAX_EPOCH}, the last epoch a buffer's batch names hold"):
                move()
            assert loader.position == (0, 0)
        assert progress(job.buffer) in (None, (0, 0))
