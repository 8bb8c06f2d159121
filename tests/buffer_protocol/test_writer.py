"""The batch writer: begin, fill slots (in any order, from other processes), commit or abort."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefetchd.buffer_protocol import (
    BatchLayout,
    PendingBatch,
    batch_name,
    list_batches,
    list_temp_files,
    map_batch,
    write_batch,
)

FIELDS: dict[str, Any] = {"epoch": 3, "step": 1, "seed": 9, "producer": "p", "replaced": 2}


def _arrays(n: int, h: int = 4, w: int = 5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(n)
    return rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8), rng.integers(0, 1000, n), np.arange(n) + 50


@settings(max_examples=40, deadline=1000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(order=st.integers(1, 6).flatmap(lambda n: st.permutations(range(n))))
def test_slots_filled_in_any_order_give_the_bytes_of_write_batch(order: list[int], tmp_path: Path) -> None:
    directory = Path(tempfile.mkdtemp(dir=tmp_path))
    images, labels, indices = _arrays(len(order))
    write_batch(directory / "whole.batch", images, labels, indices, **FIELDS)
    pending = PendingBatch.begin(directory / batch_name(3, 1), BatchLayout.plan(*images.shape))
    with pending.slots() as slots:
        for slot in order:
            slots.fill(slot, memoryview(images[slot].reshape(-1)))
    final = pending.commit(labels, indices, **FIELDS)
    assert final.read_bytes() == (directory / "whole.batch").read_bytes()
    assert list(list_temp_files(directory)) == []


def test_another_process_fills_slots_knowing_only_the_temp_path_and_offsets(tmp_path: Path) -> None:
    images, labels, indices = _arrays(3)
    layout = BatchLayout.plan(*images.shape)
    pending = PendingBatch.begin(tmp_path / batch_name(0, 0), layout)
    assert list_batches(tmp_path) == {} and list(list_temp_files(tmp_path)) == [pending.tmp]
    assert pending.tmp.stat().st_size == layout.file_len
    fill = ("import sys; from prefetchd.buffer_protocol import SlotFiller\n"
            "path, offset, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])\n"
            "with SlotFiller(path, offset, size) as slots:\n"
            "    for slot in (2, 0, 1): slots.fill(slot, memoryview(bytes([slot + 1]) * size))\n")
    subprocess.run([sys.executable, "-c", fill, str(pending.tmp), str(layout.tensors["images"].offset),
                    str(layout.slot_bytes)], check=True, timeout=60)
    pending.commit(labels, indices, **FIELDS)
    batch = map_batch(tmp_path / batch_name(0, 0))
    assert [int(image.max()) for image in batch.images] == [1, 2, 3]
    assert [int(image.min()) for image in batch.images] == [1, 2, 3]
    assert batch.labels.tolist() == labels.tolist() and batch.indices.tolist() == indices.tolist()
    assert (batch.meta.epoch, batch.meta.step, batch.meta.replaced) == (3, 1, 2)


def test_abort_removes_the_temp_file_and_later_fills_fail_instead_of_creating_one(tmp_path: Path) -> None:
    pending = PendingBatch.begin(tmp_path / batch_name(0, 0), BatchLayout.plan(2, 4, 4))
    pending.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError):
        pending.slots()
    with pytest.raises(FileNotFoundError):
        pending.commit(np.zeros(2), np.zeros(2), **FIELDS)
    assert list(tmp_path.iterdir()) == []


def test_a_commit_that_cannot_publish_leaves_nothing_behind(tmp_path: Path) -> None:
    final = tmp_path / batch_name(0, 0)
    final.mkdir()  # rename cannot replace a directory with a file
    pending = PendingBatch.begin(final, BatchLayout.plan(2, 4, 4))
    with pytest.raises(OSError):
        pending.commit(np.zeros(2), np.zeros(2), **FIELDS)
    assert list(list_temp_files(tmp_path)) == [] and final.is_dir()
