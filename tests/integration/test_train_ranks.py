"""prefetchd-train itself under torchrun: two CPU ranks (gloo) against real daemons with --world-size 2.

One run stops mid-epoch with a checkpoint holding both ranks' positions; a second one, whose
daemons --spawn-daemon starts on local rank 0, resumes every rank exactly there and finishes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import torch
from torchvision.datasets import ImageFolder

import tests.torchrun

from prefetchd.buffer_protocol import Progress, batch_name, daemon_pid, stream_dir
from prefetchd.trainer.checkpoint import LAST_CHECKPOINT, load_checkpoint

JOB = ["--batch-size", "8", "--image-size", "32", "--epochs", "2"]


def torchrun(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return tests.torchrun.run(["--standalone", "--nproc-per-node", "2", "-m", "prefetchd.trainer.train", *args], 400)


def two_boxes(box0: list[str | Path], box1: list[str | Path],
              timeout: float = 300) -> list[subprocess.CompletedProcess[str]]:
    """Two "boxes" of one rank each (torchrun --nnodes 2 on loopback), each with its own command line,
    as two machines would run it; both are killed with their ranks if they outlast ``timeout`` (a hang)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return tests.torchrun.finish([
        tests.torchrun.start(["--nnodes", "2", "--node-rank", node, "--nproc-per-node", "1", "--master-addr",
                              "127.0.0.1", "--master-port", port, "-m", "prefetchd.trainer.train", *args])
        for node, args in enumerate((box0, box1))
    ], timeout)


def test_prefetchd_train_under_torchrun_stops_and_resumes_every_rank(
    shapes_data: Path, shm_dir: Path, tmp_path: Path, start_daemon
) -> None:
    train_data, val_data = shapes_data / "train", shapes_data / "val"
    buffer, val_buffer = shm_dir / "bf", shm_dir / "bf-val"
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.json"
    daemons = [
        start_daemon(buffer, "--data", train_data, *JOB, "--world-size", "2", "--workers", "1", "--high-water", "3"),
        start_daemon(val_buffer, "--data", val_data, "--split", "val", *JOB, "--world-size", "2", "--workers", "1"),
    ]
    common = ["--buffer", buffer, "--val-buffer", val_buffer, "--model", "mobilenet_v3_small", "--device", "cpu",
              "--threads", "1", "--timeout", "120", "--metrics-json", metrics, "--checkpoint-dir", ckpt]

    first = torchrun(*common, "--max-steps", "3")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:] + daemons[0].log
    assert "stopped after global step 3" in first.stdout
    doc = load_checkpoint(ckpt / LAST_CHECKPOINT)
    assert doc["world_size"] == 2 and doc["global_step"] == 3
    for rank, state in enumerate(doc["ranks"]):
        train_state = state["loaders"]["train"]
        assert train_state["identity"]["rank"] == rank and (train_state["epoch"], train_state["step"]) == (0, 3)
        assert state["partial"]["seen"] == 3 * 8  # this rank's own sums of the interrupted epoch
    assert Progress.read(stream_dir(buffer, 1, 2)) == Progress(0, 3)

    for daemon in daemons:  # the resumed run starts its own, as a box without a service would
        daemon.terminate()
    second = torchrun(*common, "--resume", "--spawn-daemon", "--data", train_data, "--val-data", val_data,
                      "--batch-size", "8", "--image-size", "32", "--epochs", "2", "--workers", "1")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    out = second.stdout
    assert f"starting the train daemon for {buffer}" in out and "ranks 0-1 of 2" in out
    assert out.count("resumed from") == 1 and out.count("epoch 2/2  train loss") == 1, "rank 0 alone prints"

    result = json.loads(metrics.read_text())
    assert result["finished"] is True and result["world_size"] == 2 and result["global_steps"] == 10
    assert result["resumed_from"]["position"] == [0, 3]
    n_train, n_val = (len(ImageFolder(str(d)).samples) for d in (train_data, val_data))
    for row in result["epochs"]:
        # Both ranks' images: in epoch 0 each rank's 3 steps before the stop (from its own saved sums) + 2 after.
        assert row["train_images"] == n_train and row["val_images"] == n_val  # 72 = 2 x 36, 18 = 2 x 9
        assert 0 <= row["data_wait_share"] <= row["data_wait_share_max"] <= 1
        assert 0 <= row["train_top1"] <= row["train_top3"] <= 1
    assert result["train_images"] == 2 * n_train
    for rank in (0, 1):  # every rank consumed both epochs of its streams, and the spawned daemons are gone
        assert Progress.read(stream_dir(buffer, rank, 2)) == Progress(2, 0)
        assert Progress.read(stream_dir(val_buffer, rank, 2)) == Progress(2, 0)
    assert daemon_pid(buffer) is None and daemon_pid(val_buffer) is None
    final = torch.load(ckpt / LAST_CHECKPOINT, weights_only=True)
    assert [r["loaders"]["train"]["epoch"] for r in final["ranks"]] == [2, 2]


