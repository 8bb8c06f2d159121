"""prefetchd-train --spawn-daemon: real daemons started through the CLI, fed to the trainer, stopped at the end.

The trainer runs in-process (CliRunner); the daemons it spawns are real processes whose
stderr is this process's fd 2, hence capfd."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from click.testing import CliRunner
from torchvision.datasets import ImageFolder

from prefetchd.buffer_protocol import Progress, ProtocolError, daemon_pid
from prefetchd.daemon.status_view import describe_status, format_status
from prefetchd.trainer import BufferLoader
from prefetchd.trainer.checkpoint import LAST_CHECKPOINT
from prefetchd.trainer.config import TrainConfig
from prefetchd.trainer.passes import timed_batches
from prefetchd.trainer.spawn import SpawnedDaemon, restarter, spawn_daemon
from prefetchd.trainer.train import EXIT_BUFFER, EXIT_FAILED, main, train
from tests.waiting import wait_for


def test_spawn_daemon_end_to_end(shapes_data: Path, shm_dir: Path, tmp_path: Path) -> None:
    buffer, metrics = shm_dir / "bf", tmp_path / "metrics.json"
    csv_path = tmp_path / "metrics.csv"
    args = [
        "--buffer", str(buffer), "--spawn-daemon", "--data", str(shapes_data / "train"),
        "--val-data", str(shapes_data / "val"), "--epochs", "1", "--batch-size", "8", "--image-size", "32",
        "--workers", "1", "--device", "cpu", "--threads", "1", "--model", "mobilenet_v3_small",
        "--metrics-json", str(metrics), "--metrics-csv", str(csv_path), "--timeout", "120",
    ]
    # Twice: the second run finds the first's finished positions in both buffers and starts again.
    for _ in range(2):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
    val_buffer = shm_dir / "bf-val"  # no --val-buffer: next to the training buffer
    assert f"starting the train daemon for {buffer}" in result.stdout
    assert f"starting the val daemon for {val_buffer}" in result.stdout
    doc = json.loads(metrics.read_text())
    row = doc["epochs"][0]
    assert row["train_images"] == len(ImageFolder(str(shapes_data / "train")).samples)
    assert row["val_images"] == len(ImageFolder(str(shapes_data / "val")).samples)
    assert doc["finished"] is True and len(csv_path.read_text().splitlines()) == 2
    # Both buffers were consumed to the end, and both daemons are gone.
    assert Progress.read(buffer) == Progress(1, 0) and Progress.read(val_buffer) == Progress(1, 0)
    assert daemon_pid(buffer) is None and daemon_pid(val_buffer) is None


def test_spawn_daemon_drop_last_trains_where_a_one_image_batch_cannot(
        shapes_data: Path, shm_dir: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # 72 training images in batches of 71 end every epoch in one image, which ResNet-18 at
    # 32 px cannot train on (BatchNorm after pooling to 1 x 1): refused before the first step.
    buffer, metrics = shm_dir / "bf", tmp_path / "metrics.json"
    args = ["--buffer", str(buffer), "--spawn-daemon", "--data", str(shapes_data / "train"), "--val-data",
            str(shapes_data / "val"), "--epochs", "1", "--batch-size", "71", "--image-size", "32", "--workers", "1",
            "--device", "cpu", "--threads", "1", "--model", "resnet18", "--metrics-json", str(metrics)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code != 0 and "ends in a batch of 1 image" in result.output + result.stderr
    assert daemon_pid(buffer) is None and daemon_pid(shm_dir / "bf-val") is None
    assert "--drop-last --reset" in result.output + result.stderr
    # --drop-last reaches the training daemon only: it leaves out the one image, validation sees all.
    # --reset: the buffer holds the refused run's batches, which kept the short one.
    result = CliRunner().invoke(main, [*args, "--drop-last"])
    assert result.exit_code != 0 and "exited with code 2 before serving it" in result.output
    assert "drop_last: False -> True" in capfd.readouterr().err  # the daemon's own words, on our stderr
    result = CliRunner().invoke(main, [*args, "--drop-last", "--reset"])
    assert result.exit_code == 0, result.output
    row = json.loads(metrics.read_text())["epochs"][0]
    assert row["train_images"] == 71
    assert row["val_images"] == len(ImageFolder(str(shapes_data / "val")).samples)


def test_spawned_daemon_that_fails_is_reported(tmp_path: Path, shm_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    buffer = shm_dir / "bf"
    result = CliRunner().invoke(main, [
        "--buffer", str(buffer), "--spawn-daemon", "--data", str(empty), "--epochs", "1", "--device", "cpu",
        "--timeout", "60",
    ])
    assert result.exit_code == EXIT_FAILED
    assert f"the daemon started for {buffer} exited with code" in result.stderr
    assert "Traceback" not in result.output
    assert str(empty) in capfd.readouterr().err  # the daemon's own message about the dataset


# -- a daemon that dies or gets stuck under a --spawn-daemon run is restarted ------------------------

SMALL_JOB = dict(epochs=2, batch_size=8, image_size=32, workers=1, high_water=2, timeout=60.0, quiet=True)


def _batches(shapes_data: Path, buffer: Path, hit: Callable[[SpawnedDaemon], None] | None = None,
             at: tuple[int, int] = (0, 3), restarts: int = 2,
             waits: list[float] | None = None) -> tuple[list[tuple[int, int, list[int], str]], list[str]]:
    """Every batch of a 2-epoch job, read through the run's restart path; ``hit`` is done to the
    daemon right after batch ``at`` is handed over.  ``waits`` gets each batch's wait, as timed
    for the data-wait share."""
    said: list[str] = []
    config = TrainConfig(buffer=buffer, spawn_daemon=True, data=shapes_data / "train", daemon_restarts=restarts,
                         **SMALL_JOB)  # type: ignore[arg-type]
    daemon = spawn_daemon(buffer, shapes_data / "train", "train", config, said.append)
    assert daemon is not None
    try:
        daemon.wait_ready(60)
        seen = []
        with BufferLoader(buffer, normalize=False, timeout=60, daemon_grace=1.0, stall_timeout=3.0) as loader:
            recover = restarter([daemon], config, said.append)
            for _ in range(2):
                for batch, waited in timed_batches(loader, recover):
                    if waits is not None:
                        waits.append(waited)
                    digest = hashlib.sha256(batch.images.numpy().tobytes()).hexdigest()
                    seen.append((batch.epoch, batch.step, batch.indices.tolist(), digest))
                    if hit is not None and (batch.epoch, batch.step) == at:
                        hit(daemon)
    finally:
        daemon.stop()
    return seen, said


@pytest.fixture(scope="module")
def uninterrupted(shapes_data: Path) -> list[tuple[int, int, list[int], str]]:
    """The batches of the small job as a run without faults sees them."""
    buffer = Path("/dev/shm" if os.access("/dev/shm", os.W_OK) else "/tmp") / f"prefetchd-test-clean-{os.getpid()}"
    try:
        want, _ = _batches(shapes_data, buffer)
    finally:
        shutil.rmtree(buffer, ignore_errors=True)
    assert len(want) == 2 * 9 and len({(e, s) for e, s, _, _ in want}) == 18
    return want


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_restarted_daemon_delivers_every_batch_exactly_once(shapes_data: Path, shm_dir: Path, sig: int,
                                                            uninterrupted: list[tuple[int, int, list[int], str]]) -> None:
    want = uninterrupted
    first: list[int] = []
    waits: list[float] = []
    got, said = _batches(shapes_data, shm_dir / "hit",
                         lambda d: (first.append(d.proc.pid), os.kill(d.proc.pid, sig)), waits=waits)
    # The first batch after the hit that was not in the buffer yet waited for the loader to give up on the
    # daemon (daemon_grace 1 s, stall_timeout 3 s) and for the restart: time the data-wait share must
    # count, not start afresh after the recovery.
    assert max(waits[4:]) >= (3.0 if sig == signal.SIGSTOP else 1.0), waits
    # The same (epoch, step, indices, pixels), in the same order: nothing skipped, nothing twice.
    assert got == want
    restarted = [line for line in said if "restarting it" in line]
    assert len(restarted) == 1, said
    assert ("is stuck" if sig == signal.SIGSTOP else "is gone") in restarted[0]
    assert f"pid {first[0]}" in restarted[0] and "1 of at most 2 restarts" in restarted[0]
    assert not psutil.pid_exists(first[0]) or psutil.Process(first[0]).status() == psutil.STATUS_ZOMBIE


def _train_cli(shapes_data: Path, buffer: Path, metrics: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "prefetchd.trainer.train", "--buffer", str(buffer), "--spawn-daemon",
         "--data", str(shapes_data / "train"), "--epochs", "1", "--batch-size", "8", "--image-size", "32",
         "--workers", "1", "--high-water", "2", "--device", "cpu", "--threads", "1", "--model",
         "mobilenet_v3_small", "--metrics-json", str(metrics), "--timeout", "60", "--quiet", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def _hit_daemon_mid_run(trainer: subprocess.Popen[str], buffer: Path, sig: int) -> int:
    """Send ``sig`` to the trainer's daemon once the trainer is past step 2 of epoch 0."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and trainer.poll() is None:
        try:
            p = Progress.read(buffer)
        except ProtocolError:
            p = None
        pid = daemon_pid(buffer)
        if p is not None and (p.epoch, p.step) >= (0, 2) and pid is not None:
            os.kill(pid, sig)
            return pid
        time.sleep(0.01)
    out = trainer.communicate(timeout=60)[0] if trainer.poll() is not None else ""
    raise AssertionError(f"the trainer never got to step 2 with a daemon (exit {trainer.poll()}):\n{out}")


