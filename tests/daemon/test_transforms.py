"""prefetchd.daemon.transforms: torchvision's RandomResizedCrop/flip and
Resize+CenterCrop semantics, decoded as ImageFolder's loader decodes."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.io
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw, ImageFilter, ImageOps, JpegImagePlugin
from torchvision.datasets.folder import pil_loader
from torchvision.transforms import RandomResizedCrop, v2
from torchvision.transforms.v2 import functional as F

from prefetchd.daemon import jpeg_crop, resample
from prefetchd.daemon.decode import draft_scale, load_rgb
from prefetchd.daemon.errors import ConfigError
from prefetchd.daemon.hook import HookError, load_hook, validate_hook
from prefetchd.daemon.plan import (AugmentOptions, center_crop_box, pixel_box, plan_sample, random_resized_crop_box,
                                   scale_jitter_box)
from prefetchd.daemon.sampler import sample_rng
from prefetchd.daemon.transforms import StageTimes, augment

# torchvision 0.29 announces that its decoders move to TorchCodec; they still work.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")


def smooth_image(path: Path, w: int, h: int, seed: int = 0) -> Path:
    """``smooth_array`` saved losslessly (PNG) or as the suffix says: detail that shows a
    misplaced crop, without the pixel noise on which two correct resamplers disagree."""
    Image.fromarray(smooth_array(w, h, seed)).save(path)
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
                                             ("LA", ".png"), ("1", ".png"), ("L", ".jpg")])  # I;16: test_bad_images
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


# -- the fast path: torchvision decode_jpeg, one resampler for every decoder ----------------


def smooth_array(w: int, h: int, seed: int = 0) -> np.ndarray:
    """Smooth RGB content (gradients and blurred blobs) as an H x W x 3 array."""
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
    return np.array(img.filter(ImageFilter.GaussianBlur(max(1, min(w, h) // 40))))


def save_jpeg(path: Path, arr: np.ndarray, **kw: object) -> Path:
    Image.fromarray(arr).save(path, "JPEG", quality=kw.pop("quality", 92), **kw)  # type: ignore[arg-type]
    return path


def png_twin(jpeg: Path) -> Path:
    """The JPEG's pixels as Pillow decodes them (EXIF applied), saved losslessly: same
    pixels, but the Pillow decode path."""
    twin = jpeg.with_suffix(".png")
    load_rgb(jpeg).save(twin)
    return twin


class DecoderSpy:
    """Counts torchvision JPEG decodes and records the scale of each Pillow draft decode."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # These tests are about the whole-image decoders: the crop-aware one steps aside
        # (tests/daemon/test_jpeg_crop.py tests it against them).
        monkeypatch.setattr(jpeg_crop, "_extension", None)
        self.jpeg_calls = 0
        self.draft_scales: list[int] = []
        real_decode = torchvision.io.decode_jpeg
        real_draft = JpegImagePlugin.JpegImageFile.draft

        def decode(*args: object, **kw: object) -> object:
            self.jpeg_calls += 1
            return real_decode(*args, **kw)  # type: ignore[arg-type]

        def draft(img: JpegImagePlugin.JpegImageFile, mode: str | None,
                  size: tuple[int, int] | None) -> object:
            width = img.size[0]
            result = real_draft(img, mode, size)
            if result is not None:
                self.draft_scales.append(round(width / result[1][2]))
            return result

        monkeypatch.setattr(torchvision.io, "decode_jpeg", decode)
        monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", draft)


def diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.astype(np.int16) - b.astype(np.int16))


@pytest.mark.parametrize("train", [True, False])
def test_fast_path_equals_the_pillow_path_on_the_same_pixels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             train: bool) -> None:
    # Both decoders are libjpeg-turbo and every path shares the crop box draw and the
    # resampler, so a JPEG and a lossless copy of its decoded pixels agree exactly.
    jpeg = save_jpeg(tmp_path / "img.jpg", smooth_array(333, 250, seed=4))
    twin = png_twin(jpeg)
    spy = DecoderSpy(monkeypatch)
    for seed in range(6):
        rng = sample_rng(seed, 0, 0) if train else None
        fast = augment(jpeg, 128, train, rng)  # no crop of a 250 px high image is twice 128: no draft
        assert spy.jpeg_calls == seed + 1 and spy.draft_scales == []
        slow = augment(twin, 128, train, sample_rng(seed, 0, 0) if train else None)
        assert spy.jpeg_calls == seed + 1  # the PNG never reaches decode_jpeg
        assert fast.shape == slow.shape == (128, 128, 3) and fast.dtype == slow.dtype == np.uint8
        assert fast.flags.c_contiguous
        assert diff(fast, slow).max() <= 1