def test_only_rank_0s_box_needs_checkpoint_dir(shapes_data: Path, shm_dir: Path, tmp_path: Path, start_daemon) -> None:
    """The README's promise: rank 0 writes and reads the checkpoint, so the other box is given no
    --checkpoint-dir (nor --checkpoint-every) and still takes part in every save and in the resume."""
    buffer, ckpt, metrics = shm_dir / "bf", tmp_path / "ckpt", tmp_path / "metrics.json"
    job = ["--batch-size", "8", "--image-size", "32", "--epochs", "1"]
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *job, "--world-size", "2", "--workers", "1")
    common = ["--buffer", buffer, "--model", "mobilenet_v3_small", "--device", "cpu", "--threads", "1",
              "--timeout", "120", "-q"]
    box0 = [*common, "--checkpoint-dir", ckpt, "--metrics-json", metrics]

    # Saves at step 2 (--checkpoint-every) and at step 3 (--max-steps); box 1 knows of neither.
    first = two_boxes([*box0, "--checkpoint-every", "2", "--max-steps", "3"], [*common, "--max-steps", "3"], 150)
    for rank, run in enumerate(first):
        assert run.returncode == 0, f"rank {rank}: " + run.stdout[-3000:] + run.stderr[-3000:] + daemon.log
    assert "stopped after global step 3" in first[0].stdout
    doc = load_checkpoint(ckpt / LAST_CHECKPOINT)
    assert doc["world_size"] == 2 and doc["global_step"] == 3
    assert [(s["loaders"]["train"]["epoch"], s["loaders"]["train"]["step"]) for s in doc["ranks"]] == [(0, 3)] * 2

    # The resume: rank 0 reads the checkpoint and sends rank 1 its position; the epoch's end is saved too.
    second = two_boxes([*box0, "--resume"], [*common, "--resume"], 150)
    for rank, run in enumerate(second):
        assert run.returncode == 0, f"rank {rank}: " + run.stdout[-3000:] + run.stderr[-3000:] + daemon.log
    assert "resumed from" in second[0].stdout and "global step 3" in second[0].stdout
    result = json.loads(metrics.read_text())
    assert result["finished"] is True and result["global_steps"] == 5 and result["resumed_from"]["position"] == [0, 3]
    final = load_checkpoint(ckpt / LAST_CHECKPOINT)
    assert final["global_step"] == 5 and [r["loaders"]["train"]["epoch"] for r in final["ranks"]] == [1, 1]
    for rank in (0, 1):
        assert Progress.read(stream_dir(buffer, rank, 2)) == Progress(1, 0)


def test_when_local_rank_0_cannot_start_the_daemon_the_other_rank_says_so(shm_dir: Path, tmp_path: Path) -> None:
    run = torchrun("--buffer", shm_dir / "bf", "--spawn-daemon", "--data", tmp_path / "nonexistent", "--epochs", "1",
                   "--device", "cpu", "--timeout", "60")
    assert run.returncode != 0
    said = " ".join(run.stderr.split())
    assert "the daemon started for" in said and "exited with code 1 before serving it" in said, said[-3000:]
    # Rank 1 learns it either from the barrier, or from the SIGTERM torchrun sends once rank 0 exited: its
    # handler runs when the barrier returns, and under load that came first (a fresh CI run). Both say so.
    assert "prefetchd-train[rank 1]: rank 1: another rank stopped while this one waited for it (at the start, " \
           "while local rank 0 starts the daemons)" in said or \
           "prefetchd-train[rank 1]: stopped by SIGTERM before training began" in said, said[-3000:]
    assert "waited 120 s" not in said and "pair.cc" not in said  # no false duration, no cut-off gloo text


