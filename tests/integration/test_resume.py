"""Exact resume with real processes: consumers and trainers SIGKILLed at seeded steps, a daemon killed
and its buffer lost, and still every batch arrives bit for bit as in an uninterrupted run."""

from __future__ import annotations

import hashlib
import json
import os
import random
import runpy
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torchvision.datasets import ImageFolder

from prefetchd.buffer_protocol import Progress, daemon_pid, list_batches
from prefetchd.trainer import Batch, BufferLoader
from prefetchd.trainer.checkpoint import LAST_CHECKPOINT
from prefetchd.trainer.train import main
from tests.waiting import wait_for

EPOCHS = 2
ARGS = ["--batch-size", "8", "--image-size", "32", "--workers", "1", "--seed", "7", "--epochs", str(EPOCHS),
        "--high-water", "4", "--low-water", "2"]
SEED = 20261122

# A consumer as a trainer would be: take a batch, log what it got, "train" on it, checkpoint.
# The kill mostly lands in the training step, after the log and before the checkpoint, so the
# restarted consumer gets that batch again.
CONSUMER = r'''
import hashlib, json, os, sys, time
from pathlib import Path
import torch
from prefetchd.trainer import BufferLoader
from prefetchd.trainer.checkpoint import save_checkpoint

buffer, ckpt, log = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
every, step_seconds, epochs = int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6])
go = Path(sys.argv[7]) if len(sys.argv) > 7 else None
while go is not None and not go.exists():  # started early, to have the imports done when its turn comes
    time.sleep(0.005)
loader = BufferLoader(buffer, normalize=False, timeout=60, daemon_grace=60)
if ckpt.exists():
    loader.load_state_dict(torch.load(ckpt, weights_only=True)["loader"])
fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
taken = 0
while loader.position[0] < epochs:
    for batch in loader:
        images = batch.images.permute(0, 2, 3, 1).contiguous().numpy()
        record = {"epoch": batch.epoch, "step": batch.step, "indices": batch.indices.tolist(),
                  "labels": batch.labels.tolist(), "sha256": hashlib.sha256(images.tobytes()).hexdigest()}
        os.write(fd, (json.dumps(record) + "\n").encode())  # one write: whole lines even under SIGKILL
        taken += 1
        time.sleep(step_seconds)
        if taken % every == 0:
            save_checkpoint(ckpt, {"loader": loader.state_dict()})
loader.close()
os.close(fd)
'''


def record(batch: Batch) -> dict[str, Any]:
    images = batch.images.permute(0, 2, 3, 1).contiguous().numpy()
    return {"epoch": batch.epoch, "step": batch.step, "indices": batch.indices.tolist(),
            "labels": batch.labels.tolist(), "sha256": hashlib.sha256(images.tobytes()).hexdigest()}


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def checkpoint_position(path: Path) -> tuple[int, int]:
    if not path.exists():
        return (0, 0)
    state = torch.load(path, weights_only=True)["loader"]
    return (state["epoch"], state["step"])



