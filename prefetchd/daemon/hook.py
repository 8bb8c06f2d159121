"""The user's transform hook (``transform = "package.module:callable"``): found, checked, run.

What it gets and when: ``plan``'s docstring, item 4.  It must return a uint8 tensor of the
shape it got.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from prefetchd.daemon.errors import ConfigError

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