def test_fast_path_is_torchvisions_random_resized_crop_on_uint8(tmp_path: Path) -> None:
    # Exactly torchvision's resized_crop + horizontal_flip on the decoded uint8 tensor,
    # with the box and flip drawn from the sample's stream in that order.  (160 px
    # from a 300 px high image: never a crop twice the output, so never a draft decode.)
    jpeg = save_jpeg(tmp_path / "img.jpg", smooth_array(400, 300, seed=1))
    img = load_rgb(jpeg)
    tensor = torch.from_numpy(np.array(img)).permute(2, 0, 1)
    flips = 0
    for seed in range(8):
        out = augment(jpeg, 160, True, sample_rng(seed, 3, 9))
        rng = sample_rng(seed, 3, 9)
        left, top, right, bottom = random_resized_crop_box(400, 300, rng)
        flip = rng.random() < 0.5
        flips += flip
        ref = F.resized_crop(tensor, top, left, bottom - top, right - left, [160, 160], antialias=True)
        ref = F.horizontal_flip(ref) if flip else ref
        assert np.array_equal(out, ref.permute(1, 2, 0).numpy())
        # Close to the previous implementation, Pillow's resize of the box; that one
        # also reads pixels just outside the box, so the borders differ a little more.
        old = img.resize((160, 160), Image.Resampling.BILINEAR, box=(left, top, right, bottom))
        old = old.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else old
        d = diff(out, np.asarray(old))
        assert d.mean() < 1.0 and np.percentile(d[3:-3, 3:-3], 99) <= 3
    assert 0 < flips < 8


def test_same_seed_same_bytes_different_seed_different_bytes(tmp_path: Path) -> None:
    jpeg = save_jpeg(tmp_path / "img.jpg", smooth_array(320, 240, seed=2))
    first = [augment(jpeg, 48, True, sample_rng(5, e, 11)).tobytes() for e in range(5)]
    again = [augment(jpeg, 48, True, sample_rng(5, e, 11)).tobytes() for e in reversed(range(5))][::-1]
    assert first == again
    assert len(set(first)) == 5


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_on_the_fast_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, orientation: int) -> None:
    arr = smooth_array(120, 80, seed=orientation)
    arr[:20, :20] = (255, 0, 0)  # a marker in the stored top-left corner
    exif = Image.Exif()
    exif[0x0112] = orientation
    jpeg = save_jpeg(tmp_path / "img.jpg", arr, exif=exif.tobytes())
    upright = np.asarray(ImageOps.exif_transpose(Image.open(jpeg)).convert("RGB"))
    assert upright.shape[:2] == ((120, 80) if orientation >= 5 else (80, 120))
    twin = tmp_path / "upright.png"
    Image.fromarray(upright).save(twin)
    spy = DecoderSpy(monkeypatch)
    for train in (True, False):
        fast = augment(jpeg, 40, train, sample_rng(1, 0, 0) if train else None)
        slow = augment(twin, 40, train, sample_rng(1, 0, 0) if train else None)
        assert diff(fast, slow).max() <= 1
    assert spy.jpeg_calls == 2


def test_cmyk_jpeg_goes_through_pillow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "cmyk.jpg"
    Image.fromarray(smooth_array(64, 48)).convert("CMYK").save(path, quality=95)
    spy = DecoderSpy(monkeypatch)
    out = augment(path, 32, False, None)
    assert spy.jpeg_calls == 0
    ref = np.asarray(load_rgb(path).resize((32, 32), Image.Resampling.BILINEAR, box=center_crop_box(64, 48, 32)))
    assert out.shape == (32, 32, 3) and diff(out, ref).mean() < 1.5


def test_grayscale_jpeg_becomes_three_equal_channels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gray.jpg"
    Image.fromarray(smooth_array(90, 70)).convert("L").save(path, quality=90)
    spy = DecoderSpy(monkeypatch)
    out = augment(path, 40, True, sample_rng(0, 0, 0))  # 70 px high: no crop is twice 40, so no draft
    assert spy.jpeg_calls == 1
    assert out.shape == (40, 40, 3)
    assert np.array_equal(out[..., 0], out[..., 1]) and np.array_equal(out[..., 1], out[..., 2])
    assert out.std() > 5  # not a flat image


