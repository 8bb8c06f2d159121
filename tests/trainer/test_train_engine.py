"""prefetchd-train as a training engine: optimizers, schedule, top-k, CSV, checkpoints, exact resume,
--pretrained from the local cache only. Fake buffers (written by the protocol's writer), CPU, tiny images."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torchvision
from click.testing import CliRunner

from prefetchd.buffer_protocol import Manifest, Progress
from prefetchd.trainer.checkpoint import CHECKPOINT_FORMAT, LAST_CHECKPOINT, load_checkpoint
from prefetchd.trainer.config import TrainConfig
from prefetchd.trainer.model import build_model, cached_weights, check_last_batch, warmup_cosine
from prefetchd.trainer.errors import LoaderError, OptionError, SetupError
from prefetchd.trainer.train import EXIT_FAILED, main, train

if TYPE_CHECKING:
    from conftest import FakeJob, MakeJob

TINY = dict(classes=3, samples=12, batch_size=4, image_size=16, epochs=2, write=2)
SMALL_MODEL = "mobilenet_v3_small"  # small checkpoints; its dropout makes resume depend on the restored RNG


def jobs(make_job: MakeJob, root: Path, **overrides: Any) -> tuple[FakeJob, FakeJob]:
    settings = {**TINY, **overrides}
    return make_job(root / "train", **settings), make_job(root / "val", seed=8, split="val", **settings)


def quiet(_: str) -> None:
    pass


def config(train_job: FakeJob, val_job: FakeJob | None, **kwargs: Any) -> TrainConfig:
    kwargs.setdefault("model", SMALL_MODEL)
    return TrainConfig(
        buffer=train_job.buffer, val_buffer=val_job.buffer if val_job else None, device="cpu", threads=1,
        timeout=10, quiet=True, **kwargs,
    )


def untimed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-epoch metrics without the times, which differ from run to run."""
    timing = {"train_s", "val_s", "images_per_s", "data_wait_s", "epoch_s", "data_wait_share"}
    return [{k: v for k, v in r.items() if k not in timing} for r in rows]


def test_warmup_then_cosine() -> None:
    f = warmup_cosine(4, 12)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0
    assert f(8) == pytest.approx(0.5)
    assert f(12) == pytest.approx(0.0, abs=1e-12) and f(20) == pytest.approx(0.0, abs=1e-12)
    plain = warmup_cosine(0, 10)
    assert plain(0) == 1.0 and plain(5) == pytest.approx(0.5)


def test_adamw_warmup_smoothing_amp_csv_and_topk(make_job: MakeJob, buffer: Path, tmp_path: Path) -> None:
    train_job, val_job = jobs(make_job, buffer)
    csv_path, json_path = tmp_path / "m.csv", tmp_path / "m.json"
    result = CliRunner().invoke(main, [
        "--buffer", str(train_job.buffer), "--val-buffer", str(val_job.buffer), "--device", "cpu", "--threads", "1",
        "--optimizer", "adamw", "--warmup-epochs", "1", "--label-smoothing", "0.1", "--amp",
        "--metrics-csv", str(csv_path), "--metrics-json", str(json_path), "--timeout", "10", "-q",
        "--model", SMALL_MODEL,
    ])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
    assert len(lines) == 2 and "top-3" in lines[0]  # 3 classes: top-k with k = 3
    metrics = json.loads(json_path.read_text())
    assert metrics["top_k"] == 3 and metrics["finished"] is True
    assert metrics["config"]["optimizer"] == "adamw" and metrics["config"]["amp"] is True
    # The values used where the options left a default to work out: adamw's lr and decay, the manifest's epochs.
    assert (metrics["config"]["lr"], metrics["config"]["weight_decay"], metrics["config"]["epochs"]) == (1e-3, 0.05, 2)
    assert metrics["config"]["val_buffer"] == str(val_job.buffer)
    rows = list(csv.DictReader(csv_path.open()))
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    for row, doc in zip(rows, metrics["epochs"]):
        assert math.isfinite(float(row["train_loss"])) and float(row["train_top3"]) == 1.0  # top-3 of 3 classes
        assert int(row["train_images"]) == 12 and int(row["val_images"]) == 12
        assert row["cuda_max_memory_mib"] == ""  # CPU
        assert float(row["train_loss"]) == doc["train_loss"]
    # Warmup over epoch 0 (3 steps), then cosine: epoch 0 starts at a third of the peak.
    assert metrics["epochs"][0]["lr"] == pytest.approx(1e-3 / 3)
    assert metrics["epochs"][1]["lr"] == pytest.approx(1e-3)


def test_a_run_stopped_before_its_first_epoch_ends_leaves_a_csv_of_every_column(make_job: MakeJob, buffer: Path,
                                                                                tmp_path: Path) -> None:
    """Such a run (--max-steps, a SIGTERM) left a --metrics-csv of the one column ``epoch`` (new-user review):
    it has the header of a finished run's file, without a row."""
    train_job, val_job = jobs(make_job, buffer, epochs=1, write=1)  # 3 steps an epoch
    stopped, whole = tmp_path / "stopped.csv", tmp_path / "whole.csv"
    assert train(config(train_job, val_job, max_steps=2, metrics_csv=stopped), echo=quiet)["epochs"] == []
    train(config(train_job, val_job, metrics_csv=whole), echo=quiet)
    header = whole.read_text().splitlines()[0]
    assert stopped.read_text() == header + "\n" and ",val_top3," in header
    # Under torchrun a row holds the most starved rank's share too: a column known before the first row as well.
    from prefetchd.trainer.engine import csv_columns

    assert csv_columns(3, distributed=True) == [*header.split(","), "data_wait_share_max"]


