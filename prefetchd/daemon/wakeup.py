"""What wakes the daemon's loops: signals and changes to the files trainers write.

Signal handlers only record the signal; ``signal.set_wakeup_fd`` and the
progress/job watcher write into one non-blocking pipe, so a loop can sleep in
``wait()`` on that pipe (and its workers) and still react within milliseconds.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType, TracebackType

from prefetchd.daemon.watcher import BufferWatcher

# SIGHUP too: a daemon started with & from an ssh session gets it at logout, and would die without a word.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _handled(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> list[signal.Signals]:
    """The stop signals this process acts on: not SIGHUP where it was started with it ignored, as `nohup` starts
    it.  Handled anyway, `nohup prefetchd start ... &` stopped at logout all the same (a walk).  SIGINT is handled
    even so: a shell ignores it for a background job of a script, where `kill -INT` is still meant to stop it."""
    return [s for s in signals if s != signal.SIGHUP or signal.getsignal(s) != signal.SIG_IGN]


_deferred: int | None = None  # a stop signal that came before a Wakeup took the handlers over


def _defer(signum: int, _frame: FrameType | None) -> None:
    global _deferred
    _deferred = signum


@contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Within the block, until a ``Wakeup`` takes over, a stop signal is recorded, not acted on: the
    first loop then stops at once, cleanly.  Its default action would end the process half set up,
    leaving the worker server's socket folder in TMPDIR and no status saying it stopped.  A block
    that ends before any Wakeup (a refused start) puts the handlers back and hands the signal on,
    unless the start's error is on its way out and the signal's action is the default: the error
    ends the process as the signal would have, but with its message logged and the socket folder
    removed at exit, neither of which a death by the signal allows."""
    global _deferred
    previous = {s: signal.signal(s, _defer) for s in _handled()}
    refused = False
    try:
        yield
    except BaseException:
        refused = True
        raise
    finally:
        for s, handler in previous.items():
            if signal.getsignal(s) is _defer:
                signal.signal(s, handler)
        pending, _deferred = _deferred, None
        if pending is not None and not (refused and signal.getsignal(pending) == signal.SIG_DFL):
            os.kill(os.getpid(), pending)  # as if it came now


class Wakeup:
    """Context manager owning the wake-up pipe, the stop-signal handlers and the watcher."""

    def __init__(self, buffer: Path, last: bool = False) -> None:
        """``last``: the process exits once this loop ends.  A stop signal that arrives while it
        exits is then ignored instead of handed back to the default action, which would turn a
        clean exit into status 143 (SIGTERM) or 130 (SIGINT) half-way through its cleanup."""
        self.buffer = buffer
        self.last = last
        self.stop_signal: int | None = None
        self._fds: tuple[int, int] | None = None

    def __enter__(self) -> Wakeup:
        r, w = os.pipe()
        for fd in (r, w):
            os.set_blocking(fd, False)
        self._fds = (r, w)
        self._old_handlers = {s: signal.signal(s, self._on_signal) for s in _handled()}
        global _deferred
        if _deferred is not None and self.stop_signal is None:
            self.stop_signal, _deferred = _deferred, None
        self._old_wakeup = signal.set_wakeup_fd(w)
        self._watcher = BufferWatcher(self.buffer, w)
        return self

    def __exit__(self, *exc: tuple[type[BaseException] | None, BaseException | None, TracebackType | None]) -> None:
        self._watcher.stop()
        signal.set_wakeup_fd(self._old_wakeup)
        # Blocked while they become SIG_IGN: one that came inside signal.signal, after it ran the handlers
        # of those pending and before it set SIG_IGN, was left with no Python handler, and CPython wrote
        # "Signal 15 ignored due to race condition" with a traceback into the log of a clean exit (seen
        # once under a SIGTERM storm, test_daemon_exit.py).  Blocked, it waits, and SIG_IGN discards it.  In
        # this thread: with the watcher joined, the only one left but a --metrics server's.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS) if self.last else None
        for s, h in self._old_handlers.items():
            # SIG_IGN, not a Python handler: the interpreter resets its own handlers to the
            # default while it finalizes, and leaves an ignored signal ignored to the end.
            signal.signal(s, signal.SIG_IGN if self.last else h)
        if blocked is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        assert self._fds is not None
        for fd in self._fds:
            os.close(fd)
        self._fds = None

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.stop_signal is None:  # the first says why it stopped; another while it stops changes nothing
            self.stop_signal = signum

    @property
    def watching(self) -> bool:
        """Whether changes to progress and job files wake the loop (else it must poll them)."""
        return self._fds is not None and self._watcher.watching

    def fileno(self) -> int:
        assert self._fds is not None, "use Wakeup as a context manager"
        return self._fds[0]

    def drain(self) -> bool:
        """Empty the pipe; True when anything had woken us."""
        got = False
        try:
            while os.read(self.fileno(), 4096):
                got = True
        except BlockingIOError:
            pass
        return got

    @property
    def stop_reason(self) -> str:
        return f"stopped by {signal.Signals(self.stop_signal).name}" if self.stop_signal else "finished"