def test_prefetchd_train_restarts_a_stuck_daemon_and_finishes(shapes_data: Path, shm_dir: Path,
                                                              tmp_path: Path) -> None:
    buffer, metrics = shm_dir / "bf", tmp_path / "metrics.json"
    trainer = _train_cli(shapes_data, buffer, metrics, "--daemon-timeout", "3")
    try:
        stopped = _hit_daemon_mid_run(trainer, buffer, signal.SIGSTOP)
        out = trainer.communicate(timeout=180)[0]
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == 0, out
    assert f"(pid {stopped}) is stuck; restarting it" in out and "runs again" in out
    doc = json.loads(metrics.read_text())
    # An epoch of 72 samples: no batch lost or repeated across the restart.
    assert [row["train_images"] for row in doc["epochs"]] == [72] and doc["finished"] is True
    assert daemon_pid(buffer) is None and not psutil.pid_exists(stopped)


def test_prefetchd_train_gives_up_when_restarts_are_spent(shapes_data: Path, shm_dir: Path, tmp_path: Path) -> None:
    buffer = shm_dir / "bf"
    trainer = _train_cli(shapes_data, buffer, tmp_path / "metrics.json", "--daemon-restarts", "0")
    try:
        killed = _hit_daemon_mid_run(trainer, buffer, signal.SIGKILL)
        start = time.monotonic()
        out = trainer.communicate(timeout=120)[0]
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == EXIT_BUFFER, out
    assert time.monotonic() - start < 60
    assert f"(pid {killed}) is gone and --daemon-restarts 0 allows no restart; giving up" in out
    assert "; restarting it (" not in out and "Traceback" not in out
    assert daemon_pid(buffer) is None