def test_a_rank_that_fails_cleanly_leaves_the_others_one_line(shapes_data: Path, shm_dir: Path,
                                                             start_daemon) -> None:
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", "--batch-size", "8", "--image-size", "32",
                          "--epochs", "1", "--world-size", "2", "--ranks", "0", "--workers", "1")
    daemon.wait_until((stream_dir(buffer, 0, 2) / "manifest.json").is_file, 60, "rank 0's manifest")
    run = torchrun("--buffer", buffer, "--device", "cpu", "--threads", "1", "--model", "mobilenet_v3_small",
                   "--timeout", "3", "-q")
    assert run.returncode != 0
    said = " ".join(run.stderr.split())
    # Rank 1's own reason, at once rather than after --timeout: the box's daemon does not produce its stream.
    assert f"Error: rank 1: the daemon of {buffer} (pid {daemon.proc.pid}) produces rank 0, not rank 1" in said, \
        said[-3000:]
    # Rank 0 learns it from its collective, or from the SIGTERM torchrun sends once rank 1 exited, whichever
    # comes first (under load, the signal: a loaded test run); either way in one line of its own.
    assert "prefetchd-train[rank 0]: rank 0: another rank stopped while this one waited for it" in said or \
           "prefetchd-train[rank 0]: stopped by SIGTERM before training began" in said, said[-3000:]
    assert "pair.cc" not in said and "Connection closed by peer" not in said


def test_a_spawned_daemon_lost_under_torchrun_ends_the_run_saying_to_resume(shapes_data: Path, shm_dir: Path,
                                                                           tmp_path: Path) -> None:
    """The loader's restart command names the job, not how --spawn-daemon started it; under torchrun
    the way on is the same command with --resume."""
    buffer = shm_dir / "bf"
    run = tests.torchrun.start(
        ["--standalone", "--nproc-per-node", "2",
         "-m", "prefetchd.trainer.train", "--buffer", buffer, "--spawn-daemon", "--data", shapes_data / "train",
         "--batch-size", "8", "--image-size", "32", "--epochs", "50", "--workers", "1", "--device", "cpu",
         "--threads", "1", "--model", "mobilenet_v3_small", "--timeout", "60", "-q",
         "--checkpoint-dir", tmp_path / "ckpt"])
    try:
        deadline = time.monotonic() + 120
        while Progress.read(stream_dir(buffer, 1, 2)) is None or daemon_pid(buffer) is None:
            assert run.poll() is None and time.monotonic() < deadline, "the run should be training"
            time.sleep(0.2)
        pid = daemon_pid(buffer)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
    except BaseException:
        tests.torchrun.kill_with_ranks(run)
        raise
    err = tests.torchrun.finish([run], 120)[0].stderr
    said = " ".join(err.split())
    assert run.returncode != 0
    assert "a lost daemon ends the run" in said and "run this same command again with --resume" in said, said[-3000:]
    assert "No need to start it by hand as above" in said, said[-3000:]  # its restart command is not the way here
    assert "for its 2 ranks together" in said, said[-3000:]


def _rank_processes(run: subprocess.Popen[str]) -> list[psutil.Process]:
    """The trainer processes torchrun ``run`` started, in the order it started them."""
    return sorted((p for p in psutil.Process(run.pid).children(recursive=True)
                   if "prefetchd.trainer.train" in " ".join(p.cmdline())), key=lambda p: p.pid)


def _stalled_at(buffers: list[Path], runs: list[subprocess.Popen[str]], quiet: float = 3.0) -> int:
    """The step every rank's progress names once none has moved for ``quiet`` seconds: the ranks wait."""
    last, since = None, time.monotonic()
    deadline = since + 120
    while True:
        now = [Progress.read(stream_dir(b, rank, 2)) for rank, b in enumerate(buffers)]
        steps = [p.step if p is not None else None for p in now]
        if steps != last:
            last, since = steps, time.monotonic()
        elif time.monotonic() - since >= quiet and None not in steps:
            assert len(set(steps)) == 1, steps
            return int(steps[0])  # type: ignore[arg-type]
        assert all(r.poll() is None for r in runs) and time.monotonic() < deadline, "the ranks should be training"
        time.sleep(0.1)


