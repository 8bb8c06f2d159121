"""How many images each worker task takes (``pool.task_images``)."""

from __future__ import annotations

import itertools

from prefetchd.daemon.pool import TASKS_PER_WORKER
from prefetchd.daemon.pool import MAX_CHUNK, MAX_REMOTE_CHUNK, MIN_CHUNK, task_images


def _batches_to_fill_every_slot(batch_size: int, workers: int, chunk: int) -> int:
    tasks_per_batch = -(-batch_size // chunk)
    return -(-workers * TASKS_PER_WORKER // tasks_per_batch)


def test_few_workers_take_the_largest_tasks() -> None:
    assert task_images(128, 1, 16) == MAX_CHUNK
    assert task_images(128, 2, 16) == MAX_CHUNK


def test_many_workers_keep_tasks_of_min_chunk_where_the_cap_has_room() -> None:
    # The rule before: 128 // (2 * 16) = 4 images a task, a thousand tasks a second at 16 workers.
    assert task_images(128, 16, 16) == MIN_CHUNK
    assert task_images(256, 16, 16) == MIN_CHUNK
    assert _batches_to_fill_every_slot(128, 16, MIN_CHUNK) <= 16 // 2


def test_a_small_cap_spreads_each_batch_over_more_workers() -> None:
    assert task_images(128, 16, 4) == 8  # two batches at once fill the 32 slots
    assert task_images(128, 16, 2) == 4  # one batch fills them, as it always did
    assert task_images(128, 16, 1) == 4


def test_every_task_goes_to_a_ray_cluster_in_larger_slices() -> None:
    assert task_images(128, 0, 16) == MAX_REMOTE_CHUNK
    assert task_images(40, 0, 16) == 20  # two slices a batch at least


def test_a_batch_splits_into_tasks_of_nearly_equal_size() -> None:
    assert task_images(32, 16, 16) == 8
    assert task_images(33, 1, 16) == 11  # 11 + 11 + 11, not 16 + 16 + 1
    assert task_images(48, 2, 16) == 16


def test_bounds_over_a_grid_of_batches_workers_and_caps() -> None:
    for batch_size, workers, cap in itertools.product(range(1, 300, 7), range(0, 40, 3), (1, 2, 3, 4, 8, 16, 64)):
        chunk = task_images(batch_size, workers, cap)
        limit = MAX_REMOTE_CHUNK if workers == 0 else MAX_CHUNK
        assert 1 <= chunk <= min(limit, batch_size), (batch_size, workers, cap, chunk)
        tasks = -(-batch_size // chunk)
        assert (chunk - 1) * tasks < batch_size, ("uneven split", batch_size, workers, cap, chunk)
        if workers:
            spread = max(1, batch_size // (workers * TASKS_PER_WORKER))
            # Larger tasks than one batch spread over every slot only where half the cap holds
            # the batches it then takes to fill them.
            if chunk > spread:
                assert _batches_to_fill_every_slot(batch_size, workers, chunk) <= max(1, cap // 2), (
                    batch_size, workers, cap, chunk)