def test_a_run_that_ends_on_an_error_leaves_the_metrics_of_the_epochs_it_finished(
    make_job: MakeJob, buffer: Path, tmp_path: Path
) -> None:
    """A daemon killed for good in the first epoch ended the run with exit 3 and no --metrics-csv at all, where
    README says the files are rewritten at the end (a review): the header alone, as for a run stopped there."""
    train_job, val_job = jobs(make_job, buffer, write=0)  # a manifest, and no batch ever
    csv_path, json_path = tmp_path / "m.csv", tmp_path / "m.json"
    with pytest.raises(LoaderError):
        train(dataclasses.replace(config(train_job, val_job, metrics_csv=csv_path, metrics_json=json_path),
                                  timeout=1.0, daemon_timeout=1.0), echo=quiet)
    assert csv_path.read_text().startswith("epoch,") and len(csv_path.read_text().splitlines()) == 1
    metrics = json.loads(json_path.read_text())
    assert metrics["finished"] is False and metrics["epochs"] == []


def test_the_start_line_counts_in_the_singular_where_it_is_one(make_job: MakeJob, buffer: Path) -> None:
    train_job, _ = jobs(make_job, buffer, epochs=1, write=1)
    said: list[str] = []
    train(TrainConfig(buffer=train_job.buffer, device="cpu", threads=1, timeout=10, epochs=1, model=SMALL_MODEL),
          echo=said.append)
    assert any(", 3 classes, 3 steps of 4 x 16px per epoch, 1 epoch, sgd" in line for line in said), said


def test_top5_with_enough_classes(make_job: MakeJob, buffer: Path, tmp_path: Path) -> None:
    train_job, _ = jobs(make_job, buffer, classes=6, epochs=1, write=1)
    metrics = train(config(train_job, None, epochs=1), echo=quiet)
    assert metrics["top_k"] == 5
    row = metrics["epochs"][0]
    assert 0.0 <= row["train_top1"] <= row["train_top5"] <= 1.0
    assert row["val_top5"] is None


def test_stop_and_resume_is_exact(make_job: MakeJob, buffer: Path, tmp_path: Path) -> None:
    """Stopped mid-epoch (--max-steps) and resumed == never stopped: weights, optimizer and metrics."""
    settings = dict(warmup_epochs=0.5, label_smoothing=0.1, checkpoint_every=2, epochs=2)
    a_train, a_val = jobs(make_job, buffer / "a")
    whole = train(config(a_train, a_val, checkpoint_dir=tmp_path / "a", **settings), echo=quiet)

    b_train, b_val = jobs(make_job, buffer / "b")
    said: list[str] = []
    first = train(config(b_train, b_val, checkpoint_dir=tmp_path / "b", max_steps=4, **settings), echo=said.append)
    assert first["finished"] is False and first["global_steps"] == 4
    assert len(first["epochs"]) == 1  # epoch 0 (3 steps) done, stopped after step 1 of epoch 1
    assert any("--resume" in line for line in said)
    stopped = load_checkpoint(tmp_path / "b" / LAST_CHECKPOINT)
    assert stopped["format"] == CHECKPOINT_FORMAT and stopped["global_step"] == 4
    assert stopped["loaders"]["train"]["epoch"] == 1 and stopped["loaders"]["train"]["step"] == 1
    assert stopped["loaders"]["val"]["epoch"] == 1 and stopped["loaders"]["val"]["step"] == 0
    assert stopped["partial"]["seen"] == 4
    again = train(config(b_train, b_val, checkpoint_dir=tmp_path / "b", max_steps=4, resume=True, **settings),
                  echo=quiet)  # the same limit, already reached: nothing more to train
    assert again["global_steps"] == 4 and load_checkpoint(tmp_path / "b" / LAST_CHECKPOINT)["global_step"] == 4

    said.clear()
    resumed = train(config(b_train, b_val, checkpoint_dir=tmp_path / "b", resume=True, **settings), echo=said.append)
    # One count for people, from 1 as the progress lines count: stopped after step 1 (0-based) of epoch 1.
    assert any("resumed from" in line and "global step 4; the next training batch is step 2 of epoch 2 "
               "(e000001-s00000001.batch)" in line for line in said), said
    assert any(line.startswith("done: ") and "in all (" in line and "since resuming at global step 4" in line
               for line in said), said  # every epoch's images, only this process's time
    assert resumed["finished"] is True and resumed["resumed_from"]["global_step"] == 4

    assert untimed(resumed["epochs"]) == untimed(whole["epochs"])
    a = load_checkpoint(tmp_path / "a" / LAST_CHECKPOINT)
    b = load_checkpoint(tmp_path / "b" / LAST_CHECKPOINT)
    assert a["global_step"] == b["global_step"] == 6
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    for (ka, va), (kb, vb) in zip(a["optimizer"]["state"].items(), b["optimizer"]["state"].items()):
        assert torch.equal(va["momentum_buffer"], vb["momentum_buffer"])
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"] == 6
    # Both runs consumed both buffers to the end.
    assert Progress.read(b_train.buffer) == Progress(2, 0) and Progress.read(b_val.buffer) == Progress(2, 0)
    # Resumed from the checkpoint at the job's end: not "the next training batch is step 1 of epoch 3" of a
    # 2-epoch job (a review).
    said.clear()
    train(config(b_train, b_val, checkpoint_dir=tmp_path / "b", resume=True, **settings), echo=said.append)
    assert any("resumed from" in line and "global step 6; every training batch of the job's 2 epochs was read"
               in line for line in said), said


