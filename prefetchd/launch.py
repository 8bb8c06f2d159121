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

A launched daemon is not tied to the process that started it (the trainer's --spawn-daemon
wants one that outlives a killed trainer).  A program that must not leave it behind (the
bench, tools/) wraps its entry point in ``stops_cleanly``: SIGTERM and SIGHUP then unwind it as
Ctrl-C does, through the ``finally`` blocks that stop its daemons and delete its temp files.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from prefetchd.buffer_protocol import daemon_pid
from prefetchd.buffer_protocol.layout import MANIFEST_NAME

READY_POLL_SECONDS = 0.05
# File timestamps come from the kernel's coarse clock (a scheduler tick behind), so a manifest
# written just after time.time() can carry an mtime a little before it.
MTIME_SLACK_SECONDS = 0.05
# An error line of the daemon's log, "TIME LEVEL LOGGER: MESSAGE" (prefetchd/daemon/logs.py's setup_logging).
DAEMON_ERROR_LINE = re.compile(r" (?:ERROR|CRITICAL) +\S+: (.*)$")
# What a scheduler, `timeout`, `kill PID` or a closed terminal sends; Ctrl-C's SIGINT already
# raises KeyboardInterrupt.
TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

F = TypeVar("F", bound=Callable[..., Any])


class LaunchError(Exception):
    """A daemon this process started did not come to serve its buffer."""


class DaemonExited(LaunchError):
    """The daemon exited before it served its buffer.  ``brief``: that, with what it said last (its
    error, from its log), for a program that deletes the log and so must not point at it."""

    def __init__(self, buffer: Path, code: int, said: str, log: Path | None, command: str) -> None:
        self.code, self.said = code, said
        self.brief = f"the daemon started for {buffer} exited with code {code} before serving it" + (
            f": {said}" if said else "")
        where = "its message is above" if log is None else f"its messages are in {log}"
        super().__init__(f"{self.brief} ({where}); the command was: {command}")


class DaemonNotReady(LaunchError):
    """The daemon still runs but did not serve its buffer in time."""


class Terminated(KeyboardInterrupt):
    """A termination signal reached a ``stops_cleanly`` entry point.  A KeyboardInterrupt, so
    whatever cleans up after Ctrl-C cleans up after it too, and ``except Exception`` lets it by."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stops_cleanly(main: F) -> F:
    """Decorate a program's entry point (a click command's function, or a plain ``main``) so that
    SIGTERM and SIGHUP raise Terminated in it, unwinding its ``finally`` and ``with`` blocks (the
    daemons it launched are stopped, its temp files deleted), and it then exits with 128 + the
    signal's number, as a process the signal killed would; so does Ctrl-C (SIGINT's KeyboardInterrupt).

    Without it the default action ends the process on the spot: none of its cleanup runs, and
    its daemons, not tied to it (see launch), keep running with their buffers.  Only the first
    signal interrupts; more while it cleans up are ignored, so a scheduler's repeated SIGTERM
    cannot cut the cleanup short (stop_daemon_process bounds it; SIGKILL still ends it at once).
    """

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return main(*args, **kwargs)  # signal handlers can only be set from the main thread
        received: list[int] = []

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            received.append(signum)
            if len(received) == 1:
                raise Terminated(signum)

        previous = {s: signal.signal(s, on_signal) for s in TERMINATION_SIGNALS}
        try:
            return main(*args, **kwargs)
        except Terminated as exc:
            sys.stderr.write(f"stopped by {signal.Signals(exc.signum).name}\n")
            raise SystemExit(128 + exc.signum) from None
        except KeyboardInterrupt:  # Ctrl-C, cleaned up alike: click's "Aborted!" exited 1 (a walk of the demo)
            sys.stderr.write("interrupted\n")
            raise SystemExit(128 + signal.SIGINT) from None
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    return wrapper  # type: ignore[return-value]


@contextmanager
def signals_held(signums: Sequence[int] = (signal.SIGINT, *TERMINATION_SIGNALS)) -> Iterator[None]:
    """Hold the stop signals while the block runs, then deliver each, in order, to this process's own handlers: for
    a daemon's launch and the registration of its stop, between which a Ctrl-C left a daemon running that nothing
    would stop (a user's walk of prefetchd-train --spawn-daemon), and a checkpoint's write.  Each one held counts:
    a second SIGTERM is prefetchd-train's "stop now".  The launched daemon is not affected (an exec resets handled
    signals).  Off the main thread, where no handler can be set, it holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: held.append(signum)) for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        for s in held:
            signal.raise_signal(s)


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
    in a shell would (a program that must stop it on SIGTERM uses ``stops_cleanly``).
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
        try:
            fresh = all(m.stat().st_mtime >= since - MTIME_SLACK_SECONDS for m in manifests)
        except FileNotFoundError:
            fresh = False
        if fresh and code == 0:
            # It wrote its manifests and finished at once: its trainers had consumed the whole job (a finished
            # run resumed).  Told apart from a refusal by its code; an exit 1 from a quicker poll here (a user's
            # walk: 4 of 12 such resumes failed, "exited with code 0 before serving it").
            return
        if code is not None:
            command = " ".join(str(a) for a in proc.args) if isinstance(proc.args, list) else str(proc.args)
            raise DaemonExited(buffer, code, last_words(log) if log is not None else "", log, command)
        if fresh and daemon_pid(buffer) == proc.pid:
            return
        if time.monotonic() >= deadline:
            logged = "" if log is None else f" (its log: {log})"
            raise DaemonNotReady(f"the daemon started for {buffer} (pid {proc.pid}) wrote no manifest within "
                                 f"{timeout:g} s{logged}; it may still be indexing a large dataset: {more_time}")
        time.sleep(READY_POLL_SECONDS)


def last_words(log: Path) -> str:
    """What a daemon that exited said last in ``log``: its last ERROR or CRITICAL message (the
    reason it refused to start), else the log's last line (a traceback's exception); "" when
    there is no log."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    errors = [m.group(1) for m in map(DAEMON_ERROR_LINE.search, lines) if m]
    return errors[-1] if errors else (lines[-1] if lines else "")


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
    except DaemonExited:
        raise  # its message carries the daemon's error
    except BaseException:
        sys.stderr.write(log.read_text(errors="replace")[-3000:])
        raise
    finally:
        stop_daemon_process(proc, stop_seconds)
        shutil.rmtree(buffer, ignore_errors=True)


__all__ = ["DaemonExited", "DaemonNotReady", "LaunchError", "Terminated", "daemon_for_a_run", "last_words", "launch",
           "option_args", "start_argv", "stop_daemon_process", "stops_cleanly", "wait_ready"]
