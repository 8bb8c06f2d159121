"""prefetchd.daemon.transforms: torchvision's RandomResizedCrop/flip and
Resize+CenterCrop semantics, decoded as ImageFolder's loader decodes."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw, ImageFilter
from torchvision.datasets.folder import pil_loader
from torchvision.transforms import RandomResizedCrop, v2
from torchvision.transforms.v2 import functional as F

from prefetchd.daemon.sampler import sample_rng
from prefetchd.daemon.transforms import augment, center_crop_box, load_rgb, random_resized_crop_box


def smooth_image(path: Path, w: int, h: int, seed: int = 0) -> Path:
    """Gradients plus blurred blobs: detail that shows a misplaced crop, without
    the pixel noise on which two correct resamplers disagree."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 255, w)[None, :, None]
    y = np.linspace(0, 255, h)[:, None, None]
    arr = np.concatenate([np.broadcast_to(x, (h, w, 1)), np.broadcast_to(y, (h, w, 1)),
                          np.broadcast_to((x + y) / 2, (h, w, 1))], axis=2).astype(np.uint8)
    img = Image.fromarray(arr)
    draw = ImageDraw.Draw(img)
    for _ in range(8):
        cx, cy = int(rng.integers(0, w)), int(rng.integers(0, h))
        r = int(rng.integers(5, max(6, min(w, h) // 4)))
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    img = img.filter(ImageFilter.GaussianBlur(max(1, min(w, h) // 40)))
    img.save(path)
    return path


# -- random_resized_crop_box ----------------------------------------------------------


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


# -- center_crop_box -----------------------------------------------------------------


@pytest.mark.parametrize(("w", "h", "size"), [(640, 480, 224), (480, 640, 224), (300, 200, 64), (123, 457, 32),
                                              (224, 224, 224), (1000, 40, 32), (50, 300, 56)])
def test_center_box_is_torchvisions_region(w: int, h: int, size: int) -> None:
    left, top, right, bottom = center_crop_box(w, h, size)
    side = right - left
    assert side == pytest.approx(bottom - top)
    assert (left + right) / 2 == pytest.approx(w / 2) and (top + bottom) / 2 == pytest.approx(h / 2)
    assert 0 <= left and 0 <= top and right <= w and bottom <= h
    # torchvision: the shorter side becomes R = int(size / 0.875), then a size x size
    # centre crop, i.e. size / R of the short side in original pixels
    short = min(w, h)
    resized = int(size / 0.875)
    tv_side = size * short / resized
    assert side == pytest.approx(tv_side, rel=1e-9)


@pytest.mark.parametrize(("w", "h", "size"), [(640, 480, 224), (500, 375, 100), (300, 200, 64),
                                              (333, 500, 112), (50, 300, 56)])
def test_val_augment_matches_torchvision(tmp_path: Path, w: int, h: int, size: int) -> None:
    path = smooth_image(tmp_path / "img.png", w, h, seed=w)
    ours = augment(path, size, train=False, rng=None)
    pipeline = v2.Compose([v2.Resize(int(size / 0.875), antialias=True), v2.CenterCrop(size)])
    ref = np.asarray(pipeline(Image.open(path).convert("RGB")))
    assert ours.shape == ref.shape == (size, size, 3) and ours.dtype == np.uint8
    assert np.abs(ours.astype(np.int16) - ref.astype(np.int16)).mean() < 3.0


def test_val_augment_is_deterministic_without_rng(tmp_path: Path) -> None:
    path = smooth_image(tmp_path / "img.png", 120, 90)
    assert np.array_equal(augment(path, 32, train=False, rng=None), augment(path, 32, train=False, rng=None))


# -- augment (train) -----------------------------------------------------------------


@pytest.mark.parametrize(("w", "h", "size"), [(200, 150, 48), (1, 1, 8), (3, 500, 16), (64, 64, 64), (40, 30, 96)])
def test_train_augment_shape_and_determinism(make_image: Callable[..., Path], tmp_path: Path,
                                             w: int, h: int, size: int) -> None:
    path = make_image(tmp_path / "img.png", size=(w, h))
    out = augment(path, size, train=True, rng=sample_rng(1, 2, 3))
    assert out.shape == (size, size, 3) and out.dtype == np.uint8
    assert np.array_equal(out, augment(path, size, train=True, rng=sample_rng(1, 2, 3)))


def test_train_augment_varies_with_the_stream(make_image: Callable[..., Path], tmp_path: Path) -> None:
    path = make_image(tmp_path / "img.png", size=(120, 90))
    outs = {augment(path, 32, train=True, rng=sample_rng(0, epoch, 5)).tobytes() for epoch in range(8)}
    assert len(outs) == 8


def test_train_augment_needs_an_rng(make_image: Callable[..., Path], tmp_path: Path) -> None:
    path = make_image(tmp_path / "img.png")
    with pytest.raises(ValueError):
        augment(path, 16, train=True, rng=None)


def test_train_augment_is_torchvisions_resized_crop(make_image: Callable[..., Path], tmp_path: Path) -> None:
    # The crop box and the flip are drawn from the sample's stream in that order.
    path = make_image(tmp_path / "img.png", size=(200, 150), seed=3)
    img = Image.open(path).convert("RGB")
    for seed in range(6):
        out = augment(path, 48, train=True, rng=sample_rng(seed, 0, 0))
        rng = sample_rng(seed, 0, 0)
        left, top, right, bottom = random_resized_crop_box(200, 150, rng)
        flip = rng.random() < 0.5
        ref = F.resized_crop(img, top, left, bottom - top, right - left, [48, 48], antialias=True)
        if flip:
            ref = F.horizontal_flip(ref)
        assert np.abs(out.astype(np.int16) - np.asarray(ref).astype(np.int16)).mean() < 1.5


def test_flip_happens_about_half_the_time(tmp_path: Path) -> None:
    # A left-to-right ramp: the output's left edge is darker than its right edge
    # unless the crop was flipped.
    ramp = np.broadcast_to(np.arange(256, dtype=np.uint8)[None, :, None], (192, 256, 3)).copy()
    path = tmp_path / "ramp.png"
    Image.fromarray(ramp).save(path)
    flips = 0
    trials = 300
    for seed in range(trials):
        out = augment(path, 16, train=True, rng=sample_rng(seed, 0, 0)).astype(int)
        left, right = out[:, 0, 0].mean(), out[:, -1, 0].mean()
        assert left != right
        flips += left > right
    assert 0.4 * trials < flips < 0.6 * trials


# -- load_rgb ----------------------------------------------------------------------


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    arr = np.zeros((20, 40, 3), dtype=np.uint8)  # 40 wide, 20 high
    arr[:10, :10] = (255, 0, 0)  # red block at the stored top-left
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    rotated = tmp_path / "rot6.jpg"
    Image.fromarray(arr).save(rotated, exif=exif, quality=95)
    plain = tmp_path / "plain.jpg"
    Image.fromarray(arr).save(plain, quality=95)

    assert load_rgb(plain).size == (40, 20)
    img = load_rgb(rotated)
    assert img.mode == "RGB" and img.size == (20, 40)
    px = np.asarray(img).astype(int)
    assert px[:10, -10:, 0].mean() > 200 and px[:10, -10:, 1].mean() < 60  # red now top-right
    assert px[:10, :10, 0].mean() < 60


def _save_mode(path: Path, mode: str) -> Path:
    rng = np.random.default_rng(0)
    base = Image.fromarray(rng.integers(0, 256, (9, 13, 3), dtype=np.uint8))
    if mode == "L":
        base.convert("L").save(path)
    elif mode == "P":
        base.convert("P", palette=Image.Palette.ADAPTIVE, colors=16).save(path)
    elif mode == "RGBA":
        rgba = base.convert("RGBA")
        rgba.putalpha(Image.fromarray(rng.integers(0, 256, (9, 13), dtype=np.uint8)))
        rgba.save(path)
    elif mode == "CMYK":
        base.convert("CMYK").save(path, quality=95)
    elif mode == "I;16":
        Image.fromarray(rng.integers(0, 300, (9, 13), dtype=np.uint16)).save(path)
    elif mode == "LA":
        base.convert("LA").save(path)
    elif mode == "1":
        base.convert("1").save(path)
    return path


@pytest.mark.parametrize(("mode", "suffix"), [("L", ".png"), ("P", ".png"), ("RGBA", ".png"), ("CMYK", ".jpg"),
                                             ("I;16", ".png"), ("LA", ".png"), ("1", ".png"), ("L", ".jpg")])
def test_modes_become_rgb_like_imagefolder(tmp_path: Path, mode: str, suffix: str) -> None:
    path = _save_mode(tmp_path / f"img{suffix}", mode)
    with Image.open(path) as raw:
        assert raw.mode == mode  # the file really is in that mode
    img = load_rgb(path)
    assert img.mode == "RGB" and img.size == (13, 9)
    assert np.array_equal(np.asarray(img), np.asarray(pil_loader(str(path))))
    out = augment(path, 8, train=True, rng=sample_rng(0, 0, 0))
    assert out.shape == (8, 8, 3) and out.dtype == np.uint8


def test_cmyk_colours_survive(tmp_path: Path) -> None:
    path = tmp_path / "cyan.jpg"
    Image.new("CMYK", (8, 8), (255, 0, 0, 0)).save(path, quality=95)
    r, g, b = np.asarray(load_rgb(path))[4, 4].astype(int)
    assert r < 20 and g > 235 and b > 235


# -- broken files ----------------------------------------------------------------------


def test_truncated_jpeg_raises(make_image: Callable[..., Path], tmp_path: Path) -> None:
    path = make_image(tmp_path / "t.jpg", size=(64, 64))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 6 // 10])
    with pytest.raises(Exception):
        augment(path, 16, train=True, rng=sample_rng(0, 0, 0))
    with pytest.raises(Exception):
        augment(path, 16, train=False, rng=None)


@pytest.mark.parametrize("content", [b"just some text\n", b"", b"\xff\xd8\xff\xe0garbage"])
def test_non_images_raise(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "fake.jpg"
    path.write_bytes(content)
    with pytest.raises(Exception):
        augment(path, 16, train=True, rng=sample_rng(0, 0, 0))


def test_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        augment(tmp_path / "gone.jpg", 16, train=False, rng=None)
