"""prefetchd-train --spawn-daemon: real daemons started through the CLI, fed to the trainer, stopped at the end.

The trainer runs in-process (CliRunner); the daemons it spawns are real processes whose
stderr is this process's fd 2, hence capfd."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from torchvision.datasets import ImageFolder

from prefetchd.buffer_protocol import Progress, daemon_pid
from prefetchd.trainer.train import EXIT_FAILED, main


def test_spawn_daemon_end_to_end(shapes_data: Path, shm_dir: Path, tmp_path: Path) -> None:
    buffer, metrics = shm_dir / "bf", tmp_path / "metrics.json"
    csv_path = tmp_path / "metrics.csv"
    result = CliRunner().invoke(main, [
        "--buffer", str(buffer), "--spawn-daemon", "--data", str(shapes_data / "train"),
        "--val-data", str(shapes_data / "val"), "--epochs", "1", "--batch-size", "8", "--image-size", "32",
        "--workers", "1", "--device", "cpu", "--threads", "1", "--model", "mobilenet_v3_small",
        "--metrics-json", str(metrics), "--metrics-csv", str(csv_path), "--timeout", "120",
    ])
    assert result.exit_code == 0, result.output
    val_buffer = shm_dir / "bf-val"  # no --val-buffer: next to the training buffer
    assert f"started the train daemon for {buffer}" in result.stdout
    assert f"started the val daemon for {val_buffer}" in result.stdout
    doc = json.loads(metrics.read_text())
    row = doc["epochs"][0]
    assert row["train_images"] == len(ImageFolder(str(shapes_data / "train")).samples)
    assert row["val_images"] == len(ImageFolder(str(shapes_data / "val")).samples)
    assert doc["finished"] is True and len(csv_path.read_text().splitlines()) == 2
    # Both buffers were consumed to the end, and both daemons are gone.
    assert Progress.read(buffer) == Progress(1, 0) and Progress.read(val_buffer) == Progress(1, 0)
    assert daemon_pid(buffer) is None and daemon_pid(val_buffer) is None


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
