"""The user's transform hook (``transform = "package.module:callable"``): found, checked, run.

What it gets and when: ``plan``'s docstring, item 4.  It must return a uint8 tensor of the
shape it got.
"""

from __future__ import annotations

import importlib
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
    except Exception as exc:  # the user's module may fail in any way while it is imported
        raise ConfigError(f"transform = {name!r}: cannot import {module_name} ({type(exc).__name__}: {exc}); "
                          "install it or add its folder to PYTHONPATH") from None
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
    if failed:
        raise failed[0]
    return done[0]


def _where(thread: threading.Thread) -> str:
    """Where ``thread``, importing a hook's module, is: its innermost frame past the import machinery and, where
    that is in another module, the hook's module's line it came from; "" where no such frame is (in C code)."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return ""
    stack = traceback.extract_stack(frame)
    inside = [i for i, f in enumerate(stack) if f.filename == __file__ and f.name == "validate_hook"]
    ours = [f for f in stack[inside[-1] + 1:] if not f.filename.startswith("<frozen")
            and os.path.dirname(f.filename) != os.path.dirname(importlib.__file__)] if inside else []
    if not ours:
        return ""

    def at(f: traceback.FrameSummary) -> str:
        return f"{f.filename}:{f.lineno} (`{f.line}`)" if f.line else f"{f.filename}:{f.lineno}"

    came = f", called from {at(ours[0])}" if len(ours) > 1 else ""
    return f"; it is at {at(ours[-1])}{came}"


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
    except Exception as exc:
        raise HookError(f"transform {name} failed on {path}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or tuple(out.shape) != (3, size, size):
        got = (f"a {out.dtype} tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor)
               else "None" if out is None else f"an object of type {type(out).__name__}")
        raise HookError(f"transform {name} returned {got} for {path}; it must return a uint8 tensor of shape "
                        f"(3, {size}, {size})")
    return out.permute(1, 2, 0)