def test_a_restart_that_fails_before_serving_ends_the_run_at_once_with_the_daemons_message(
        shapes_data: Path, shm_dir: Path, tmp_path: Path) -> None:
    """RELIABILITY.md, prefetchd-train: a restarted daemon that exits before serving (a bad dataset, say) ends the
    run at once with its own message, exit code 1: no restart loop, and no wait of --timeout (60 s here) for a
    daemon that is not there. The dataset is moved away before the daemon is killed: its restart fails at the
    index."""
    root = tmp_path / "data"
    shutil.copytree(shapes_data / "train", root / "train")
    buffer = shm_dir / "bf"
    trainer = _train_cli(root, buffer, tmp_path / "metrics.json")
    try:
        deadline = time.monotonic() + 120
        while (pid := daemon_pid(buffer)) is None or (progress := Progress.read(buffer)) is None or \
                (progress.epoch, progress.step) < (0, 2):
            assert trainer.poll() is None and time.monotonic() < deadline, "the trainer never got to step 2"
            time.sleep(0.01)
        (root / "train").rename(root / "moved")
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        out = trainer.communicate(timeout=120)[0]
    finally:
        if trainer.poll() is None:
            trainer.kill()
    assert trainer.returncode == EXIT_FAILED, out
    assert time.monotonic() - start < 40, f"took {time.monotonic() - start:.0f} s: {out}"
    assert out.count("; restarting it (") == 1 and f"(pid {pid}) is gone; restarting it (1 of at most 3" in out, out
    assert str(root / "train") in out, "the restarted daemon's own message, about its dataset"
    assert "giving up" not in out and "Traceback" not in out, out
    assert daemon_pid(buffer) is None