def test_a_resume_follows_this_runs_lr_decay_and_schedule_not_the_checkpoints(
    make_job: MakeJob, buffer: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Loading the optimizer and scheduler brought back the checkpoint's lr and decay: a changed --lr was
    named in the warning and then ignored."""
    train_job, val_job = jobs(make_job, buffer, epochs=4, write=4)  # 3 steps per epoch
    ckpt = tmp_path / "ckpt"
    train(config(train_job, val_job, epochs=2, checkpoint_dir=ckpt, max_steps=4), echo=quiet)
    with caplog.at_level("WARNING"):
        train(config(train_job, val_job, epochs=4, lr=0.5, weight_decay=0.01, momentum=0.5, checkpoint_dir=ckpt,
                     max_steps=5, resume=True), echo=quiet)
    group = load_checkpoint(ckpt / LAST_CHECKPOINT)["optimizer"]["param_groups"][0]
    assert group["lr"] == pytest.approx(0.5 * warmup_cosine(0, 4 * 3)(5))  # this run's peak and 4-epoch cosine
    assert (group["initial_lr"], group["weight_decay"], group["momentum"]) == (0.5, 0.01, 0.5)
    warned = [r.getMessage() for r in caplog.records if "resuming at global step 4 with a learning rate" in r.getMessage()]
    assert warned and f"{0.5 * warmup_cosine(0, 12)(4):.4g}, not the checkpoint's {0.05 * warmup_cosine(0, 6)(4):.4g}" \
        in warned[0], warned
    # The checkpoint's None for --lr and --weight-decay is the optimizer's default: say which, not "None".
    changed = [r.getMessage() for r in caplog.records if "with changed settings" in r.getMessage()]
    assert changed and "lr: default (0.05) -> 0.5" in changed[0] and "None" not in changed[0], changed
    assert "weight_decay: default (0.0005) -> 0.01" in changed[0] and "momentum: 0.9 -> 0.5" in changed[0], changed


def test_a_resume_that_names_the_default_a_checkpoint_left_to_the_optimizer_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from prefetchd.trainer.checkpoint import check_resumable
    from prefetchd.trainer.config import plain_config
    saved = plain_config(TrainConfig(buffer=tmp_path))
    with caplog.at_level("WARNING"):
        check_resumable(tmp_path / "last.pt", {"config": saved}, TrainConfig(buffer=tmp_path, lr=0.05, weight_decay=5e-4), 1)
    assert not [r for r in caplog.records if "changed settings" in r.getMessage()]  # sgd's defaults, written out


def test_checkpoint_after_the_last_step_of_an_epoch_resumes_with_validation(
    make_job: MakeJob, buffer: Path, tmp_path: Path
) -> None:
    train_job, val_job = jobs(make_job, buffer)
    ckpt = tmp_path / "ckpt"
    steps = iter(range(1, 100))
    # A SIGTERM seen at epoch 0's last step (the third) stops before its validation.
    stopped = train(config(train_job, val_job, epochs=2, checkpoint_dir=ckpt), echo=quiet,
                    should_stop=lambda: next(steps) >= 3)
    assert stopped["stopped_by"] == "SIGTERM" and stopped["epochs"] == []
    doc = load_checkpoint(ckpt / LAST_CHECKPOINT)
    assert doc["epoch"] == 0 and doc["loaders"]["train"]["epoch"] == 1 and doc["metrics"] == []
    metrics = train(config(train_job, val_job, epochs=2, checkpoint_dir=ckpt, resume=True), echo=quiet)
    assert [r["epoch"] for r in metrics["epochs"]] == [0, 1]
    assert [r["train_images"] for r in metrics["epochs"]] == [12, 12]
    assert [r["val_images"] for r in metrics["epochs"]] == [12, 12]


def test_max_steps_on_an_epochs_last_step_ends_that_epoch_with_its_validation_and_line(
    make_job: MakeJob, buffer: Path, tmp_path: Path
) -> None:
    train_job, val_job = jobs(make_job, buffer)  # 3 steps per epoch, 2 epochs
    ckpt = tmp_path / "ckpt"
    said: list[str] = []
    first = train(config(train_job, val_job, epochs=2, checkpoint_dir=ckpt, max_steps=3), echo=said.append)
    assert first["stopped_by"] == "--max-steps" and first["finished"] is False and first["global_steps"] == 3
    assert [(r["epoch"], r["val_images"]) for r in first["epochs"]] == [(0, 12)]
    assert any(line.startswith("epoch 1/2 ") for line in said), said
    doc = load_checkpoint(ckpt / LAST_CHECKPOINT)
    assert doc["epoch"] == 1 and doc["partial"] is None and len(doc["metrics"]) == 1  # the epoch-end checkpoint

    # A limit on the run's last step: the run is simply done.
    done = train(config(train_job, val_job, epochs=2, checkpoint_dir=ckpt, max_steps=6, resume=True), echo=said.append)
    assert done["finished"] is True and done["stopped_by"] is None and len(done["epochs"]) == 2
    assert said[-1].startswith("done: "), said


def test_resume_without_a_checkpoint_starts_from_scratch(make_job: MakeJob, buffer: Path, tmp_path: Path) -> None:
    train_job, _ = jobs(make_job, buffer, epochs=1, write=1)
    said: list[str] = []
    metrics = train(config(train_job, None, checkpoint_dir=tmp_path / "none", resume=True), echo=said.append)
    assert any("no checkpoint" in line and "from scratch" in line for line in said)
    assert metrics["resumed_from"] is None and metrics["finished"] is True
    assert (tmp_path / "none" / LAST_CHECKPOINT).is_file()  # saved at the epoch's end


def test_a_run_without_resume_refuses_to_overwrite_a_checkpoint(make_job: MakeJob, buffer: Path,
                                                                tmp_path: Path) -> None:
    """A forgotten --resume would train from scratch and replace the earlier run's last.pt."""
    train_job, _ = jobs(make_job, buffer, epochs=1, write=1)
    ckpt = tmp_path / "ckpt"
    args = ["--buffer", str(train_job.buffer), "--device", "cpu", "--threads", "1", "--model", SMALL_MODEL, "-q",
            "--checkpoint-dir", str(ckpt), "--max-steps", "2"]
    assert CliRunner().invoke(main, args).exit_code == 0
    before = (ckpt / LAST_CHECKPOINT).read_bytes()
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    message = " ".join(result.stderr.split())
    assert f"{ckpt / LAST_CHECKPOINT} (global step 2, 0 epochs done)" in message, message
    assert "Pass --resume" in message and "another --checkpoint-dir" in message
    assert "Traceback" not in result.output and (ckpt / LAST_CHECKPOINT).read_bytes() == before
    assert CliRunner().invoke(main, [*args[:-1], "3", "--resume"]).exit_code == 0  # continues it
    # The finished run's: it said "epoch 2" of a one-epoch run, the number of the epoch it would begin next.
    finished = CliRunner().invoke(main, [*args[:-1], "3"])
    assert f"{ckpt / LAST_CHECKPOINT} (global step 3, 1 epoch done)" in " ".join(finished.stderr.split())
    assert load_checkpoint(ckpt / LAST_CHECKPOINT)["global_step"] == 3


def test_bad_or_foreign_checkpoints_are_one_clear_line(make_job: MakeJob, buffer: Path, tmp_path: Path) -> None:
    train_job, _ = jobs(make_job, buffer, epochs=1, write=1)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / LAST_CHECKPOINT).write_bytes(b"not a checkpoint")
    args = ["--buffer", str(train_job.buffer), "--device", "cpu", "--checkpoint-dir", str(ckpt), "--resume", "-q"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == EXIT_FAILED
    assert "cannot read the checkpoint" in result.stderr and "Traceback" not in result.output
    # Not torch's paragraph on its weights_only default, cut off mid-sentence (a user's walk): what it found.
    said = " ".join(result.stderr.split())
    assert "cannot read the checkpoint (damaged, or not a prefetchd-train checkpoint: " in said, said
    assert "weights_only" not in said and "arbitrary code" not in said, said

    torch.save({"format": CHECKPOINT_FORMAT, "version": 1, "config": {"model": "resnet34"}}, ckpt / LAST_CHECKPOINT)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == EXIT_FAILED and "--model resnet34" in result.stderr and "resnet18" in result.stderr
    # Another version: it named both and no way on (a user's walk of upgrades).
    for version, remedy in ((2, "resume with the prefetchd that wrote it, or a later one"),
                            ("1", "it is no checkpoint this prefetchd-train wrote")):
        torch.save({"format": CHECKPOINT_FORMAT, "version": version}, ckpt / LAST_CHECKPOINT)
        said = " ".join(CliRunner().invoke(main, args).stderr.split())
        assert f"checkpoint version {version!r}; this prefetchd-train reads version 1: {remedy}; or train from " \
               "scratch: without --resume, into another --checkpoint-dir" in said, said

    result = CliRunner().invoke(main, ["--buffer", str(train_job.buffer), "--resume"])
    assert result.exit_code == 2 and "--checkpoint-dir" in result.stderr


def test_spawn_options_need_spawn_daemon(make_job: MakeJob, buffer: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["--buffer", str(buffer), "--data", str(tmp_path)])
    assert result.exit_code == 2 and "--spawn-daemon" in result.stderr
    result = CliRunner().invoke(main, ["--buffer", str(buffer), "--spawn-daemon", "--data", str(tmp_path)])
    assert result.exit_code == 2 and "--epochs" in result.stderr
    result = CliRunner().invoke(main, ["--buffer", str(buffer), "--spawn-daemon", "--epochs", "1"])
    assert result.exit_code == 2 and "--data" in result.stderr
    result = CliRunner().invoke(main, ["--buffer", str(buffer), "--drop-last"])
    assert result.exit_code == 2 and "--drop-last" in result.stderr and "--spawn-daemon" in result.stderr


def test_a_val_buffer_is_checked_for_being_one(make_job: MakeJob, buffer: Path, tmp_path: Path) -> None:
    """--val-buffer must be served by a --split val daemon, and every hint to start one says --split val."""
    train_job, _ = jobs(make_job, buffer, epochs=1, write=1)
    base = ["--buffer", str(train_job.buffer), "--device", "cpu", "--threads", "1", "--model", SMALL_MODEL, "-q"]
    # --spawn-daemon without --val-data cannot start the validation daemon: said at once, not after --timeout.
    missing = buffer / "no-val"
    result = CliRunner().invoke(main, [*base, "--val-buffer", str(missing), "--spawn-daemon", "--data",
                                       str(tmp_path), "--epochs", "1"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.stderr.split())
    assert f"--val-buffer {missing}: no daemon serves it" in said and "--val-data" in said
    assert f"prefetchd start --buffer {missing} --data ROOT --split val" in said
    # Without --spawn-daemon the wait runs out, and the command it suggests makes a validation stream.
    result = CliRunner().invoke(main, [*base, "--val-buffer", str(missing), "--timeout", "0.2"])
    assert result.exit_code == 3, result.output
    assert f"prefetchd start --buffer {missing} --data ROOT --split val" in " ".join(result.stderr.split())
    # A train-split daemon's batches (random crops) are no validation set.
    crops = make_job(buffer / "crops", **{**TINY, "epochs": 1, "write": 1})
    result = CliRunner().invoke(main, [*base, "--val-buffer", str(crops.buffer)])
    assert result.exit_code == EXIT_FAILED, result.output
    said = " ".join(result.stderr.split())
    assert f"--val-buffer {crops.buffer}: its daemon produces the train split" in said and "--split val" in said
    assert "train loss" not in result.output
    # Nor is a val split's (held-out centre crops in a fixed order) a training set: it trained on it, silently.
    held_out = make_job(buffer / "held-out", **{**TINY, "epochs": 1, "write": 1, "split": "val"})
    result = CliRunner().invoke(main, ["--buffer", str(held_out.buffer), *base[2:]])
    assert result.exit_code == EXIT_FAILED, result.output
    said = " ".join(result.stderr.split())
    assert f"--buffer {held_out.buffer}: its daemon produces the val split" in said and "without --split val" in said
    assert "train loss" not in result.output


def test_a_val_buffer_whose_samples_are_training_samples_is_refused(make_job: MakeJob, buffer: Path) -> None:
    """Daemons on one dataset with other --val-fraction values (or a training one with none) serve overlapping
    sides: the run reported a validation accuracy on images it trained on (a walk).  The same fraction passes."""
    base = ["--device", "cpu", "--threads", "1", "--model", SMALL_MODEL, "-q", "--epochs", "1"]

    def run(train_fraction: float | None, val_fraction: float | None) -> Any:
        root = buffer / f"{train_fraction}-{val_fraction}"
        train_job = make_job(root / "train", **{**TINY, "epochs": 1, "write": 1}, fingerprint="one")
        val_job = make_job(root / "val", **{**TINY, "epochs": 1, "write": 1}, fingerprint="one", split="val")
        for job, fraction in ((train_job, train_fraction), (val_job, val_fraction)):
            dataclasses.replace(job.manifest, val_fraction=fraction).write(job.buffer)
        return CliRunner().invoke(main, ["--buffer", str(train_job.buffer), "--val-buffer", str(val_job.buffer), *base])

    for train_fraction, val_fraction, said in ((0.2, 0.3, "the training one with --val-fraction 0.2 and the "
                                                "validation one with --val-fraction 0.3"),
                                               (None, 0.3, "the training one with no --val-fraction (every sample)")):
        result = run(train_fraction, val_fraction)
        assert result.exit_code == EXIT_FAILED, result.output
        message = " ".join(result.stderr.split())
        assert "'s validation samples are training samples too" in message and said in message, message
        assert "Start both with the same --val-fraction" in message and "train loss" not in result.output
    result = run(0.2, 0.2)
    assert result.exit_code == 0, result.output



def test_a_val_buffer_of_the_first_classes_passes_and_one_of_other_classes_is_refused(
        make_job: MakeJob, buffer: Path) -> None:
    """Label k must name the same class on both sides.  A validation side of the first classes only (a file list of
    integer labels without the largest, a val tree without the last folder) does: it was refused, with the first
    five classes of each side, equal (a walk).  A class in another place, or one training lacks, is refused."""
    base = ["--device", "cpu", "--threads", "1", "--model", SMALL_MODEL, "-q", "--epochs", "1"]

    def run(name: str, val_classes: list[str]) -> Any:
        train_job = make_job(buffer / name / "train", **{**TINY, "epochs": 1, "write": 1})
        val_job = make_job(buffer / name / "val", **{**TINY, "epochs": 1, "write": 1, "classes": 2}, split="val")
        dataclasses.replace(val_job.manifest, classes=val_classes).write(val_job.buffer)
        return CliRunner().invoke(main, ["--buffer", str(train_job.buffer), "--val-buffer", str(val_job.buffer), *base])

    result = run("first", ["class0", "class1"])
    assert result.exit_code == 0, result.output
    for name, classes, said in (
            ("other", ["class0", "other"], "serves 2 classes and {train} 3 classes: label 1 is class 'other' there and "
                                           "'class1' in training."),
            ("more", ["class0", "class1", "class2", "class3"], "serves 4 classes and {train} 3 classes: label 3 and "
                                                               "above ('class3', ...) name classes the training data lacks.")):
        result = run(name, classes)
        assert result.exit_code == EXIT_FAILED, result.output
        message = " ".join(result.stderr.split())
        assert f"{buffer / name / 'val'} " + said.format(train=buffer / name / "train") in message, message
        assert "Both daemons must serve the same classes" in message and "train loss" not in result.output

def test_a_job_of_one_class_is_refused_with_the_folder_it_likely_meant(make_job: MakeJob, buffer: Path) -> None:
    """--data /imagenet holding train/ alone indexes one class, "train": cross-entropy over one class is 0,
    and the run "trained" to 100 % top-1 on nothing."""
    one = make_job(buffer / "one", **{**TINY, "classes": 1})
    result = CliRunner().invoke(main, ["--buffer", str(one.buffer), "--device", "cpu", "--threads", "1", "--model",
                                       SMALL_MODEL, "-q"])
    assert result.exit_code == EXIT_FAILED, result.output
    said = " ".join(result.stderr.split())
    assert "the training data /data/fake has one class (class0): a classifier learns nothing" in said, said
    assert "--data /data/fake/class0" in said and "train loss" not in result.output


def _epoch(samples: int, batch_size: int, image_size: int, drop_last: bool = False) -> Manifest:
    steps = samples // batch_size if drop_last else -(-samples // batch_size)
    return Manifest(dataset_root="/d", fingerprint="f", classes=["a", "b"], num_samples=samples, split="train", seed=0,
                    batch_size=batch_size, image_size=image_size, samples_per_epoch=samples, steps_per_epoch=steps,
                    epochs=None, producer="p", drop_last=drop_last)


def test_an_epoch_ending_in_one_image_the_model_cannot_train_on_is_refused_before_the_first_step() -> None:
    # ResNet-18 at 32 px pools to 1 x 1 before its last BatchNorm: one image is one value per channel.
    with pytest.raises(SetupError, match=r"ends in a batch of 1 image \(17 samples in batches of 8\).*--drop-last"):
        check_last_batch("resnet18", 2, _epoch(17, 8, 32))
    check_last_batch("resnet18", 2, _epoch(17, 8, 32, drop_last=True))  # every batch of 8
    check_last_batch("resnet18", 2, _epoch(18, 8, 32))  # ends in 2 images
    check_last_batch("resnet18", 2, _epoch(17, 8, 224))  # 7 x 7 values per channel
    check_last_batch("squeezenet1_1", 2, _epoch(17, 8, 32))  # no BatchNorm


def test_pretrained_only_from_the_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "hub"))
    monkeypatch.setattr(torch.hub, "_hub_dir", None)  # follow TORCH_HOME even if set_dir was called
    name, path = cached_weights("resnet18")
    assert name == "ResNet18_Weights.IMAGENET1K_V1" and path.parent == tmp_path / "hub" / "hub" / "checkpoints"

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("must never download")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_download)
    with pytest.raises(SetupError, match="not in the local torch hub cache.*never downloads") as info:
        build_model("resnet18", 3, pretrained=True, echo=quiet)
    assert str(path) in str(info.value)

    # A stand-in for the real file (no network here): 1000-class weights with a recognisable conv1.
    reference = torchvision.models.resnet18()
    torch.nn.init.constant_(reference.conv1.weight, 0.125)
    path.parent.mkdir(parents=True)
    torch.save(reference.state_dict(), path)
    said: list[str] = []
    model = build_model("resnet18", 3, pretrained=True, echo=said.append)
    assert torch.equal(model.conv1.weight, reference.conv1.weight)
    assert torch.equal(model.layer4[1].bn2.running_var, reference.layer4[1].bn2.running_var)
    assert isinstance(model.fc, torch.nn.Linear) and model.fc.out_features == 3  # re-initialised head
    assert any("fc.weight" in line for line in said)

    path.write_bytes(b"truncated")
    with pytest.raises(SetupError, match="cannot read"):
        build_model("resnet18", 3, pretrained=True, echo=quiet)


