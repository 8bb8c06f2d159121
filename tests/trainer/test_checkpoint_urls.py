"""prefetchd-train's checkpoints in object storage: --checkpoint-dir s3://bucket/run, against moto on loopback."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from click.testing import CliRunner

from prefetchd.buffer_protocol import Progress
from prefetchd.trainer.checkpoint import (CHECKPOINT_FORMAT, CHECKPOINT_VERSION, LAST_CHECKPOINT, SAVE_RETRY_ATTEMPTS, CheckpointPlan,
                                         Checkpointer, load_checkpoint, save_checkpoint)
from prefetchd.trainer.errors import CheckpointError
from prefetchd.trainer.config import TrainConfig
from prefetchd.trainer.train import EXIT_FAILED, main, train

if TYPE_CHECKING:
    from conftest import MakeJob

TINY = dict(classes=3, samples=12, batch_size=4, image_size=16, epochs=2, write=2)
SETTINGS = dict(model="mobilenet_v3_small", device="cpu", threads=1, timeout=10, quiet=True, checkpoint_every=2,
                epochs=2)


def quiet(_: str) -> None:
    pass


def test_stop_and_resume_through_s3_is_exact(s3: Any, make_job: MakeJob, buffer: Path, tmp_path: Path) -> None:
    whole_job = make_job(buffer / "a", **TINY)
    train(TrainConfig(buffer=whole_job.buffer, checkpoint_dir=tmp_path / "local", **SETTINGS), echo=quiet)  # type: ignore[arg-type]
    whole = load_checkpoint(tmp_path / "local" / LAST_CHECKPOINT)

    url = s3.url("runs/r1")
    job = make_job(buffer / "b", **TINY)
    first = train(TrainConfig(buffer=job.buffer, checkpoint_dir=url, max_steps=4, **SETTINGS), echo=quiet)  # type: ignore[arg-type]
    assert first["global_steps"] == 4
    assert s3.fs.exists(f"{s3.bucket}/runs/r1/{LAST_CHECKPOINT}")
    stopped = load_checkpoint(f"{url}/{LAST_CHECKPOINT}")
    assert stopped["format"] == CHECKPOINT_FORMAT and stopped["global_step"] == 4

    # Through the CLI: the URL must reach the trainer unmangled (a Path would make it s3:/...).
    result = CliRunner().invoke(main, [
        "--buffer", str(job.buffer), "--device", "cpu", "--threads", "1", "--timeout", "10", "--model",
        "mobilenet_v3_small", "--checkpoint-every", "2", "--epochs", "2", "--checkpoint-dir", url + "/", "--resume",
    ])
    assert result.exit_code == 0, result.output
    assert "resumed from" in result.output and url in result.output
    resumed = load_checkpoint(f"{url}/{LAST_CHECKPOINT}")
    assert resumed["global_step"] == whole["global_step"] == 6
    for key, value in whole["model"].items():
        assert torch.equal(value, resumed["model"][key]), key


def test_resume_without_a_checkpoint_in_the_bucket_starts_from_scratch(s3: Any, make_job: MakeJob,
                                                                        buffer: Path) -> None:
    job = make_job(buffer, **{**TINY, "epochs": 1, "write": 1})
    said: list[str] = []
    url = s3.url("fresh")
    train(TrainConfig(buffer=job.buffer, checkpoint_dir=url, resume=True, **{**SETTINGS, "epochs": 1}),  # type: ignore[arg-type]
          echo=said.append)
    assert any("no checkpoint" in line and url in line for line in said)
    assert load_checkpoint(f"{url}/{LAST_CHECKPOINT}")["global_step"] == 3


def test_a_run_without_resume_refuses_to_overwrite_a_checkpoint_in_the_bucket(s3: Any, make_job: MakeJob,
                                                                             buffer: Path) -> None:
    job = make_job(buffer, **{**TINY, "epochs": 1, "write": 1})
    url = s3.url("taken")
    args = ["--buffer", str(job.buffer), "--device", "cpu", "--threads", "1", "--model", "mobilenet_v3_small", "-q",
            "--checkpoint-dir", url, "--max-steps", "1"]
    assert CliRunner().invoke(main, args).exit_code == 0
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert f"{url}/{LAST_CHECKPOINT} (global step 1, 0 epochs done)" in " ".join(result.stderr.split())
    assert load_checkpoint(f"{url}/{LAST_CHECKPOINT}")["global_step"] == 1


def test_checkpoint_urls_without_credentials_fail_with_one_clear_line(s3: Any, make_job: MakeJob, buffer: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    job = make_job(buffer, **{**TINY, "epochs": 1, "write": 1})
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    result = CliRunner().invoke(main, ["--buffer", str(job.buffer), "--device", "cpu", "-q", "--checkpoint-dir",
                                       s3.url("run"), "--resume"])
    assert result.exit_code == EXIT_FAILED, result.output
    assert "no credentials found for s3://" in result.stderr and "Traceback" not in result.output


def test_spawn_daemon_passes_a_data_url_unmangled(s3: Any, shm_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """--data s3://... reaches the spawned daemon as given (a Path would make it s3:/...): its error names it."""
    url = s3.url("no/such/prefix")
    # On the tmpfs: under tmp_path, on a disk with under ~14 GB free, the default floor (5 % of the disk) and
    # high-water mark were refused before the dataset was read.
    buffer = shm_dir / "bf"
    result = CliRunner().invoke(main, ["--buffer", str(buffer), "--spawn-daemon", "--data", url + "/", "--epochs", "1",
                                       "--device", "cpu", "--timeout", "60"])
    assert result.exit_code == EXIT_FAILED
    assert f"the daemon started for {buffer} exited with code" in result.stderr
    assert f"{url}: nothing is stored under this prefix" in capfd.readouterr().err