def test_progressive_jpeg_on_the_fast_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arr = smooth_array(200, 150, seed=7)
    prog = save_jpeg(tmp_path / "prog.jpg", arr, progressive=True)
    with Image.open(prog) as img:
        assert img.info.get("progressive") or img.info.get("progression")
    spy = DecoderSpy(monkeypatch)
    out = augment(prog, 80, True, sample_rng(2, 0, 0))
    assert spy.jpeg_calls == 1
    assert diff(out, augment(png_twin(prog), 80, True, sample_rng(2, 0, 0))).max() <= 1


def test_a_jpeg_torchvision_refuses_falls_back_to_pillow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jpeg = save_jpeg(tmp_path / "img.jpg", smooth_array(100, 80))
    expected = augment(jpeg, 32, True, sample_rng(0, 0, 1))

    def refuse(*args: object, **kw: object) -> torch.Tensor:
        raise RuntimeError("decode_jpeg: unsupported")

    monkeypatch.setattr(torchvision.io, "decode_jpeg", refuse)
    assert diff(augment(jpeg, 32, True, sample_rng(0, 0, 1)), expected).max() <= 1


def test_exif_disagreement_falls_back_to_pillow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # If torchvision's EXIF reading ever disagreed with Pillow's (which sized the box),
    # Pillow decodes: the box is never applied to a differently oriented image.
    exif = Image.Exif()
    exif[0x0112] = 6
    jpeg = save_jpeg(tmp_path / "img.jpg", smooth_array(100, 60), exif=exif.tobytes())
    expected = augment(jpeg, 32, False, None)
    real = torchvision.io.decode_jpeg
    monkeypatch.setattr(torchvision.io, "decode_jpeg", lambda data, mode, apply_exif_orientation: real(data, mode=mode))
    assert diff(augment(jpeg, 32, False, None), expected).max() <= 1


# -- reduced-size (draft) decoding ------------------------------------------------------


@pytest.mark.parametrize(("side", "size", "scale"), [(100, 64, 1), (127, 64, 1), (128, 64, 2), (255, 64, 2),
                                                     (256, 64, 4), (511, 64, 4), (512, 64, 8), (5000, 64, 8),
                                                     (447, 224, 1), (448, 224, 2)])
def test_draft_scale_keeps_the_crop_at_least_the_output(side: int, size: int, scale: int) -> None:
    assert draft_scale((10, 20, 10 + side, 20 + side + 50), size) == scale
    assert draft_scale((0, 0, side + 50, side), size) == scale  # the shorter side decides
    assert side / scale >= size or scale == 1


def test_pixel_box_rounds_inside_the_image() -> None:
    assert pixel_box((0, 0, 10, 10), 10, 10) == (0, 0, 10, 10)
    assert pixel_box((1.4, 2.6, 7.5, 8.49), 10, 10) == (1, 3, 8, 8)
    assert pixel_box((-3.0, -1.0, 12.0, 11.0), 10, 10) == (0, 0, 10, 10)
    assert pixel_box((4.4, 4.4, 4.45, 4.45), 10, 10) == (4, 4, 5, 5)  # never empty
    assert pixel_box((9.9, 9.9, 10.0, 10.0), 10, 10) == (9, 9, 10, 10)


def test_draft_decode_only_when_the_crop_is_twice_the_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    jpeg = save_jpeg(tmp_path / "big.jpg", smooth_array(1000, 800, seed=5))
    spy = DecoderSpy(monkeypatch)
    # val at 64 px: the centre crop is 800 * 64 / 73 = 701 source pixels, 1/8 scale leaves 87 >= 64
    out = augment(jpeg, 64, False, None)
    assert spy.draft_scales == [8] and spy.jpeg_calls == 0
    # val at 400 px: the 800 * 400 / 457 = 700 px crop is under twice that -> full decode with torchvision
    augment(jpeg, 400, False, None)
    assert spy.draft_scales == [8] and spy.jpeg_calls == 1
    # train: the scale follows each sample's crop box
    for seed in range(30):
        rng = sample_rng(seed, 0, 0)
        w, h = 1000, 800
        expected = draft_scale(random_resized_crop_box(w, h, rng), 96)
        before = (len(spy.draft_scales), spy.jpeg_calls)
        augment(jpeg, 96, True, sample_rng(seed, 0, 0))
        if expected == 1:
            assert (len(spy.draft_scales), spy.jpeg_calls) == (before[0], before[1] + 1)
        else:
            assert spy.draft_scales[-1] == expected and spy.jpeg_calls == before[1]
    assert set(spy.draft_scales) >= {2, 4}
    # DCT scaling then resampling stays close to a full decode then resampling
    full = augment(png_twin(jpeg), 64, False, None)
    assert diff(out, full).mean() < 2.0
    assert np.array_equal(out, augment(jpeg, 64, False, None))