def test_spawn_daemon_uses_a_running_daemon_only_if_it_serves_the_job(
    make_job: MakeJob, buffer: Path, tmp_path: Path
) -> None:
    import os

    train_job, _ = jobs(make_job, buffer, epochs=1, write=1)
    train_job.claim()  # a live "daemon" owns the buffer: nothing is spawned
    args = ["--buffer", str(train_job.buffer), "--spawn-daemon", "--epochs", "1", "--device", "cpu", "-q",
            "--model", SMALL_MODEL, "--threads", "1"]
    result = CliRunner().invoke(main, [*args, "--data", str(tmp_path), "--batch-size", "8"])
    assert result.exit_code == 1
    assert f"served by the running daemon (pid {os.getpid()})" in result.stdout
    assert "produces dataset /data/fake" in result.stderr and "batch size 4, not 8" in result.stderr
    assert "prefetchd stop --buffer" in result.stderr and "to let --spawn-daemon start the job asked for, or drop the differing flags" in " ".join(result.stderr.split())
    result = CliRunner().invoke(main, [*args, "--data", "/data/fake"])
    assert result.exit_code == 0, result.output


def signalled_after_the_first_checkpoint(make_job: MakeJob, buffer: Path, ckpt: Path, signum: int) -> Any:
    """prefetchd-train's CLI on a 2-epoch job of 20 steps each, checkpointing every step, sent ``signum`` (handled
    by main()'s handler in this, the main, thread) once the first checkpoint is there; its CliRunner result."""
    import os
    import threading
    import time

    train_job, _ = jobs(make_job, buffer, samples=80)

    def send_after_the_first_checkpoint() -> None:
        deadline = time.monotonic() + 60
        while not (ckpt / LAST_CHECKPOINT).exists() and time.monotonic() < deadline:
            time.sleep(0.002)
        os.kill(os.getpid(), signum)

    killer = threading.Thread(target=send_after_the_first_checkpoint)
    killer.start()
    result = CliRunner().invoke(main, [
        "--buffer", str(train_job.buffer), "--device", "cpu", "--threads", "1", "--model", SMALL_MODEL, "-q",
        "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--timeout", "10",
        "--metrics-json", str(ckpt.parent / "metrics.json"),
    ])
    killer.join()
    return result


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_sigterm_stops_at_a_step_with_a_checkpoint(make_job: MakeJob, buffer: Path, tmp_path: Path, name: str) -> None:
    """SIGHUP (a closed terminal) too: it ended the run on the spot, without a word or a checkpoint, its spawned
    daemons left running (a user's walk); now as SIGTERM, exit 129."""
    import signal

    signum = signal.Signals[name]
    ckpt = tmp_path / "ckpt"
    before = signal.getsignal(signum)
    result = signalled_after_the_first_checkpoint(make_job, buffer, ckpt, signum)
    assert result.exit_code == 128 + signum, result.output
    assert signal.getsignal(signum) == before, "the handler is put back"
    line = [x for x in result.stdout.splitlines() if x.startswith("stopped after global step")]
    assert line and f"({name}, checkpoint" in line[0] and "--resume" in line[0]
    assert json.loads((tmp_path / "metrics.json").read_text())["stopped_by"] == name
    step = int(line[0].split()[4])
    assert 1 <= step < 40
    doc = load_checkpoint(ckpt / LAST_CHECKPOINT)
    assert doc["global_step"] == step  # the checkpoint is of the step it stopped at


