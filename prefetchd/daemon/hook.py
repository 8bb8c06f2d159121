"""The user's transform hook (``transform = "package.module:callable"``): found, checked, run.

What it gets and when: ``plan``'s docstring, item 4.  It must return a uint8 tensor of the
shape it got.
"""

from __future__ import annotations

import importlib
import linecache
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from prefetchd.daemon.errors import ConfigError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import torch

Hook = Callable[["torch.Tensor", np.random.Generator], "torch.Tensor"]


class HookError(RuntimeError):
    """The user's transform hook failed or broke its contract: a bug to fix, not a bad image."""


def validate_hook(name: str) -> Hook:
    """Import the hook named ``"package.module:callable"``; a ``ConfigError`` says what is wrong."""
    module_name, _, attr = name.partition(":")  # the form was checked with the rest of the config
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError as exc:  # it, or what it imports, is not there
        raise ConfigError(f"transform = {name!r}: cannot import {module_name} ({type(exc).__name__}: {exc}); "
                          "install it or add its folder to PYTHONPATH") from None
    except (Exception, SystemExit) as exc:  # the user's module may fail in any way while it is imported
        # sys.exit() in it ended `start` (and `config`) with its code and not a word (a walk).
        raise ConfigError(f"transform = {name!r}: importing {module_name} raised {type(exc).__name__}: {exc}; "
                          "fix the module (it runs in every worker too)") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"transform = {name!r}: {module_name} has no attribute {attr!r}") from None
    if not callable(obj):
        raise ConfigError(f"transform = {name!r}: {attr} is an object of type {type(obj).__name__}, not a callable taking "
                          "(uint8 tensor, numpy Generator)")
    return obj


def validate_hook_within(name: str, timeout: float, tick: Callable[[str], None], every: float = 1.0,
                         note_after: float = 60.0) -> Hook:
    """``validate_hook``, its import bounded by ``timeout`` seconds (--worker-start-timeout): the daemon checks the
    hook once when a job starts, and a module that blocks when imported (a read of a hung mount, a lock, a network
    call) held the daemon there for good, beating no more and deaf to SIGTERM, whose handler only sets a flag.  The
    import runs on a thread while ``tick(message)`` runs here every ``every`` seconds (the start's heartbeat, where a
    stop signal is noticed: what it raises ends the wait); after ``note_after`` seconds the log says where the
    import is; past ``timeout`` a ``ConfigError`` says so.  A thread cannot be killed: one that never returns stays,
    asleep, until the daemon exits (a job refused for it leaves a daemon that serves the next)."""
    module = name.partition(":")[0]
    done: list[Hook] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(validate_hook(name))
        except BaseException as exc:  # re-raised below, in the daemon's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="prefetchd-hook-import", daemon=True)
    start = time.monotonic()
    thread.start()
    noted = False
    while thread.is_alive():
        waited = time.monotonic() - start
        if waited >= timeout:
            raise ConfigError(f"transform = {name!r}: importing {module} did not return in {timeout:g} s "
                              f"(--worker-start-timeout){_where(thread)}; something there never returns (a read of "
                              "a hung mount, a lock, a network call?): fix the module, or raise "
                              "--worker-start-timeout if importing it takes that long")
        if waited >= note_after and not noted:
            noted = True
            log.warning("importing the --transform hook's module %s has taken %.0f s%s; at %g s "
                        "(--worker-start-timeout) the job is refused", module, waited, _where(thread), timeout)
        tick(f"importing the --transform hook's module {module} ({waited:.0f} s)")
        thread.join(min(every, max(0.0, timeout - waited)))
    if failed and MAIN_THREAD_ONLY in str(failed[0]):
        # A module that sets a signal handler when imported (signal.signal works in the main thread alone): it
        # imports in the workers' main threads, so it is checked in the daemon's as it was before the bound.
        log.info("%s sets a signal handler when imported: checked in the daemon's main thread, unbounded", module)
        return validate_hook(name)
    if failed:
        raise failed[0]
    return done[0]


# How CPython's signal.signal refuses a thread other than the main one (Python 3.10-3.13).
MAIN_THREAD_ONLY = "signal only works in main thread"


