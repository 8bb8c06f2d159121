from __future__ import annotations

import grp
import json
import math
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from click.testing import CliRunner

from prefetchd.buffer_protocol import VERSION, Progress
from prefetchd.trainer.train import EXIT_BUFFER, EXIT_FAILED, EXIT_NO_ACCESS, EXIT_USAGE, main
from tests.as_nobody import as_nobody

if TYPE_CHECKING:
    from conftest import MakeJob


def test_trains_one_epoch_and_writes_metrics(make_job: MakeJob, buffer: Path, tmp_path: Path) -> None:
    tiny = dict(classes=2, samples=8, batch_size=4, image_size=32, epochs=1, write=1)
    train = make_job(buffer / "train", **tiny)
    val = make_job(buffer / "val", seed=8, split="val", **tiny)
    metrics_path = tmp_path / "metrics.json"
    result = CliRunner().invoke(
        main,
        ["--buffer", str(train.buffer), "--val-buffer", str(val.buffer), "--metrics-json", str(metrics_path),
         "--threads", "1", "--device", "cpu", "--timeout", "10"],
    )
    assert result.exit_code == 0, result.output
    epoch_lines = [line for line in result.stdout.splitlines() if line.startswith("epoch 1/1")]
    assert len(epoch_lines) == 1
    assert "train loss" in epoch_lines[0] and "val loss" in epoch_lines[0] and "data-wait" in epoch_lines[0]
    assert "img/s" in epoch_lines[0]

    metrics = json.loads(metrics_path.read_text())
    assert metrics["num_epochs"] == 1 and len(metrics["epochs"]) == 1
    row = metrics["epochs"][0]
    for key in ("train_loss", "train_top1", "val_loss", "val_top1", "images_per_s", "data_wait_share", "epoch_s"):
        assert isinstance(row[key], float) and math.isfinite(row[key]), key
    assert row["train_images"] == 8 and row["val_images"] == 8
    assert 0 <= metrics["final_val_top1"] <= 1
    assert 0 <= metrics["data_wait_share"] <= 1
    # Both buffers were consumed to the end of the epoch.
    assert Progress.read(train.buffer) == Progress(1, 0)
    assert Progress.read(val.buffer) == Progress(1, 0)


