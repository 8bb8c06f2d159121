"""prefetchd.daemon.sampler: epoch order and per-sample random streams are pure
functions of (seed, epoch, rank, world size) and (seed, epoch, index)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefetchd.daemon.sampler import (
    batch_len,
    batch_slice,
    epoch_order,
    sample_rng,
    samples_per_rank,
    steps_per_epoch,
)

members_st = st.lists(st.integers(0, 10**6), min_size=1, max_size=300, unique=True).map(
    lambda xs: np.asarray(sorted(xs), dtype=np.int64)
)


@settings(max_examples=80, deadline=None)
@given(members=members_st, seed=st.integers(0, 2**63 - 1), epoch=st.integers(0, 10**4))
def test_order_is_a_deterministic_permutation(members: np.ndarray, seed: int, epoch: int) -> None:
    before = members.copy()
    order = epoch_order(members, seed, epoch, shuffle=True)
    assert order.dtype == np.int64
    assert sorted(order.tolist()) == members.tolist()
    assert np.array_equal(epoch_order(members, seed, epoch, shuffle=True), order)
    assert np.array_equal(members, before)  # the caller's array is left alone


def test_epochs_and_seeds_give_different_orders() -> None:
    members = np.arange(0, 400, 2, dtype=np.int64)
    orders = {tuple(epoch_order(members, seed, epoch, shuffle=True).tolist())
              for seed in (0, 1, 2**40) for epoch in range(5)}
    assert len(orders) == 15
    assert tuple(members.tolist()) not in orders


def test_no_shuffle_keeps_the_order() -> None:
    members = np.asarray([9, 3, 7, 1, 100], dtype=np.int64)
    for seed, epoch in [(0, 0), (5, 3)]:
        assert epoch_order(members, seed, epoch, shuffle=False).tolist() == [9, 3, 7, 1, 100]


def _check_ranks(members: np.ndarray, seed: int, epoch: int, world_size: int, shuffle: bool = True) -> None:
    n = len(members)
    per_rank = samples_per_rank(n, world_size)
    assert per_rank == -(-n // world_size)
    ranks = [epoch_order(members, seed, epoch, shuffle=shuffle, rank=r, world_size=world_size)
             for r in range(world_size)]
    assert [len(r) for r in ranks] == [per_rank] * world_size
    counts = Counter(int(x) for r in ranks for x in r)
    assert set(counts) == set(members.tolist())  # every member, nothing else
    padding = world_size * per_rank - n
    assert sum(c - 1 for c in counts.values()) == padding
    assert max(counts.values()) <= -(-world_size * per_rank // n)  # padding repeats the order evenly
    # each rank is the same for a rank in a different run
    again = epoch_order(members, seed, epoch, shuffle=shuffle, rank=world_size - 1, world_size=world_size)
    assert np.array_equal(again, ranks[-1])
    # dealing round-robin: interleaving the ranks gives the one-rank order, then the padding
    interleaved = np.stack(ranks, axis=1).reshape(-1)
    alone = epoch_order(members, seed, epoch, shuffle=shuffle)
    assert np.array_equal(interleaved[:n], alone)
    assert np.array_equal(interleaved[n:], np.resize(alone, padding))


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("n", [4, 9, 10, 11, 12, 101])
def test_ranks_split_evenly(n: int, world_size: int) -> None:
    members = np.arange(5, 5 + 3 * n, 3, dtype=np.int64)
    _check_ranks(members, seed=7, epoch=2, world_size=world_size)
    _check_ranks(members, seed=7, epoch=2, world_size=world_size, shuffle=False)


@settings(max_examples=80, deadline=None)
@given(
    members=st.lists(st.integers(0, 10**6), min_size=1, max_size=200, unique=True).map(
        lambda xs: np.asarray(sorted(xs), dtype=np.int64)),
    world_size=st.integers(1, 8),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 100),
)
def test_ranks_split_evenly_property(members: np.ndarray, world_size: int, seed: int, epoch: int) -> None:
    _check_ranks(members, seed, epoch, world_size)


@pytest.mark.parametrize(("n", "world_size"), [(1, 3), (1, 4), (2, 5), (3, 8)])
def test_tiny_dataset_on_many_ranks(n: int, world_size: int) -> None:
    members = np.arange(n, dtype=np.int64)
    counts = [len(epoch_order(members, 0, 0, shuffle=True, rank=r, world_size=world_size))
              for r in range(world_size)]
    assert counts == [samples_per_rank(n, world_size)] * world_size


def test_a_rank_keeps_its_share_alone() -> None:
    # A slice of the padded order was a view keeping all of it alive: at ImageNet size in a world of 65536,
    # ~20 MB for a rank's 20 samples, in each of the epochs a stream keeps.
    members = np.arange(100_000, dtype=np.int64)
    for shuffle in (True, False):
        for world_size in (1000, 3):
            order = epoch_order(members, 5, 1, shuffle=shuffle, rank=2, world_size=world_size)
            assert order.base is None and order.nbytes == samples_per_rank(len(members), world_size) * 8


# -- batches ----------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(samples=st.integers(1, 5000), batch_size=st.integers(1, 600))
def test_batches_tile_the_epoch(samples: int, batch_size: int) -> None:
    steps = steps_per_epoch(samples, batch_size)
    assert (steps - 1) * batch_size < samples <= steps * batch_size
    covered: list[int] = []
    for step in range(steps):
        sl = batch_slice(step, batch_size, samples)
        n = batch_len(step, batch_size, samples)
        part = list(range(samples)[sl])
        assert len(part) == n > 0
        covered += part
        if step < steps - 1:
            assert n == batch_size
    assert covered == list(range(samples))
    assert sum(batch_len(s, batch_size, samples) for s in range(steps)) == samples
    last = batch_len(steps - 1, batch_size, samples)
    assert last == (samples % batch_size or batch_size)


def test_batches_examples() -> None:
    assert steps_per_epoch(10, 4) == 3
    assert [batch_len(s, 4, 10) for s in range(3)] == [4, 4, 2]
    assert batch_slice(2, 4, 10) == slice(8, 10)
    assert steps_per_epoch(8, 4) == 2 and batch_len(1, 4, 8) == 4
    assert steps_per_epoch(1, 128) == 1 and batch_len(0, 128, 1) == 1
    # drop_last: only full batches, each of the batch size.
    assert steps_per_epoch(10, 4, drop_last=True) == 2 and batch_len(1, 4, 10) == 4
    assert steps_per_epoch(8, 4, drop_last=True) == 2 and steps_per_epoch(3, 4, drop_last=True) == 0


# -- per-sample random streams ------------------------------------------------------


def _draw(seed: int, epoch: int, index: int) -> tuple[float, ...]:
    return tuple(sample_rng(seed, epoch, index).random(4).tolist())


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), epoch=st.integers(0, 10**6), index=st.integers(0, 2**31 - 1))
def test_sample_rng_is_reproducible(seed: int, epoch: int, index: int) -> None:
    assert _draw(seed, epoch, index) == _draw(seed, epoch, index)


# Golden values, computed once (numpy 2, torch/torchvision of this venv).  A draw compared with
# itself in one process cannot see a library upgrade that changes the streams; these can, and such
# a change breaks every buffer's bit-identity with its earlier batches (and every resume across it).
def test_epoch_order_is_pinned() -> None:
    members = np.arange(12, dtype=np.int64)
    assert epoch_order(members, 1234, 3, shuffle=True).tolist() == [0, 1, 7, 10, 11, 9, 4, 2, 8, 6, 3, 5]
    assert epoch_order(members, 1234, 3, shuffle=True, rank=1, world_size=5).tolist() == [1, 4, 5]


def test_sample_rng_is_pinned() -> None:
    assert sample_rng(1234, 3, 17).random(4).tolist() == [
        0.17040837385022567, 0.22287617179486519, 0.8909742902010762, 0.35534893099784315]
    assert sample_rng(2**63 - 1, 10**6, 2**31 - 1).integers(0, 2**32, 4).tolist() == [
        3089234565, 1179503587, 2481599456, 1741755836]


def test_augmented_pixels_are_pinned() -> None:
    """The stream as the daemon uses it: crop box, flip and jitter draws, then torchvision's resize
    and colour ops on a PNG that Pillow decodes: an upgrade of any of them that changes a pixel fails."""
    pytest.importorskip("torch", reason="augmenting needs torch (.ci/run's Python 3.10 stage runs without it)")
    import hashlib
    import io

    from PIL import Image

    from prefetchd.daemon.plan import AugmentOptions, random_resized_crop_box
    from prefetchd.daemon.transforms import augment_bytes

    assert random_resized_crop_box(640, 480, sample_rng(7, 0, 5)) == (26, 90, 332, 353)
    y, x = np.mgrid[0:48, 0:64]
    pixels = np.stack([(x * 4) % 256, (y * 5) % 256, ((x + y) * 3) % 256], -1).astype(np.uint8)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")

    def digest(train: bool, options: AugmentOptions) -> str:
        rng = sample_rng(7, 0, 5) if train else None
        out = augment_bytes(bytearray(png.getvalue()), "gradient.png", 32, train, rng, options)
        assert out.shape == (32, 32, 3)
        return hashlib.sha256(out.tobytes()).hexdigest()

    assert digest(True, AugmentOptions()) == "c94f115b94d7d5d544214369dffeffdccb49777a6ceb402da938bf95ed8258b4"
    assert digest(True, AugmentOptions(color_jitter=0.4)) == (
        "7028f51162436268030fefb79ea7e862f4b590caedb47851cba44193d432a38b")
    assert digest(False, AugmentOptions()) == "349dce698807fd42852967647cf8a6de07d952d79862fdfaa72e98819d81748d"


@settings(max_examples=60, deadline=None)
@given(
    a=st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 10**6), st.integers(0, 2**31 - 1)),
    b=st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 10**6), st.integers(0, 2**31 - 1)),
)
def test_sample_rng_differs_across_inputs(a: tuple[int, int, int], b: tuple[int, int, int]) -> None:
    if a != b:
        assert _draw(*a) != _draw(*b)


def test_sample_rng_neighbours_differ() -> None:
    base = (3, 1, 10)
    draws = {_draw(*base)}
    for delta in [(1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 0, -1), (0, -1, 0), (-1, 0, 0)]:
        draws.add(_draw(*(x + d for x, d in zip(base, delta))))
    # swapping the roles of the arguments must not alias either
    draws.add(_draw(1, 3, 10))
    draws.add(_draw(10, 1, 3))
    draws.add(_draw(3, 10, 1))
    assert len(draws) == 10


def test_sample_rng_is_independent_of_the_order_stream() -> None:
    # Epoch order and augmentation come from one seed but must not share a stream.
    members = np.arange(50, dtype=np.int64)
    order = epoch_order(members, 11, 0, shuffle=True)
    for index in range(64):
        assert not np.array_equal(sample_rng(11, 0, index).permutation(50), order)
