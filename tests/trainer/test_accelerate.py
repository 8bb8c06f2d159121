"""A BufferLoader in real Accelerate (CPU): prepare() hands it back untouched, and save_state/load_state
carry its position through register_for_checkpointing(EveryRank(loader))."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from prefetchd.trainer import BufferLoader, EveryRank, StateMismatch
from prefetchd.trainer.rank_state import own_state
from prefetchd.trainer.ranks import Ranks

if TYPE_CHECKING:  # conftest is pytest's to import; only its types are needed here
    from conftest import MakeJob

accelerate = pytest.importorskip("accelerate")


def test_prepare_returns_the_loader_itself_and_its_batches_unmoved(make_job: MakeJob) -> None:
    job = make_job(write=1)
    accelerator = accelerate.Accelerator(cpu=True)
    loader = BufferLoader(job.buffer, device=accelerator.device, normalize=False, timeout=5)
    model = torch.nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _, _, prepared = accelerator.prepare(model, optimizer, loader)
    assert prepared is loader, "not wrapped, so not re-sharded and not moved"
    batches = list(prepared)
    assert [b.step for b in batches] == [0, 1, 2]
    assert all(b.images.device == accelerator.device for b in batches)
    # Each batch is the file's own bytes (uint8, NCHW view of HWC): nothing converted or copied them.
    assert all(b.images.dtype == torch.uint8 and b.images.is_contiguous(memory_format=torch.channels_last)
               for b in batches)
    loader.close()


def test_save_state_and_load_state_carry_the_position(make_job: MakeJob, tmp_path: Path) -> None:
    job = make_job(write=2)
    accelerator = accelerate.Accelerator(cpu=True)
    loader = BufferLoader(job.buffer, normalize=False, timeout=5)
    accelerator.register_for_checkpointing(EveryRank(loader))
    it = iter(loader)
    next(it), next(it)
    accelerator.save_state(str(tmp_path / "step_2"))
    rest = [(b.epoch, b.step, b.indices.tolist()) for b in it]
    loader.close()

    again = BufferLoader(job.buffer, normalize=False, timeout=5)
    accelerator = accelerate.Accelerator(cpu=True)  # a new run of the script
    accelerator.register_for_checkpointing(EveryRank(again))
    accelerator.load_state(str(tmp_path / "step_2"))
    assert again.position == (0, 2)
    assert [(b.epoch, b.step, b.indices.tolist()) for b in again] == rest
    again.close()


def test_every_rank_state_gives_each_rank_its_own() -> None:
    state = {"format": "prefetchd.rank_states", "version": 1, "ranks": [{"epoch": 0}, {"epoch": 1}]}
    assert own_state(state, Ranks(rank=1, world_size=2, local_rank=1, local_world_size=2)) == {"epoch": 1}
    with pytest.raises(StateMismatch, match="2 ranks but this run has 1"):
        own_state(state, Ranks())
    with pytest.raises(StateMismatch, match="has no format: expected the dict EveryRank.state_dict"):
        own_state({"epoch": 0, "step": 1}, Ranks())  # a bare BufferLoader state


def test_a_state_saved_through_every_rank_or_the_loader_itself_says_which_to_load_it_with(
        make_job: MakeJob, tmp_path: Path) -> None:
    """Saved with register_for_checkpointing(EveryRank(loader)), loaded with register_for_checkpointing(loader):
    the message was "loader state has epoch=None, step=None" (a user's walk); the other way round it said the
    state was "not written by prefetchd"."""
    job = make_job(write=1)
    saved = {}
    for name, wrap in (("every", EveryRank), ("plain", lambda loader: loader)):
        loader = BufferLoader(job.buffer, normalize=False, timeout=5)
        accelerator = accelerate.Accelerator(cpu=True)
        accelerator.register_for_checkpointing(wrap(loader))
        next(iter(loader))
        saved[name] = tmp_path / name
        accelerator.save_state(str(saved[name]))
        loader.close()
    for name, wrap, message in (("every", lambda loader: loader, "holds every rank's position"),
                                ("plain", EveryRank, "one loader's position")):
        loader = BufferLoader(job.buffer, normalize=False, timeout=5)
        accelerator = accelerate.Accelerator(cpu=True)
        accelerator.register_for_checkpointing(wrap(loader))
        with pytest.raises(StateMismatch, match=message):
            accelerator.load_state(str(saved[name]))
        loader.close()


def test_skip_first_batches_kept_from_a_dataloader_script_says_to_drop_it(make_job: MakeJob) -> None:
    job = make_job(write=1)
    accelerator = accelerate.Accelerator(cpu=True)
    with BufferLoader(job.buffer, normalize=False, timeout=5) as loader:
        assert not hasattr(loader, "dataset")
        with pytest.raises(AttributeError, match=r"a BufferLoader has no dataset: .* drop "
                                                 r"accelerator.skip_first_batches"):
            accelerator.skip_first_batches(loader, 1)
