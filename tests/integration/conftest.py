"""Fixtures of the integration tests that start daemons on a dataset of their own."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from prefetchd.synthetic import make_shapes_dataset
from tests.integration.hung_hook import MAGENTA


@pytest.fixture
def magenta_data(shm_dir: Path) -> tuple[Path, Path]:
    """A small class-folder dataset with one image that is magenta all over (what the hooks of hung_hook.py
    and crash_hook.py look for); and that image."""
    make_shapes_dataset(shm_dir / "data", classes=3, train_per_class=8, val_per_class=0, seed=1)
    train = shm_dir / "data" / "train"
    magenta = sorted(p for p in train.iterdir())[1] / "zz_magenta.jpg"
    Image.new("RGB", (64, 48), MAGENTA).save(magenta, quality=95)
    return train, magenta
