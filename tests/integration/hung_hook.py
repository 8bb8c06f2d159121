"""Transform hooks for test_worker_hangs.py and test_ray_faults.py, imported by the daemon's workers (and Ray
workers): the identity, but on the one image of the dataset that is magenta all over it never returns, as a
hook that loops on one image would (or does so once)."""

from __future__ import annotations

import os
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


HANG_ONCE = "PREFETCHD_TEST_HANG_ONCE"  # a path: the first process to create it hangs, the others do not


def hangs_once_on_magenta(image: Any, rng: Any) -> Any:
    """The identity, but the first call on the magenta image (of all processes: the one that creates the
    file ``$PREFETCHD_TEST_HANG_ONCE`` names) never returns, as a read of a mount that hangs for a while."""
    marker = os.environ.get(HANG_ONCE)
    if marker and is_magenta(image):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return image
        while True:
            time.sleep(1)
    return image