def _train_until(buffers: list[Path], runs: list[subprocess.Popen[str]], step: int) -> None:
    deadline = time.monotonic() + 120
    while not all((p := Progress.read(stream_dir(b, rank, 2))) is not None and p.step >= step
                  for rank, b in enumerate(buffers)):
        assert all(r.poll() is None for r in runs) and time.monotonic() < deadline, "the ranks should be training"
        time.sleep(0.1)


def _assert_saved_at(ckpt: Path, step: int) -> None:
    doc = load_checkpoint(ckpt / LAST_CHECKPOINT)
    assert doc["global_step"] == step
    # A rank that held its next batch when the ranks agreed to stop gave it back: a resume starts with it.
    assert [(s["loaders"]["train"]["epoch"], s["loaders"]["train"]["step"]) for s in doc["ranks"]] == [(0, step)] * 2


def test_a_sigterm_while_the_ranks_wait_for_a_batch_saves_the_steps_done(
    shapes_data: Path, shm_dir: Path, tmp_path: Path, start_daemon
) -> None:
    """The daemon stalls (SIGSTOP) and both ranks wait for their next batch: torchrun's SIGTERM, which it
    passes to the ranks, stopped nothing; after 30 s torchrun killed them, and the steps since the last
    checkpoint were lost (review). Now the ranks stop at once, together, with the checkpoint a stop
    during a step saves."""
    buffer, ckpt = shm_dir / "bf", tmp_path / "ckpt"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", "--batch-size", "4", "--image-size", "32",
                          "--epochs", "2", "--world-size", "2", "--workers", "1", "--high-water", "2")
    run = tests.torchrun.start(
        ["--standalone", "--nproc-per-node", "2", "-m", "prefetchd.trainer.train", "--buffer", buffer,
         "--device", "cpu", "--threads", "1", "--model", "mobilenet_v3_small", "--timeout", "300",
         "--daemon-timeout", "0", "-q", "--checkpoint-dir", ckpt])
    try:
        _train_until([buffer, buffer], [run], 2)
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        step = _stalled_at([buffer, buffer], [run])
        os.kill(run.pid, signal.SIGTERM)
        done = tests.torchrun.finish([run], 25)[0]  # torchrun kills its ranks 30 s after passing the SIGTERM
    finally:
        tests.torchrun.kill_with_ranks(run)
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert f"stopped after global step {step} (SIGTERM, checkpoint" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "forcefully exiting" not in done.stderr
    _assert_saved_at(ckpt, step)


