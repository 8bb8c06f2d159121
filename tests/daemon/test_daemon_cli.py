"""prefetchd.daemon.cli, run as `prefetchd` (prefetchd.cli): flag/file/default precedence and the
stop/status commands, driven through click's CliRunner (no daemon is started here)."""

from __future__ import annotations

import contextlib
import dataclasses
import grp
import importlib
import json
import re
import shlex
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
import psutil
import pytest
from click.testing import CliRunner, Result

import prefetchd.cli as prefetchd_cli
from prefetchd.options import raised_writing_stdout
from prefetchd.buffer_protocol import (VERSION, DaemonLock, Errors, Manifest, RunningJob, State, daemon_pid, lock_holders,
                                      read_status, write_status)
from prefetchd.daemon import cli, status_view
from prefetchd.daemon.config import DaemonConfig, load_toml, tomllib  # the standard library's, or tomli before 3.11
from prefetchd.daemon.dataset import split_members
from prefetchd.daemon.errors import EXIT_NO_ACCESS, EXIT_NOT_RUNNING, EXIT_USAGE, ConfigError
from prefetchd.daemon.job_inbox import JOB_FIELDS
from tests.as_nobody import NOBODY, as_nobody
from tests.owners import owned
from tests.status_examples import CONSUMER, STORAGE_WAIT, TRAINER, bad_files, production, production_without_trainer, report
from tests.status_examples import stream
from tests.status_examples import write_status_at_heartbeat
from tests.status_examples import status as status_example

LOCK = "daemon.lock"
OURS = os.stat("/proc/self/ns/pid").st_ino  # this process's pid namespace


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[DaemonConfig]:
    """Replace the daemon's run loop: `start` builds its config and hands it over here."""
    import prefetchd.daemon.main as daemon_main

    seen: list[DaemonConfig] = []

    def fake_run(cfg: DaemonConfig) -> int:
        seen.append(cfg)
        return 0

    monkeypatch.setattr(daemon_main, "run_daemon", fake_run)
    # Leave the root logger as pytest set it up; messages reach caplog.
    monkeypatch.setattr(cli, "setup_logging", lambda level: None)
    return seen


def run_start(runner: CliRunner, args: list[str]) -> Result:
    return runner.invoke(prefetchd_cli.main, ["start", *args], catch_exceptions=False)


# -- start: where each value comes from ---------------------------------------------------


def test_defaults_when_nothing_is_given(runner: CliRunner, captured: list[DaemonConfig], tmp_path: Path) -> None:
    result = run_start(runner, ["--buffer", str(tmp_path / "bf")])
    assert result.exit_code == 0, result.output
    assert captured == [DaemonConfig(buffer=tmp_path / "bf")]


def test_file_overrides_defaults_and_flags_override_file(
    runner: CliRunner, captured: list[DaemonConfig], tmp_path: Path
) -> None:
    cfg = tmp_path / "etc" / "daemon.toml"
    cfg.parent.mkdir()
    cfg.write_text('buffer = "bf"\ndata = "imgs"\nbatch-size = 64\nimage_size = 96\nseed = 5\n'
                   'split = "val"\nval_fraction = 0.1\nreset = true\nworkers = 3\n')
    result = run_start(runner, ["--config", str(cfg), "--batch-size", "32", "--seed", "0", "--epochs", "2",
                                "--data", str(tmp_path / "other")])
    assert result.exit_code == 0, result.output
    (got,) = captured
    assert got.buffer == tmp_path / "etc" / "bf"  # file, relative to the file
    assert got.data == str(tmp_path / "other")  # flag beats file (a location: a string)
    assert got.batch_size == 32  # flag beats file
    assert got.seed == 0  # a flag equal to the dataclass default still beats the file
    assert got.image_size == 96 and got.split == "val" and got.val_fraction == 0.1  # file
    assert got.reset is True and got.workers == 3  # file, no flag given
    assert got.epochs == 2  # flag, not in the file
    assert got.high_water is None and got.low_water is None  # nobody: sized later from the machine


def test_flag_alone_beats_dataclass_default(runner: CliRunner, captured: list[DaemonConfig], tmp_path: Path) -> None:
    result = run_start(runner, ["--buffer", str(tmp_path), "--image-size", "64", "--split", "val",
                                "--high-water", "9", "--low-water", "2", "--val-fraction", "0.5", "--reset"])
    assert result.exit_code == 0, result.output
    expected = DaemonConfig(buffer=tmp_path, image_size=64, split="val", high_water=9, low_water=2,
                            val_fraction=0.5, reset=True)
    assert captured == [expected]


def test_every_config_field_has_a_flag(runner: CliRunner) -> None:
    result = runner.invoke(prefetchd_cli.main, ["start", "--help"])
    assert result.exit_code == 0
    for f in dataclasses.fields(DaemonConfig):
        assert "--" + f.name.replace("_", "-") in result.output
    for flag in ["--buffer", "--data", "--config", "--batch-size", "--image-size", "--workers", "--high-water",
                 "--low-water", "--seed", "--epochs", "--split"]:
        assert flag in result.output


def test_submit_offers_job_settings_but_not_the_allow_lists(runner: CliRunner) -> None:
    """A job cannot widen what jobs may do: the allow-lists are the daemon's, not the submitter's."""
    result = runner.invoke(prefetchd_cli.main, ["submit", "--help"])
    assert result.exit_code == 0
    assert "--transform" in result.output and "--data" in result.output
    assert "--allowed-data" not in result.output and "--allowed-transforms" not in result.output


def test_submit_help_names_the_daemons_settings_as_the_defaults_not_starts(runner: CliRunner) -> None:
    """A job leaves unset what the daemon's own flags and config decide: `start`'s "[default: 128]" (or
    "[default: run on]") in submit's help told the user of a service configured otherwise the wrong value."""
    job_options = [p for p in cli.submit.params if isinstance(p, click.Option) and p.name in JOB_FIELDS]
    assert {p.name for p in job_options} == JOB_FIELDS
    for option in job_options:
        assert option.help is not None and re.search(r"\[default: the daemon's own setting(; [^\]]+)?\]$", option.help), \
            option.help
        assert option.help.count("[default:") == 1, option.help
    shown = " ".join(runner.invoke(prefetchd_cli.main, ["submit", "--help"]).output.split())
    assert "[default: 128]" not in shown and "[default: run on]" not in shown
    assert "Images per batch. [default: the daemon's own setting; 1<=x<=65536]" in shown
    # start's help still names its own defaults, and the range its flag's type leaves to the merged settings' check.
    assert "Images per batch. [default: 128; 1<=x<=65536]" in " ".join(
        runner.invoke(prefetchd_cli.main, ["start", "--help"]).output.split())


def _start_error(runner: CliRunner, caplog: pytest.LogCaptureFixture, args: list[str]) -> tuple[int, str]:
    with caplog.at_level(logging.ERROR):
        result = run_start(runner, args)
    return result.exit_code, result.output + caplog.text


def test_unknown_key_in_config_exits_2(
    runner: CliRunner, captured: list[DaemonConfig], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("batch_size = 64\nhigh_watermark = 10\n")
    code, text = _start_error(runner, caplog, ["--config", str(bad), "--buffer", str(tmp_path / "bf")])
    assert code == EXIT_USAGE == 2
    assert "unknown key 'high_watermark' (did you mean 'high_water'?)" in text and str(bad) in text
    assert captured == []


@pytest.mark.parametrize(("key", "needle"), [
    ("log_level", "'log_level' is not a config key: set it with --log-level on the command line (a service's: in its "
                  "unit's ExecStart)"),
    ("log-level", "'log-level' is not a config key: set it with --log-level"),
    ("config", "'config' is not a config key: a config file cannot name another"),
])
def test_a_command_line_only_option_in_a_config_file_says_where_it_is_set(
    runner: CliRunner, captured: list[DaemonConfig], caplog: pytest.LogCaptureFixture, tmp_path: Path, key: str,
    needle: str,
) -> None:
    """It was refused as an unknown key, with the list of allowed ones, which does not have it either."""
    bad = tmp_path / "bad.toml"
    bad.write_text(f"{key} = 'debug'\n")
    code, text = _start_error(runner, caplog, ["--config", str(bad), "--buffer", str(tmp_path / "bf")])
    assert code == EXIT_USAGE and needle in " ".join(text.split()) and "allowed keys are" in text, text
    assert captured == []


@pytest.mark.parametrize(
    ("toml", "args", "needle"),
    [
        # Each error names the value as the user gave it: the file and its key, or the flag.
        ("batch_size = 'many'\n", [], "c.toml: batch_size = 'many'"),
        ("low_water = 8\nhigh_water = 8\n", [], "c.toml: low_water = 8"),
        ("low_water = 4\n", ["--high-water", "4"], "c.toml: low_water = 4"),  # file and flag together break the rule
        ("batch_size = 64\n", ["--batch-size", "0"], "--batch-size 0: must be at least 1"),
        ("workers = 0\n", [], "c.toml: workers = 0 leaves nobody to build batches"),
        ("", ["--workers", "0"], "--workers 0 leaves nobody to build batches"),
        ("", ["--val-fraction", "-0.1"], "--val-fraction -0.1: must be at least 0"),
        # Said "valid" by `prefetchd config`, refused by start once the dataset was indexed (a user's walk).
        ("", ["--val-fraction", "1"], "--val-fraction 1 leaves the train split empty: hold out a fraction below 1, "
                                      "or leave val_fraction out to train on all of the data"),
        ("split = 'val'\n", ["--val-fraction", "0"], "--val-fraction 0 leaves the val split empty: hold out a "
                                                        "fraction above 0"),
        ("", ["--consumer-timeout", "0"], "--consumer-timeout 0: must be above 4"),  # not "0.0", which was not typed
        ("", ["--color-jitter", "-1"], "--color-jitter -1: must be at least 0"),
        ("", ["--ray", "remote"], "--ray remote: expected 'local'"),
        ("", ["--transform", "nocolon"], "--transform nocolon: expected 'package.module:callable'"),
        ("transform = 'nocolon'\n", [], "c.toml: transform = 'nocolon': expected 'package.module:callable'"),
        ("", ["--allowed-transforms", "a:b", "--allowed-transforms", "nocolon"], "--allowed-transforms nocolon: expected"),
        ("[[[\n", [], "not valid TOML"),
    ],
)
def test_bad_configuration_exits_2(
    runner: CliRunner, captured: list[DaemonConfig], caplog: pytest.LogCaptureFixture, tmp_path: Path,
    toml: str, args: list[str], needle: str,
) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    code, text = _start_error(runner, caplog, ["--config", str(cfg), "--buffer", str(tmp_path), *args])
    assert code == 2
    assert needle in text
    assert captured == []


def test_no_buffer_anywhere_exits_2(
    runner: CliRunner, captured: list[DaemonConfig], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    code, text = _start_error(runner, caplog, ["--data", str(tmp_path)])
    assert code == 2
    assert "--buffer" in text


def test_missing_config_file_exits_2(
    runner: CliRunner, captured: list[DaemonConfig], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    code, text = _start_error(runner, caplog, ["--config", str(tmp_path / "nope.toml"), "--buffer", str(tmp_path)])
    assert code == 2
    assert "nope.toml" in text


@pytest.mark.parametrize("args", [["--split", "test"], ["--batch-size", "many"], ["--bogus-flag", "1"]])
def test_bad_flags_exit_2(runner: CliRunner, captured: list[DaemonConfig], tmp_path: Path, args: list[str]) -> None:
    result = runner.invoke(prefetchd_cli.main, ["start", "--buffer", str(tmp_path), *args])
    assert result.exit_code == 2
    assert captured == []


@pytest.mark.parametrize("command", ["start", "config", "submit", "stop", "status", "show"])
def test_a_buffer_given_as_an_argument_is_told_how_to_give_it(runner: CliRunner, captured: list[DaemonConfig],
                                                               tmp_path: Path, command: str) -> None:
    """`prefetchd stop /dev/shm/bf` (stop's help speaks of "the daemon that owns BUFFER") said only "Missing
    option '--buffer'", and `start` "Got unexpected extra argument": neither how to write it."""
    result = runner.invoke(prefetchd_cli.main, [command, str(tmp_path / "bf"), "--timeout", "3"]
                           if command in ("stop", "submit") else [command, str(tmp_path / "bf")], prog_name="prefetchd")
    assert result.exit_code == 2, result.output
    assert f"the buffer is an option, not an argument: prefetchd {command} --buffer {tmp_path / 'bf'} ..." in result.output
    assert captured == []
    # Help still helps, and an argument beside --buffer is only a stray argument.
    shown = runner.invoke(prefetchd_cli.main, [command, str(tmp_path / "bf"), "--help"], prog_name="prefetchd")
    assert shown.exit_code == 0 and f"Usage: prefetchd {command}" in shown.output, shown.output
    stray = runner.invoke(prefetchd_cli.main, [command, "--buffer", str(tmp_path), "extra"])
    assert stray.exit_code == 2 and "Got unexpected extra argument (extra)" in stray.output, stray.output
    assert "not an argument" not in stray.output


# -- status ------------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["prefetchd", "prefetchd.cli"])
def test_the_command_runs_as_either_module(module: str, tmp_path: Path) -> None:
    """`python -m prefetchd.cli` (the entry point's module) exited 0 having done nothing."""
    out = subprocess.run([sys.executable, "-m", module, "status", "--buffer", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == EXIT_NOT_RUNNING and f"prefetchd on {tmp_path}: not running" in out.stdout, out


def test_version_names_the_buffer_protocol(runner: CliRunner) -> None:
    """A trainer needs the daemon's buffer protocol version, not its package version (systemd/README.md,
    "Upgrading"): `prefetchd --version` says both."""
    out = runner.invoke(prefetchd_cli.main, ["--version"])
    assert out.exit_code == 0 and out.output.endswith(f", buffer protocol {VERSION}\n"), out.output


def test_status_not_running(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path)])
    assert result.exit_code == EXIT_NOT_RUNNING == 3
    assert "not running" in result.output and "does not exist" not in result.output
    assert str(tmp_path) in result.output


def test_status_of_a_missing_buffer(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path / "never-made")])
    assert result.exit_code == 3
    assert f"not running\n{tmp_path / 'never-made'} does not exist" in result.output  # a typo, not a stopped daemon
    result = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path / "never-made"), "--json"])
    assert result.exit_code == 3
    assert json.loads(result.output)["problems"] == [f"{tmp_path / 'never-made'} does not exist"]