def test_ctrl_c_says_what_resume_continues_from(make_job: MakeJob, buffer: Path, tmp_path: Path) -> None:
    """Ctrl-C stops at once, without the checkpoint SIGTERM saves: it said only "interrupted" (review)."""
    import signal

    from prefetchd.trainer.train import EXIT_INTERRUPTED

    ckpt = tmp_path / "ckpt"
    result = signalled_after_the_first_checkpoint(make_job, buffer, ckpt, signal.SIGINT)
    assert result.exit_code == EXIT_INTERRUPTED, result.output
    # Its metrics are written as an error's are (they were not: a user's walk), the epochs it finished: none.
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["finished"] is False and metrics["epochs"] == [] and metrics["global_steps"] >= 1
    step = load_checkpoint(ckpt / LAST_CHECKPOINT)["global_step"]
    said = " ".join(result.stderr.split())
    assert f"interrupted; --resume continues from the last checkpoint, {ckpt / LAST_CHECKPOINT} (global step {step}," \
        in said, said


@pytest.mark.parametrize(("first", "name"), [("SIGTERM", "SIGTERM"), ("SIGHUP", "SIGHUP"), ("SIGTERM", "SIGHUP")])
def test_a_second_stop_signal_exits_as_that_signal_not_as_ctrl_c(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                 first: str, name: str) -> None:
    """A second SIGTERM (a scheduler's grace period running out) stops at once, as Ctrl-C does, but it was told
    and exited as Ctrl-C: "interrupted", 130, where a supervisor expects the signal's 143.  Of two different
    signals, the second is the one said and exited as (it said one and exited as the other: a walk)."""
    import os
    import signal

    import prefetchd.trainer.train as train_module

    signum = signal.Signals[name]

    def signalled_twice_in_training(*args: Any, training: Any, **kwargs: Any) -> dict[str, Any]:
        training()
        os.kill(os.getpid(), signal.Signals[first])  # the handler runs before os.kill returns to this (main) thread
        os.kill(os.getpid(), signum)
        raise AssertionError("the second signal did not stop the run")

    monkeypatch.setattr(train_module, "train", signalled_twice_in_training)
    before = signal.getsignal(signum)
    before_first = signal.getsignal(signal.Signals[first])
    result = CliRunner().invoke(main, ["--buffer", str(tmp_path / "bf"), "--device", "cpu", "-q"])
    assert result.exit_code == 128 + signum, result.output
    assert f"stopped by a second {name} without waiting for the step (no --checkpoint-dir: nothing to resume " \
           "from)" in result.stderr, result.stderr
    assert "interrupted" not in result.stderr
    assert signal.getsignal(signum) == before and signal.getsignal(signal.Signals[first]) == before_first


