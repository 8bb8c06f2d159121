"""A transform hook for test_worker_hangs.py, imported by the daemon's workers: the identity, but on the
one image of the dataset that is magenta all over it never returns, as a hook that loops on one image would."""

from __future__ import annotations

import time
from typing import Any

MAGENTA = (255, 0, 255)


def is_magenta(image: Any) -> bool:
    """Whether a 3 x S x S uint8 tensor is magenta all over (JPEG's rounding allowed): any crop of it is."""
    r, g, b = (float(image[c].float().mean()) for c in range(3))
    return r > 230 and g < 25 and b > 230


def never_returns_on_magenta(image: Any, rng: Any) -> Any:
    while is_magenta(image):
        time.sleep(1)
    return image