def test_status_json_not_running(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path), "--json"])
    assert result.exit_code == 3
    doc = json.loads(result.output)
    assert {"running", "pid", "status", "manifest", "buffer"} <= set(doc)
    assert doc["running"] is False and doc["pid"] is None
    assert doc["status"] is None and doc["manifest"] is None
    assert doc["buffer"] == str(tmp_path)


@pytest.mark.parametrize(("state", "unsaid"), [(State.FULL, True), (State.FILLING, True), (State.STOPPED, False),
                                               (State.FAILED, False)])
def test_a_daemon_that_ended_without_its_last_state_is_said_to_have_been_killed(runner: CliRunner, tmp_path: Path,
                                                                               state: State, unsaid: bool) -> None:
    """A SIGKILLed daemon's status read "not running (last state: full)", as if full were how it ended; only a
    comparison with a clean stop's showed the crash (a user's walk, monitoring)."""
    write_status(tmp_path, status_example(state))
    doc = json.loads(runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path), "--json"]).output)
    assert doc["running"] is False and doc["ended_unsaid"] is unsaid
    text = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path)])
    assert text.exit_code == EXIT_NOT_RUNNING
    said = ("; it ended without writing its last state: killed (SIGKILL, the OOM killer: `dmesg`, or a signal other "
            "than the SIGTERM, SIGINT and SIGHUP it stops on) or crashed")
    assert (said in text.output) is unsaid, text.output
    assert f"(last state: {state}" in text.output


def test_status_watch_json_prints_one_document_per_line(tmp_path: Path) -> None:
    """`status --watch --json | jq`: stdout is JSON Lines; the "Ctrl-C to leave" note goes to stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "prefetchd", "status", "--buffer", str(tmp_path), "--watch", "--json",
                             "--interval", "0.1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        docs = [json.loads(proc.stdout.readline()) for _ in range(3)]
        assert [d["buffer"] for d in docs] == [str(tmp_path)] * 3 and not any(d["running"] for d in docs)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert all(json.loads(line) for line in out.splitlines())
    assert "Ctrl-C to leave" in err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["--help"], ["status", "--json"], ["status", "--watch", "--interval", "0.1"],
                                  ["-c", "from prefetchd.trainer.command import main; main()", "--help"]])
def test_output_that_cannot_be_written_is_said_not_a_traceback(tmp_path: Path, args: list[str]) -> None:
    """`prefetchd status > /dev/full` (stdout on a full disk) was click.echo's OSError traceback; so was
    `prefetchd-train --help > /dev/full`."""
    program = "prefetchd-train" if args[0] == "-c" else "prefetchd"
    if args[0] == "status":
        args = [*args, "--buffer", str(tmp_path)]
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, *(args if args[0] == "-c" else ["-m", "prefetchd", *args])],
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == f"{program}: cannot write to standard output: No space left on device\n", proc.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_an_error_that_is_not_stdouts_keeps_its_traceback() -> None:
    """Only click.echo's write to stdout is said as unwritable output; any other OSError is a bug to show."""
    full = open("/dev/full", "w")
    try:
        for raise_it in (lambda: open("/nonexistent/x"), lambda: click.echo("x", file=full)):
            with pytest.raises(OSError) as caught:
                raise_it()
            assert not raised_writing_stdout(caught.value)
    finally:
        with contextlib.suppress(OSError):  # its close flushes what echo left there, onto /dev/full again
            full.close()


def test_status_refuses_an_interval_without_watch(runner: CliRunner, tmp_path: Path) -> None:
    """`status --interval 5` printed one status and exited, as if the interval were taken."""
    result = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path), "--interval", "5"])
    assert result.exit_code == EXIT_USAGE, result.output
    assert "Error: --interval 5 sets how often --watch redraws; add --watch, or leave --interval out" in result.output


def test_status_with_a_live_owner(runner: CliRunner, tmp_path: Path) -> None:
    lock = DaemonLock(tmp_path)
    lock.acquire()  # this test process plays the daemon
    try:
        result = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path), "--json"])
        assert result.exit_code == 0, result.output
        doc = json.loads(result.output)
        assert doc["running"] is True and doc["pid"] == os.getpid() and doc["status"] is None
        written = status_example(pid=os.getpid())
        write_status_at_heartbeat(tmp_path, written)
        doc = json.loads(runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path), "--json"]).output)
        assert doc["status"] == json.loads(json.dumps(written.to_doc()))  # the document as status.json holds it
        assert doc["status"]["format"] == "prefetchd.status" and doc["status"]["rates"]["samples_per_s"] == 850.4
        text = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path)])
        assert text.exit_code == 0
        assert f"running (pid {os.getpid()})" in text.output
    finally:
        lock.release()
    after = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path)])
    assert after.exit_code == 3  # a released lock is no owner


def test_status_ignores_a_stale_pid(runner: CliRunner, tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    (tmp_path / LOCK).write_text(f"{proc.pid}\n")  # the owner died without releasing
    result = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path), "--json"])
    assert result.exit_code == 3
    assert json.loads(result.output)["running"] is False
    # a live process that is younger than the lock file is a reused pid, not the owner
    (tmp_path / LOCK).write_text(f"{os.getpid()}\n")
    old = psutil.Process().create_time() - 100
    os.utime(tmp_path / LOCK, (old, old))
    assert runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path)]).exit_code == 3


def test_a_lock_held_by_no_daemon_is_named_by_status_and_stop(runner: CliRunner, tmp_path: Path) -> None:
    """A process that is no daemon holding daemon.lock: `start` stops at it (exit 5) with `fuser`, while `status`
    said only "not running" and `stop` "no daemon is running" (a review, holding it with flock(1))."""
    (tmp_path / LOCK).write_text("")
    holder = subprocess.Popen(["flock", "-n", str(tmp_path / LOCK), "sleep", "60"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while holder.pid not in (lock_holders(tmp_path / LOCK) or set()) and time.monotonic() < deadline:
            time.sleep(0.05)
        said = f"{tmp_path / LOCK} is locked by pid {holder.pid}, which is not a running prefetchd daemon"
        status = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path)])
        assert status.exit_code == 3 and said in status.output and "fuser -v" in status.output, status.output
        stop = runner.invoke(prefetchd_cli.main, ["stop", "--buffer", str(tmp_path)])
        assert stop.exit_code == 0 and f"note: {said}" in stop.stderr, stop.output
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # flock and its sleep, which holds the lock too
        holder.wait()
    deadline = time.monotonic() + 10
    while lock_holders(tmp_path / LOCK) and time.monotonic() < deadline:  # the sleep's exit lets it go
        time.sleep(0.05)
    assert "locked by" not in runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path)]).output


def test_status_of_a_lock_nobody_holds_is_not_running(runner: CliRunner, tmp_path: Path) -> None:
    """daemon.lock naming a live process older than it, of its owner, held by nobody: what a daemon of another pid
    namespace killed before its first status leaves, naming its pid 1 there, the host's init (SPEC rule 4)."""
    (tmp_path / LOCK).write_text(f"{os.getpid()}\n")
    result = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path), "--json"])
    assert result.exit_code == 3 and json.loads(result.output)["running"] is False, result.output
    with owned(tmp_path):  # held, by the process it names: running
        result = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path)])
        assert result.exit_code == 0 and f"running (pid {os.getpid()})" in result.output, result.output


def test_status_reports_a_corrupt_status_file(runner: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "status.json").write_text("{not json")
    result = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path), "--json"])
    assert result.exit_code == 3
    doc = json.loads(result.output)
    assert doc["status"] is None
    assert any("status.json" in p for p in doc["problems"])
    text = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path)])
    assert text.exit_code == 3 and "status.json" in text.output


# -- stop -------------------------------------------------------------------------------


def test_stop_without_a_daemon(runner: CliRunner, tmp_path: Path) -> None:
    result = runner.invoke(prefetchd_cli.main, ["stop", "--buffer", str(tmp_path)])
    assert result.exit_code == 0
    assert "no daemon is running" in result.output


def test_stop_of_a_buffer_that_does_not_exist_exits_3(runner: CliRunner, tmp_path: Path) -> None:
    """A typo'd --buffer said "no daemon is running" and exited 0, so `stop --buffer X && echo stopped` went on."""
    typo = tmp_path / "typo"
    result = runner.invoke(prefetchd_cli.main, ["stop", "--buffer", str(typo)])
    assert result.exit_code == EXIT_NOT_RUNNING == 3, result.output
    assert f"{typo} does not exist, so no daemon runs on it; check the path" in result.stderr
    assert not typo.exists()


def _owner(buffer: Path, ignore_term: bool) -> tuple[subprocess.Popen[bytes], threading.Thread]:
    """A child process that owns ``buffer``'s lock, reaped by a thread as soon as it exits."""
    code = (
        "import signal, sys, time\n"
        "from pathlib import Path\n"
        "from prefetchd.buffer_protocol import DaemonLock\n"
        + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
        + "DaemonLock(Path(sys.argv[1])).acquire()\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(buffer)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    reaper = threading.Thread(target=proc.wait, daemon=True)
    reaper.start()
    return proc, reaper


def test_stop_terminates_the_owner(runner: CliRunner, tmp_path: Path) -> None:
    proc, reaper = _owner(tmp_path, ignore_term=False)
    try:
        started = time.monotonic()
        result = runner.invoke(prefetchd_cli.main, ["stop", "--buffer", str(tmp_path), "--timeout", "10"])
        assert result.exit_code == 0, result.output
        assert f"pid {proc.pid}" in result.output and "stopped" in result.output
        assert time.monotonic() - started < 5
        reaper.join(5)
        assert proc.returncode == -15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stop_gives_up_after_its_timeout(runner: CliRunner, tmp_path: Path) -> None:
    proc, reaper = _owner(tmp_path, ignore_term=True)
    try:
        result = runner.invoke(prefetchd_cli.main, ["stop", "--buffer", str(tmp_path), "--timeout", "0.5"])
        assert result.exit_code == 1
        assert f"kill -9 {proc.pid}" in result.output
        assert proc.poll() is None  # SIGTERM was ignored; still there
    finally:
        proc.kill()
        reaper.join(5)


@pytest.mark.skipif(os.geteuid() != 0, reason="plays two users: the owner runs as nobody, stop as another uid")
def test_stop_of_another_users_daemon_says_who_can_stop_it(runner: CliRunner, shm_buffer: Path) -> None:
    """A trainer user running `prefetchd stop` on the service's buffer: no PermissionError
    traceback, but whose daemon it is and how to stop it."""
    os.chmod(shm_buffer, 0o755)  # the stopper, not root, reads the lock
    (shm_buffer / LOCK).touch()
    os.chown(shm_buffer / LOCK, 65534, 65534)  # as the owner made it
    # util-linux's flock, not this interpreter, which nobody may not run where it lives under root's home (CI's
    # Python 3.10); its command says when the lock is held, and setpriv and flock (--no-fork) exec: the pid holds the lock,
    # and its kill lets go of it.
    owner = subprocess.Popen(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "flock", "--exclusive",
                              "--no-fork", shm_buffer / LOCK, "sh", "-c", "echo; exec sleep 60"], stdout=subprocess.PIPE)
    try:
        assert owner.stdout is not None and owner.stdout.readline() == b"\n"  # it holds the lock, as a daemon does
        (shm_buffer / LOCK).write_text(f"{owner.pid}\n")  # written after the owner started: its lock
        os.seteuid(65533)  # without root's CAP_KILL, and another uid than the owner's
        try:
            result = runner.invoke(prefetchd_cli.main, ["stop", "--buffer", str(shm_buffer), "--timeout", "1"])
        finally:
            os.seteuid(0)
        assert result.exit_code == 1, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        assert f"the daemon (pid {owner.pid}) runs as user nobody; run this command as that user or root" \
            in result.output, result.output
        assert owner.poll() is None
    finally:
        owner.kill()
        owner.wait()