def test_sigterm_before_training_stops_at_once_instead_of_waiting_out_the_timeout(tmp_path: Path) -> None:
    """No daemon has written the manifest yet: a scheduler's SIGTERM waited the whole --timeout and ended in
    a timeout error (exit 3) rather than the SIGTERM's 143."""
    import os
    import signal
    import threading
    import time

    from prefetchd.trainer.train import EXIT_TERMINATED

    before = signal.getsignal(signal.SIGTERM)
    killer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))
    killer.start()
    started = time.monotonic()
    result = CliRunner().invoke(main, ["--buffer", str(tmp_path / "no-daemon-yet"), "--device", "cpu", "-q",
                                       "--timeout", "120"])
    killer.join()
    assert result.exit_code == EXIT_TERMINATED, result.output
    assert "stopped by SIGTERM before training began" in result.output
    assert time.monotonic() - started < 60  # not the 120 s of --timeout
    assert signal.getsignal(signal.SIGTERM) == before, "the handler is put back"


@pytest.mark.parametrize("waiting_in", ["train", "val"])
@pytest.mark.parametrize("ended_by", ["a stop", "a stuck daemon"])
def test_a_wait_that_ends_without_a_batch_saves_the_last_steps_checkpoint_and_resumes_exactly(
    make_job: MakeJob, buffer: Path, tmp_path: Path, waiting_in: str, ended_by: str
) -> None:
    """A stop asked for while the trainer waits (a stalled daemon would hold it until the stall bound),
    or the daemon lost there (by default the last checkpoint is an epoch old): the run ends at once with
    a checkpoint of the last step."""
    import threading
    import time

    from prefetchd.trainer.errors import DaemonStuck

    settings = dict(warmup_epochs=0.5, checkpoint_every=100, epochs=2)
    a_train, a_val = jobs(make_job, buffer / "a")
    whole = train(config(a_train, a_val, checkpoint_dir=tmp_path / "a", **settings), echo=quiet)

    b_train, b_val = jobs(make_job, buffer / "b", write=0)
    for job in (b_train, b_val):
        job.claim()  # an owner that is alive but writes nothing more: a stalled daemon
    steps = b_train.manifest.steps_per_epoch
    written = 2 if waiting_in == "train" else steps  # all of epoch 0's training batches, then no val batch
    for step in range(written):
        b_train.write(0, step)
    waits_at = Progress(*((0, 2) if waiting_in == "train" else (1, 0)))
    asked = threading.Event()

    def ask_once_it_waits() -> None:  # the trainer publishes the position it waits for before waiting
        deadline = time.monotonic() + 30
        while Progress.read(b_train.buffer) != waits_at and time.monotonic() < deadline:
            time.sleep(0.005)
        asked.set()

    said: list[str] = []
    started = time.monotonic()
    # --timeout 10 s: without the stop (or the stall bound) the wait would end in a LoaderTimeout.
    if ended_by == "a stop":
        asker = threading.Thread(target=ask_once_it_waits)
        asker.start()
        first = train(config(b_train, b_val, checkpoint_dir=tmp_path / "b", **settings), echo=said.append,
                      should_stop=asked.is_set)
        asker.join()
        assert first["stopped_by"] == "SIGTERM" and first["finished"] is False and first["global_steps"] == written
    else:
        with pytest.raises(DaemonStuck):
            train(config(b_train, b_val, checkpoint_dir=tmp_path / "b", daemon_timeout=0.5, **settings),
                  echo=said.append)
        assert any(f"saved a checkpoint of global step {written} before stopping" in line for line in said), said
    assert time.monotonic() - started < 10
    doc = load_checkpoint(tmp_path / "b" / LAST_CHECKPOINT)
    assert doc["global_step"] == written and doc["epoch"] == 0
    assert Progress(doc["loaders"]["train"]["epoch"], doc["loaders"]["train"]["step"]) == waits_at
    assert doc["partial"]["seen"] == 4 * written

    b_train.write_epochs(2)
    b_val.write_epochs(2)
    resumed = train(config(b_train, b_val, checkpoint_dir=tmp_path / "b", resume=True, **settings), echo=quiet)
    assert resumed["finished"] is True
    assert untimed(resumed["epochs"]) == untimed(whole["epochs"])


