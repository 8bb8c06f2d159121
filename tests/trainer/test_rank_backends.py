"""Ranks whose devices need different backends (gloo on a box without a GPU, nccl on one with) waited for each
other inside init_process_group until torch's timeout.  Before the group the ranks compare their devices through
torchrun's store (``agree_on_backend``), and every rank refuses at once, naming each rank's device.  Two real
ranks under torchrun; the devices are given to the exchange, as no box here has a GPU to resolve one from."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import tests.torchrun

from prefetchd.trainer.ranks import Ranks, agree_on_backend

SCRIPT = r"""
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from prefetchd.trainer.errors import SetupError
from prefetchd.trainer.ranks import Ranks, agree_on_backend
ranks = Ranks.from_env()
device = sys.argv[1].split(",")[ranks.rank]
if device == "absent":  # a rank that never comes to the exchange
    sys.exit(0)
started = time.monotonic()
try:
    agree_on_backend(ranks, torch.device(device), timeout=timedelta(seconds=float(sys.argv[2])))
except SetupError as exc:
    print(f"rank {ranks.rank} refused after {time.monotonic() - started:.1f} s: {exc}", flush=True)
    sys.exit(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=30))  # the exchange's connection left none behind
dist.barrier()
print(f"rank {ranks.rank} agreed and joined the group", flush=True)
dist.destroy_process_group()
"""


def exchange(tmp_path: Path, devices: str, timeout: float = 60) -> str:
    """torchrun's output of two ranks exchanging ``devices`` (rank 0's, rank 1's); fails on a hang."""
    script = tmp_path / "exchange.py"
    script.write_text(SCRIPT)
    run = tests.torchrun.run(["--standalone", "--nproc-per-node", "2", script, devices, str(timeout)], 120)
    return run.stdout + run.stderr


def refusals(out: str) -> dict[int, tuple[float, str]]:
    return {int(rank): (float(seconds), message)
            for rank, seconds, message in re.findall(r"rank (\d) refused after ([\d.]+) s: (.*)", out)}


def test_ranks_on_cpu_and_cuda_both_refuse_at_once_naming_each_device(tmp_path: Path) -> None:
    out = exchange(tmp_path, "cpu,cuda:0")
    refused = refusals(out)
    assert sorted(refused) == [0, 1], out[-3000:]
    for seconds, message in refused.values():
        assert seconds < 10, "the exchange ends when both devices are known, not at a timeout"
        assert message.startswith("the device differs between ranks (rank 0: cpu (gloo), rank 1: cuda:0 (nccl)); ")
        assert "--device cpu" in message
    assert "joined the group" not in out


def test_ranks_on_one_device_type_agree_and_then_make_their_group(tmp_path: Path) -> None:
    out = exchange(tmp_path, "cpu,cpu")
    assert "rank 0 agreed and joined the group" in out and "rank 1 agreed and joined the group" in out, out[-3000:]
    assert not refusals(out)


def test_a_rank_that_never_says_its_device_is_named_after_the_timeout(tmp_path: Path) -> None:
    refused = refusals(exchange(tmp_path, "cpu,absent", timeout=2))
    assert list(refused) == [0]
    seconds, message = refused[0]
    assert 2 <= seconds < 10
    assert message == ("rank 0 waited 2 s for every rank's device before making the process group, and these "
                       "never said theirs: rank 1; the output of their boxes says why")


def test_without_torchruns_agent_store_nothing_is_exchanged() -> None:
    """MASTER_* set by hand: rank 0 makes the store inside init_process_group, so there is none to ask
    before it.  Here MASTER_PORT names no server: a rank that asked would fail to connect."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    rank_1 = Ranks(rank=1, world_size=2, local_world_size=1)
    agree_on_backend(rank_1, torch.device("cuda", 0), env, timeout=timedelta(seconds=1))
    with pytest.raises(RuntimeError):  # the same rank under torchrun's agent store does ask
        agree_on_backend(rank_1, torch.device("cuda", 0), {**env, "TORCHELASTIC_USE_AGENT_STORE": "True"},
                         timeout=timedelta(seconds=1))


TRAINER = r"""
import os, sys
from prefetchd.trainer.train import main
# torchrun gives every rank one command line: the boxes' --device auto differing is played by the local rank.
device = sys.argv[2].split(",")[int(os.environ["LOCAL_RANK"])]
main(["--buffer", sys.argv[1], "--device", device, "--epochs", "1"])
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefetchd_train_on_a_gpu_rank_and_a_cpu_rank_refuses_on_both(tmp_path: Path) -> None:
    """The real mixture, on a box with a GPU: `prefetchd-train` with rank 0 on CUDA (nccl) and rank 1 on the
    CPU (gloo), which waited in init_process_group until torch's 30 minutes.  Both ranks exit 1 at once, naming
    each rank's device, before any buffer is looked at (there is none)."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    run = tests.torchrun.run(["--standalone", "--nproc-per-node", "2", script, tmp_path / "no-buffer", "cuda,cpu"], 180)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    assert "the device differs between ranks (rank 0: cuda:0 (nccl), rank 1: cpu (gloo))" in out, out[-3000:]
    assert "exitcode  : 1" in out, out[-3000:]  # torchrun's summary: a SetupError's code (the other may be its SIGTERM)