def test_stop_sends_to_systemctl_only_a_daemon_that_a_unit_runs() -> None:
    """A daemon started by hand was said to stop with `systemctl stop prefetchd@NAME` (a walk as a non-root user):
    its unit is read from /proc/PID/cgroup, here a real cgroup v1 named as systemd names a unit's.  A second
    start on a service's buffer (exit 5) advised `prefetchd stop`, which leaves the unit inactive as if stopped
    through systemctl: it names the unit too."""
    from prefetchd.buffer_protocol import DaemonOwner
    from prefetchd.daemon.cli import not_ours_to_signal
    from tests.cgroups import cgroup_v1

    with cgroup_v1("pids", {}) as group:
        unit = group / "prefetchd@bf.service"
        unit.mkdir()
        sleeper = subprocess.Popen(["sleep", "60"])
        try:
            by_hand = not_ours_to_signal(sleeper.pid)
            assert "systemctl" not in by_hand and by_hand.endswith("; run this command as that user or root"), by_hand
            assert DaemonOwner(sleeper.pid).how_to_stop("/dev/shm/bf") == "`prefetchd stop --buffer /dev/shm/bf`"
            (unit / "cgroup.procs").write_text(str(sleeper.pid))
            said = not_ours_to_signal(sleeper.pid)
            assert "; stop its service with `systemctl stop prefetchd@bf.service`, or run this command as that " \
                "user or root" in said, said
            assert DaemonOwner(sleeper.pid).how_to_stop("/dev/shm/bf") == "`systemctl stop prefetchd@bf.service` (its service)"
        finally:
            sleeper.kill()
            sleeper.wait()
            if (unit / "cgroup.procs").exists():
                unit.rmdir()


def test_status_says_what_stop_refuses_for_a_lock_whose_holder_is_not_the_pid_it_names(
    runner: CliRunner, shm_buffer: Path
) -> None:
    """daemon.lock naming a live process of this user, older than the file, while another process holds its lock:
    `prefetchd stop` refuses (the holder is not the pid), and `prefetchd status` said "running (pid N)" alone."""
    named = subprocess.Popen(["sleep", "60"])
    lock = shm_buffer / LOCK
    holder = subprocess.Popen(["flock", "--exclusive", "--no-fork", lock, "sh", "-c", "echo; exec sleep 60"],
                              stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"\n"
        lock.write_text(f"{named.pid}\n")
        said = f"{lock} names pid {named.pid}, but here its lock is held by pid {holder.pid}, not by pid {named.pid}"
        stop = runner.invoke(prefetchd_cli.main, ["stop", "--buffer", str(shm_buffer), "--timeout", "1"])
        assert stop.exit_code == 1 and said in stop.output, stop.output
        status = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(shm_buffer)])
        assert said in " ".join(status.output.split()), status.output
        assert named.poll() is None and holder.poll() is None
    finally:
        for p in (named, holder):
            p.kill()
            p.wait()


LOCK_LEFT_TO_A_CHILD = """
import fcntl, subprocess, sys
lock = open(sys.argv[1], "a")
fcntl.flock(lock, fcntl.LOCK_EX)
subprocess.Popen(["sleep", sys.argv[2]], pass_fds=[lock.fileno()])  # holds it on after this process exits
"""


def test_a_second_stop_of_a_daemon_that_is_exiting_waits_for_it(runner: CliRunner, shm_buffer: Path) -> None:
    """Two `prefetchd stop` at once: the first's daemon said its last word (stopped) and exited while a process of
    it still held the lock, which /proc/locks showed as no visible holder, and the second refused, exit 1, naming
    "a daemon of another pid namespace" (a walk, 2 of 8 runs).  It waits for the lock to go, as the first does."""
    named = subprocess.Popen(["sleep", "60"])
    lock = shm_buffer / LOCK
    try:
        lock.write_text(f"{named.pid}\n")
        subprocess.run([sys.executable, "-c", LOCK_LEFT_TO_A_CHILD, str(lock), "2"], check=True, timeout=30)
        assert named.pid not in (lock_holders(lock) or {named.pid})  # held, by another process than the one named
        write_status(shm_buffer, status_example(State.STOPPED, pid=named.pid, production=None))
        said = " ".join(runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(shm_buffer)]).output.split())
        assert "its lock is held by" not in said and "state stopped" in said, said
        stop = runner.invoke(prefetchd_cli.main, ["stop", "--buffer", str(shm_buffer), "--timeout", "20"])
        assert stop.exit_code == 0, stop.output
        assert stop.output == f"stopped the daemon on {shm_buffer} (pid {named.pid}), which was stopping already\n"
        assert daemon_pid(shm_buffer) is None and named.poll() is None  # waited for, not signalled
    finally:
        named.kill()
        named.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="plays a group member, who plants the lock, and root, who stops")
def test_a_lock_planted_by_another_user_names_no_daemon_to_stop(runner: CliRunner, shm_buffer: Path) -> None:
    """Anyone who may write the buffer (--group-access: the group) can rename their own daemon.lock into it,
    naming any pid, with an mtime after that process started; root's `prefetchd stop` then SIGTERMed it."""
    victim = subprocess.Popen(["sleep", "60"])  # root's
    # The member holds the planted lock too (flock(2) needs only read access), as a daemon would: the file's
    # owner alone rules the pid out.
    try:
        with owned(shm_buffer, victim.pid) as planted:
            os.chown(planted, 65533, 65533)
            os.utime(planted, (time.time() + 3600, time.time() + 3600))
            result = runner.invoke(prefetchd_cli.main, ["stop", "--buffer", str(shm_buffer), "--timeout", "1"])
            assert result.exit_code == 0 and f"no daemon is running on {shm_buffer}" in result.output, result.output
            assert status_view.describe_status(shm_buffer).pid is None
            assert victim.poll() is None
            os.chown(planted, 0, 0)  # made by the process it names: that one is the daemon
            assert daemon_pid(shm_buffer) == victim.pid
    finally:
        victim.kill()
        victim.wait()


def test_describe_status_of_an_empty_buffer(tmp_path: Path) -> None:
    assert json.loads(status_view.status_json(status_view.describe_status(tmp_path))) == {
        "buffer": str(tmp_path), "owner": str(tmp_path), "rank": None, "running": False, "pid": None,
        "heartbeat_age_s": None, "stale": False, "status": None, "manifest": None, "problems": [], "no_rank": False, "served": True,
        "other_pid_namespace": False, "command_pid_namespace": OURS, "readable": True, "ended_unsaid": False}


def _manifest(**changes: Any) -> Manifest:
    """A train job's manifest: 1500 samples of 10 classes, 64 a batch."""
    base = Manifest(dataset_root="/data", fingerprint="f", classes=[f"c{i}" for i in range(10)], num_samples=1500,
                    split="train", seed=0, batch_size=64, image_size=224, samples_per_epoch=1500, steps_per_epoch=24,
                    epochs=None, producer="t")
    return dataclasses.replace(base, **changes)


def _running_status_text(state: State = State.FILLING, **production_changes: Any) -> str:
    """`prefetchd status` of a running daemon whose production is ``production(**production_changes)``."""
    return status_view.format_status(report(status_example(state, production=production(**production_changes))))


def test_the_memory_line_counts_the_consumed_batch_files_kept_to_build_in(tmp_path: Path) -> None:
    """Its "in the buffer" (Production.buffer_bytes) counts batches: the files of consumed ones the daemon keeps
    to build in again hold tmpfs memory too, and a user comparing with `du` found them missing (a user's walk)."""
    from prefetchd.buffer_protocol.layout import spare_name

    def memory_line() -> str:
        shown = status_view.format_status(report(status_example(production=production()), buffer=tmp_path))
        return next(line for line in shown.splitlines() if line.startswith("  memory"))

    assert memory_line() == "  memory    14.0 MiB in the buffer, 1.0 GiB free on its filesystem"
    for n in range(3):
        (tmp_path / spare_name(n)).write_bytes(b"\1" * 8192)
    assert memory_line() == ("  memory    14.0 MiB in the buffer (and 24.0 KiB in 3 consumed batch files kept to build "
                             "in again), 1.0 GiB free on its filesystem")


def test_status_of_an_earlier_builds_daemon_shows_its_submitted_job_as_the_last_one(tmp_path: Path) -> None:
    """A daemon of an earlier 0.1 build (still running while the package is upgraded, systemd/README.md) writes no
    running_job: `prefetchd status` took its absence for a daemon producing its own --data and showed the job it
    had accepted and produced as "later ..., answered at ... (the job being produced runs on)"."""
    doc = status_example(running_job=None).to_doc()
    del doc["running_job"], doc["job_result"]["submitter"]
    (tmp_path / "status.json").write_text(json.dumps(doc))
    earlier = read_status(tmp_path)
    assert earlier is not None and not earlier.running_job_known
    text = status_view.format_status(report(earlier))
    assert "  last job  0123456789ab accepted: producing /data" in text and "later" not in text, text
    assert "running_job" not in json.loads(status_view.status_json(report(earlier)))["status"]  # not "none runs"
    # One of this build's that names no running job runs the job it was started with: the answer is to a later one.
    assert "  later     0123456789ab submitted by " in status_view.format_status(report(status_example(running_job=None)))


def test_status_of_a_job_starting_shows_no_answer_of_the_job_before_it_as_a_later_one() -> None:
    """For the ~70 ms a job change takes, the job before it's answer read as "later ... (the job above runs on)"."""
    starting = status_example(running_job=RunningJob(job_id="fedcba987654", submitter=1001, submitted=1700000005.0,
                                                     answer=""))
    text = status_view.format_status(report(starting))
    assert "  job       fedcba987654 submitted by " in text and ": starting" in text, text
    assert "0123456789ab" not in text, text  # the answer of the job before, at 1700000000.0
    refused = dataclasses.replace(starting, job_result=dataclasses.replace(starting.job_result, job_id="aaaabbbbcccc",
                                                                           accepted=False, time=1700000006.0))
    assert "  REFUSED   aaaabbbbcccc" in status_view.format_status(report(refused))  # a later request's: said


def test_status_says_how_many_samples_the_split_holds_where_val_fraction_cut_it() -> None:
    """`--val-fraction 0.1` trains on 1350 of 1500 samples; the status showed only the 1500."""
    def dataset_line(**changes: Any) -> str:
        text = status_view.format_status(report(status_example(), manifest=_manifest(**changes)))
        return next(line for line in text.splitlines() if line.startswith("  dataset "))

    assert dataset_line(val_fraction=0.1) == ("  dataset   /data (1500 samples, 10 classes), split train of 1350 samples "
                                              "(--val-fraction 0.1 holds out 150), batch 64 x 224px, 24 steps/epoch, "
                                              "seed 0")
    assert dataset_line(seed=7).endswith(", seed 7")  # jobs that differ in their seed alone are told apart
    assert ("split val of 150 samples (held out by --val-fraction 0.1), batch"
            in dataset_line(split="val", val_fraction=0.1))
    # The counts are the daemon's own split's (split_members), rounding and all.
    members = {split: len(split_members(1500, split, 1 / 3)) for split in ("train", "val")}
    assert f"split train of {members['train']} samples (--val-fraction {1 / 3!r} holds out {members['val']})" in \
        dataset_line(val_fraction=1 / 3)
    assert "(1500 samples, 10 classes), split train, batch" in dataset_line()  # no --val-fraction: the whole dataset


def test_a_stale_status_says_its_figures_are_as_old_as_its_last_heartbeat() -> None:
    """A SIGSTOPped daemon's status said "trainer pid 777 alive, progress written 0 s ago" as if of now."""
    stale = status_view.format_status(report(status_example(), stale=True, heartbeat_age_s=13.2))
    assert stale.splitlines()[1] == ("  WARNING  no heartbeat for 13 s: the daemon may be stuck or stopped, and the figures below "
                                     "are its last status's, 13 s old or more")
    assert "WARNING" not in status_view.format_status(report(status_example()))