def test_a_max_steps_run_stopped_in_its_last_validation_validates_on_resume(
        make_job: MakeJob, buffer: Path, tmp_path: Path) -> None:
    """--max-steps on epoch 0's last step, and a stop while that epoch's validation waits: the resume under
    the same --max-steps took the run for done, and epoch 0 never got its validation or its row (review)."""
    import threading
    import time

    steps = TINY["samples"] // TINY["batch_size"]
    b_train, b_val = jobs(make_job, buffer, write=0)
    for job in (b_train, b_val):
        job.claim()
    for step in range(steps):
        b_train.write(0, step)  # epoch 0 to train, no validation batch yet
    settings = dict(max_steps=steps, checkpoint_dir=tmp_path / "ckpt")
    asked = threading.Event()

    def ask_once_it_validates() -> None:
        # The training pass's end: the val progress names (0, 0) from the run's start, and this comes just before.
        deadline = time.monotonic() + 30
        while Progress.read(b_train.buffer) != Progress(1, 0) and time.monotonic() < deadline:
            time.sleep(0.005)
        asked.set()

    asker = threading.Thread(target=ask_once_it_validates)
    asker.start()
    first = train(config(b_train, b_val, **settings), echo=quiet, should_stop=asked.is_set)
    asker.join()
    assert first["stopped_by"] == "SIGTERM" and first["epochs"] == [] and first["global_steps"] == steps
    b_val.write_epochs(1)
    resumed = train(config(b_train, b_val, resume=True, **settings), echo=quiet)
    assert resumed["stopped_by"] == "--max-steps" and resumed["global_steps"] == steps
    assert [row["epoch"] for row in resumed["epochs"]] == [0] and resumed["epochs"][0]["val_images"] == TINY["samples"]


