"""A --transform hook that draws from numpy's and torch's global generators, as augmentation code written for a
DataLoader does, instead of the Generator it is handed: the daemon's workers must not all draw the same numbers
(tests/daemon/test_pool.py)."""

from __future__ import annotations

import numpy as np
import torch


def noise(image: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """Channel 1 from np.random, channel 2 from torch's default generator; channel 0 kept."""
    out = image.clone()
    side = tuple(image.shape[1:])
    out[1] = torch.from_numpy(np.random.randint(0, 256, side, dtype=np.uint8))
    out[2] = torch.randint(0, 256, side, dtype=torch.uint8)
    return out
