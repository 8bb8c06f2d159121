"""prefetchd.options: a dataclass's field metadata yields click options and value checks, for both roles."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from prefetchd.options import check_value, click_options, setting


@dataclass(frozen=True)
class Example:
    out: Path = setting(MISSING, "Where to write.", Path, path="dir")
    size: int = setting(8, "Items per group.", int, minimum=1, maximum=64)
    mode: str = setting("fast", "How.", str, choices=("fast", "slow"))
    rate: float | None = setting(None, "Per second.", float, minimum=0, min_open=True)
    source: Path | str | None = setting(None, "A folder or a URL.", Path, location=True)
    dry_run: bool = setting(False, "Only say what would happen.", bool, short="-n")


def _command(layered: bool) -> tuple[click.Command, list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    @click.command()
    @click_options(Example, layered=layered)
    def cmd(**values: Any) -> None:
        seen.append(values)

    return cmd, seen


def test_plain_options_carry_the_defaults_and_check_ranges_at_parse_time() -> None:
    cmd, seen = _command(layered=False)
    result = CliRunner().invoke(cmd, ["--out", "o", "-n", "--source", "s3://bucket//p"])
    assert result.exit_code == 0, result.output
    assert Example(**seen[0]) == Example(out=Path("o"), dry_run=True, source="s3://bucket//p")
    assert seen[0]["source"] == "s3://bucket//p"  # a URL stays a string: Path would fold its '//'
    for args, complaint in ((["--out", "o", "--size", "0"], "0 is not in the range 1<=x<=64"),
                            (["--out", "o", "--rate", "0"], "0.0 is not in the range x>0"),
                            (["--out", "o", "--mode", "medium"], "'medium' is not one of 'fast', 'slow'"),
                            ([], "Missing option '--out'")):
        result = CliRunner().invoke(cmd, args)
        assert result.exit_code == 2 and complaint in result.output, result.output
    shown = CliRunner().invoke(cmd, ["--help"], terminal_width=200).output
    assert "Items per group.  [default: 8; 1<=x<=64]" in shown
    assert "--dry-run / --no-dry-run" not in shown and "-n, --dry-run" in shown


def test_layered_options_pass_only_what_was_given_and_leave_ranges_to_check_value() -> None:
    cmd, seen = _command(layered=True)
    result = CliRunner().invoke(cmd, ["--out", "o", "--size", "0"])
    assert result.exit_code == 0, result.output
    assert seen[0]["size"] == 0 and seen[0]["mode"] is None  # absent: the caller layers a file under it
    fields = {f.name: f for f in dataclasses.fields(Example)}
    with pytest.raises(KeyError, match=r"size = 0: must be at least 1"):
        check_value(fields["size"], 0, KeyError)
    with pytest.raises(ValueError, match=r"rate = 0.0: must be above 0"):
        check_value(fields["rate"], 0.0)
    check_value(fields["source"], Path("local"))  # a location may be given as a Path
    shown = CliRunner().invoke(cmd, ["--help"], terminal_width=200).output
    assert "--dry-run / --no-dry-run" in shown
    # The range is in the help although the flag's type does not check it (start's --batch-size had none).
    assert "Items per group. [default: 8; 1<=x<=64]" in shown and "Per second. [x>0]" in shown, shown


def test_prefetchd_train_without_flags_gets_trainconfigs_defaults() -> None:
    from prefetchd.trainer.config import TrainConfig
    from prefetchd.trainer.train import main

    ctx = main.make_context("prefetchd-train", ["--buffer", "bf"])
    given = dict(ctx.params)
    assert given.pop("verbose") is False
    assert TrainConfig(**given) == TrainConfig(buffer=Path("bf"))
    assert set(given) == {f.name for f in dataclasses.fields(TrainConfig)}


def test_the_trainer_never_imports_the_daemon_and_options_imports_neither() -> None:
    code = ("import sys, {mod}; print(sorted({{m.split('.')[1] for m in sys.modules "
            "if m.startswith(('prefetchd.daemon', 'prefetchd.trainer'))}}))")
    loaded = {mod: subprocess.run([sys.executable, "-c", code.format(mod=mod)], capture_output=True, text=True,
                                  check=True).stdout.strip()
              for mod in ("prefetchd.options", "prefetchd.trainer.train")}
    assert loaded == {"prefetchd.options": "[]", "prefetchd.trainer.train": "['trainer']"}


@pytest.mark.parametrize("layered", [False, True])
@pytest.mark.parametrize("text", ["nan", "inf"])
def test_a_float_flag_refuses_nan_and_infinity(layered: bool, text: str) -> None:
    # click's range checks compare, and every comparison with nan is false: `--lr nan` trained on.
    cmd, seen = _command(layered=layered)
    result = CliRunner().invoke(cmd, ["--out", "o", "--rate", text])
    assert result.exit_code == 2 and f"Invalid value for '--rate': '{text}' is not a finite number" in result.output
    assert not seen


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_check_value_refuses_nan_and_infinity_as_a_config_file_gives_them(value: float) -> None:
    fields = {f.name: f for f in dataclasses.fields(Example)}
    with pytest.raises(ValueError, match=rf"rate = {value!r}: expected a finite number"):
        check_value(fields["rate"], value)


def test_every_float_option_of_both_commands_refuses_nan() -> None:
    from prefetchd.cli import main as prefetchd
    from prefetchd.trainer.train import main as train

    def commands(command: click.Command) -> list[click.Command]:
        below = command.commands.values() if isinstance(command, click.Group) else ()
        return [command, *(c for sub in below for c in commands(sub))]

    floats = [p for c in commands(prefetchd) + [train] for p in c.params if isinstance(p.type, click.types.FloatParamType)]
    assert {p.name for p in floats} >= {"lr", "momentum", "warmup_epochs", "timeout", "daemon_timeout",
                                        "consumer_timeout", "val_fraction", "interval", "seconds"}
    for param in floats:
        with pytest.raises(click.BadParameter, match="is not a finite number"):
            param.type.convert("nan", param, None)


def test_a_daemon_config_file_with_nan_is_refused(tmp_path: Path) -> None:
    from prefetchd.daemon.config import ConfigError, load_toml

    (tmp_path / "d.toml").write_text("consumer-timeout = nan\n")
    with pytest.raises(ConfigError, match=r"d.toml: consumer_timeout = nan: expected a finite number"):
        load_toml(tmp_path / "d.toml")


def test_a_path_under_a_folder_this_user_may_not_enter_is_said_in_one_line(shm_dir: Path) -> None:
    """pack, show --out, demo --workdir, bench --out and prefetchd-train --checkpoint-dir met a PermissionError
    where a path of the user's lay under a folder it may not enter (/root, a home of mode 0700): a traceback, exit
    1 (a walk as a non-root user).  Run as nobody, in a fork of this process (no interpreter to start)."""
    import contextlib
    import io

    from prefetchd.cli import main
    from tests.as_nobody import as_nobody

    shm_dir.chmod(0o755)
    private = shm_dir / "private"
    private.mkdir(mode=0o700)
    (shm_dir / "out").mkdir(mode=0o755)
    os.chown(shm_dir / "out", 65534, 65534)  # nobody's to pack into: SRC is the path under the closed folder

    def pack() -> str:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                main.main(["pack", str(private / "data"), str(shm_dir / "out")], prog_name="prefetchd")
            except SystemExit as exc:
                return f"exit {exc.code}: {err.getvalue()}"
        return f"no exit: {err.getvalue()}"

    said = as_nobody(pack)
    assert said.startswith(f"exit 4: prefetchd: {private}: permission denied: it belongs to root (uid 0)"), said
    assert said.rstrip().endswith("; pass a path this user may use") and "Traceback" not in said, said
