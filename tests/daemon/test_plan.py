"""prefetchd.daemon.plan: the random draws and the box arithmetic, without decoding an image:
torchvision's RandomResizedCrop box and its fallbacks, the Resize+CenterCrop region, boxes
rounded to pixels, and the colour-jitter and scale-jitter draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchvision.transforms import RandomResizedCrop, v2

from prefetchd.daemon.plan import (AugmentOptions, center_crop_box, pixel_box, plan_sample, random_resized_crop_box,
                                   scale_jitter_box)
from prefetchd.daemon.sampler import sample_rng


# -- random_resized_crop_box ---------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(w=st.integers(1, 2000), h=st.integers(1, 2000), seed=st.integers(0, 2**32 - 1))
def test_random_box_is_inside_the_image(w: int, h: int, seed: int) -> None:
    left, top, right, bottom = random_resized_crop_box(w, h, np.random.default_rng(seed))
    assert all(isinstance(v, int) for v in (left, top, right, bottom))
    assert 0 <= left < right <= w
    assert 0 <= top < bottom <= h


@pytest.mark.parametrize(("w", "h"), [(2000, 10), (10, 2000), (2000, 1), (1, 2000), (1000, 3), (7, 900)])
def test_fallback_for_extreme_aspect_ratios(w: int, h: int) -> None:
    # No crop of at least 8% of the area with a ratio in [3/4, 4/3] fits: every try
    # fails and the box is the centred largest crop with the ratio clamped.
    for seed in range(20):
        left, top, right, bottom = random_resized_crop_box(w, h, np.random.default_rng(seed))
        bw, bh = right - left, bottom - top
        if w > h:
            assert (bw, bh) == (int(round(h * 4 / 3)), h)
            assert bw / bh <= 4 / 3 + 0.5 / bh
        else:
            assert (bw, bh) == (w, int(round(w / (3 / 4))))
            assert bh / bw <= 4 / 3 + 0.5 / bw
        assert left == (w - bw) // 2 and top == (h - bh) // 2


def test_fallback_for_2000x10_exactly() -> None:
    assert random_resized_crop_box(2000, 10, np.random.default_rng(0)) == (993, 0, 1006, 10)
    assert random_resized_crop_box(10, 2000, np.random.default_rng(0)) == (0, 993, 10, 1006)


class _AlwaysTooBig:
    """An rng whose every draw is the upper bound: each try asks for the whole area
    at ratio 4/3, which does not fit a square, so all ten tries fail."""

    def uniform(self, lo: float, hi: float) -> float:
        return hi

    def integers(self, lo: int, hi: int) -> int:
        raise AssertionError("no try should succeed")


@pytest.mark.parametrize(("w", "h"), [(100, 100), (90, 100), (120, 100)])
def test_fallback_within_ratio_is_the_full_image(w: int, h: int) -> None:
    assert random_resized_crop_box(w, h, _AlwaysTooBig()) == (0, 0, w, h)  # type: ignore[arg-type]


@pytest.mark.parametrize(("w", "h"), [(1000, 800), (640, 480), (500, 900)])
def test_random_box_distribution(w: int, h: int) -> None:
    rng = np.random.default_rng(1234)
    fractions, log_ratios = [], []
    for _ in range(3000):
        left, top, right, bottom = random_resized_crop_box(w, h, rng)
        bw, bh = right - left, bottom - top
        fractions.append(bw * bh / (w * h))
        log_ratios.append(math.log(bw / bh))
    fr, lr = np.asarray(fractions), np.asarray(log_ratios)
    tol = 2.5 / min(w, h)  # integer rounding of the box sides
    assert fr.min() >= 0.08 - 2 * tol and fr.max() <= 1.0
    assert np.all(np.abs(lr) <= math.log(4 / 3) + tol)
    assert fr.min() < 0.1 and lr.min() < math.log(3 / 4) + 0.03 and lr.max() > math.log(4 / 3) - 0.03
    # the same distribution as torchvision's RandomResizedCrop, quantile by quantile
    torch.manual_seed(0)
    image = torch.empty(3, h, w)
    ref = []
    for _ in range(3000):
        _, _, th, tw = RandomResizedCrop.get_params(image, [0.08, 1.0], [3 / 4, 4 / 3])
        ref.append((tw * th / (w * h), math.log(tw / th)))
    ref_fr, ref_lr = np.asarray(ref).T
    q = [0.05, 0.25, 0.5, 0.75, 0.95]
    assert np.quantile(fr, q) == pytest.approx(np.quantile(ref_fr, q), abs=0.04)
    assert np.quantile(lr, q) == pytest.approx(np.quantile(ref_lr, q), abs=0.04)
    assert fr.mean() == pytest.approx(ref_fr.mean(), abs=0.02)
    # positions spread over the image too
    assert len({random_resized_crop_box(w, h, np.random.default_rng(s))[:2] for s in range(50)}) > 40


# -- center_crop_box -----------------------------------------------------------------------


def torchvision_region(w: int, h: int, size: int) -> tuple[float, float, float, float]:
    """The source region torchvision's Resize(int(size / 0.875)) + CenterCrop(size) keep, asked of torchvision
    itself: the resized size from resizing a w x h image, the crop's offset from cropping an image whose pixels
    hold their own column (row) number."""
    new_h, new_w = v2.functional.resize(torch.zeros(1, h, w, dtype=torch.uint8), int(size / 0.875)).shape[1:]
    cols = torch.arange(new_w, dtype=torch.float64).expand(1, new_h, new_w)
    rows = torch.arange(new_h, dtype=torch.float64)[:, None].expand(1, new_h, new_w)
    left = int(v2.functional.center_crop(cols, size)[0, 0, 0])
    top = int(v2.functional.center_crop(rows, size)[0, 0, 0])
    return (left * w / new_w, top * h / new_h, (left + size) * w / new_w, (top + size) * h / new_h)


@pytest.mark.parametrize(("w", "h", "size"), [(640, 480, 224), (480, 640, 224), (300, 200, 64), (123, 457, 32),
                                              (224, 224, 224), (1000, 40, 32), (50, 300, 56), (867, 894, 224)])
def test_center_box_is_torchvisions_region(w: int, h: int, size: int) -> None:
    """The last: the centred square of the ideal scale, kept before, was 3.4 source pixels off torchvision's region
    at the bottom (a user's walk), where the docs said half a source pixel."""
    box = center_crop_box(w, h, size)
    assert box == pytest.approx(torchvision_region(w, h, size), abs=1e-9)
    left, top, right, bottom = box
    assert 0 <= left and 0 <= top and right <= w and bottom <= h
    assert max(abs(a - b) for a, b in zip(pixel_box(box, w, h), box)) <= 0.5  # the docs' "half a source pixel"


@settings(max_examples=200, deadline=None)
@given(w=st.integers(1, 1200), h=st.integers(1, 1200), size=st.integers(1, 320))
def test_center_box_is_torchvisions_region_for_any_shape(w: int, h: int, size: int) -> None:
    assert center_crop_box(w, h, size) == pytest.approx(torchvision_region(w, h, size), abs=1e-9)


# -- pixel_box -----------------------------------------------------------------------------


def test_pixel_box_rounds_inside_the_image() -> None:
    assert pixel_box((0, 0, 10, 10), 10, 10) == (0, 0, 10, 10)
    assert pixel_box((1.4, 2.6, 7.5, 8.49), 10, 10) == (1, 3, 8, 8)
    assert pixel_box((-3.0, -1.0, 12.0, 11.0), 10, 10) == (0, 0, 10, 10)
    assert pixel_box((4.4, 4.4, 4.45, 4.45), 10, 10) == (4, 4, 5, 5)  # never empty
    assert pixel_box((9.9, 9.9, 10.0, 10.0), 10, 10) == (9, 9, 10, 10)


@settings(max_examples=300, deadline=None)
@given(w=st.integers(1, 3000), h=st.integers(1, 3000), data=st.data())
def test_pixel_box_is_inside_and_near_the_box(w: int, h: int, data: st.DataObject) -> None:
    left = data.draw(st.floats(0, w - 0.01))
    top = data.draw(st.floats(0, h - 0.01))
    right = data.draw(st.floats(left + 0.01, w))
    bottom = data.draw(st.floats(top + 0.01, h))
    pl, pt, pr, pb = pixel_box((left, top, right, bottom), w, h)
    assert 0 <= pl < pr <= w and 0 <= pt < pb <= h
    if right - left >= 1 and bottom - top >= 1:
        assert max(abs(pl - left), abs(pt - top), abs(pr - right), abs(pb - bottom)) <= 1.0


# -- colour jitter draws -------------------------------------------------------------------


def test_color_jitter_keeps_the_box_and_flip_draws() -> None:
    for seed in range(20):
        plain = plan_sample(500, 375, 224, True, sample_rng(seed, 0, 0))
        jittered = plan_sample(500, 375, 224, True, sample_rng(seed, 0, 0), AugmentOptions(color_jitter=0.4))
        assert (plain.box, plain.flip) == (jittered.box, jittered.flip)
        assert sorted(jittered.jitter_order) == [0, 1, 2]
        assert all(0.6 <= f <= 1.4 for f in jittered.jitter_factors)
        assert plain.jitter_order == () and plain.jitter_factors == ()


def test_color_jitter_draws_cover_the_range() -> None:
    plans = [plan_sample(64, 64, 32, True, sample_rng(s, 0, 0), AugmentOptions(color_jitter=0.8)) for s in range(400)]
    factors = np.array([p.jitter_factors for p in plans])
    assert factors.min() >= 0.2 and factors.max() <= 1.8
    assert factors.min() < 0.3 and factors.max() > 1.7
    assert len({p.jitter_order for p in plans}) == 6  # every order of the three operations
    strong = plan_sample(64, 64, 32, True, sample_rng(0, 0, 0), AugmentOptions(color_jitter=2.0))
    assert all(0.0 <= f <= 3.0 for f in strong.jitter_factors)  # factors never go below 0


# -- scale jitter box ----------------------------------------------------------------------


@pytest.mark.parametrize(("w", "h"), [(500, 375), (375, 500), (300, 300), (1000, 333)])
def test_scale_jitter_box_is_resnets_scale_augmentation(w: int, h: int) -> None:
    short = min(w, h)
    sides = []
    for seed in range(300):
        left, top, right, bottom = scale_jitter_box(w, h, 224, (256, 480), np.random.default_rng(seed))
        side = right - left
        assert side == bottom - top  # a square crop of the resized image is square here too
        assert 0 <= left and 0 <= top and right <= w and bottom <= h
        assert round(224 * short / 480) <= side <= round(224 * short / 256)
        sides.append(side)
    assert min(sides) <= round(224 * short / 470) and max(sides) >= round(224 * short / 266)


def test_scale_jitter_draws_the_shorter_side_first() -> None:
    rng = np.random.default_rng(3)
    shorter = int(np.random.default_rng(3).integers(256, 481))
    left, top, right, bottom = scale_jitter_box(640, 480, 224, (256, 480), rng)
    assert right - left == round(224 * 480 / shorter)


def test_scale_jitter_of_a_small_image_upsamples_the_whole_short_side() -> None:
    box = scale_jitter_box(50, 40, 224, (256, 480), np.random.default_rng(0))
    assert box[3] - box[1] <= 40 and box[2] - box[0] == box[3] - box[1] >= 1