def test_draft_results_close_to_full_decode_in_train(tmp_path: Path) -> None:
    jpeg = save_jpeg(tmp_path / "big.jpg", smooth_array(1200, 900, seed=8))
    twin = png_twin(jpeg)
    drafted = 0
    for seed in range(12):
        rng = sample_rng(seed, 1, 2)
        drafted += draft_scale(random_resized_crop_box(1200, 900, rng), 80) > 1
        a = augment(jpeg, 80, True, sample_rng(seed, 1, 2))
        b = augment(twin, 80, True, sample_rng(seed, 1, 2))
        assert diff(a, b).mean() < 2.5
    assert drafted >= 6


def test_draft_with_exif_rotation(tmp_path: Path) -> None:
    arr = smooth_array(1000, 600, seed=3)
    arr[:150, :150] = (255, 0, 0)
    exif = Image.Exif()
    exif[0x0112] = 8
    jpeg = save_jpeg(tmp_path / "rot.jpg", arr, exif=exif.tobytes())
    assert draft_scale(center_crop_box(600, 1000, 32), 32) == 8
    out = augment(jpeg, 32, False, None)
    ref = augment(png_twin(jpeg), 32, False, None)
    assert diff(out, ref).mean() < 3.0


# -- stage timings ---------------------------------------------------------------------------


def test_stage_times_add_up(tmp_path: Path) -> None:
    jpeg = save_jpeg(tmp_path / "img.jpg", smooth_array(200, 150))
    times = StageTimes()
    augment(jpeg, 32, True, sample_rng(0, 0, 0), times=times)
    assert times.read > 0 and times.decode > 0 and times.augment > 0
    first = (times.read, times.decode, times.augment)
    augment(jpeg, 32, True, sample_rng(0, 0, 0), times=times)
    assert times.read > first[0] and times.decode > first[1] and times.augment > first[2]