def test_validation_at_another_size_than_training_is_warned_of(make_job: MakeJob, buffer: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A val daemon started without the train daemon's --image-size served 224 px to a model trained at 32:
    it validated at chance, with nothing to say why (walkthrough review)."""
    tiny = dict(classes=2, samples=8, batch_size=4, epochs=1, write=1)
    train = make_job(buffer / "train", image_size=32, **tiny)
    val = make_job(buffer / "val", seed=8, split="val", image_size=48, **tiny)
    args = ["--buffer", str(train.buffer), "--val-buffer", str(val.buffer), "--threads", "1", "--device", "cpu",
            "--timeout", "10"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output  # validating at a larger size can be on purpose
    said = [r.getMessage() for r in caplog.records if "validated at another size" in r.getMessage()]
    assert len(said) == 1 and f"{val.buffer} serves 48 x 48 images but {train.buffer} trains at 32 x 32" in said[0]
    assert said[0].endswith("start the validation daemon with --image-size 32")


def test_missing_daemon_is_one_clear_line(buffer: Path) -> None:
    result = CliRunner().invoke(main, ["--buffer", str(buffer), "--timeout", "0.1", "--device", "cpu"])
    assert result.exit_code == EXIT_BUFFER
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("prefetchd-train: ") and "prefetchd start --buffer" in lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("args", [["--help"], ["--bogus"], ["/dev/shm/bf"]])
def test_help_and_usage_errors_answer_before_torch_is_imported(args: list[str]) -> None:
    """`prefetchd-train --help` took ~4 s: torch and torchvision were imported before click parsed a flag."""
    code = ("import sys\nfrom prefetchd.trainer.command import main\n"
            f"try:\n    main({args!r}, prog_name='prefetchd-train')\nexcept SystemExit as exc:\n    print('exit', exc.code)\n"
            "print('torch imported:', 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    said = done.stdout + done.stderr
    assert "Usage: prefetchd-train" in said and "torch imported: False" in said, said
    assert ("exit 0" if args == ["--help"] else f"exit {EXIT_USAGE}") in said, said


def test_version_names_the_buffer_protocol_without_importing_torch() -> None:
    """`prefetchd-train --version` was "No such option" (a walk); `prefetchd --version` had it."""
    code = ("import sys\nfrom prefetchd.trainer.command import main\n"
            "try:\n    main(['--version'], prog_name='prefetchd-train')\nexcept SystemExit as exc:\n    print('exit', exc.code)\n"
            "print('torch imported:', 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == [f"prefetchd-train, version {version('prefetchd')}, buffer protocol {VERSION}",
                                        "exit 0", "torch imported: False"], done.stdout + done.stderr


_WITHOUT_LIGHTNING = """
import sys
class Hidden:  # as where Lightning is not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "lightning":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hidden())
try:
    import prefetchd.lightning
except ModuleNotFoundError as exc:
    print(exc)
"""


def test_the_lightning_module_without_lightning_names_the_extra_to_install() -> None:
    """It was a bare "No module named 'lightning'", where --ray and s3:// name their extra (a walk)."""
    done = subprocess.run([sys.executable, "-c", _WITHOUT_LIGHTNING], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == ("prefetchd's BufferDataModule needs Lightning (No module named 'lightning'): pip "
                                   "install 'prefetchd[lightning]'"), done.stdout + done.stderr


def test_a_buffer_given_as_an_argument_is_told_how_to_give_it(buffer: Path) -> None:
    """`prefetchd-train /dev/shm/bf` said "Got unexpected extra argument" and not how to write it."""
    result = CliRunner().invoke(main, [str(buffer), "--epochs", "1"], prog_name="prefetchd-train")
    assert result.exit_code == EXIT_USAGE, result.output
    assert f"the buffer is an option, not an argument: prefetchd-train --buffer {buffer} ..." in result.output


@pytest.mark.skipif(os.geteuid() != 0, reason="plays the service, whose buffers they are, and a user not in their group")
def test_a_buffer_this_user_may_not_read_says_whose_it_is_and_exits_4(make_job: MakeJob, buffer: Path) -> None:
    """A --group-access buffer of a group the user is not in: click's bare "Directory ... is not readable" (exit 2),
    where `prefetchd status` says whose it is and how to join its group (exit 4); now the trainer says that too, of
    --val-buffer as of --buffer."""
    os.chmod(buffer, 0o755)
    train, val = make_job(buffer / "train"), make_job(buffer / "val", split="val")
    for job in (train, val):
        for path in (job.buffer, *job.buffer.iterdir()):
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
    os.chmod(val.buffer, 0o2770)
    os.chown(val.buffer, 0, 65533)  # as the service's: its user, its group, which nobody is not in
    # Once here, before the fork (as_nobody), so that what the run imports is imported: no daemon serves it.
    warm = CliRunner().invoke(main, ["--buffer", str(buffer / "none"), "--timeout", "0.1", "--device", "cpu"])
    assert warm.exit_code == EXIT_BUFFER, warm.output

    def as_outsider() -> str:
        said = []
        for args in (["--buffer", str(val.buffer)], ["--buffer", str(train.buffer), "--val-buffer", str(val.buffer)]):
            result = CliRunner().invoke(main, [*args, "--timeout", "1", "--device", "cpu"])
            said.append({"code": result.exit_code, "stderr": result.stderr})
        return json.dumps(said)

    said = json.loads(as_nobody(as_outsider) or "[]")
    assert len(said) == 2, said
    group = _group_name(65533) or "gid 65533"
    why = (f"{val.buffer}: permission denied: it belongs to root (uid 0) and group {group} (mode 2770), and nobody "
           f"(uid 65534) is not in that group; join it (`sudo usermod -aG {group.removeprefix('gid ')} nobody`, which "
           "takes effect at the next login), or ask root (uid 0) for access")
    for flag, answer in zip(("--buffer", "--val-buffer"), said):
        assert answer["code"] == EXIT_NO_ACCESS == 4, answer
        assert answer["stderr"].startswith(f"prefetchd-train: cannot read {flag} {val.buffer}: "), answer
        assert why in " ".join(answer["stderr"].split()) and "not readable" not in answer["stderr"], answer
    assert not (train.buffer / "progress.json").exists()  # refused before it read or wrote anything


def _group_name(gid: int) -> str | None:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return None


def test_epochs_required_for_an_endless_job(make_job: MakeJob) -> None:
    job = make_job(epochs=None)
    result = CliRunner().invoke(main, ["--buffer", str(job.buffer), "--device", "cpu"])
    assert result.exit_code == 2
    assert "--epochs" in result.stderr


def test_more_epochs_than_the_daemon_produces(make_job: MakeJob) -> None:
    job = make_job(epochs=1)
    result = CliRunner().invoke(main, ["--buffer", str(job.buffer), "--device", "cpu", "--epochs", "3"])
    assert result.exit_code == 1
    assert "produces only 1 epoch;" in result.stderr


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:x", "meta"])
def test_an_unknown_device_is_one_usage_line(buffer: Path, device: str) -> None:
    result = CliRunner().invoke(main, ["--buffer", str(buffer), "--timeout", "0.1", "--device", device])
    assert result.exit_code == 2, result.output
    assert f"Error: --device {device}: " in result.stderr and "use auto, cpu, cuda or cuda:N" in result.stderr
    assert "Traceback" not in result.output


@pytest.mark.parametrize("refused", [["--model", "resnet181"], ["--device", "cuda"]])
def test_a_model_or_device_the_trainer_refuses_is_a_usage_error(make_job: MakeJob, monkeypatch: pytest.MonkeyPatch,
                                                               refused: list[str]) -> None:
    """Both exited 1, as a failed setup does, where every other bad option value exits 2 (new-user review)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without CUDA, whatever this one has
    job = make_job(epochs=1)
    result = CliRunner().invoke(main, ["--buffer", str(job.buffer), "--timeout", "10", "--threads", "1", *refused])
    assert result.exit_code == EXIT_USAGE, result.output
    assert "Usage: " in result.stderr and f"\nError: {' '.join(refused)}: " in result.stderr, result.stderr
    assert "Traceback" not in result.output


def test_an_unknown_model_is_refused_before_any_daemon_is_started(tmp_path: Path) -> None:
    """A typo in --model was told only once the model was built: after the buffers' --timeout without a daemon,
    and with --spawn-daemon after the daemons started (here: the missing dataset's failure said instead)."""
    result = CliRunner().invoke(main, ["--buffer", str(tmp_path / "bf"), "--spawn-daemon", "--data",
                                       str(tmp_path / "no-such-data"), "--epochs", "1", "--model", "resnet181"])
    assert result.exit_code == EXIT_USAGE, result.output
    assert "--model resnet181: not a torchvision classification model" in result.stderr, result.output
    assert not (tmp_path / "bf").exists()  # no daemon was started on it


@pytest.mark.parametrize(("flag", "value"), [("--image-size", "4"), ("--image-size", "8193"), ("--batch-size", "65537")])
def test_sizes_the_daemon_refuses_are_refused_before_any_daemon_is_started(tmp_path: Path, flag: str,
                                                                          value: str) -> None:
    """--image-size 4 was taken, a daemon started with it refused it (exit 2), and the run ended with exit 1 (a
    walk of the docs against the commands): the daemon's ranges, from one place (manifest.BATCH_SIZES/IMAGE_SIZES)."""
    (tmp_path / "data").mkdir()
    result = CliRunner().invoke(main, ["--buffer", str(tmp_path / "bf"), "--spawn-daemon", "--data",
                                       str(tmp_path / "data"), "--epochs", "1", flag, value])
    assert result.exit_code == EXIT_USAGE and f"Invalid value for '{flag}'" in result.stderr, result.output
    assert not (tmp_path / "bf").exists()


@pytest.mark.parametrize(("flags", "said"), [
    (["--resume"], "--resume continues from DIR/last.pt: pass --checkpoint-dir DIR"),
    (["--checkpoint-every", "2"], "--checkpoint-every 2 saves DIR/last.pt that often: pass --checkpoint-dir DIR"),
])
def test_checkpoint_flags_without_a_checkpoint_dir_are_refused(buffer: Path, flags: list[str], said: str) -> None:
    """--checkpoint-every without --checkpoint-dir trained to the end and saved nothing (a user's walk)."""
    result = CliRunner().invoke(main, ["--buffer", str(buffer), "--timeout", "0.1", "--device", "cpu", *flags])
    assert result.exit_code == EXIT_USAGE and f"Error: {said}" in result.stderr, result.output


@pytest.mark.parametrize(("flag", "value"), [("--momentum", "-5"), ("--momentum", "1"), ("--weight-decay", "-1"),
                                             ("--label-smoothing", "1")])
def test_optimizer_and_loss_settings_out_of_range_are_refused_at_parse_time(buffer: Path, flag: str, value: str) -> None:
    result = CliRunner().invoke(main, ["--buffer", str(buffer), "--timeout", "0.1", "--device", "cpu", flag, value])
    assert result.exit_code == 2 and f"Invalid value for '{flag}'" in result.stderr, result.output


@pytest.mark.parametrize("flag", ["--metrics-json", "--metrics-csv"])
@pytest.mark.parametrize("where", ["/proc/m.out", "missing/m.out"])
def test_an_unwritable_metrics_path_is_refused_before_the_first_step(buffer: Path, tmp_path: Path, flag: str,
                                                                     where: str) -> None:
    path = where if where.startswith("/") else str(tmp_path / where)
    # No daemon serves the buffer: the check comes before any wait for one (and before a spawned daemon).
    result = CliRunner().invoke(main, ["--buffer", str(buffer), "--timeout", "0.1", "--device", "cpu", flag, path])
    assert result.exit_code == 2, result.output  # a bad argument, as every other one (it was 1)
    assert f"\nError: {flag} {path}: " in result.stderr and result.stderr.strip().splitlines()[-1].startswith("Error: ")
    assert ("does not exist; create it first" in result.stderr) == where.startswith("missing")
    assert not (tmp_path / "missing").exists()  # a typo in the folder is refused, not created


def test_data_and_val_data_take_every_form_of_dataset_and_say_so(tmp_path: Path) -> None:
    """--help said "the training class folders (a folder or a URL)", and a file list was refused as it was
    parsed ("Directory 'l.csv' is a file"), though `prefetchd start --data` takes lists and packs too."""
    shown = CliRunner().invoke(main, ["--help"], terminal_width=200).output
    # Each option's entry: its line and the lines it wraps onto, joined.
    entries = re.split(r"\n(?=  -)", shown)
    lines = {entry.split()[0]: " ".join(entry.split()) for entry in entries if entry.startswith("  -")}
    assert "class folders, a .csv/.tsv/.txt file list" in lines["--data"] and "`prefetchd pack`" in lines["--data"]
    assert lines["--data"].startswith("--data PATH|URL") and "any of --data's forms" in lines["--val-data"], lines
    listed = tmp_path / "train.csv"
    listed.write_text("a.jpg,0\n")
    for flag in ("--data", "--val-data"):  # refused for the model, which is checked before a daemon is started
        result = CliRunner().invoke(main, ["--buffer", str(tmp_path / "bf"), "--spawn-daemon", "--data", str(tmp_path),
                                           flag, str(listed), "--epochs", "1", "--model", "resnet181"])
        assert result.exit_code == EXIT_USAGE and "--model resnet181" in result.stderr, result.output
    result = CliRunner().invoke(main, ["--buffer", str(tmp_path / "bf"), "--checkpoint-dir", str(listed)])
    assert result.exit_code == EXIT_USAGE and "is a file" in result.stderr, result.output  # that one is a folder

def test_an_unwritable_checkpoint_dir_is_refused_before_any_daemon_starts(buffer: Path, tmp_path: Path) -> None:
    """As the metrics paths: rank 0's probe of --checkpoint-dir comes before the daemons it would start."""
    (tmp_path / "afile").write_text("")
    target = tmp_path / "afile" / "ck"
    buffer = buffer / "bf"  # none yet: a daemon started would make it
    result = CliRunner().invoke(main, ["--buffer", str(buffer), "--spawn-daemon", "--data", str(tmp_path), "--epochs",
                                       "1", "--timeout", "60", "--device", "cpu", "--checkpoint-dir", str(target)])
    assert result.exit_code == EXIT_FAILED, result.output
    assert f"--checkpoint-dir {target}: cannot write there" in result.stderr, result.stderr
    assert not buffer.exists(), "a daemon was started for a run that could not save its checkpoints"


def test_wording_of_the_option_and_wait_messages(buffer: Path) -> None:
    from prefetchd.trainer.config import TrainConfig
    from prefetchd.trainer.errors import OptionError
    from prefetchd.trainer.daemon_status import _summary_parts
    from prefetchd.trainer.spawn import check_spawn_options
    from tests.status_examples import production, status

    with pytest.raises(OptionError, match=r"^--workers configures the daemon that --spawn-daemon starts; add "
                                          r"--spawn-daemon, or pass it to `prefetchd start`$"):
        check_spawn_options(TrainConfig(buffer=buffer, workers=2))
    with pytest.raises(OptionError, match=r"^--workers, --reset configure the daemon .* pass them to `prefetchd start`$"):
        check_spawn_options(TrainConfig(buffer=buffer, workers=2, reset=True))
    assert "1 batch waiting (high water 32)" in _summary_parts(status(production=production(waiting=1)))
    result = CliRunner().invoke(main, ["--buffer", str(buffer), "--timeout", "0.1", "--device", "cpu"])
    assert "or pass a larger --timeout" in result.stderr, result.output


@pytest.mark.parametrize("spawn", [False, True])
def test_a_val_buffer_that_is_the_training_buffer_is_refused(buffer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             spawn: bool) -> None:
    from prefetchd.trainer.config import TrainConfig
    from prefetchd.trainer.errors import OptionError
    from prefetchd.trainer.spawn import check_spawn_options

    monkeypatch.chdir(buffer.parent)
    spawned = dict(spawn_daemon=True, data=tmp_path, val_data=tmp_path, epochs=1) if spawn else {}
    same = Path("..") / buffer.parent.name / buffer.name  # another spelling of the same folder
    with pytest.raises(OptionError, match=r"^--val-buffer .* is the training --buffer .*; a validation daemon"):
        check_spawn_options(TrainConfig(buffer=buffer, val_buffer=same, **spawned))  # type: ignore[arg-type]