def test_status_of_a_done_daemon_says_what_done_means() -> None:
    """Done: every batch built, while trainers may still read; it resumes nothing at the low-water mark."""
    done, filling = _running_status_text(State.DONE), _running_status_text(State.FILLING)
    assert "state done (every batch of the job's epochs is built; trainers may still be reading)" in done
    assert "builds again at" not in done and "builds again at" in filling
    assert re.search(r"\d+/\d+ batches waiting, \d+ building", done), done


def test_status_says_when_max_buffer_bytes_is_what_limits_the_buffer() -> None:
    """'5/6 batches waiting, state full' left the reader guessing why not 6."""
    narrowed = stream(consumers=(dataclasses.replace(CONSUMER, window=5),), waiting=5)
    capped = _running_status_text(State.FULL, streams=(narrowed,), waiting=5, high_water=6)
    assert "--max-buffer-bytes (max_buffer_bytes in the config), not the high-water mark, limits the buffer: it keeps " \
           "5 of 6 batches (1.0 MiB each) for 1 consumer" in capped  # a service's operator sets the key
    assert "capped" not in _running_status_text(State.FULL)  # window 32 of 32


def test_status_says_the_builds_wait_for_the_storage_and_what_that_means_for_trainers() -> None:
    began = time.time() - 95
    waiting = _running_status_text(storage_wait=dataclasses.replace(STORAGE_WAIT, since=began, ranks_since=(began,)))
    assert re.search(r"storage   the builds have waited 9\d s for the dataset's storage; they resume when it is "
                     r"back, and trainers wait on past their --timeout meanwhile", waiting), waiting
    assert "storage " not in _running_status_text()


def test_status_names_the_ranks_whose_builds_wait_for_the_storage() -> None:
    """With several streams only the named ranks' trainers wait on; a daemon of an earlier build named none."""
    streams = (stream(0), stream(1), stream(2))
    one = _running_status_text(streams=streams, storage_wait=dataclasses.replace(STORAGE_WAIT, ranks=(1,)))
    assert "the builds of rank 1 have waited" in one, one
    assert "and trainers of rank 1 wait on past their --timeout" in one, one
    two = _running_status_text(streams=streams, storage_wait=dataclasses.replace(STORAGE_WAIT, ranks=(0, 2),
                                                                                 ranks_since=(STORAGE_WAIT.since,) * 2))
    assert "the builds of ranks 0,2 have waited" in two and "trainers of ranks 0,2 wait on" in two, two
    every = _running_status_text(streams=streams, storage_wait=dataclasses.replace(STORAGE_WAIT, ranks=None,
                                                                                   ranks_since=None))
    assert "the builds have waited" in every and "and trainers wait on" in every, every


def test_status_says_since_when_each_ranks_builds_wait_for_the_storage(tmp_path: Path) -> None:
    """Rank 0's batches failed 10 minutes ago, rank 2's one: the status said both had waited 10 minutes, and so did
    the view of rank 2's own stream directory, whose trainer's log said otherwise."""
    now = time.time()
    outage = dataclasses.replace(STORAGE_WAIT, since=now - 600, ranks=(0, 2), ranks_since=(now - 600, now - 60))
    streams = (stream(0), stream(1), stream(2))
    whole = _running_status_text(streams=streams, storage_wait=outage)
    assert "the builds of ranks 0,2 have waited 60 s (rank 2) to 600 s (rank 0) for the dataset's storage" in whole, whole
    lock = DaemonLock(tmp_path)
    lock.acquire()  # this test process plays the daemon
    try:
        for rank in range(3):
            (tmp_path / f"rank-0000{rank}").mkdir()
        write_status_at_heartbeat(tmp_path, status_example(pid=os.getpid(), production=production(
            streams=streams, storage_wait=outage)))

        def rank_view(rank: int) -> tuple[str, object]:
            got = status_view.describe_status(tmp_path / f"rank-0000{rank}")
            return status_view.format_status(got), json.loads(status_view.status_json(got))["status"]["storage_wait"]

        text, doc = rank_view(2)
        assert "  storage   the builds have waited 60 s for the dataset's storage" in text, text
        assert doc == {"since": now - 60, "reason": STORAGE_WAIT.reason, "ranks": [2], "ranks_since": [now - 60]}
        text, doc = rank_view(1)  # none of its batches failed: its trainer times out as ever
        assert "  storage " not in text and doc is None, text
        # A daemon of an earlier build kept one time and named no ranks: every rank's wait, since then.
        write_status_at_heartbeat(tmp_path, status_example(pid=os.getpid(), production=production(
            streams=streams, storage_wait=dataclasses.replace(outage, ranks=None, ranks_since=None))))
        assert "  storage   the builds have waited 600 s for the dataset's storage" in rank_view(1)[0]
    finally:
        lock.release()


def test_status_waiting_for_a_job_shows_no_finished_jobs_dataset() -> None:
    manifest = Manifest(dataset_root="/data/old", fingerprint="f", classes=["a", "b"], num_samples=240, split="train",
                        seed=0, batch_size=8, image_size=32, samples_per_epoch=240, steps_per_epoch=30, epochs=None,
                        producer="test")
    waiting = report(status_example(State.WAITING_FOR_JOB, production=None), manifest=manifest)
    assert "240 samples" not in status_view.format_status(waiting)
    assert "240 samples" in status_view.format_status(dataclasses.replace(waiting, status=status_example(State.FILLING)))


def test_status_lists_the_first_undecodable_files() -> None:
    errors = Errors(replaced_samples=7, undecodable_files=7, undecodable=bad_files(7), worker_restarts=0,
                    write_failures=0, progress_file="")
    text = _running_status_text(errors=errors)
    assert "7 bad files" in text and "bad file  /d/c/0.jpg: empty" in text
    assert text.count("  bad file  ") == status_view.SHOWN_BAD_FILES and "and 2 more" in text


def test_the_progress_line_names_the_slowest_consumer_when_consumers_are_listed() -> None:
    alone = _running_status_text(streams=(stream(consumers=(dataclasses.replace(CONSUMER, name=""),)),))
    assert "  progress  trainer at epoch" in alone and "  consumer  " not in alone
    shared = _running_status_text(streams=(stream(consumers=(CONSUMER,)),))
    assert "  progress  slowest holding consumer at epoch" in shared and "  consumer  trial-3 at epoch" in shared


def test_status_says_no_trainer_yet_before_any_trainer_wrote_progress() -> None:
    """It said 'trainer at epoch 0 step 0', as if one were there, stuck at the start."""
    text = status_view.format_status(report(status_example(production=production_without_trainer())))
    assert "  progress  no trainer yet (the buffer starts at epoch 0 step 0)" in text, text
    assert "trainer at epoch" not in text, text
    rank_1_only = production_without_trainer(2).streams[1]
    ranks = status_view.format_status(report(status_example(production=production_without_trainer(
        2, high_water=8, streams=(stream(0), rank_1_only), progress=stream(0).progress, trainer=stream(0).trainer))))
    assert "  progress  slowest holding consumer at epoch 1 step 40" in ranks, ranks  # rank 0 has one
    assert re.search(r"rank 1 .* waiting, no trainer yet", ranks) and "rank 0     [" in ranks, ranks


@pytest.mark.parametrize(("namespace", "named"), [(OURS, "pid 777"), (OURS + 1, "pid 777 of another pid namespace"),
                                                 (None, "pid 777")])
def test_status_says_whether_a_trainers_pid_is_of_this_pid_namespace(runner: CliRunner, tmp_path: Path,
                                                                     namespace: int | None, named: str) -> None:
    """The trainer's pid is its own namespace's, whichever the daemon's is: shown bare to a reader of another one
    (in a third container, or the daemon's), it named no process there, or an unrelated one.  A status without
    the trainer's namespace (an older daemon, a progress document without it) shows the pid as it always did."""
    trainer = dataclasses.replace(TRAINER, pid_namespace=namespace)
    consumer = dataclasses.replace(CONSUMER, trainer=trainer)
    lock = DaemonLock(tmp_path)
    lock.acquire()  # this test process plays the daemon
    try:
        write_status_at_heartbeat(tmp_path, status_example(pid=os.getpid(), production=production(
            trainer=trainer, streams=(stream(trainer=trainer, consumers=(consumer,)),))))
        text = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path)])
        doc = json.loads(runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(tmp_path), "--json"]).output)
    finally:
        lock.release()
    assert text.exit_code == 0, text.output
    assert f"; trainer {named} alive, progress written 0 s ago" in text.output, text.output
    assert f"  consumer  trial-3 at epoch 1 step 40; {named} alive, wrote 0 s ago; window 32" in text.output, text.output
    assert "of another pid namespace" not in text.output.replace(named, ""), text.output  # nothing else said so
    assert doc["command_pid_namespace"] == OURS
    assert doc["status"]["trainer"]["pid_namespace"] == doc["status"]["streams"][0]["consumers"][0]["trainer"][
        "pid_namespace"] == namespace


def test_a_consumer_whose_progress_names_no_pid_is_shown_so(runner: CliRunner, tmp_path: Path) -> None:
    """A progress document of an older writer has no pid: "pid unknown", not "pid None"."""
    consumer = dataclasses.replace(CONSUMER, trainer=dataclasses.replace(TRAINER, pid=None, alive=None))
    lock = DaemonLock(tmp_path)
    lock.acquire()  # this test process plays the daemon
    try:
        write_status_at_heartbeat(tmp_path, status_example(pid=os.getpid(), production=production(
            streams=(stream(consumers=(consumer,)),))))
        text = status_view.format_status(status_view.describe_status(tmp_path))
    finally:
        lock.release()
    assert "  consumer  trial-3 at epoch 1 step 40; pid unknown alive?, wrote 0 s ago; window 32" in text, text


def test_a_stopped_daemons_status_still_names_its_bad_files(tmp_path: Path) -> None:
    """They are what to mend before the next run; the text showed them only while it ran."""
    errors = Errors(replaced_samples=3, undecodable_files=3, undecodable=bad_files(3), worker_restarts=0,
                    write_failures=0, progress_file="")
    write_status(tmp_path, status_example(State.STOPPED, message="stopped: finished",
                                          production=production(errors=errors)))
    text = status_view.format_status(status_view.describe_status(tmp_path))
    assert text.startswith(f"prefetchd on {tmp_path}: not running (last state: stopped: stopped: finished)"), text
    assert "3 replaced samples, 3 bad files" in text and "bad file  /d/c/0.jpg: empty" in text
    write_status(tmp_path, status_example(State.STOPPED, production=production()))  # nothing went wrong: no lines
    assert "errors" not in status_view.format_status(status_view.describe_status(tmp_path))


def test_status_rates_say_their_window_and_consumption_in_images_too() -> None:
    """"produce 382 img/s with 1 worker (0% CPU)" just after the buffer filled read as a contradiction (the rate is
    over 10 s, the CPU share now), and consumption was in batches/s only, beside img/s (a walk reading status)."""
    status = status_example()
    assert status.production is not None
    rates = dataclasses.replace(status.production.rates, consumed_batches_per_s=2.5)
    status = dataclasses.replace(status, production=dataclasses.replace(status.production, rates=rates))
    manifest = _manifest()
    line = next(x for x in status_view.format_status(report(status, manifest=manifest)).splitlines()
                if x.lstrip().startswith("rates"))
    assert (f"consume 2.50 batches/s ({2.5 * manifest.batch_size:.0f} img/s) over the last 10 s; "
            in line and line.endswith("% CPU now")), line


def test_status_counts_one_of_a_thing_in_the_singular() -> None:
    """A 2-core box runs 1 worker by default: `status` says "1 worker", not "1 workers"."""
    def text(n: int) -> str:
        errors = Errors(replaced_samples=n, undecodable_files=n, undecodable=bad_files(n), worker_restarts=n,
                        write_failures=n, progress_file="")
        return _running_status_text(workers=n, errors=errors)

    one, two = text(1), text(2)
    assert "s; 1 worker at " in one and "s; 2 workers at " in two
    assert ("1 replaced sample, 1 bad file, 1 worker restart, 1 failed build\n" in one
            and "2 replaced samples, 2 bad files, 2 worker restarts, 2 failed builds\n" in two)
    # A trainer's rewinds, in --json alone before (a walk): once there was one.
    rewound = _running_status_text(workers=1, errors=Errors(replaced_samples=1, undecodable_files=0, undecodable=(),
                                                            worker_restarts=0, write_failures=0, progress_file="",
                                                            progress_rewinds=2))
    assert "0 failed builds, 2 trainer rewinds (batches built again)\n" in rewound, rewound
    for steps, said in [(1, ", 1 step/epoch"), (2, ", 2 steps/epoch")]:  # a dataset of one batch: "1 steps/epoch"
        manifest = _manifest(steps_per_epoch=steps)
        assert said in status_view.format_status(report(status_example(), manifest=manifest))