@pytest.mark.parametrize("where", ["a file", "no bucket"])
def test_a_checkpoint_dir_that_cannot_be_written_fails_before_the_first_step(
        s3: Any, make_job: MakeJob, buffer: Path, tmp_path: Path, where: str) -> None:
    """Found by a probe at start, not after an epoch of training (a typo would cost hours on ImageNet)."""
    job = make_job(buffer, **{**TINY, "epochs": 1, "write": 1})
    (tmp_path / "afile").write_text("")
    target = str(tmp_path / "afile" / "ck") if where == "a file" else "s3://no-such-bucket-7c1/run"
    result = CliRunner().invoke(main, ["--buffer", str(job.buffer), "--device", "cpu", "--threads", "1",
                                       "--model", "mobilenet_v3_small", "--epochs", "1", "--checkpoint-dir", target])
    assert result.exit_code == EXIT_FAILED, result.output
    assert "--checkpoint-dir" in result.stderr and "cannot write there" in result.stderr, result.stderr
    assert "Traceback" not in result.output and "train loss" not in result.output  # no step ran
    assert Progress.read(job.buffer) in (None, Progress(0, 0))


def test_a_store_that_cannot_say_whether_a_checkpoint_is_there_stops_a_run_without_resume(
        s3: Any, proxy: Any, fast_retries: None, make_job: MakeJob, buffer: Path) -> None:
    """The look for an earlier run's checkpoint took any failure for "none": a few seconds of 503s at the start
    let a run without --resume overwrite that checkpoint at its first save (review)."""
    job = make_job(buffer, **{**TINY, "epochs": 1, "write": 1})
    url = s3.url("busy")
    args = ["--buffer", str(job.buffer), "--device", "cpu", "--threads", "1", "--model", "mobilenet_v3_small", "-q",
            "--checkpoint-dir", url, "--max-steps", "1"]
    assert CliRunner().invoke(main, args).exit_code == 0
    proxy.fail_next = 1000  # throttled beyond a read's six tries
    result = CliRunner().invoke(main, args)
    proxy.fail_next = 0
    assert result.exit_code == EXIT_FAILED, result.output
    said = " ".join(result.stderr.split())
    assert "cannot tell whether --checkpoint-dir holds a checkpoint of an earlier run" in said and "Traceback" not in said
    assert load_checkpoint(f"{url}/{LAST_CHECKPOINT}")["global_step"] == 1


def test_a_save_outlasts_a_throttling_longer_than_a_reads_retries(s3: Any, proxy: Any, fast_retries: None) -> None:
    """A save gave up after a read's six tries (~3 s): a few seconds of SlowDown at an epoch's end ended the run."""
    url = f"{s3.url('slow')}/{LAST_CHECKPOINT}"
    proxy.fail_next = SAVE_RETRY_ATTEMPTS - 1
    save_checkpoint(url, {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "global_step": 5})
    assert load_checkpoint(url)["global_step"] == 5
    proxy.fail_next = SAVE_RETRY_ATTEMPTS
    with pytest.raises(CheckpointError, match=f"cannot save the checkpoint {url}: .*still failing after"):
        save_checkpoint(url, {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "global_step": 6})
    proxy.fail_next = 0
    assert load_checkpoint(url)["global_step"] == 5


def test_a_probe_the_store_refuses_in_any_way_says_the_dir_cannot_be_written(s3: Any) -> None:
    """Only denied or unreachable counted: any other refusal of the probe's PUT (a 400, a bucket name the
    client rejects) passed it, and the first save died with a traceback after an epoch of training (review)."""
    plan = CheckpointPlan.of(TrainConfig(buffer=Path("/unused"), checkpoint_dir="s3://Bad_Bucket!/run"))  # type: ignore[arg-type]
    problem = Checkpointer(plan).unwritable()
    assert problem is not None and problem.startswith("--checkpoint-dir: cannot write there: "), problem
