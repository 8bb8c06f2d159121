"""Which samples go into batch (epoch, step), and the random stream of each sample.

Both are pure functions of the job (seed, members, batch size, rank, world size)
and their arguments, never of worker count or timing: that makes batch
(epoch, step) bit-identical across runs, restarts and worker counts, which exact
resume and every fault test rely on.
"""

from __future__ import annotations

import numpy as np

from prefetchd.buffer_protocol.manifest import batch_len, steps_per_epoch

# Distinct streams derived from one user seed.
_ORDER_STREAM = 1
_AUGMENT_STREAM = 2


def samples_per_rank(num_members: int, world_size: int = 1) -> int:
    return -(-num_members // world_size)


def global_order(members: np.ndarray, seed: int, epoch: int, *, shuffle: bool) -> np.ndarray:
    """The order of one epoch across all ranks, before padding: a seeded permutation of ``members``,
    or ``members`` as they are without shuffling."""
    if not shuffle:
        return members
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, _ORDER_STREAM])))
    return members[rng.permutation(len(members))]


def deal(order: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank ``rank``'s share of the global ``order``, padded by wrapping to a multiple of the world
    size so every rank gets the same count, then dealt round-robin.

    A new array of the rank's samples alone (``order`` itself for a world of one): a slice of the
    padded order would be a view keeping all of it alive, ~20 MB per rank and epoch for an
    ImageNet-sized job of 65536 ranks, whose ranks get 20 samples each.
    """
    if world_size == 1:
        return order
    # Position i of the padded order is order[i % n] (it repeats the order as often as needed, also
    # when the world is more than twice the dataset).
    positions = np.arange(rank, samples_per_rank(len(order), world_size) * world_size, world_size)
    return order[positions % max(1, len(order))]


def epoch_order(
    members: np.ndarray, seed: int, epoch: int, *, shuffle: bool, rank: int = 0, world_size: int = 1
) -> np.ndarray:
    """Sample indices of one epoch for one rank, in the order they are batched: ``global_order``
    dealt to the ranks (``deal``)."""
    return deal(global_order(members, seed, epoch, shuffle=shuffle), rank, world_size)


class EpochOrders:
    """The global orders of the last ``keep`` epochs, computed once for all the streams of a daemon.

    A daemon serves up to 256 ranks of one job; each needs its share of the same permutation at
    every epoch boundary, which took tens of ms per rank for an ImageNet-sized dataset (1.28 M
    members): a controller stall of seconds when computed again for each.  The ranks cross an
    epoch boundary close together, so two epochs (the one ending and the one beginning) cover them;
    a rank further apart computes its epoch again, as each rank did before.
    """

    def __init__(self, members: np.ndarray, shuffle: bool, keep: int = 2) -> None:
        self.members = members
        self.shuffle = shuffle
        self.keep = max(1, keep)
        self._orders: dict[tuple[int, int], np.ndarray] = {}  # (seed, epoch) -> global order, least recent first

    def rank_order(self, seed: int, epoch: int, rank: int, world_size: int) -> np.ndarray:
        """``epoch_order`` of the members, from the global order of (seed, epoch) computed once."""
        key = (seed, epoch)
        order = self._orders.pop(key, None)
        if order is None:
            order = global_order(self.members, seed, epoch, shuffle=self.shuffle)
            while len(self._orders) >= self.keep:
                del self._orders[next(iter(self._orders))]
        self._orders[key] = order
        return deal(order, rank, world_size)


def batch_slice(step: int, batch_size: int, samples: int) -> slice:
    start = step * batch_size
    return slice(start, min(start + batch_size, samples))


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The augmentation random stream of one sample in one epoch."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, index, _AUGMENT_STREAM])))


__all__ = ["EpochOrders", "batch_len", "batch_slice", "deal", "epoch_order", "global_order", "sample_rng", "samples_per_rank",
           "steps_per_epoch"]