def test_a_damaged_status_document_is_reported_not_raised(tmp_path: Path) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    anything = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                            max_leaves=8)
    valid = status_example(production=production(streams=(stream(0), stream(1)))).to_doc()

    @settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(damage=st.dictionaries(st.sampled_from(sorted(valid)), anything, max_size=3))
    def check(damage: dict[str, object]) -> None:
        (tmp_path / "status.json").write_text(json.dumps({**valid, **damage}))
        got = status_view.describe_status(tmp_path)
        assert got.running
        assert got.status is not None or any("status.json" in p for p in got.problems)
        assert status_view.format_status(got).startswith(f"prefetchd on {tmp_path}: running")
        json.loads(status_view.status_json(got))

    lock = DaemonLock(tmp_path)
    lock.acquire()  # this test process plays the daemon, so the whole report is drawn
    try:
        check()
    finally:
        lock.release()


@pytest.mark.parametrize(("waiting", "high"), [(-(10**10), 8), (10**12, 8), (3, 0), (3, -5)])
def test_the_fill_bar_is_bounded_whatever_the_status_says(waiting: int, high: int) -> None:
    # Found by the fuzz test above: a waiting count of -2e10 made a 20 GB string (the OOM killer came).
    assert len(status_view.fill_bar(waiting, high)) == 26


def test_config_show_is_toml_that_reads_back(runner: CliRunner, tmp_path: Path) -> None:
    # A path may hold any character; JSON's escapes of one outside the BMP are no TOML.
    data = tmp_path / 'd "quoted" \\ é 🎉'
    result = runner.invoke(prefetchd_cli.main, ["config", "--show", "--data", str(data), "--batch-size", "64",
                                                "--buffer", str(tmp_path / "bf")])
    assert result.exit_code == 0, result.output
    shown = tomllib.loads(result.output)
    assert shown["data"] == str(data) and shown["batch_size"] == 64
    fields = {f.name for f in dataclasses.fields(DaemonConfig)}
    assert set(shown) <= fields and "workers" in shown
    lines = {line.split(" = ")[0]: line for line in result.output.splitlines() if " = " in line}
    assert "# default:" in lines["workers"] and "usable CPUs" in lines["workers"]
    assert lines["readers"].endswith("# default: a local folder")  # the why, without the value again
    assert "# default: batches of " in lines["high_water"] and "MiB: at most half the free tmpfs" in lines["high_water"]


def test_the_size_of_a_tiny_batch_is_said_in_its_own_unit(runner: CliRunner, tmp_path: Path) -> None:
    """It said "batches of 0.0 MiB"."""
    result = runner.invoke(prefetchd_cli.main, ["config", "--show", "--batch-size", "1", "--image-size", "8",
                                                "--buffer", str(tmp_path / "bf")])
    assert result.exit_code == 0, result.output
    assert re.search(r"# default: batches of [\d.]+ KiB: at most half", result.output), result.output


def test_show_says_what_is_wrong_with_out_or_buffer_instead_of_a_traceback(tmp_path: Path) -> None:
    """A buffer of rank streams, an --out whose folder is missing (more of --out: the test below)."""
    buffer = _show_buffer(tmp_path / "bf")
    ranks = tmp_path / "ranks"
    (ranks / "rank-00000").mkdir(parents=True)
    (ranks / "rank-00001").mkdir()
    result = CliRunner().invoke(cli.show, ["--buffer", str(ranks), "--out", str(tmp_path / "g.png")])
    assert result.exit_code == 1 and f"pass one: --buffer {ranks / 'rank-00000'}" in result.output
    good = CliRunner().invoke(cli.show, ["--buffer", str(buffer), "--out", str(tmp_path / "g.jpg")])
    assert good.exit_code == 0 and (tmp_path / "g.jpg").stat().st_size > 0, good.output
    # A typo in the folder made it (and any folders above it): refused, as prefetchd-train's --metrics-csv is.
    missing = tmp_path / "nonexist" / "deeper"
    result = CliRunner().invoke(cli.show, ["--buffer", str(buffer), "--out", str(missing / "x.png")])
    assert result.exit_code == EXIT_USAGE, result.output
    assert (f"Error: --out {missing / 'x.png'}: the folder {missing} does not exist; create it first, or pass a "
            "path in an existing folder") in result.output
    assert not (tmp_path / "nonexist").exists()


def _show_buffer(buffer: Path, noise: bool = False) -> Path:
    """``buffer`` with a manifest and one waiting batch of 4 images (black, or ``noise``), for `prefetchd show`."""
    import numpy as np

    from prefetchd.buffer_protocol import Manifest
    from prefetchd.buffer_protocol.writer import write_batch

    buffer.mkdir()
    Manifest(dataset_root="/data", fingerprint="f", classes=["a"], num_samples=4, split="train", seed=0,
             batch_size=4, image_size=8, samples_per_epoch=4, steps_per_epoch=1, epochs=1, producer="t").write(buffer)
    images = np.random.default_rng(0).integers(0, 256, (4, 8, 8, 3), np.uint8) if noise else np.zeros((4, 8, 8, 3), np.uint8)
    write_batch(buffer / "e000000-s00000000.batch", images, np.zeros(4, np.int64),
                np.arange(4, dtype=np.int64), epoch=0, step=0, seed=0, producer="t")
    return buffer


def test_show_on_a_full_disk_fails_and_leaves_no_truncated_file(tmp_path: Path, small_tmpfs: Path) -> None:
    """Pillow's JPEG and TIFF writers let ENOSPC pass: `prefetchd show` said it wrote a grid it had cut short
    (exit 0; a user's walk, on a nearly full tmpfs)."""
    buffer = _show_buffer(tmp_path / "bf", noise=True)
    free = os.statvfs(small_tmpfs)
    (small_tmpfs / "fill").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 4096))  # one page left
    for name in ("g.jpg", "g.tif"):
        result = CliRunner().invoke(cli.show, ["--buffer", str(buffer), "--out", str(small_tmpfs / name)])
        assert result.exit_code == 1, (name, result.output)
        assert f"cannot write {small_tmpfs / name}: No space left on device" in result.output, result.output
    assert [p.name for p in small_tmpfs.iterdir()] == ["fill"]


def test_show_through_a_dangling_link_checks_where_it_points_before_reading_the_batch(tmp_path: Path) -> None:
    """A link to a file in a missing folder passed the checks (its own folder is writable) and failed at the
    save, once the batch was read, exit 1 (a user's walk); a bad --out is exit 2 up front."""
    buffer = _show_buffer(tmp_path / "bf")
    (tmp_path / "link.png").symlink_to(tmp_path / "gone" / "g.png")
    result = CliRunner().invoke(cli.show, ["--buffer", str(buffer), "--out", str(tmp_path / "link.png")])
    assert result.exit_code == EXIT_USAGE, result.output
    assert (f"--out {tmp_path / 'link.png'} links to {tmp_path / 'gone' / 'g.png'}: the folder {tmp_path / 'gone'} "
            "does not exist") in result.output, result.output
    (tmp_path / "there.png").symlink_to(tmp_path / "g.png")  # a dangling link to a writable place: written
    result = CliRunner().invoke(cli.show, ["--buffer", str(buffer), "--out", str(tmp_path / "there.png")])
    assert result.exit_code == 0 and (tmp_path / "g.png").stat().st_size > 0, result.output


def test_show_refuses_an_out_it_cannot_write_as_a_bad_value_before_reading_the_batch(tmp_path: Path) -> None:
    """A bad suffix and an unwritable --out exited 1 once the batch was read and drawn (a suffix Pillow only reads,
    .psd, with a traceback), where a missing folder of --out, a bad value as click's own, exits 2 up front."""
    buffer = _show_buffer(tmp_path / "bf")
    (tmp_path / "afile").write_text("")
    (tmp_path / "adir.png").mkdir()
    common = "name a file such as batch.png (common suffixes: .png .jpg .webp .tif .bmp, or any other suffix Pillow "
    for out, message in [
        ("grid", f"--out grid: no suffix, and the suffix picks the image format; {common}"),
        ("b.xyz", "--out b.xyz: Pillow writes no RGB image as '.xyz', and the suffix picks the image format"),
        ("b.psd", "--out b.psd: Pillow writes no RGB image as '.psd'"),  # read, not written
        ("b.xbm", "--out b.xbm: Pillow writes no RGB image as '.xbm'"),  # 1-bit images only
        (str(tmp_path / "afile" / "x.png"), f"--out {tmp_path / 'afile' / 'x.png'}: cannot write in "
                                            f"{tmp_path / 'afile'} (Not a directory); pass a path in a folder you can write"),
        (str(tmp_path / "adir.png"), f"Invalid value for '--out': File '{tmp_path / 'adir.png'}' is a directory"),
        # A trailing slash names a folder; Path dropped it and a file grid.png was written (a walk with odd paths).
        ("grid.png/", "Invalid value for '--out': 'grid.png/' ends in '/', which names a folder; name a file"),
    ]:
        result = CliRunner().invoke(cli.show, ["--buffer", str(buffer), "--out", out])
        assert result.exit_code == EXIT_USAGE and f"Error: {message}" in result.output, (out, result.output)
        assert isinstance(result.exception, SystemExit), result.exception
    # A short list, not every suffix of the ~40 Pillow writes (.jpe .jfif .vst ...), which buried the one to use.
    said = CliRunner().invoke(cli.show, ["--buffer", str(buffer), "--out", "b.xyz"]).output
    assert f"Pillow writes no RGB image as '.xyz', and the suffix picks the image format; {common}can write" in said, said
    assert ".jpe " not in said and ".vst" not in said and len(said) < 400, said
    # Up front: an empty buffer's "no waiting batch" (exit 1) comes only for an --out that can be written.
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(cli.show, ["--buffer", str(tmp_path / "empty"), "--out", str(tmp_path / "b.xyz")])
    assert result.exit_code == EXIT_USAGE and "Pillow writes no RGB image as '.xyz'" in result.output, result.output
    result = CliRunner().invoke(cli.show, ["--buffer", str(tmp_path / "empty"), "--out", str(tmp_path / "g.png")])
    assert result.exit_code == 1 and "has no waiting batch" in result.output, result.output
    missing = CliRunner().invoke(cli.show, ["--buffer", str(tmp_path / "typo"), "--out", str(tmp_path / "g.png")])
    assert missing.exit_code == EXIT_USAGE, missing.output
    assert f"Invalid value for '--buffer': {tmp_path / 'typo'} does not exist" in missing.output, missing.output
    for suffix in (".png", ".tif"):
        good = CliRunner().invoke(cli.show, ["--buffer", str(buffer), "--out", str(tmp_path / f"g{suffix}")])
        assert good.exit_code == 0 and (tmp_path / f"g{suffix}").stat().st_size > 0, good.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir.png", "afile", "bf", "empty", "g.png", "g.tif"]


@pytest.mark.skipif(os.geteuid() != 0, reason="drops to user nobody in a forked child")
def test_show_refuses_an_out_in_a_folder_its_user_cannot_write_before_reading_the_batch(shm_buffer: Path) -> None:
    """A folder without write permission was found only at the save, once the batch was drawn: exit 1.  A file
    there that the user may write is written in place, as ever."""
    os.chmod(shm_buffer, 0o755)
    buffer = _show_buffer(shm_buffer / "bf")
    for path in (buffer, *buffer.iterdir()):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    locked = shm_buffer / "locked"
    locked.mkdir(mode=0o555)
    (locked / "theirs.png").write_bytes(b"")
    os.chmod(locked / "theirs.png", 0o666)
    # Drawn once here, so that what it imports (the command's module, Pillow's plugins and font) is imported
    # before the fork: nobody may not read where the interpreter and its packages live (CI's, under root's home).
    warm = CliRunner().invoke(cli.show, ["--buffer", str(buffer), "--out", str(shm_buffer / "warm.png")])
    assert warm.exit_code == 0, warm.output

    def show_both() -> str:
        said = []
        for out in (locked / "g.png", locked / "theirs.png"):
            result = CliRunner().invoke(cli.show, ["--buffer", str(buffer), "--out", str(out)])
            said.append({"code": result.exit_code, "output": result.output})
        return json.dumps(said)

    said = json.loads(as_nobody(show_both) or "[]")
    assert len(said) == 2, said
    assert said[0]["code"] == EXIT_USAGE, said
    assert (f"Error: --out {locked / 'g.png'}: cannot write in {locked} (Permission denied); pass a path in a folder "
            "you can write") in said[0]["output"], said
    assert said[1]["code"] == 0 and (locked / "theirs.png").stat().st_size > 0, said
    assert sorted(p.name for p in locked.iterdir()) == ["theirs.png"]


