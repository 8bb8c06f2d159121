"""prefetchd-train's view of torchrun: the environment, which stream a rank reads, and the clear
refusals when the daemon's world size or a checkpoint's does not match. No process group here;
tests/integration/test_train_ranks.py runs two real ranks."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from click.testing import CliRunner

from prefetchd.buffer_protocol import stream_dir
from prefetchd.trainer.errors import LoaderTimeout, OptionError, SetupError
from prefetchd.trainer.ranks import Ranks, wait_for_stream
from prefetchd.trainer.checkpoint import LAST_CHECKPOINT
from prefetchd.trainer.train import EXIT_FAILED, main

if TYPE_CHECKING:
    from conftest import FakeJob, MakeJob


def torchrun_env(rank: int, world: int, local_rank: int, local_world: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world)}


def test_ranks_from_the_torchrun_environment() -> None:
    assert Ranks.from_env({}) == Ranks() and not Ranks().distributed
    box1 = Ranks.from_env(torchrun_env(rank=5, world=8, local_rank=1, local_world=4))
    assert (box1.rank, box1.world_size, box1.local_rank, box1.local_world_size) == (5, 8, 1, 4)
    assert box1.distributed and not box1.is_main and not box1.is_local_main
    assert list(box1.local_ranks) == [4, 5, 6, 7] and box1.ranks_flag() == "4-7"
    assert Ranks.from_env(torchrun_env(0, 2, 0, 1)).ranks_flag() == "0"
    # torchrun --nproc-per-node 1 is one rank: no process group, the flat buffer.
    assert not Ranks.from_env(torchrun_env(0, 1, 0, 1)).distributed


@pytest.mark.parametrize("env, fragment", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "LOCAL_RANK not"),
    ({**torchrun_env(0, 2, 0, 2), "RANK": "zero"}, "RANK='zero'"),
    (torchrun_env(2, 2, 0, 2), "do not fit together"),
    (torchrun_env(1, 2, 0, 2), "do not fit together"),  # this box's ranks 1-2 of a world of 2
])
def test_a_broken_torchrun_environment_is_refused(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(SetupError, match=fragment):
        Ranks.from_env(env)


def test_a_launcher_of_several_boxes_without_local_world_size_is_told_to_set_it() -> None:
    """A SLURM-like launch sets RANK, WORLD_SIZE and LOCAL_RANK but not LOCAL_WORLD_SIZE: prefetchd took one box to
    hold every rank, so box 1 (RANK=1, LOCAL_RANK=0 of 2) started a daemon for ranks 1-2 and died in a traceback
    ("rank 2 is outside a world of 2"), and its hints named `--ranks 1-2` (a review of README's "Many ranks")."""
    with pytest.raises(SetupError, match=r"^LOCAL_WORLD_SIZE is not set, and this box's ranks begin at 1 \(RANK=1, "
                                         r"LOCAL_RANK=0\): .* must set LOCAL_WORLD_SIZE"):
        Ranks.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    # One box (torch.multiprocessing.spawn): every rank is local, as before.
    one_box = Ranks.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert list(one_box.local_ranks) == [0, 1]


def as_rank(job: FakeJob, buffer: Path, rank: int, world: int) -> Path:
    """Move ``job``'s manifest to rank ``rank``'s stream of a ``world``-rank daemon on ``buffer``."""
    directory = stream_dir(buffer, rank, world)
    directory.mkdir(parents=True, exist_ok=True)
    dataclasses.replace(job.manifest, rank=rank, world_size=world).write(directory)
    return directory


def test_each_rank_waits_for_its_own_stream(make_job: MakeJob, buffer: Path) -> None:
    job = make_job(buffer / "staging")
    own = as_rank(job, buffer / "bf", 1, 2)
    assert wait_for_stream(buffer / "bf", Ranks(1, 2, 1, 2), timeout=5) == own
    with pytest.raises(LoaderTimeout, match=r"rank-00000 does not exist.*--world-size 2"):
        wait_for_stream(buffer / "bf", Ranks(0, 2, 0, 2), timeout=0.1)


def test_a_daemon_for_another_world_size_is_refused_at_once(make_job: MakeJob, buffer: Path) -> None:
    job = make_job(buffer / "flat")  # a single-stream daemon's manifest
    with pytest.raises(SetupError) as raised:
        wait_for_stream(buffer / "flat", Ranks(1, 4, 1, 4), timeout=60)
    message = str(raised.value)
    assert "--world-size 1" in message and "torchrun runs 4 ranks (WORLD_SIZE=4)" in message
    assert "--world-size 4 --reset" in message and "without torchrun" in message
    as_rank(job, buffer / "four", 0, 4)
    with pytest.raises(SetupError, match=r"--world-size 4 .* torchrun runs 2 ranks.* with 4 processes in all"):
        wait_for_stream(buffer / "four", Ranks(0, 2, 0, 2), timeout=60)
    # A validation buffer's: the command it suggests starts a --split val daemon (it started a train one).
    with pytest.raises(SetupError, match=r"prefetchd start --buffer \S+ \.\.\. --split val --world-size 2 --reset"):
        wait_for_stream(buffer / "four", Ranks(0, 2, 0, 2), timeout=60, split="val")


def test_one_process_on_a_buffer_of_rank_streams_says_use_torchrun(make_job: MakeJob, buffer: Path) -> None:
    job = make_job(buffer / "staging")
    as_rank(job, buffer / "bf", 0, 2)
    result = CliRunner().invoke(main, ["--buffer", str(buffer / "bf"), "--device", "cpu", "--timeout", "60"])
    assert result.exit_code == EXIT_FAILED, result.output
    assert "produces streams for --world-size 2" in result.stderr and "runs as one process" in result.stderr
    assert "torchrun --nproc-per-node 2 train.py" in result.stderr and "-m prefetchd.trainer.train" in result.stderr
    assert 'Lightning: `Trainer(strategy="ddp", devices=2)`' in result.stderr
    assert "without --world-size and with --reset" in result.stderr
    assert "prefetchd-train" not in result.stderr  # the same words serve rank_stream() in a script of ones own
    assert "Traceback" not in result.output


def test_a_checkpoint_of_another_world_size_is_refused(make_job: MakeJob, buffer: Path, tmp_path: Path) -> None:
    job = make_job(epochs=1, write=1, samples=8)
    ckpt = tmp_path / "ckpt"
    args = ["--buffer", str(job.buffer), "--device", "cpu", "--threads", "1", "--model", "mobilenet_v3_small",
            "-q", "--checkpoint-dir", str(ckpt)]
    assert CliRunner().invoke(main, args).exit_code == 0
    doc = torch.load(ckpt / LAST_CHECKPOINT, weights_only=True)
    assert doc["world_size"] == 1 and "ranks" not in doc  # a one-rank checkpoint keeps its layout
    torch.save({**doc, "world_size": 2, "ranks": [doc, doc]}, ckpt / LAST_CHECKPOINT)
    result = CliRunner().invoke(main, [*args, "--resume"])
    assert result.exit_code == EXIT_FAILED
    assert "taken with 2 ranks, this run has 1" in result.stderr and "under torchrun with 2 processes" in result.stderr


def test_under_torchrun_cuda_means_the_local_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefetchd.trainer.preflight import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto", Ranks(3, 4, 1, 2)) == torch.device("cuda", 1)
    assert resolve_device("cuda", Ranks(0, 4, 0, 2)) == torch.device("cuda", 0)
    assert resolve_device("cuda:0", Ranks(3, 4, 1, 2)) == torch.device("cuda", 0)  # asked for by name
    assert resolve_device("cuda", Ranks()) == torch.device("cuda")  # one process: as before
    with pytest.raises(SetupError, match="LOCAL_RANK 2 needs a GPU of its own, but this machine has 2"):
        resolve_device("auto", Ranks(2, 4, 2, 4))


def test_ranks_with_different_step_counts_are_refused_before_ddp_could_hang(make_job: MakeJob) -> None:
    from prefetchd.trainer import BufferLoader
    from prefetchd.trainer.collective import Collective
    from prefetchd.trainer.preflight import check_equal_steps

    class TwoRanks(Collective):
        def all_gather(self, obj: object) -> list[object]:
            return [obj, (len(loader) + 1, None, 2)]  # rank 1 reads a job with one more step

    job = make_job(samples=8, batch_size=4)
    with BufferLoader(job.buffer, timeout=5) as loader:
        check_equal_steps(Collective(Ranks()), loader, None, 2)  # one rank: nothing to compare
        with pytest.raises(SetupError, match=r"rank 0: 2 train steps.*rank 1: 3 train steps.*DDP would hang"):
            check_equal_steps(TwoRanks(Ranks(0, 2, 0, 2)), loader, None, 2)


def test_ranks_resolving_different_epochs_are_told_to_pass_the_same_epochs(make_job: MakeJob) -> None:
    from prefetchd.trainer import BufferLoader
    from prefetchd.trainer.collective import Collective
    from prefetchd.trainer.preflight import check_equal_steps

    class TwoRanks(Collective):
        def all_gather(self, obj: object) -> list[object]:
            return [obj, (len(loader), None, 3)]  # rank 1 was given --epochs 3

    job = make_job(samples=8, batch_size=4)
    with BufferLoader(job.buffer, timeout=5) as loader:
        with pytest.raises(OptionError, match=r"--epochs differs between ranks \(rank 0: 2, rank 1: 3"):
            check_equal_steps(TwoRanks(Ranks(0, 2, 0, 2)), loader, None, 2)


def test_one_ranks_stream_passed_as_the_buffer_is_refused_at_once(make_job: MakeJob, buffer: Path) -> None:
    own = as_rank(make_job(buffer / "staging"), buffer / "bf", 0, 2)
    with pytest.raises(SetupError) as raised:
        wait_for_stream(own, Ranks(0, 2, 0, 2), timeout=60)
    message = str(raised.value)
    assert f"{own} is the stream of one rank" in message and "rank 0 of --world-size 2" in message
    assert f"pass the daemon's --buffer, {buffer / 'bf'}" in message and "indexing" not in message
