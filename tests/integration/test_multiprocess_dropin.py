"""Lightning's DDP strategy and Accelerate with real processes: two CPU ranks (gloo), one stream each.

The single-process tests (test_dropin.py, tests/trainer/test_lightning.py and test_accelerate.py)
cannot show that each rank reads its own stream of a ``--world-size 2`` daemon, nor that a checkpoint
rank 0 writes brings every rank back to its own position. Here the scripts are files run as users run
them, with docs/DROP_IN.md's command lines ("Several processes"): Lightning's ``ddp`` strategy re-runs
the script once per extra rank, and ``accelerate launch`` (torchrun underneath) starts the Accelerate
script once per rank. Every rank records what it received (epoch, step, sample indices, sha1 of the
images) to a JSON file of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from prefetchd.buffer_protocol import stream_dir
from prefetchd.trainer import BufferLoader

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with the gloo backend: the ranks are CPU processes joined by gloo",
)

WORLD = 2
# 72 training images (shapes_data) over 2 ranks: 36 a rank, batches of 8, so 5 steps an epoch.
JOB = ["--batch-size", "8", "--image-size", "32", "--epochs", "2", "--seed", "3", "--world-size", str(WORLD),
       "--workers", "1"]
STEPS_PER_EPOCH = 5
# What `accelerate launch` is given (no accelerate config file is read: HF_HOME is the test's own).
ACCELERATE_LAUNCH = ["--multi_gpu", "--num_processes", str(WORLD), "--num_machines", "1", "--mixed_precision", "no",
                     "--dynamo_backend", "no", "--main_process_port", "0"]

LIGHTNING_DDP = '''\
"""Two CPU ranks under Lightning's ddp strategy, fed by a BufferDataModule; each rank records its batches."""
import hashlib
import json
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from prefetchd.lightning import BufferDataModule


class Recorder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(3, 3)
        self.received = []

    def training_step(self, batch, batch_idx):
        images, labels = batch
        digest = hashlib.sha1(images.contiguous().numpy().tobytes()).hexdigest()
        self.received.append([batch.epoch, batch.step, batch.indices.tolist(), digest])
        return torch.nn.functional.cross_entropy(self.net(images.float().mean((2, 3))), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main():
    buffer, out, max_epochs, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    ckpt_path = sys.argv[5] if len(sys.argv) > 5 else None
    module = Recorder()
    # Stopped by max_steps (mid-epoch), the run checkpoints at that step; otherwise at every epoch's end.
    every = max_steps if max_steps > 0 else None
    trainer = L.Trainer(
        strategy="ddp", devices=2, accelerator="cpu", max_epochs=max_epochs, max_steps=max_steps,
        default_root_dir=out, logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=out, save_last=True, every_n_train_steps=every)],
    )
    trainer.fit(module, datamodule=BufferDataModule(buffer, normalize=False, timeout=120), ckpt_path=ckpt_path)
    doc = {"world_size": torch.distributed.get_world_size(), "received": module.received}
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(doc, f)


if __name__ == "__main__":
    main()
'''

ACCELERATE_RANKS = '''\
"""One epoch per rank with Accelerate: a BufferLoader on this rank's stream, through accelerator.prepare."""
import hashlib
import json
import os
import sys

import torch
from accelerate import Accelerator

from prefetchd.trainer import BufferLoader, rank_stream