def _where(thread: threading.Thread) -> str:
    """Where ``thread``, importing a hook's module, is: its innermost frame past the import machinery and, where
    that is in another module, the hook's module's line it came from; "" where no such frame is (in C code).

    The frames are walked without a look at their files (``traceback.extract_stack`` reads each one's source, and
    stats those read before): an import that waits on a hung mount is often of a module on that mount, whose read
    would hold the daemon's thread for good, deaf to SIGTERM, as the import itself did before it ran on a thread.
    Their lines are read on threads of their own (``_lines``) and left out where they do not come in time."""
    frame = sys._current_frames().get(thread.ident or -1)
    stack: list[tuple[str, int, str]] = []  # (file, line number, function), outermost first
    while frame is not None:
        stack.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    stack.reverse()
    inside = [i for i, (filename, _, name) in enumerate(stack) if filename == __file__ and name == "validate_hook"]
    ours = [f for f in stack[inside[-1] + 1:] if not f[0].startswith("<frozen")
            and os.path.dirname(f[0]) != os.path.dirname(importlib.__file__)] if inside else []
    if not ours:
        return ""
    shown = [ours[-1], *ours[:1]] if len(ours) > 1 else [ours[-1]]
    lines = _lines([(filename, lineno) for filename, lineno, _ in shown])

    def at(i: int) -> str:
        filename, lineno, _ = shown[i]
        return f"{filename}:{lineno} (`{lines[i]}`)" if lines.get(i) else f"{filename}:{lineno}"

    came = f", called from {at(1)}" if len(shown) > 1 else ""
    return f"; it is at {at(0)}{came}"


# How long the daemon waits for a source line of a hook's import to show it: a local file's comes in microseconds.
LINE_READ_SECONDS = 1.0


def _lines(places: list[tuple[str, int]]) -> dict[int, str]:
    """The source line of each (file, line number) of ``places``, by its index, read with ``linecache`` on a thread
    each for at most ``LINE_READ_SECONDS`` in all; one that did not come is left out.  A thread whose read never
    returns (a file on a hung mount) stays, asleep, as the import's does."""
    got: dict[int, str] = {}

    def read(i: int, filename: str, lineno: int) -> None:
        got[i] = linecache.getline(filename, lineno).strip()

    readers = [threading.Thread(target=read, args=(i, *place), name="prefetchd-hook-source", daemon=True)
               for i, place in enumerate(places)]
    end = time.monotonic() + LINE_READ_SECONDS
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(max(0.0, end - time.monotonic()))
    return dict(got)


@lru_cache(maxsize=8)
def load_hook(name: str) -> Hook:
    """``validate_hook``, once per process; a failure here is the hook's bug, reported as ``HookError``."""
    try:
        return validate_hook(name)
    except ConfigError as exc:
        raise HookError(str(exc)) from None


def apply_hook(name: str, hwc: torch.Tensor, rng: np.random.Generator, size: int, path: str) -> torch.Tensor:
    import torch

    hook = load_hook(name)
    try:
        out = hook(hwc.permute(2, 0, 1), rng)
    except (Exception, SystemExit) as exc:
        # sys.exit() too: it ended the worker, and after two the file was "crashed its worker", replaced, the job
        # stopped as bad data naming good images (a walk of hooks); a hook's bug, as the import check takes it.
        # Not KeyboardInterrupt: on a Ray worker it is Ray's cancel of a slice no longer wanted (bridge_slices).
        # Where it raised, the innermost frame (in the hook, or in what the hook called): a walk had only the words.
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        raise HookError(f"transform {name} failed on {path}: {type(exc).__name__}: {exc} (raised at "
                        f"{frame.filename}:{frame.lineno}, in {frame.name})") from exc
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or tuple(out.shape) != (3, size, size):
        got = (f"a {out.dtype} tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor)
               else "None" if out is None else f"an object of type {type(out).__name__}")
        raise HookError(f"transform {name} returned {got} for {path}; it must return a uint8 tensor of shape "
                        f"(3, {size}, {size})")
    return out.permute(1, 2, 0)