def test_a_sigterm_to_the_rank_that_holds_its_batch_stops_the_rank_that_waits(
    shapes_data: Path, shm_dir: Path, tmp_path: Path, start_daemon
) -> None:
    """Two boxes: box 1's daemon stalls, so rank 1 waits for a batch while rank 0 holds its own. Only rank 0
    gets the SIGTERM: it used to sit in the step's gradient all-reduce, its handler never ran, and rank 1
    waited for the stalled daemon for ever. Now both stop before that step, with its checkpoint, and
    each exits as a SIGTERM during a step does (143)."""
    ckpt = tmp_path / "ckpt"
    buffers = [shm_dir / "box0", shm_dir / "box1"]
    job = ["--batch-size", "4", "--image-size", "32", "--epochs", "2", "--world-size", "2", "--workers", "1"]
    daemons = [start_daemon(b, "--data", shapes_data / "train", *job, "--ranks", str(rank), "--high-water", "3")
               for rank, b in enumerate(buffers)]
    common = ["--device", "cpu", "--threads", "1", "--model", "mobilenet_v3_small", "--timeout", "300",
              "--daemon-timeout", "0", "-q"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runs = [tests.torchrun.start(["--nnodes", "2", "--node-rank", node, "--nproc-per-node", "1", "--master-addr",
                                  "127.0.0.1", "--master-port", port, "-m", "prefetchd.trainer.train", *args])
            for node, args in enumerate([["--buffer", buffers[0], *common, "--checkpoint-dir", ckpt],
                                         ["--buffer", buffers[1], *common]])]
    try:
        _train_until(buffers, runs, 2)
        os.kill(daemons[1].proc.pid, signal.SIGSTOP)
        step = _stalled_at(buffers, runs)
        assert (stream_dir(buffers[0], 0, 2) / batch_name(0, step)).is_file(), "rank 0 has its next batch"
        (rank0,) = _rank_processes(runs[0])
        rank0.send_signal(signal.SIGTERM)
        done = tests.torchrun.finish(runs, 60)
    finally:
        for run in runs:
            tests.torchrun.kill_with_ranks(run)
        os.kill(daemons[1].proc.pid, signal.SIGCONT)
    said = done[0].stdout + done[0].stderr[-3000:] + done[1].stderr[-3000:]
    assert f"stopped after global step {step} (SIGTERM, checkpoint" in done[0].stdout, said
    for box in done:  # torchrun's summary of a rank that exited 143
        assert "exitcode  : 143" in box.stderr, said
    _assert_saved_at(ckpt, step)


def test_ranks_given_different_max_steps_refuse_at_start(shapes_data: Path, shm_dir: Path, tmp_path: Path,
                                                         start_daemon) -> None:
    """Two boxes launched by hand with different --max-steps: rank 0 stopped at its limit and began the
    checkpoint's gather while rank 1 went on into the next step's agreement, and the run hung (or one rank
    failed on the other's collective). Now every rank refuses before the first step, naming the option."""
    ckpt = tmp_path / "ckpt"
    buffers = [shm_dir / "box0", shm_dir / "box1"]
    job = ["--batch-size", "4", "--image-size", "32", "--epochs", "1", "--world-size", "2", "--workers", "1"]
    daemons = [start_daemon(b, "--data", shapes_data / "train", *job, "--ranks", str(rank))
               for rank, b in enumerate(buffers)]
    common = ["--device", "cpu", "--threads", "1", "--timeout", "120", "-q"]
    # And a model and a learning rate of their own: DDP failed on the model in its constructor, with a
    # traceback, and ranks of different --lr trained apart without a word.
    done = two_boxes(["--buffer", buffers[0], *common, "--checkpoint-dir", ckpt, "--max-steps", "3",
                      "--model", "mobilenet_v3_small", "--lr", "0.1"],
                     ["--buffer", buffers[1], *common, "--max-steps", "5", "--model", "resnet18", "--lr", "0.001"], 120)
    said = [" ".join(box.stderr.split()) for box in done]
    logs = "\n".join(s[-3000:] for s in said) + daemons[0].log[-2000:]
    for rank, box in enumerate(done):
        assert "--max-steps differs between ranks (rank 0: 3, rank 1: 5); pass the same value to every rank" \
            in said[rank], logs
        assert "--model differs between ranks (rank 0: mobilenet_v3_small, rank 1: resnet18)" in said[rank], logs
        assert "--lr differs between ranks (rank 0: 0.1, rank 1: 0.001)" in said[rank], logs
        assert "exitcode  : 2" in box.stderr, logs  # torchrun's summary: the usage error's code
    assert not (ckpt / LAST_CHECKPOINT).exists(), "refused before the first step"


def test_validation_on_one_rank_only_is_refused_at_start(shm_dir: Path, tmp_path: Path) -> None:
    """Each validation step begins with the ranks' agreement whether to stop: a rank without a validation
    buffer would pair its next training step's with it. Refused before any stream is waited for."""
    common = ["--device", "cpu", "--threads", "1", "--timeout", "5", "--max-steps", "2", "-q"]
    done = two_boxes(["--buffer", shm_dir / "bf", "--val-buffer", shm_dir / "bf-val", *common],
                     ["--buffer", shm_dir / "bf", *common], 120)
    for box in done:
        said = " ".join(box.stderr.split())
        assert "validation differs between ranks (rank 0: on, rank 1: off); give every rank a validation buffer" \
            in said, said[-3000:]
        assert "--max-steps differs" not in said and "exitcode  : 2" in box.stderr, said[-3000:]