def test_config_check_says_when_the_dataset_is_not_there(runner: CliRunner, tmp_path: Path) -> None:
    """Values can be valid while `start` would stop at once at a missing --data: say so."""
    args = ["config", "--buffer", str(tmp_path / "bf"), "--data"]
    missing = runner.invoke(prefetchd_cli.main, [*args, str(tmp_path / "nope")])
    assert missing.exit_code == 0 and f"but data {tmp_path / 'nope'} does not exist (yet)" in missing.output
    (tmp_path / "data").mkdir()
    there = runner.invoke(prefetchd_cli.main, [*args, str(tmp_path / "data")])
    assert there.exit_code == 0 and there.output.strip() == "configuration is valid"
    # A start command line checks as it is: its --log-level was "No such option" (a walk of the docs).
    logged = runner.invoke(prefetchd_cli.main, [*args, str(tmp_path / "data"), "--log-level", "debug"])
    assert logged.exit_code == 0 and logged.output.strip() == "configuration is valid", logged.output


def test_config_check_says_when_the_metrics_textfile_cannot_be_written(runner: CliRunner, shm_buffer: Path) -> None:
    """`config` said "configuration is valid" of a --metrics-textfile the daemon then warned once a minute it could
    not write (a walk as a non-root user): said, not refused, as the data's caveats are."""
    os.chmod(shm_buffer, 0o755)
    args = ["config", "--buffer", str(shm_buffer / "bf"), "--metrics-textfile"]
    missing = runner.invoke(prefetchd_cli.main, [*args, str(shm_buffer / "nope" / "bf.prom")])
    assert missing.exit_code == 0 and " ".join(missing.output.split()) == (
        f"configuration is valid, but this user may not write metrics_textfile {shm_buffer / 'nope' / 'bf.prom'}, so "
        "a daemon run by this user would warn once a minute that it cannot (a service's daemon runs as its unit's "
        f"User=): its folder {shm_buffer / 'nope'} does not exist (the daemon does not create it)"), missing.output
    fine = runner.invoke(prefetchd_cli.main, [*args, str(shm_buffer / "bf.prom")])
    assert fine.exit_code == 0 and fine.output.strip() == "configuration is valid", fine.output
    # A folder, or a name ending in '/', was valid too, and the daemon warned each minute (or wrote bf.prom).
    for folder, said in ((str(shm_buffer), "is a directory"), (f"{shm_buffer / 'bf.prom'}/", "which names a folder")):
        refused = runner.invoke(prefetchd_cli.main, [*args, folder])
        assert refused.exit_code == EXIT_USAGE and said in refused.output, refused.output
    if os.geteuid() != 0:
        return
    theirs = shm_buffer / "textfiles"
    theirs.mkdir(mode=0o755)  # root's: nobody may not write in it

    def check() -> str:
        result = CliRunner().invoke(prefetchd_cli.main, ["config", "--buffer", str(shm_buffer / "nobodys"),
                                                         "--metrics-textfile", str(theirs / "bf.prom")])
        return f"{result.exit_code} {result.output}"

    said = " ".join(as_nobody(check).split())
    assert said.startswith(f"0 configuration is valid, but this user may not write metrics_textfile {theirs / 'bf.prom'}"
                           ), said
    assert f"{theirs}: permission denied: it belongs to root (uid 0)" in said, said