def main():
    buffer, out = sys.argv[1], sys.argv[2]
    accelerator = Accelerator(cpu=True)
    loader = BufferLoader(rank_stream(buffer), device=accelerator.device, normalize=False, timeout=120)
    model = torch.nn.Linear(3, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    received = []
    for batch in prepared:
        images, labels = batch
        digest = hashlib.sha1(images.contiguous().numpy().tobytes()).hexdigest()
        received.append([batch.epoch, batch.step, batch.indices.tolist(), digest, str(images.device),
                         str(images.dtype), images.is_contiguous(memory_format=torch.channels_last)])
        loss = torch.nn.functional.cross_entropy(model(images.float().mean((2, 3))), labels)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    doc = {
        "rank": accelerator.process_index, "processes": accelerator.num_processes,
        "distributed_type": str(accelerator.distributed_type), "backend": torch.distributed.get_backend(),
        "prepared_is_loader": prepared is loader, "stream": str(loader.buffer),
        "weights": accelerator.unwrap_model(model).weight.detach().tolist(), "received": received,
    }
    loader.close()
    with open(os.path.join(out, f"rank{accelerator.process_index}.json"), "w") as f:
        json.dump(doc, f)
    # Every collective done, the results on disk: leave without torch's teardown.  A rank can abort
    # there ("terminate called without an active exception", SIGABRT) when its gloo threads meet the
    # other rank's closed sockets or their own destructors: seen in CI in rank 0 with the group left
    # alive, and in rank 1 after end_training() destroyed it.  Neither is prefetchd's to test.
    accelerator.wait_for_everyone()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
'''

Received = tuple[int, int, tuple[int, ...], str]  # epoch, step, sample indices, sha1 of the images


def run_script(argv: list[str | Path], what: str, env: dict[str, str] | None = None) -> None:
    """Run ``argv`` to the end; on a hang, kill its whole process group (the ranks it started) and fail."""
    with subprocess.Popen([str(a) for a in argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # a rank left waiting on a collective would outlive the test
            out, err = proc.communicate()
            raise AssertionError(f"{what} did not finish in 400 s:\n{out[-3000:]}\n{err[-5000:]}") from None
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{out[-3000:]}\n{err[-5000:]}"


def rank_docs(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def batches(doc: dict[str, Any]) -> list[Received]:
    return [(row[0], row[1], tuple(row[2]), row[3]) for row in doc["received"]]


def assert_disjoint_shares(per_rank: list[list[Received]], epochs: range, samples: int) -> None:
    """Every epoch, the ranks' sample indices do not overlap and together are the whole dataset."""
    for epoch in epochs:
        shares = [[i for e, _, indices, _ in received if e == epoch for i in indices] for received in per_rank]
        assert all(len(share) == len(set(share)) for share in shares), "a rank got a sample twice in an epoch"
        assert not set(shares[0]) & set(shares[1]), f"epoch {epoch}: both ranks got the same samples"
        assert sorted(shares[0] + shares[1]) == list(range(samples)), f"epoch {epoch}: not the whole dataset"


def read_epoch(stream: Path, epoch: int) -> list[Received]:
    """``epoch`` of one stream as a lone BufferLoader in this process reads it (the daemon remakes it)."""
    with BufferLoader(stream, normalize=False, timeout=120) as loader:
        loader.set_epoch(epoch)
        return [(b.epoch, b.step, tuple(b.indices.tolist()),
                 hashlib.sha1(b.images.contiguous().numpy().tobytes()).hexdigest()) for b in loader]


def run_lightning(script: Path, buffer: Path, out: Path, max_epochs: int, max_steps: int = -1,
                  ckpt_path: Path | None = None) -> None:
    """``python lightning_ddp.py ...``: rank 0, and the ddp strategy re-runs the script for rank 1."""
    resume = [] if ckpt_path is None else [ckpt_path]
    run_script([sys.executable, script, buffer, out, str(max_epochs), str(max_steps), *resume],
               f"the ddp run into {out.name}")


def saved_positions(checkpoint: Path) -> list[tuple[int, int, int, int]]:
    """(rank, world size, epoch, step) of every rank's training position in a Lightning checkpoint."""
    state = torch.load(checkpoint, weights_only=False)["BufferDataModule"]
    return [(r["identity"]["rank"], r["identity"]["world_size"], r["epoch"], r["step"]) for r in state["ranks"]]


def test_lightning_ddp_gives_each_rank_its_stream_and_resumes_every_rank_exactly(
    shapes_data: Path, shm_dir: Path, tmp_path: Path, start_daemon: Any
) -> None:
    """An uninterrupted two-epoch run, and the same job stopped at an epoch's end and mid-epoch (each on a daemon
    of its own, same seed) then resumed from its last.ckpt: every rank gets the uninterrupted run's batches.  One
    test, so that both stops compare with one uninterrupted run (a DDP run is ~10 s of CPU)."""
    pytest.importorskip("lightning")
    train = shapes_data / "train"
    samples = sum(1 for p in train.rglob("*") if p.is_file())
    script = tmp_path / "lightning_ddp.py"
    script.write_text(LIGHTNING_DDP)
    # (max_epochs, max_steps) of the stopped run, and where it stopped: max_epochs=1, then 2 from its last.ckpt;
    # 7 steps, that is 2 into the second epoch, checkpointed there.
    stops = {"epoch_end": (1, -1, (1, 0)), "mid_epoch": (2, 7, (1, 2))}
    for name in ("full", *stops):
        start_daemon(shm_dir / name, "--data", train, *JOB)

    full = tmp_path / "full"
    run_lightning(script, shm_dir / "full", full, max_epochs=2)
    uninterrupted = [batches(doc) for doc in rank_docs(full)]
    assert [doc["world_size"] for doc in rank_docs(full)] == [WORLD, WORLD], "a real two-process group"
    for received in uninterrupted:
        assert [(e, s) for e, s, _, _ in received] == [(e, s) for e in range(2) for s in range(STEPS_PER_EPOCH)]
    assert_disjoint_shares(uninterrupted, range(2), samples)

    for name, (max_epochs, max_steps, at) in stops.items():
        first, resumed = tmp_path / f"{name}-first", tmp_path / f"{name}-resumed"
        run_lightning(script, shm_dir / name, first, max_epochs, max_steps)
        checkpoint = first / "last.ckpt"
        assert saved_positions(checkpoint) == [(0, WORLD, *at), (1, WORLD, *at)], f"{name}: both ranks' positions"
        run_lightning(script, shm_dir / name, resumed, max_epochs=2, ckpt_path=checkpoint)
        for rank, (before, after) in enumerate(zip(rank_docs(first), rank_docs(resumed))):
            assert batches(before) + batches(after) == uninterrupted[rank], (
                f"{name}, rank {rank}: the stopped and resumed run got other batches than the uninterrupted one")


def test_accelerate_ranks_read_their_own_streams_unmoved(
    shapes_data: Path, shm_dir: Path, tmp_path: Path, start_daemon: Any
) -> None:
    pytest.importorskip("accelerate")
    train = shapes_data / "train"
    samples = sum(1 for p in train.rglob("*") if p.is_file())
    script = tmp_path / "accelerate_ranks.py"
    script.write_text(ACCELERATE_RANKS)
    buffer, out = shm_dir / "bf", tmp_path / "out"
    out.mkdir()
    start_daemon(buffer, "--data", train, *JOB)
    # `accelerate launch --cpu --num_processes 2` starts ONE process (several CPU processes need an mpirun
    # hostfile); `--multi_gpu` launches through torchrun whatever the devices, and the script's
    # Accelerator(cpu=True) then joins the ranks over gloo. Port 0: a free one, so parallel runs do not collide.
    run_script([sys.executable, "-m", "accelerate.commands.launch", *ACCELERATE_LAUNCH, script, buffer, out],
               "the accelerate script under accelerate launch", env={**os.environ, "HF_HOME": str(tmp_path / "hf")})

    docs = rank_docs(out)
    for rank, doc in enumerate(docs):
        assert (doc["rank"], doc["processes"], doc["backend"]) == (rank, WORLD, "gloo")
        assert doc["distributed_type"] == "DistributedType.MULTI_CPU"
        assert doc["prepared_is_loader"], "prepare() wrapped the loader: it would re-shard and move the batches"
        assert doc["stream"] == str(stream_dir(buffer, rank, WORLD))
        # As the daemon wrote them: uint8 NHWC bytes, on the process's device, neither converted nor copied.
        assert {tuple(row[4:]) for row in doc["received"]} == {("cpu", "torch.uint8", True)}
    assert docs[0]["weights"] == docs[1]["weights"], "DDP averaged the gradients of the two ranks' batches"
    per_rank = [batches(doc) for doc in docs]
    assert_disjoint_shares(per_rank, range(1), samples)
    for rank, received in enumerate(per_rank):
        assert received == read_epoch(stream_dir(buffer, rank, WORLD), 0), f"rank {rank} read another stream"


def test_the_documented_command_lines_are_the_ones_run_here() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "DROP_IN.md").read_text().replace("\\\n    ", "")
    assert f"--data data/train {' '.join(JOB)} &" in doc
    assert f"accelerate launch {' '.join(ACCELERATE_LAUNCH)} accelerate_ranks.py" in doc
    assert 'Trainer(strategy="ddp", devices=2, accelerator="cpu"' in doc
    assert 'strategy="ddp", devices=2, accelerator="cpu"' in LIGHTNING_DDP
