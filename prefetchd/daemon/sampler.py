"""Which samples go into batch (epoch, step), and the random stream of each sample.

Both are pure functions of the job (seed, members, batch size, rank, world size)
and their arguments, never of worker count or timing: that makes batch
(epoch, step) bit-identical across runs, restarts and worker counts, which exact
resume and every fault test rely on.
"""

from __future__ import annotations

import numpy as np

from prefetchd.buffer_protocol.documents import batch_len, steps_per_epoch

# Distinct streams derived from one user seed.
_ORDER_STREAM = 1
_AUGMENT_STREAM = 2


def samples_per_rank(num_members: int, world_size: int = 1) -> int:
    return -(-num_members // world_size)


def epoch_order(
    members: np.ndarray, seed: int, epoch: int, *, shuffle: bool, rank: int = 0, world_size: int = 1
) -> np.ndarray:
    """Sample indices of one epoch for one rank, in the order they are batched.

    The global order is a seeded permutation of ``members`` (or ``members`` as
    they are, without shuffling), padded by wrapping to a multiple of the world
    size so every rank gets the same count, then dealt round-robin.
    """
    order = members
    if shuffle:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, _ORDER_STREAM])))
        order = members[rng.permutation(len(members))]
    # np.resize repeats the order as often as needed, also when the world is
    # more than twice the dataset.
    order = np.resize(order, samples_per_rank(len(order), world_size) * world_size)
    return order[rank::world_size]


def batch_slice(step: int, batch_size: int, samples: int) -> slice:
    start = step * batch_size
    return slice(start, min(start + batch_size, samples))


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The augmentation random stream of one sample in one epoch."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, index, _AUGMENT_STREAM])))


__all__ = ["batch_len", "batch_slice", "epoch_order", "sample_rng", "samples_per_rank", "steps_per_epoch"]