def test_stage_times_count_a_failed_decode(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0garbage")
    times = StageTimes()
    with pytest.raises(Exception):
        augment(bad, 32, True, sample_rng(0, 0, 0), times=times)
    assert times.read > 0 and times.decode > 0 and times.augment == 0


# -- colour jitter ---------------------------------------------------------------------------


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


def test_color_jitter_is_torchvisions_ops_in_the_drawn_order(tmp_path: Path) -> None:
    jpeg = save_jpeg(tmp_path / "img.jpg", smooth_array(160, 120, seed=6))
    ops = [F.adjust_brightness, F.adjust_contrast, F.adjust_saturation]
    for seed in range(6):
        options = AugmentOptions(color_jitter=0.5)
        out = augment(jpeg, 48, True, sample_rng(seed, 0, 3), options)
        assert np.array_equal(out, augment(jpeg, 48, True, sample_rng(seed, 0, 3), options))
        plain = augment(jpeg, 48, True, sample_rng(seed, 0, 3))
        plan = plan_sample(160, 120, 48, True, sample_rng(seed, 0, 3), options)
        ref = torch.from_numpy(plain).permute(2, 0, 1).contiguous()
        for i in plan.jitter_order:
            ref = ops[i](ref, plan.jitter_factors[i])
        assert np.array_equal(out, ref.permute(1, 2, 0).numpy())
        assert not np.array_equal(out, plain)


def test_jittered_brightness_stays_within_the_strength(tmp_path: Path) -> None:
    path = tmp_path / "grey.png"
    Image.new("RGB", (64, 48), (128, 128, 128)).save(path)
    options = AugmentOptions(color_jitter=0.4)
    ratios = []
    for seed in range(60):
        out = augment(path, 16, True, sample_rng(seed, 0, 0), options)
        assert np.all(out == out[0, 0, 0])  # still uniform and grey
        ratios.append(out[0, 0, 0] / 128)
    # brightness moves a grey image by its factor in [0.6, 1.4]; contrast and saturation
    # only by torchvision's rounding of the grey level (127.99 -> 127)
    assert min(ratios) >= 0.6 - 0.03 and max(ratios) <= 1.4 + 0.01
    assert min(ratios) < 0.7 and max(ratios) > 1.3


# -- scale jitter ----------------------------------------------------------------------------


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


def test_scale_jitter_replaces_the_random_resized_crop(tmp_path: Path) -> None:
    jpeg = save_jpeg(tmp_path / "img.jpg", smooth_array(400, 300, seed=9))
    options = AugmentOptions(scale_jitter=(256, 480))
    outs = set()
    for seed in range(10):
        out = augment(jpeg, 224, True, sample_rng(seed, 0, 0), options)
        assert out.shape == (224, 224, 3)
        assert np.array_equal(out, augment(jpeg, 224, True, sample_rng(seed, 0, 0), options))
        plan = plan_sample(400, 300, 224, True, sample_rng(seed, 0, 0), options)
        left, top, right, bottom = plan.box
        assert right - left == bottom - top and 140 <= right - left <= 263
        outs.add(out.tobytes())
    assert len(outs) == 10


def test_scale_jitter_of_a_small_image_upsamples_the_whole_short_side() -> None:
    box = scale_jitter_box(50, 40, 224, (256, 480), np.random.default_rng(0))
    assert box[3] - box[1] <= 40 and box[2] - box[0] == box[3] - box[1] >= 1


# -- the user's transform hook -------------------------------------------------------------


HOOK_MODULE = """
import numpy as np
import torch

calls = []

def invert(image, rng):
    calls.append((tuple(image.shape), image.dtype, type(rng).__name__))
    return 255 - image

def noisy(image, rng):
    return (image.int() + int(rng.integers(0, 50))).clamp(0, 255).to(torch.uint8)

def wrong_shape(image, rng):
    return image[:, :-1]

def wrong_dtype(image, rng):
    return image.float()

def not_a_tensor(image, rng):
    return image.numpy()

def broken(image, rng):
    raise KeyError("oops")

class Holder:
    @staticmethod
    def flip(image, rng):
        return image.flip(-1)

NOT_CALLABLE = 3
"""


@pytest.fixture
def hook_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"prefetchd_test_hooks_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(HOOK_MODULE)
    (tmp_path / f"{name}_fails.py").write_text("raise ImportError('needs a GPU library')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    load_hook.cache_clear()
    return name


def test_validate_hook_finds_the_callable(hook_module: str) -> None:
    assert validate_hook(f"{hook_module}:invert").__name__ == "invert"
    assert validate_hook(f"{hook_module}:Holder.flip").__name__ == "flip"


@pytest.mark.parametrize(("suffix", "words"), [
    (":nowhere", ["no attribute", "nowhere"]),
    (":NOT_CALLABLE", ["int", "not a callable"]),
    (":Holder.nothing", ["no attribute"]),
])
def test_validate_hook_errors_say_what_is_wrong(hook_module: str, suffix: str, words: list[str]) -> None:
    name = hook_module + suffix
    with pytest.raises(ConfigError) as exc:
        validate_hook(name)
    assert repr(name) in str(exc.value)
    for word in words:
        assert word in str(exc.value)


def test_validate_hook_reports_import_failures(hook_module: str) -> None:
    for name, words in [("no_such_module_prefetchd:fn", ["cannot import", "ModuleNotFoundError", "PYTHONPATH"]),
                        (f"{hook_module}_fails:fn", ["cannot import", "needs a GPU library"])]:
        with pytest.raises(ConfigError) as exc:
            validate_hook(name)
        for word in words:
            assert word in str(exc.value)


def test_hook_runs_after_the_built_in_augmentation(tmp_path: Path, hook_module: str) -> None:
    import importlib

    module = importlib.import_module(hook_module)
    jpeg = save_jpeg(tmp_path / "img.jpg", smooth_array(120, 90))
    plain = augment(jpeg, 32, True, sample_rng(0, 0, 0))
    out = augment(jpeg, 32, True, sample_rng(0, 0, 0), AugmentOptions(transform=f"{hook_module}:invert"))
    assert np.array_equal(out, 255 - plain)
    assert module.calls == [((3, 32, 32), torch.uint8, "Generator")]
    val = augment(jpeg, 32, False, sample_rng(0, 0, 0), AugmentOptions(transform=f"{hook_module}:Holder.flip"))
    assert np.array_equal(val, augment(jpeg, 32, False, None)[:, ::-1])


def test_hook_draws_from_the_samples_stream(tmp_path: Path, hook_module: str) -> None:
    jpeg = save_jpeg(tmp_path / "img.jpg", smooth_array(120, 90))
    options = AugmentOptions(transform=f"{hook_module}:noisy", color_jitter=0.2)
    a = [augment(jpeg, 32, True, sample_rng(1, e, 0), options).tobytes() for e in range(4)]
    assert a == [augment(jpeg, 32, True, sample_rng(1, e, 0), options).tobytes() for e in range(4)]
    assert len(set(a)) == 4


@pytest.mark.parametrize(("hook", "words"), [
    ("wrong_shape", ["(3, 31, 32)", "(3, 32, 32)"]),
    ("wrong_dtype", ["torch.float32", "uint8"]),
    ("not_a_tensor", ["ndarray", "uint8 tensor"]),
    ("broken", ["KeyError", "oops"]),
    ("nowhere", ["no attribute"]),
])
def test_hook_failures_are_hook_errors(tmp_path: Path, hook_module: str, hook: str, words: list[str]) -> None:
    jpeg = save_jpeg(tmp_path / "img.jpg", smooth_array(60, 50))
    with pytest.raises(HookError) as exc:
        augment(jpeg, 32, True, sample_rng(0, 0, 0), AugmentOptions(transform=f"{hook_module}:{hook}"))
    assert f"{hook_module}:{hook}" in str(exc.value)
    for word in words:
        assert word in str(exc.value)


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


@settings(max_examples=25, deadline=None)
@given(w=st.integers(1, 700), h=st.integers(1, 700), size=st.integers(8, 256), seed=st.integers(0, 2**32 - 1),
       train=st.booleans())
def test_any_jpeg_gives_a_contiguous_slot_image(tmp_path_factory: pytest.TempPathFactory, w: int, h: int, size: int,
                                               seed: int, train: bool) -> None:
    path = tmp_path_factory.mktemp("any") / "img.jpg"
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(1, h // 16), max(1, w // 16), 3), dtype=np.uint8)
    Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR).save(path, quality=85)
    out = augment(path, size, train, sample_rng(seed, 0, 0) if train else None)
    assert out.shape == (size, size, 3) and out.dtype == np.uint8 and out.flags.c_contiguous
    assert np.array_equal(out, augment(path, size, train, sample_rng(seed, 0, 0) if train else None))


# -- what a worker imports --------------------------------------------------------


IMPORTS_OF_A_WORKER = """
import sys
from pathlib import Path
import numpy as np
from prefetchd.daemon.sampler import sample_rng
from prefetchd.daemon.plan import AugmentOptions
from prefetchd.daemon.transforms import augment_bytes, preload
jitter = sys.argv[2] == "jitter"
options = AugmentOptions(color_jitter=0.4 if jitter else None)
preload(options)
out = augment_bytes(bytearray(Path(sys.argv[1]).read_bytes()), sys.argv[1], 64, True, sample_rng(0, 0, 1), options)
assert out.shape == (64, 64, 3)
print("torch" in sys.modules, "torchvision" in sys.modules)
"""


@pytest.mark.skipif(not jpeg_crop.available(), reason="the crop-aware JPEG extension is not built here")
def test_a_worker_imports_torch_only_to_jitter(make_image: Callable[..., Path], tmp_path: Path) -> None:
    """Importing torch and torchvision is most of a worker's start (~1.8 + 1.6 s here): with the C
    extension a worker needs neither, unless it jitters colours (or, on a CPU without torch's uint8
    kernel, to resize: then torch alone)."""
    path = make_image(tmp_path / "a.jpg", size=(400, 300))
    imported = {}
    for mode in ("plain", "jitter"):
        run = subprocess.run([sys.executable, "-c", IMPORTS_OF_A_WORKER, str(path), mode], capture_output=True,
                             text=True, timeout=120)
        assert run.returncode == 0, run.stderr[-3000:]
        imported[mode] = run.stdout.strip()
    assert imported == {"plain": f"{not resample.uint8_kernel()} False", "jitter": "True True"}
