"""Starting a `prefetchd start` process from another program, waiting until it serves, and
stopping it: the trainer's --spawn-daemon, `prefetchd bench`, `prefetchd demo`, tools/ and
the tests all do it the same way.

::

    argv = start_argv(buffer, {"data": root, "batch_size": 64, "reset": True, "log_level": "warning"})
    since = time.time()
    proc = launch(argv, log=work / "daemon.log")
    wait_ready(proc, buffer, since=since, timeout=60)   # DaemonExited / DaemonNotReady
    ...
    stop_daemon_process(proc, 30)

Options are plain values keyed by the daemon's option names (``batch_size`` becomes
``--batch-size``), not a DaemonConfig: the trainer launches daemons and must not import
prefetchd.daemon, which pulls in the decoding stack.  The daemon validates them, so a
wrong name or value fails where `prefetchd start` reports it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefetchd.buffer_protocol import daemon_pid
from prefetchd.buffer_protocol.layout import MANIFEST_NAME

READY_POLL_SECONDS = 0.05
# File timestamps come from the kernel's coarse clock (a scheduler tick behind), so a manifest
# written just after time.time() can carry an mtime a little before it.
MTIME_SLACK_SECONDS = 0.05


class LaunchError(Exception):
    """A daemon this process started did not come to serve its buffer."""


class DaemonExited(LaunchError):
    """The daemon exited before it served its buffer."""


class DaemonNotReady(LaunchError):
    """The daemon still runs but did not serve its buffer in time."""


def buffer_root(need: int = 0) -> Path:
    """Where a program that starts its own daemon (demo, bench, tools) puts the buffer: /dev/shm,
    the RAM disk the daemon is meant for, or the temp folder where there is none to write to (or
    it has less than twice ``need`` bytes free)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and (not need or shutil.disk_usage(shm).free > 2 * need):
        return shm
    return Path(tempfile.gettempdir())


def option_args(options: Mapping[str, Any]) -> list[str]:
    """``--flag value`` for each option, in the mapping's order: ``batch_size=64`` is
    ``--batch-size 64``, True is ``--flag``, False is ``--no-flag`` and None leaves the
    option out (the daemon's default, or its --config file's value, applies)."""
    args: list[str] = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if value is True:
            args.append(flag)
        elif value is False:
            args.append(f"--no-{flag[2:]}")
        else:
            args += [flag, str(value)]
    return args


def start_argv(buffer: Path, options: Mapping[str, Any] | None = None, *, extra: Sequence[str] = (),
               python: str = sys.executable) -> list[str]:
    """The command line of `prefetchd start` on ``buffer`` with ``options`` (see option_args), then
    ``extra`` arguments as they are; run by ``python``, so the daemon is this installation's."""
    return [python, "-m", "prefetchd", "start", "--buffer", str(buffer), *option_args(options or {}), *extra]


def launch(argv: Sequence[str], *, log: Path | None = None, stdout: int | None = None) -> subprocess.Popen[bytes]:
    """Start the daemon ``argv`` describes (see start_argv) and return at once, so several can
    start side by side.  With ``log`` its stdout and stderr go to that file (replaced); without,
    stdout goes to ``stdout`` (None: ours, or subprocess.DEVNULL) and stderr is ours.  Its stdin
    is /dev/null: a daemon never reads it, and must not hold a terminal that is not its own.
    It is not tied to this process: if we are killed it keeps running, as a `prefetchd start`
    in a shell would.
    """
    if log is None:
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=stdout)
    with open(log, "wb") as fh:
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT)


def wait_ready(proc: subprocess.Popen[Any], buffer: Path, *, since: float, timeout: float,
               streams: Sequence[Path] = (), log: Path | None = None, more_time: str = "give it a longer timeout") -> None:
    """Wait until ``proc`` owns ``buffer`` and has written the manifest of each of ``streams``
    (the buffer itself when empty) at or after ``since`` (a time.time() taken before the
    launch: an older manifest is an earlier daemon's).

    Raises DaemonExited when it exits first (its messages are in ``log``, or on our stderr), and
    DaemonNotReady after ``timeout`` seconds; ``more_time`` says how to give it longer.
    """
    deadline = time.monotonic() + timeout
    manifests = [Path(d) / MANIFEST_NAME for d in (streams or (buffer,))]
    while True:
        code = proc.poll()
        if code is not None:
            command = " ".join(str(a) for a in proc.args) if isinstance(proc.args, list) else str(proc.args)
            where = "its message is above" if log is None else f"its messages are in {log}"
            raise DaemonExited(f"the daemon started for {buffer} exited with code {code} before serving it "
                               f"({where}); the command was: {command}")
        try:
            fresh = all(m.stat().st_mtime >= since - MTIME_SLACK_SECONDS for m in manifests)
        except FileNotFoundError:
            fresh = False
        if fresh and daemon_pid(buffer) == proc.pid:
            return
        if time.monotonic() >= deadline:
            logged = "" if log is None else f" (its log: {log})"
            raise DaemonNotReady(f"the daemon started for {buffer} (pid {proc.pid}) wrote no manifest within "
                                 f"{timeout:g} s{logged}; it may still be indexing a large dataset: {more_time}")
        time.sleep(READY_POLL_SECONDS)


def stop_daemon_process(proc: subprocess.Popen[Any], seconds: float) -> bool:
    """Stop a daemon this process started, as the daemon stops cleanly: SIGTERM (with SIGCONT, so
    a stopped one can act on it), up to ``seconds`` to delete its half-written batches and go,
    then SIGKILL.  True when it had to be killed; the kernel drops its lock either way."""
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    try:
        proc.wait(seconds)
        return False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return True


@contextmanager
def daemon_for_a_run(buffer: Path, extra: Sequence[str], log: Path, stop_seconds: float = 20.0
                     ) -> Iterator[subprocess.Popen[bytes]]:
    """A `prefetchd start --buffer BUFFER EXTRA...` for the block, as benchmark scripts run one:
    its log's tail goes to stderr if the block raises; it is stopped and its buffer removed after."""
    shutil.rmtree(buffer, ignore_errors=True)
    proc = launch(start_argv(buffer, extra=extra), log=log)
    try:
        yield proc
    except BaseException:
        sys.stderr.write(log.read_text(errors="replace")[-3000:])
        raise
    finally:
        stop_daemon_process(proc, stop_seconds)
        shutil.rmtree(buffer, ignore_errors=True)


__all__ = ["DaemonExited", "DaemonNotReady", "LaunchError", "daemon_for_a_run", "launch", "option_args", "start_argv",
           "stop_daemon_process", "wait_ready"]