def test_a_run_killed_with_its_daemon_resumes_without_a_warning_about_its_own_dead_trainer(
        shapes_data: Path, shm_dir: Path, tmp_path: Path) -> None:
    """A job scheduler ends a run's trainer and the daemon it started alike. The restart (--resume) starts a
    daemon that finds the killed trainer's progress: the previous run of this same trainer, which takes over
    at once, is no warning on the restarted run's stderr (the daemon's INFO line is below --spawn-daemon's
    log level)."""
    buffer, ckpt = shm_dir / "bf", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "prefetchd.trainer.train", "--buffer", str(buffer), "--spawn-daemon",
           "--data", str(shapes_data / "train"), "--epochs", "1", "--batch-size", "8", "--image-size", "32",
           "--workers", "1", "--device", "cpu", "--threads", "1", "--model", "mobilenet_v3_small",
           "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    # A session of its own: the daemon it starts is in its process group, and the kill takes both.
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for((ckpt / LAST_CHECKPOINT).exists, 120, "the first checkpoint", first)
        killed = Progress.read(buffer)
        assert killed is not None and daemon_pid(buffer) is not None
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        wait_for(lambda: daemon_pid(buffer) is None, 30, "the killed run's daemon to be gone")

        second = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stdout + second.stderr
        assert "starting the train daemon" in second.stdout and "resumed from" in second.stdout
        assert "gone away" not in second.stderr and f"pid {killed.pid}" not in second.stderr, second.stderr
    finally:
        try:
            os.killpg(first.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_val_buffer_shows_this_run_from_its_first_training_step(shapes_data: Path, shm_dir: Path) -> None:
    """`prefetchd status` of the validation buffer names this run's trainer, at the first validation batch it
    will read, from the start of training: not a killed earlier run's position, its pid GONE, until this run's
    first validation pass a training epoch later."""
    buffer, val_buffer = shm_dir / "bf", shm_dir / "bf-val"
    config = TrainConfig(buffer=buffer, spawn_daemon=True, data=shapes_data / "train", val_data=shapes_data / "val",
                         epochs=3, batch_size=8, image_size=32, workers=1, device="cpu", threads=1,
                         model="mobilenet_v3_small", timeout=60, quiet=True)
    first = subprocess.Popen(
        [sys.executable, "-m", "prefetchd.trainer.train", "--buffer", str(buffer), "--spawn-daemon", "--data",
         str(config.data), "--val-data", str(config.val_data), "--epochs", "3", "--batch-size", "8", "--image-size",
         "32", "--workers", "1", "--device", "cpu", "--threads", "1", "--model", "mobilenet_v3_small", "-q"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    orphans: list[int] = []

    def validated() -> bool:
        try:
            p = Progress.read(val_buffer)
        except (ProtocolError, OSError):
            return False
        return p is not None and p.epoch == 1

    try:
        # Killed in its second epoch, past its first validation pass; its daemons serve on.
        wait_for(validated, 120, "the first run's first validation pass", first)
        orphans += [pid for pid in (daemon_pid(buffer), daemon_pid(val_buffer)) if pid is not None]
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        shown: list[str] = []

        def look() -> bool:
            """Once this run trains (asked after each step and while it waits for one): what status shows of
            the val buffer; then stop."""
            def current() -> bool:
                shown[:] = [format_status(describe_status(val_buffer))]
                return "trainer at epoch 0 step 0" in shown[0] and f"trainer pid {os.getpid()} alive" in shown[0]

            wait_for(current, 30, "the val buffer's status to show this run")
            return True

        metrics = train(config, echo=lambda _: None, should_stop=look)
        assert metrics["stopped_by"] == "SIGTERM" and metrics["epochs"] == []  # stopped before any validation
        assert "GONE" not in shown[0], shown[0]
    finally:
        if first.poll() is None:
            first.kill()
        for pid in orphans:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_ctrl_c_as_a_daemon_is_launched_leaves_no_daemon_running(shapes_data: Path, shm_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C (or SIGTERM) that came between a spawned daemon's launch and the registration of its stop left
    that daemon running, unmentioned (a user's walk: the val daemon served on after the trainer exited 130)."""
    import prefetchd.trainer.spawn as spawn_module

    launched: list[subprocess.Popen[bytes]] = []
    launch = spawn_module.launch

    def launch_then_ctrl_c(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        proc = launch(*args, **kwargs)
        launched.append(proc)
        os.kill(os.getpid(), signal.SIGINT)  # delivered at once: its handler runs before the launch returns
        return proc

    monkeypatch.setattr(spawn_module, "launch", launch_then_ctrl_c)
    result = CliRunner().invoke(main, [
        "--buffer", str(shm_dir / "bf"), "--spawn-daemon", "--data", str(shapes_data / "train"), "--epochs", "1",
        "--batch-size", "8", "--image-size", "32", "--workers", "1", "--device", "cpu", "--threads", "1", "-q"])
    try:
        assert result.exit_code == 130, result.output
        assert len(launched) == 1 and launched[0].poll() is not None, "the daemon it launched is stopped"
    finally:
        for proc in launched:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
