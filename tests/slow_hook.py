"""A `--transform` hook for tests that need a worker busy for long, as one decoding a huge image is: the
identity, taking SECONDS per image."""

from __future__ import annotations

import time
from typing import Any

SECONDS = 2.5


def slow(image: Any, rng: Any) -> Any:
    time.sleep(SECONDS)
    return image