def test_a_stop_during_a_validation_with_its_batches_there_stops_before_the_next_training_step(
        make_job: MakeJob, buffer: Path, tmp_path: Path) -> None:
    """Only the waits of a validation asked whether to stop: with its batches there, a SIGTERM during it
    was seen after the next epoch's first training step (review: stopped at global step 10, not 9)."""
    steps = TINY["samples"] // TINY["batch_size"]
    settings = dict(checkpoint_dir=tmp_path / "ckpt", warmup_epochs=0.5)
    whole = train(config(*jobs(make_job, buffer / "whole"), checkpoint_dir=tmp_path / "whole", warmup_epochs=0.5),
                  echo=quiet)
    b_train, b_val = jobs(make_job, buffer / "b", write=0)
    b_train.write_epochs(2)
    b_val.write_epochs(2)

    def after_the_first_validation_step() -> bool:
        return Progress.read(b_val.buffer) == Progress(0, 1)

    first = train(config(b_train, b_val, **settings), echo=quiet, should_stop=after_the_first_validation_step)
    assert first["stopped_by"] == "SIGTERM" and first["global_steps"] == steps and first["epochs"] == []
    assert load_checkpoint(tmp_path / "ckpt" / LAST_CHECKPOINT)["global_step"] == steps
    resumed = train(config(b_train, b_val, resume=True, **settings), echo=quiet)
    assert resumed["finished"] is True and untimed(resumed["epochs"]) == untimed(whole["epochs"])


def test_a_resumed_pass_counts_its_steps_from_the_epochs_start(make_job: MakeJob, buffer: Path) -> None:
    """A pass resumed at step 2 of 3 shows 3/3 when it ends, not 1/3."""
    import io

    from prefetchd.trainer import BufferLoader
    from prefetchd.trainer.passes import run_pass
    from prefetchd.trainer.report import ProgressLine

    job = make_job(write=3)  # 10 samples in batches of 4: steps 0-2 of epoch 0
    job.write_epochs(1)
    loader = BufferLoader(job.buffer, timeout=10, start=(0, 2))
    log = io.StringIO()
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(3))
    stats = run_pass(model, loader, torch.nn.CrossEntropyLoss(), ProgressLine(log, "epoch 1/2 val", len(loader), True))
    assert stats.images == 2  # the epoch's last, short batch alone
    assert "epoch 1/2 val 3/3" in log.getvalue(), log.getvalue()


def test_a_wait_a_stop_ends_counts_as_waiting(make_job: MakeJob) -> None:
    """The seconds a stalled daemon held the pass before a SIGTERM ended its wait were left out of the
    checkpoint's wait_seconds: after the resume the epoch's data-wait share blamed them on compute (review)."""
    import io
    import time

    from prefetchd.trainer import BufferLoader
    from prefetchd.trainer.passes import PassState, run_pass
    from prefetchd.trainer.report import ProgressLine

    job = make_job(write=0)
    job.write(0, 0)  # then nothing: an owner alive that builds nothing more
    job.claim()
    loader = BufferLoader(job.buffer, timeout=30)
    first_asked: list[float] = []

    def after_half_a_second() -> bool:  # a SIGTERM half a second into the wait
        first_asked.append(time.monotonic())
        return first_asked[-1] - first_asked[0] > 0.5

    loader.stop_requested = after_half_a_second
    saved: list[PassState] = []
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(3))
    stats = run_pass(model, loader, torch.nn.CrossEntropyLoss(), ProgressLine(io.StringIO(), "epoch 1/2 val", 3, True),
                     between_steps=lambda snapshot, error: saved.append(snapshot()))
    assert stats.stopped and stats.images == 4
    assert saved and saved[0].wait_seconds >= 0.5 and stats.wait_seconds >= 0.5, (saved, stats)


@pytest.mark.parametrize("name", ["fasterrcnn_resnet50_fpn", "raft_small", "fcn_resnet50", "r3d_18", "no_such_model"])
def test_only_classification_models_are_accepted(name: str) -> None:
    # fasterrcnn_resnet50_fpn downloaded a backbone when built; raft_small has no num_classes.
    with pytest.raises(OptionError, match=rf"^--model {name}: not a torchvision classification model; .*list_models"):
        build_model(name, 3, pretrained=False)


@pytest.mark.parametrize(("name", "told"), [("vit_b_16", "exactly 224 px"), ("inception_v3", "at least 299 px")])
def test_a_model_that_cannot_take_the_jobs_image_size_is_refused_before_the_first_step(name: str, told: str) -> None:
    with pytest.raises(SetupError, match=rf"^--model {name} cannot run on images of 32 px \(.*\); it needs images of "
                                         rf"{told}: start the daemon with --image-size"):
        check_last_batch(name, 2, _epoch(16, 8, 32))