def test_config_check_says_when_start_could_not_import_the_transform(runner: CliRunner, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`config` said "configuration is valid" of a hook module start could not import, or of a name that is no
    callable, which start refused (exit 2; a user's walk)."""
    (tmp_path / "config_check_hooks.py").write_text("NOT_CALLABLE = 1\ndef fine(t, rng):\n    return t\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["config", "--buffer", str(tmp_path / "bf"), "--transform"]
    for hook, said in (("config_check_nosuchmod:fn", "cannot import config_check_nosuchmod (ModuleNotFoundError"),
                       ("config_check_hooks:NOT_CALLABLE", "NOT_CALLABLE is an object of type int, not a callable"),
                       ("config_check_hooks:nope", "config_check_hooks has no attribute 'nope'")):
        result = runner.invoke(prefetchd_cli.main, [*args, hook])
        assert result.exit_code == 0, result.output
        assert result.output.startswith(f"configuration is valid, but transform = {hook!r}: {said}"), result.output
        assert "so `prefetchd start` run by this user would refuse it" in result.output
    fine = runner.invoke(prefetchd_cli.main, [*args, "config_check_hooks:fine"])
    assert fine.exit_code == 0 and fine.output.strip() == "configuration is valid", fine.output


@pytest.mark.skipif(os.geteuid() != 0, reason="plays the service, whose buffer it is, and a user not in its group")
def test_config_check_says_when_this_user_may_not_use_the_buffer(shm_buffer: Path) -> None:
    """`prefetchd config` said "configuration is valid" to a user outside the buffer's group, whose `start` then
    stopped at it.  Said as `status` says it, and not refused (exit 0): the service runs as another user."""
    os.chmod(shm_buffer, 0o755)
    theirs, readable = shm_buffer / "bf", shm_buffer / "ro"
    theirs.mkdir(mode=0o2770)
    os.chmod(theirs, 0o2770)
    os.chown(theirs, 0, 65533)  # as the service's: its user, its group, which nobody is not in
    readable.mkdir(mode=0o755)  # nobody may read it, not write it
    data = shm_buffer / "data"
    data.mkdir(mode=0o755)
    private = shm_buffer / "private"  # 0700: nobody may not enter it, nor so much as ask whether data is there
    (private / "data").mkdir(parents=True, mode=0o755)
    private.chmod(0o700)
    closed = shm_buffer / "closed"  # nobody may not list it
    closed.mkdir(mode=0o700)
    toml = shm_buffer / "bf.toml"
    toml.write_text(f'buffer = "{theirs}"\ndata = "{data}"\n')
    os.chmod(toml, 0o644)
    runs = {"flag": ["--buffer", str(theirs), "--data", str(data)], "file": ["--config", str(toml)],
            "show": ["--config", str(toml), "--show"], "ro": ["--buffer", str(readable), "--data", str(data)],
            "missing": ["--buffer", str(theirs), "--data", str(shm_buffer / "nope")],
            "private": ["--buffer", str(readable / "bf"), "--data", str(private / "data")],
            "closed": ["--buffer", str(readable / "bf"), "--data", str(closed)]}
    warm = CliRunner().invoke(prefetchd_cli.main, ["config", *runs["show"]])  # imported before the fork (as_nobody)
    assert warm.exit_code == 0 and warm.stdout.startswith("# effective prefetchd configuration"), warm.output

    def check_all() -> str:
        said = {}
        for name, args in runs.items():
            result = CliRunner().invoke(prefetchd_cli.main, ["config", *args])
            said[name] = {"code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr}
        return json.dumps(said)

    said = json.loads(as_nobody(check_all) or "{}")
    assert set(said) == set(runs), said
    assert all(answer["code"] == 0 for answer in said.values()), said
    group = _group_name(65533) or "gid 65533"
    why = (f"{theirs}: permission denied: it belongs to root (uid 0) and group {group} (mode 2770), and nobody "
           f"(uid 65534) is not in that group; join it (`sudo usermod -aG {group.removeprefix('gid ')} nobody`, which "
           "takes effect at the next login), or ask root (uid 0) for access")
    caveat = (f"this user may not use buffer {theirs}, so `prefetchd start` run by this user would stop at it (a "
              f"service's daemon runs as its unit's User=): {why}")
    for name in ("flag", "file"):
        assert " ".join(said[name]["stdout"].split()) == f"configuration is valid, but {caveat}", said[name]
    assert said["show"]["stdout"].startswith("# effective prefetchd configuration"), said["show"]
    assert f"# note: {caveat}" in " ".join(said["show"]["stderr"].split()), said["show"]
    assert said["ro"]["stdout"].startswith(f"configuration is valid, but this user may not use buffer {readable}"), said
    assert (f"{readable}: permission denied: it belongs to root (uid 0) and group {_group_name(0) or 'gid 0'} (mode "
            "0755): its group may not write it either; ask root (uid 0) for access") in said["ro"]["stdout"], said["ro"]
    assert " ".join(said["missing"]["stdout"].split()) == (
        f"configuration is valid, but data {shm_buffer / 'nope'} does not exist (yet): `prefetchd start` would stop "
        f"at it; and {caveat}"), said["missing"]
    # A folder on the way that nobody may not enter was a PermissionError's traceback; one it may not list, "valid".
    for name, data_in, where in (("private", private / "data", private), ("closed", closed, closed)):
        assert " ".join(said[name]["stdout"].split()).startswith(
            f"configuration is valid, but this user may not read data {data_in}, so `prefetchd start` run by this "
            f"user would stop at it (a service's daemon runs as its unit's User=): {where}: permission denied: it "
            f"belongs to root (uid 0) and group {_group_name(0) or 'gid 0'} (mode 0700): its group may not read it "
            "either; ask root (uid 0) for access;"), said[name]


def test_config_show_says_the_index_cache_default_is_the_callers_not_the_services(
        runner: CliRunner, shm_buffer: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`config --show` of a service's config, run by its admin, showed the admin's ~/.cache as the default
    index_cache, where the unit's daemon uses $CACHE_DIRECTORY (/var/cache/prefetchd): now labelled so.  A path
    with a space lost its first word from the comment."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "Jo Doe"))
    args = ["config", "--show", "--buffer", str(shm_buffer)]
    outside = runner.invoke(prefetchd_cli.main, args)
    assert outside.exit_code == 0, outside.output
    line = next(line for line in outside.stdout.splitlines() if line.startswith("index_cache = "))
    assert line == (f'index_cache = "{tmp_path / "Jo Doe" / "prefetchd"}"  # default: this user\'s cache folder; the '
                    "systemd unit's daemon uses $CACHE_DIRECTORY instead, which its CacheDirectory= sets to "
                    "/var/cache/prefetchd"), line
    monkeypatch.setenv("CACHE_DIRECTORY", "/var/cache/prefetchd")  # as the unit sets it
    inside = runner.invoke(prefetchd_cli.main, args)
    assert 'index_cache = "/var/cache/prefetchd"  # default: $CACHE_DIRECTORY, from systemd\n' in inside.stdout


def test_config_check_refuses_a_high_water_mark_start_refuses(runner: CliRunner, shm_buffer: Path) -> None:
    """`prefetchd config` said "valid" for a config whose `start` then failed with exit 2, which the systemd unit
    does not restart (review)."""
    (shm_buffer / "data").mkdir()
    args = ["config", "--buffer", str(shm_buffer / "not" / "yet"), "--data", str(shm_buffer / "data"), "--batch-size",
            "4096", "--image-size", "512", "--high-water", "100"]
    refused = runner.invoke(prefetchd_cli.main, args)
    assert refused.exit_code == 2 and "high_water 100 x 3.0 GiB batches" in refused.output, refused.output
    assert "lower --high-water" in refused.output and not (shm_buffer / "not").exists()


@pytest.mark.parametrize(
    ("toml", "args", "needle"),
    [
        ("", ["--batch-size", "0"], "--batch-size 0: must be at least 1"),
        ("", ["--val-fraction", "2"], "--val-fraction 2: must be at most 1"),
        ("", ["--transform", "nocolon"], "--transform nocolon: expected 'package.module:callable'"),
        ("batch_size = 0\n", [], "j.toml: batch_size = 0: must be at least 1"),
        ("transform = 'nocolon'\n", [], "j.toml: transform = 'nocolon': expected"),
    ],
)
def test_submit_refuses_a_bad_setting_before_it_writes_the_job(
    runner: CliRunner, tmp_path: Path, toml: str, args: list[str], needle: str,
) -> None:
    """By the daemon's rule, at once: the daemon used to be the first to refuse it, or nobody while none ran."""
    job = tmp_path / "j.toml"
    job.write_text(toml)
    buffer = tmp_path / "bf"
    result = runner.invoke(prefetchd_cli.main, ["submit", "--buffer", str(buffer), "--config", str(job),
                                                "--data", str(tmp_path / "data"), *args])
    assert result.exit_code == EXIT_USAGE and needle in result.output, result.output
    assert not buffer.exists()  # no job.json, no buffer made for it


def test_submit_refuses_a_dataset_that_holds_the_buffer_before_it_writes_the_job(runner: CliRunner,
                                                                                  tmp_path: Path) -> None:
    """The daemon refuses such a job (its config's rule); said at once, as for any bad setting."""
    buffer = tmp_path / "bf"
    result = runner.invoke(prefetchd_cli.main, ["submit", "--buffer", str(buffer), "--data", str(tmp_path)])
    said = " ".join(result.output.split())
    assert result.exit_code == EXIT_USAGE and f"buffer {buffer} is inside the dataset {tmp_path}" in said, said
    assert not buffer.exists()


def test_submit_to_a_ranks_stream_directory_is_refused_at_once(runner: CliRunner, tmp_path: Path) -> None:
    """Its job.json no daemon reads: submit waited out --timeout (60 s) and exited 1, the file left behind (a walk of
    the docs against the commands); stop and config refuse such a folder at once."""
    buffer = tmp_path / "bf"
    (buffer / "rank-00001").mkdir(parents=True)
    (buffer / "daemon.lock").write_text("1\n")  # as a daemon of two ranks leaves it: its buffer owns the ranks
    result = runner.invoke(prefetchd_cli.main, ["submit", "--buffer", str(buffer / "rank-00001"), "--data",
                                                str(tmp_path / "data"), "--timeout", "30"])
    said = " ".join(result.output.split())
    assert result.exit_code == EXIT_USAGE, said
    assert (f"{buffer / 'rank-00001'} is a rank's stream directory of the daemon on {buffer}, which takes jobs for all "
            f"its ranks in {buffer}: run `prefetchd submit --buffer {buffer} ...` (nothing written)") in said, said
    assert os.listdir(buffer / "rank-00001") == []
    # Named through a folder not there and '..': it made that folder in the buffer and wrote the job (a walk).
    through = buffer / "nx" / ".." / "rank-00001"
    result = runner.invoke(prefetchd_cli.main, ["submit", "--buffer", str(through), "--data", str(tmp_path / "data")])
    assert result.exit_code == EXIT_USAGE and "is a rank's stream directory of the daemon on" in result.output, \
        result.output
    assert sorted(os.listdir(buffer)) == ["daemon.lock", "rank-00001"] and os.listdir(buffer / "rank-00001") == []


def test_a_submit_no_daemon_answers_exits_3_and_leaves_the_job_for_one(runner: CliRunner, tmp_path: Path) -> None:
    """A mistyped --buffer used to exit 0, as an accepted job does: a script could not tell them apart."""
    buffer = tmp_path / "mistyped"
    result = runner.invoke(prefetchd_cli.main, ["submit", "--buffer", str(buffer), "--data", str(tmp_path / "data"),
                                                "--timeout", "2"])
    assert result.exit_code == EXIT_NOT_RUNNING == 3, result.output
    assert f"no daemon owns {buffer} yet" in result.output and "check the path" in result.output, result.output
    assert (buffer / "job.json").is_file()  # for a daemon started on it later, which adopts it


@pytest.mark.skipif(os.geteuid() != 0, reason="drops to user nobody in a forked child")
def test_submit_to_a_buffer_it_may_not_create_says_so_and_exits_4(shm_buffer: Path) -> None:
    """A mistyped --buffer under a folder the user may not write ended in mkdir's PermissionError traceback, exit 1."""
    os.chmod(shm_buffer, 0o755)
    theirs = shm_buffer / "theirs"
    theirs.mkdir(mode=0o755)
    targets = (theirs / "typo", theirs / "typo" / "deeper")

    def submit_both() -> str:
        said = []
        for buffer in targets:
            result = CliRunner().invoke(prefetchd_cli.main, ["submit", "--buffer", str(buffer), "--data",
                                                             str(shm_buffer / "data"), "--timeout", "1"])
            said.append({"code": result.exit_code, "output": result.output, "exception": repr(result.exception)})
        return json.dumps(said)

    said = json.loads(as_nobody(submit_both) or "[]")
    assert len(said) == 2, said
    why = (f"cannot create it: {theirs}: permission denied: it belongs to root (uid 0) and group "
           f"{_group_name(0) or 'gid 0'} (mode 0755): its group may not write it either; ask root (uid 0) for access")
    for buffer, answer in zip(targets, said):
        assert answer["code"] == EXIT_NO_ACCESS, answer
        assert answer["output"].startswith(f"cannot submit a job to {buffer} (nothing written): "), answer
        assert why in " ".join(answer["output"].split()), answer
        assert "Traceback" not in answer["output"] and "PermissionError" not in answer["exception"], answer
    assert list(theirs.iterdir()) == []
    # What no access check foresees (a file where a folder would be made; a read-only filesystem) is said alike.
    (shm_buffer / "afile").write_bytes(b"")
    buffer = shm_buffer / "afile" / "x" / "bf"
    result = CliRunner().invoke(prefetchd_cli.main, ["submit", "--buffer", str(buffer), "--data",
                                                     str(shm_buffer / "data"), "--timeout", "1"])
    assert result.exit_code == EXIT_NO_ACCESS, result.output
    assert (f"cannot submit a job to {buffer} (nothing written): cannot create it: {buffer}: Not a "
            "directory") in result.output, result.output


@pytest.mark.skipif(os.geteuid() != 0, reason="plays the service, whose buffer it is, and a user not in its group")
def test_a_user_outside_the_buffers_group_is_told_whose_it_is_and_how_to_join(shm_buffer: Path) -> None:
    """A --group-access buffer (2770) read by a user not in its group: click's "Directory ... is not readable"
    with exit 2, which `stop` documents for a rank's stream directory, and `status --json` printed no JSON.
    `stop` said nothing of the daemon that holds the lock.  Each now says whose the buffer is and what to do;
    `show` too, of the buffer and of a rank's stream directory in it (which click said did not exist)."""
    importlib.import_module("prefetchd.daemon.show")  # before the fork (as_nobody): `show` imports it when it runs

    os.chmod(shm_buffer, 0o755)
    buffer = shm_buffer / "bf"
    buffer.mkdir()
    (buffer / "rank-00000").mkdir()
    os.chmod(buffer, 0o2770)
    os.chown(buffer, 0, 65533)  # as the service's: its user, its group, which nobody is not in
    name = _group_name(65533)
    commands = {"status": ["status"], "json": ["status", "--json"], "stop": ["stop", "--timeout", "1"],
                "submit": ["submit", "--data", str(shm_buffer / "data"), "--timeout", "1"],
                "show": ["show", "--out", str(shm_buffer / "g.png")]}

    def as_outsider() -> str:
        said = {}
        for name, args in [*commands.items(), ("rank", ["show", "--buffer", str(buffer / "rank-00000")])]:
            result = CliRunner().invoke(prefetchd_cli.main, [*args, "--buffer", str(buffer)] if name != "rank" else args)
            said[name] = {"code": result.exit_code, "output": result.output, "exception": repr(result.exception)}
        return json.dumps(said)

    with owned(buffer):  # a daemon runs on it
        said = json.loads(as_nobody(as_outsider) or "{}")
    assert set(said) == {*commands, "rank"}, said
    why = (f"{buffer}: permission denied: it belongs to root (uid 0) and group {name or 'gid 65533'} (mode 2770), and "
           f"nobody (uid 65534) is not in that group; join it (`sudo usermod -aG {name or 65533} nobody`, which takes "
           "effect at the next login), or ask root (uid 0) for access")
    for name, expected in (("status", EXIT_NO_ACCESS), ("json", EXIT_NO_ACCESS), ("stop", 1), ("submit", EXIT_NO_ACCESS),
                           ("show", EXIT_NO_ACCESS), ("rank", EXIT_NO_ACCESS)):
        assert said[name]["code"] == expected, (name, said[name])
        if name != "stop":  # joining the group lets one read, not stop the daemon (a review)
            assert why in " ".join(said[name]["output"].split()), (name, said[name])
        assert "not readable" not in said[name]["output"], (name, said[name])
    assert said["status"]["output"].startswith(f"prefetchd on {buffer}: cannot be read by this user"), said["status"]
    doc = json.loads(said["json"]["output"])
    assert doc["readable"] is False and doc["buffer"] == str(buffer) and doc["status"] is None, doc
    # Unknown, as the text says; it was false (a review), and stale false, served true (a monitoring walk).
    assert doc["running"] is doc["stale"] is doc["served"] is doc["ended_unsaid"] is None, doc
    assert [why in " ".join(p.split()) for p in doc["problems"]] == [True], doc
    assert " ".join(said["stop"]["output"].split()) == (
        f"cannot stop the daemon on {buffer}, if one runs: this user may not read {buffer}, which belongs to root "
        "(uid 0); only root may stop it (`sudo prefetchd stop --buffer "
        f"{buffer}`); a service's daemon stops with `systemctl stop` of its unit"), said["stop"]
    assert said["submit"]["output"].startswith(f"cannot submit a job to {buffer} (nothing written):"), said["submit"]
    assert said["show"]["output"].startswith(f"cannot show a batch of {buffer}:"), said["show"]
    assert said["rank"]["output"].startswith(f"cannot show a batch of {buffer / 'rank-00000'}:"), said["rank"]
    assert sorted(os.listdir(buffer)) == [LOCK, "rank-00000"]  # no job.json
    assert not (shm_buffer / "g.png").exists()
    # One added to the group (here: nobody's own) after the session began reads it only once logged in again.
    os.chown(buffer, 0, NOBODY)
    said = json.loads(as_nobody(as_outsider, gid=65533) or "{}")
    assert [said[name]["code"] for name in commands] == [EXIT_NO_ACCESS, EXIT_NO_ACCESS, 1, EXIT_NO_ACCESS,
                                                         EXIT_NO_ACCESS], said
    assert (f"nobody (uid 65534) joined that group after this session began: log in again (or run "
            f"`newgrp {_group_name(NOBODY) or NOBODY}`)") in " ".join(said["status"]["output"].split()), said


def _group_name(gid: int) -> str | None:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return None


@pytest.mark.parametrize("command", ["stop", "submit"])
def test_a_negative_timeout_is_refused(runner: CliRunner, shm_buffer: Path, command: str) -> None:
    result = runner.invoke(prefetchd_cli.main, [command, "--buffer", str(shm_buffer), "--timeout", "-5"])
    assert result.exit_code == 2 and "--timeout" in result.output and "-5" in result.output, result.output


def _manifest_of(cfg: DaemonConfig) -> Manifest:
    """The manifest a daemon with ``cfg`` writes, as far as the job's identity goes (``job_command`` reads it)."""
    return Manifest(dataset_root=str(cfg.data), fingerprint="f", classes=["a"], num_samples=90, split=cfg.split,
                    seed=cfg.seed, batch_size=cfg.batch_size, image_size=cfg.image_size, samples_per_epoch=30,
                    steps_per_epoch=1, epochs=cfg.epochs, producer="p", val_fraction=cfg.val_fraction,
                    augmentation=cfg.augmentation, drop_last=cfg.drop_last, world_size=cfg.world_size)


def test_the_restart_command_a_trainer_prints_starts_the_same_job(runner: CliRunner, tmp_path: Path) -> None:
    """The loader's "Restart it with `prefetchd start ...`" (``job_command``), from the manifest the
    daemon wrote, read back by `prefetchd start`'s own flags: the same job identity. --val-fraction 1/3
    was written as 0.333333 (another split, refused as another job), and color jitters that ``:g``
    rounded to one string were one job's identity, though they make other images."""
    pytest.importorskip("torch")  # the trainer package imports it (CI's Python 3.10 stage has none)
    from prefetchd.trainer.job_command import job_command

    first = DaemonConfig(buffer=tmp_path / "bf", data=str(tmp_path / "data"), val_fraction=1 / 3,
                         batch_size=48, image_size=40, seed=7, color_jitter=0.30000000000000004,
                         scale_jitter="44,64", transform="pkg.mod:fn", max_image_pixels=10**8, drop_last=True,
                         epochs=5)
    assert first.augmentation != dataclasses.replace(first, color_jitter=0.3).augmentation
    assert dataclasses.replace(first, color_jitter=1.0).augmentation.startswith("color_jitter=1;")  # as before

    command = job_command(_manifest_of(first), tmp_path / "bf").split()
    assert command[:4] == ["prefetchd", "start", "--buffer", str(tmp_path / "bf")]
    result = runner.invoke(prefetchd_cli.main, ["config", "--show", *command[2:]])
    assert result.exit_code == 0, result.output
    (tmp_path / "shown.toml").write_text(result.output)
    again = DaemonConfig(**load_toml(tmp_path / "shown.toml"))
    assert _manifest_of(again).identity_diff(_manifest_of(first)) == [], command


def test_the_submit_command_a_trainer_prints_gives_the_job_over_the_daemons_own_settings(
        runner: CliRunner, tmp_path: Path) -> None:
    """The `prefetchd submit ... --replace` that a StateMismatch and a JobReplaced advise (``job_command``): a
    setting it leaves out is the daemon's own, so a job of seed 0 submitted to a service whose config says
    `seed = 7` came back as seed 7, and the same StateMismatch, round and round.  Over a config that sets
    every identity setting otherwise, the command's flags give the job back."""
    pytest.importorskip("torch")  # the trainer package imports it (CI's Python 3.10 stage has none)
    from prefetchd.trainer.job_command import job_command

    job = DaemonConfig(buffer=tmp_path / "bf", data=str(tmp_path / "data"), batch_size=48, image_size=40, epochs=5)
    (tmp_path / "service.toml").write_text('seed = 7\nsplit = "val"\nworld_size = 2\nranks = "1"\ndrop_last = true\n')
    command = job_command(_manifest_of(job), tmp_path / "bf", "submit").split()
    assert command[:4] == ["prefetchd", "submit", "--buffer", str(tmp_path / "bf")]
    result = runner.invoke(prefetchd_cli.main, ["config", "--show", "--config", str(tmp_path / "service.toml"),
                                                *command[2:]])
    assert result.exit_code == 0, result.output
    (tmp_path / "shown.toml").write_text(result.output)
    again = DaemonConfig(**load_toml(tmp_path / "shown.toml"))
    assert _manifest_of(again).identity_diff(_manifest_of(job)) == [], command
    assert again.local_ranks == (0,), command


def test_class_names_the_grid_cannot_draw_are_spelled_as_escapes() -> None:
    """Pillow's default font draws ASCII only: "café" and a Latin-1 folder name both read "caf" and a box (a user's
    walk)."""
    from prefetchd.daemon.show import drawable

    latin1 = b"caf\xe9".decode("utf-8", "surrogateescape")  # as os.listdir gives a Latin-1 folder name
    names = ["cat", "n01440764", "café", latin1, "日本", "line\nbreak", "🐱cat"]
    shown = [drawable(n) for n in names]
    assert shown == ["cat", "n01440764", "caf\\xe9", "caf\\udce9", "\\u65e5\\u672c", "line\\nbreak", "\\U0001f431cat"]
    assert all(s.isascii() and s.isprintable() for s in shown) and len(set(shown)) == len(shown)


def test_stop_under_a_folder_this_user_may_not_enter_names_the_buffer_to_stop_with_sudo(shm_dir: Path) -> None:
    """It advised `sudo prefetchd stop --buffer /root` for a buffer /root/bf: the folder that stops the user, not the
    buffer (a walk as a non-root user)."""
    import contextlib
    import io

    from prefetchd.cli import main

    shm_dir.chmod(0o755)
    private = shm_dir / "private"
    private.mkdir(mode=0o700)

    def stop() -> str:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                main.main(["stop", "--buffer", str(private / "bf")], prog_name="prefetchd")
            except SystemExit as exc:
                return f"exit {exc.code}: {' '.join(err.getvalue().split())}"
        return "no exit"

    said = as_nobody(stop)
    assert said.startswith(f"exit 1: cannot stop the daemon on {private / 'bf'}, if one runs: this user may not read "
                           f"{private}, which belongs to root (uid 0); only root may stop it (`sudo prefetchd stop "
                           f"--buffer {private / 'bf'}`)"), said


# -- paths as users give them (a walk with odd paths) ----------------------------------------


@pytest.mark.parametrize("command", ["start", "config", "status", "stop", "show", "submit"])
def test_a_buffer_path_no_daemon_can_keep_is_refused_by_every_command(runner: CliRunner, captured: list[DaemonConfig],
                                                                     shm_dir: Path, command: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``--buffer ""`` (an unset variable) was the working folder: start filled it with batches among the user's
    files.  A name past 255 bytes was an OSError traceback in status, stop, show and submit.  A path that left no
    room below it for the buffer's files started a daemon that failed every batch and retried for good."""
    monkeypatch.chdir(shm_dir)
    data = ["--data", str(shm_dir)] if command in ("start", "submit", "config") else []
    deep = shm_dir / "/".join(["d" * 250] * 16)
    for buffer, said in (("", "an empty path (an unset variable?); pass the buffer folder, e.g. /dev/shm/bf"),
                         (str(shm_dir / ("x" * 256)), "is 256 bytes long, more than the 255 a file name may have"),
                         (str(deep), f"the path is {len(str(deep))} bytes long, and the daemon's files in it take up to")):
        result = runner.invoke(prefetchd_cli.main, [command, "--buffer", buffer, *data])
        assert result.exit_code == EXIT_USAGE, (buffer[:80], result.output)
        assert said in " ".join(result.output.split()), result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert captured == [] and sorted(os.listdir(shm_dir)) == []


def test_a_buffer_in_a_config_file_is_held_to_the_same(tmp_path: Path) -> None:
    """A file's `buffer = ""` was the file's own folder; `buffer = "~/b"` a folder named ~ beside the file, where a
    trainer given the same ~/b looked in the home folder."""
    toml = tmp_path / "bf.toml"
    toml.write_text('buffer = ""\n')
    with pytest.raises(ConfigError, match=r"bf.toml: buffer = '': an empty path \(an unset variable\?\)"):
        load_toml(toml)
    toml.write_text('buffer = "~/b"\nmetrics_textfile = "~/m.prom"\n')
    values = load_toml(toml)
    assert values["buffer"] == Path.home() / "b" and values["metrics_textfile"] == Path.home() / "m.prom", values


def test_a_tilde_the_shell_left_is_the_home_folder_as_the_loader_takes_it(runner: CliRunner,
                                                                         captured: list[DaemonConfig],
                                                                         shm_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``--buffer=~/bf`` (bash expands no ~ after '='): start made ./~/bf, where BufferLoader("~/bf") looked in the
    home folder."""
    from prefetchd.trainer.wait_bounds import buffer_path

    monkeypatch.setenv("HOME", str(shm_dir / "home"))
    monkeypatch.chdir(shm_dir)
    (shm_dir / "ds").mkdir()
    result = runner.invoke(prefetchd_cli.main, ["start", "--buffer=~/bf", "--data", str(shm_dir / "ds")])
    assert result.exit_code == 0, result.output
    assert captured[0].buffer == shm_dir / "home" / "bf" == buffer_path("~/bf"), captured
    assert not (shm_dir / "~").exists()


def test_a_dotdot_after_a_link_is_where_the_kernel_takes_it(runner: CliRunner, shm_dir: Path) -> None:
    """``links/parent/../ds`` with ``parent`` a link elsewhere: the kernel opens the ds beside the link's target,
    normpath named links/ds, so start, config and submit said the data "does not exist"; a file was made through
    such a path but its probe unlinked at the lexical path (--checkpoint-dir, show --out: "cannot write there")."""
    from prefetchd.locations import normalize, probe_folder

    real = shm_dir / "real"
    (real / "sub").mkdir(parents=True)
    (real / "ds").mkdir()
    (shm_dir / "links").mkdir()
    (shm_dir / "links" / "parent").symlink_to(real / "sub")
    through = shm_dir / "links" / "parent" / ".." / "ds"
    assert os.path.isdir(through)
    assert normalize(str(through)) == str(real / "ds")
    probe_folder(through, "x")
    assert os.listdir(real / "ds") == []
    result = runner.invoke(prefetchd_cli.main, ["config", "--buffer", str(shm_dir / "bf"), "--data", str(through)])
    assert result.exit_code == 0 and result.output.strip() == "configuration is valid", result.output


def test_debug_logging_is_prefetchds_own() -> None:
    """--log-level debug logged watchdog's three lines per status.json write and Pillow's PNG chunks: 30 lines each
    10 s of an idle daemon, and not one of prefetchd's (a walk reading the log).  A real interpreter: pytest's
    handlers on the root logger would make basicConfig do nothing."""
    code = ("import logging\n"
            "from prefetchd.daemon.logs import setup_logging\n"
            "setup_logging('debug')\n"
            "logging.getLogger('watchdog.observers.inotify').debug('their noise')\n"
            "logging.getLogger('PIL.PngImagePlugin').info('their info')\n"
            "logging.getLogger('prefetchd.daemon.main').debug('our debug')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "our debug" in done.stderr and "their info" in done.stderr and "their noise" not in done.stderr, done.stderr


def test_status_keeps_a_path_with_a_newline_on_one_line(runner: CliRunner, shm_dir: Path) -> None:
    """A buffer (or dataset, or bad file) path with a newline broke status's lines in two, and its terminal escapes
    reached the terminal; the log writes them out, and so does status now (a walk with odd paths)."""
    buffer = shm_dir / "b\nuf\x1b[31m"
    buffer.mkdir()
    result = runner.invoke(prefetchd_cli.main, ["status", "--buffer", str(buffer)])
    assert result.exit_code == EXIT_NOT_RUNNING, result.output
    assert result.output.splitlines()[0] == f"prefetchd on {shm_dir}/b\\nuf\\x1b[31m: not running", result.output
    assert "\x1b" not in result.output
    # So do stop's and config's answers, which printed them raw (a regression walk: the terminal turned red).
    stopped = runner.invoke(prefetchd_cli.main, ["stop", "--buffer", str(buffer / "zz")])
    assert stopped.exit_code == EXIT_NOT_RUNNING and stopped.output == (
        f"{shm_dir}/b\\nuf\\x1b[31m/zz does not exist, so no daemon runs on it; check the path (a daemon started a "
        "moment ago makes it as it takes the buffer: stop it once `prefetchd status` says it runs)\n"), stopped.output
    checked = runner.invoke(prefetchd_cli.main, ["config", "--buffer", str(shm_dir / "bf"), "--data", str(buffer / "d")])
    assert checked.exit_code == 0 and len(checked.output.splitlines()) == 1 and "\x1b" not in checked.output, \
        checked.output
    # And click's own errors, which quote a bad value (a refusal of show's --buffer, a bad --out).
    for args in (["show", "--buffer", str(buffer / "zz")], ["show", "--buffer", str(buffer), "--out", f"{buffer}/x"]):
        refused = runner.invoke(prefetchd_cli.main, args)
        error = refused.output.splitlines()[-1]
        assert refused.exit_code == EXIT_USAGE and error.startswith("Error: ") and f"{shm_dir}/b\\nuf\\x1b[31m" in error \
            and "\x1b" not in refused.output, refused.output


@pytest.mark.parametrize("args", [
    ["config", "--buffer", "BF", "--metrics-textfile", ""],  # a daemon's internal error at its first status
    ["config", "--buffer", "BF", "--index-cache", ""],  # the working folder
    ["config", "--buffer", "BF", "--data", ""],  # likewise
    ["pack", "", "OUT"],
    ["pack", "SRC", ""],
    ["demo", "--workdir", ""],  # its files among the user's
])
def test_an_empty_path_is_refused_as_one(runner: CliRunner, shm_dir: Path, args: list[str]) -> None:
    """"" (an unset variable) for a path was the working folder: --metrics-textfile "" passed config, then the
    daemon's first status was an internal error (exit 1, restarted by the unit; a regression walk)."""
    args = [{"BF": str(shm_dir / "bf"), "OUT": str(shm_dir / "out"), "SRC": str(shm_dir)}.get(a, a) for a in args]
    result = runner.invoke(prefetchd_cli.main, args)
    assert result.exit_code == EXIT_USAGE, result.output
    assert "an empty path (an unset variable?); give the path, or leave it out" in result.output, result.output


def test_an_empty_path_in_a_config_file_is_refused_as_one(tmp_path: Path) -> None:
    """It was "expected Path" (index_cache, metrics_textfile: the value is a path, empty), or the file's folder."""
    toml = tmp_path / "bf.toml"
    for key in ("index_cache", "metrics_textfile", "data"):
        toml.write_text(f'{key} = ""\n')
        with pytest.raises(ConfigError, match=rf"bf.toml: {key} = '': an empty path \(an unset variable\?\)"):
            load_toml(toml)


def test_a_tilde_the_shell_left_in_packs_paths_is_the_home_folder(runner: CliRunner, shm_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`pack ds '~/packed'` made a folder named ~ in the working one, as --buffer=~/bf did (a regression walk)."""
    monkeypatch.setenv("HOME", str(shm_dir / "home"))
    monkeypatch.chdir(shm_dir)
    (shm_dir / "home").mkdir()
    result = runner.invoke(prefetchd_cli.main, ["pack", "~/nothing-here", "~/packed"])
    assert f"{shm_dir / 'home' / 'nothing-here'}" in result.output and "~" not in result.output, result.output
    assert not (shm_dir / "~").exists()


def test_start_from_a_deleted_folder_says_so(tmp_path: Path, shm_dir: Path) -> None:
    """Started from a folder deleted meanwhile, the daemon ended in a traceback from the worker server's start
    (multiprocessing asks for the current folder) that did not name the folder (a walk of job control)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    argv = shlex.join([sys.executable, "-m", "prefetchd", "start", "--buffer", str(shm_dir / "bf"), "--data",
                       str(tmp_path)])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(["sh", "-c", f"cd {shlex.quote(str(gone))} && rmdir {shlex.quote(str(gone))} && exec {argv}"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2, done.stderr
    assert "the current folder was deleted; cd to one that exists" in done.stderr and "Traceback" not in done.stderr
    assert not (shm_dir / "bf").exists()