def test_killed_consumer_and_daemon_resume_bit_for_bit(
    shapes_data: Path, shm_dir: Path, start_daemon: Any, tmp_path: Path
) -> None:
    data = shapes_data / "train"

    # Both daemons start together, and the uninterrupted run is read in a thread while the
    # interrupted one goes on: process start-up dominates this test.
    ref_buffer, buffer = shm_dir / "reference", shm_dir / "bf"
    ref_daemon = start_daemon(ref_buffer, "--data", data, *ARGS)
    daemon = start_daemon(buffer, "--data", data, *ARGS)
    steps = -(-len(ImageFolder(str(data)).samples) // 8)
    reference: list[dict[str, Any]] = []
    failures: list[BaseException] = []

    def read_reference() -> None:
        try:
            with BufferLoader(ref_buffer, normalize=False, timeout=60) as loader:
                assert len(loader) == steps
                reference.extend(record(b) for _ in range(EPOCHS) for b in loader)
        except BaseException as exc:  # reported by the test thread
            failures.append(exc)

    reader = threading.Thread(target=read_reference)
    reader.start()

    def index(rec: dict[str, Any]) -> int:
        return rec["epoch"] * steps + rec["step"]

    # The interrupted run: three kills at seeded steps, each with its own kind of trouble.
    rng = random.Random(SEED)
    first = rng.randint(2, 4)
    targets = [first, first + rng.randint(3, 5)]
    targets.append(targets[-1] + rng.randint(3, 5))
    roles = ["consumer", "no-checkpoint", "daemon"]  # what each kill does besides killing the consumer
    rng.shuffle(roles)
    ckpt, script = tmp_path / "consumer.pt", tmp_path / "consumer.py"
    script.write_text(CONSUMER)

    def launch(i: int) -> tuple[subprocess.Popen[bytes], Path, Path]:
        """Consumer run ``i``, started ahead of its turn: it waits for its go file after the imports."""
        every = 10**6 if roles[i] == "no-checkpoint" else 1
        log, go = tmp_path / f"run{i}.log", tmp_path / f"run{i}.go"
        argv = [str(script), str(buffer), str(ckpt), str(log), str(every), "0.1", str(EPOCHS), str(go)]
        return subprocess.Popen([sys.executable, *argv]), log, go

    runs: list[tuple[tuple[int, int], Path]] = []
    cases: list[str] = []
    waiting = [launch(0)]
    try:
        for i, target in enumerate(targets):
            proc, log, go = waiting.pop()
            runs.append((checkpoint_position(ckpt), log))
            go.touch()
            if i + 1 < len(targets):
                waiting.append(launch(i + 1))
            try:
                wait_for(lambda: any(index(r) >= target for r in read_log(log)), 60, f"step {target}", proc)
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            resume_at = checkpoint_position(ckpt)
            progress = Progress.read(buffer)
            assert progress is not None
            if roles[i] == "daemon":
                daemon.proc.send_signal(signal.SIGKILL)
                daemon.wait_exit(10)
                # The box rebooted, say: the RAM disk lost every batch; the new daemon has to make them again.
                for path in list_batches(buffer).values():
                    path.unlink()
                cases.append("buffer lost")
                daemon = start_daemon(buffer, "--data", data, *ARGS)
            elif (progress.epoch, progress.step) > resume_at:
                cases.append("rewound")  # the daemon deleted batches the restart needs again
            else:
                cases.append("held")  # progress never passed the checkpoint: the daemon kept those batches
    finally:
        for proc, _, _ in waiting:
            proc.kill()
            proc.wait()

    # The last run is not killed: it runs in this process (one interpreter start less).
    log = tmp_path / "final.log"
    runs.append((checkpoint_position(ckpt), log))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [str(script), str(buffer), str(ckpt), str(log), "1", "0", str(EPOCHS)])
        runpy.run_path(str(script), run_name="__main__")
    assert sorted(cases) == ["buffer lost", "held", "rewound"], cases
    assert daemon.wait_exit(30) == 0, "the daemon ends once both epochs are consumed"
    reader.join(60)
    assert not reader.is_alive() and not failures, failures
    assert len(reference) == EPOCHS * steps and ref_daemon.wait_exit(30) == 0

    # Each run's records up to where the next run resumed, then the last run's: the records
    # after a checkpoint were replayed by the next run.
    combined: list[dict[str, Any]] = []
    replayed = 0
    for (start, log), following in zip(runs, [*runs[1:], None]):
        records = read_log(log)
        assert records and (records[0]["epoch"], records[0]["step"]) == start
        if following is None:
            combined += records
            continue
        resume = following[0]
        kept = [r for r in records if (r["epoch"], r["step"]) < resume]
        again = [r for r in records if (r["epoch"], r["step"]) >= resume]
        for r in again:
            assert r == reference[index(r)], "a replayed batch differs from the uninterrupted run's"
        replayed += len(again)
        combined += kept
    assert replayed >= 2
    assert combined == reference


def test_trainer_killed_mid_epoch_resumes_with_its_spawned_daemon(shapes_data: Path, shm_dir: Path, tmp_path: Path) -> None:
    buffer, ckpt, metrics = shm_dir / "bf", tmp_path / "ckpt", tmp_path / "metrics.json"
    cmd = [sys.executable, "-m", "prefetchd.trainer.train", "--buffer", str(buffer), "--spawn-daemon",
           "--data", str(shapes_data / "train"), "--epochs", "1", "--batch-size", "8", "--image-size", "32",
           "--workers", "1", "--device", "cpu", "--threads", "1", "--model", "mobilenet_v3_small",
           "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--metrics-json", str(metrics), "-q"]
    orphans: set[int] = set()
    try:
        first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        # The first checkpoint (global step 2 of 9) is written atomically: once it exists it is whole.
        wait_for((ckpt / LAST_CHECKPOINT).exists, 120, "the first checkpoint", first)
        pid = daemon_pid(buffer)
        assert pid is not None
        orphans.add(pid)
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        # The daemon outlives the trainer: the buffer keeps filling for the restart.
        assert daemon_pid(buffer) == pid

        # The restart runs in this process (the kill needed a process of its own).
        second = CliRunner().invoke(main, [*cmd[3:], "--resume"])
        assert second.exit_code == 0, second.output
        assert f"served by the running daemon (pid {pid})" in second.stdout
        assert "resumed from" in second.stdout
        doc = json.loads(metrics.read_text())
        assert doc["finished"] is True and doc["resumed_from"]["global_step"] >= 2
        assert [r["train_images"] for r in doc["epochs"]] == [72]
        assert doc["global_steps"] == 9
        # With its epochs consumed the orphaned daemon leaves by itself.
        deadline = time.monotonic() + 30
        while daemon_pid(buffer) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert daemon_pid(buffer) is None
    finally:
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
