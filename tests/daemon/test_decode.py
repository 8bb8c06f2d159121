"""prefetchd.daemon.decode: which decoder runs (torchvision's decode_jpeg, Pillow, a reduced-size
draft decode) and what it yields: RGB as ImageFolder's loader decodes, EXIF orientation applied,
the same pixels whichever decoder ran, and an error for a file that is not a whole image."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.io
from PIL import Image, ImageOps, JpegImagePlugin
from torchvision.datasets.folder import pil_loader

from prefetchd.daemon import jpeg_crop
from prefetchd.daemon.decode import draft_scale, load_rgb
from prefetchd.daemon.plan import center_crop_box, random_resized_crop_box
from prefetchd.daemon.sampler import sample_rng
from prefetchd.daemon.transforms import augment
from tests.daemon.pictures import diff, save_jpeg, smooth_array

# torchvision 0.29 announces that its decoders move to TorchCodec; they still work.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")


# -- load_rgb: every mode becomes RGB, upright -----------------------------------------------


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



@pytest.mark.parametrize("orientation", range(1, 9))
def test_a_tiff_of_any_orientation_is_cropped_as_its_upright_image(tmp_path: Path, orientation: int) -> None:
    """Pillow gives a TIFF's size oriented and turns its pixels on load, yet still reads its orientation tag:
    orientations 5-8 were cropped as if the image were still stored sideways (a walk: mean difference 26-30)."""
    stored = Image.fromarray(smooth_array(120, 90, seed=orientation))
    exif = Image.Exif()
    exif[0x0112] = orientation
    tiff = tmp_path / "turned.tif"
    stored.save(tiff, exif=exif.tobytes())
    with_tag = tmp_path / "turned.png"  # a PNG of the same tag, which Pillow does not turn on load
    stored.save(with_tag, exif=exif.tobytes())
    upright = tmp_path / "upright.png"
    ImageOps.exif_transpose(Image.open(with_tag)).save(upright)
    assert Image.open(upright).size == (stored.size[::-1] if orientation >= 5 else stored.size)
    for train in (False, True):
        def out(path: Path) -> np.ndarray:
            return augment(path, 64, train=train, rng=sample_rng(3, 0, orientation) if train else None)
        assert np.array_equal(out(tiff), out(upright)), (orientation, train)
        assert np.array_equal(out(with_tag), out(upright)), (orientation, train)

# -- broken files --------------------------------------------------------------------------


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


# -- reduced-size (draft) decoding ---------------------------------------------------------


@pytest.mark.parametrize(("side", "size", "scale"), [(100, 64, 1), (127, 64, 1), (128, 64, 2), (255, 64, 2),
                                                     (256, 64, 4), (511, 64, 4), (512, 64, 8), (5000, 64, 8),
                                                     (447, 224, 1), (448, 224, 2)])
def test_draft_scale_keeps_the_crop_at_least_the_output(side: int, size: int, scale: int) -> None:
    assert draft_scale((10, 20, 10 + side, 20 + side + 50), size) == scale
    assert draft_scale((0, 0, side + 50, side), size) == scale  # the shorter side decides
    assert side / scale >= size or scale == 1


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
