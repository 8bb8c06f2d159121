"""prefetchd.daemon.jpeg_crop: the crop-aware decoder gives exactly the box a full decode
gives, and refuses every file a full decode would fail or warn on; once a file has decoded
cleanly to its end (CleanFiles), later crops stop after their last row with the same pixels."""

from __future__ import annotations

import io
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFilter

from prefetchd.bad_images import make_bad_images
from prefetchd.daemon import jpeg_crop
from prefetchd.daemon.sampler import sample_rng
from prefetchd.daemon.sources.storage import ImageRefused, read_bytes
from prefetchd.daemon.jpeg_crop import CleanFiles, TrackedFile
from prefetchd.daemon.transforms import augment_bytes

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")
needs_extension = pytest.mark.skipif(
    not jpeg_crop.available(),
    reason="prefetchd.daemon._cropjpeg is not built (no C compiler or libjpeg-turbo headers at install time)")


def photo(w: int, h: int, seed: int) -> np.ndarray:
    """Colourful detail at every scale: chroma edges show a wrong upsampling at once."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize((w, h), Image.Resampling.BICUBIC).filter(ImageFilter.GaussianBlur(2)))
    grain = rng.normal(0, 12, (h, w, 3))
    return np.clip(smooth + grain, 0, 255).astype(np.uint8)


def jpeg_bytes(arr: np.ndarray, **kw: object) -> bytearray:
    """``arr`` as JPEG; ``mode`` converts first, the rest are Pillow's JPEG options."""
    out = io.BytesIO()
    mode = str(kw.pop("mode", "RGB"))
    Image.fromarray(arr).convert(mode).save(out, "JPEG", **{"quality": 90, **kw})
    return bytearray(out.getvalue())


def full_decode(data: bytearray, scale: int) -> np.ndarray:
    """The whole-image paths of transforms: decode_jpeg at full scale, Pillow's draft below."""
    if scale == 1:
        from torchvision.io import ImageReadMode, decode_jpeg

        chw = decode_jpeg(torch.frombuffer(data, dtype=torch.uint8), mode=ImageReadMode.RGB)
        return np.asarray(chw.permute(1, 2, 0).numpy())
    with Image.open(io.BytesIO(data)) as img:
        img.draft("RGB", (img.width // scale, img.height // scale))
        return np.asarray(img.convert("RGB"))


def boxes(w: int, h: int, seed: int, count: int) -> list[tuple[int, int, int, int]]:
    """Random boxes plus the ones at the edges, where the MCU grid and the image end meet."""
    rng = np.random.default_rng(seed)
    out = [(0, 0, w, h), (0, 0, 1, 1), (w - 1, h - 1, w, h), (1, 1, w - 1, h - 1), (16, 16, 32, 32),
           (15, 17, w - 15, h - 17), (w - 9, 0, w, h)]
    for _ in range(count):
        left, right = sorted(int(v) for v in rng.choice(w + 1, 2, replace=False))
        top, bottom = sorted(int(v) for v in rng.choice(h + 1, 2, replace=False))
        out.append((left, top, right, bottom))
    return [(x0, y0, x1, y1) for x0, y0, x1, y1 in out if 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h]


ENCODINGS: dict[str, dict[str, object]] = {
    "4:2:0": {"subsampling": 2},
    "4:2:2": {"subsampling": 1},
    "4:4:4": {"subsampling": 0},
    "grayscale": {"mode": "L"},
    "progressive 4:2:0": {"progressive": True, "subsampling": 2},
    "restart markers": {"subsampling": 2, "restart_marker_blocks": 3},
    "low quality 4:2:0": {"subsampling": 2, "quality": 40},
}


@needs_extension
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("scale", [1, 2, 4, 8])
def test_the_box_equals_the_full_decodes_crop(encoding: str, scale: int) -> None:
    kw = dict(ENCODINGS[encoding])
    data = jpeg_bytes(photo(333, 251, seed=scale), **kw)  # not a multiple of any MCU size
    if "restart_marker_blocks" in kw and b"\xff\xdd" not in data:
        pytest.skip("this Pillow writes no restart markers")
    full = full_decode(data, scale)
    h, w = full.shape[:2]
    assert (w, h) == (-(-333 // scale), -(-251 // scale))
    for left, top, right, bottom in boxes(w, h, seed=scale, count=25):
        for to_end in (True, False):
            got = jpeg_crop.decode_box(data, scale, left, top, right, bottom, to_end)
            assert got is not None
            assert got.flags.c_contiguous and got.flags.writeable
            want = full[top:bottom, left:right]
            assert got.shape == want.shape, (left, top, right, bottom)
            assert np.array_equal(got, want), (encoding, scale, (left, top, right, bottom), to_end)


@needs_extension
@pytest.mark.parametrize("what", ["truncated", "corrupt scan", "cmyk", "not a jpeg", "empty", "box outside"])
def test_refuses_what_a_full_decode_would_not_decode_cleanly(what: str) -> None:
    data = jpeg_bytes(photo(200, 160, seed=1), subsampling=2)
    box = (0, 0, 40, 40)  # at the top: the damage below it is still found
    if what == "truncated":
        data = data[: len(data) * 2 // 3]
    elif what == "corrupt scan":
        data[len(data) * 2 // 3: len(data) * 2 // 3 + 40] = bytes(range(0xC0, 0xE8))
    elif what == "cmyk":
        data = jpeg_bytes(photo(200, 160, seed=1), mode="CMYK")
    elif what == "not a jpeg":
        data = bytearray(b"\xff\xd8\xff this is not a JPEG" * 4)
    elif what == "empty":
        data = bytearray()
    else:
        box = (150, 100, 201, 120)
    assert jpeg_crop.decode_box(data, 1, *box) is None


@needs_extension
@pytest.mark.parametrize("damage", ["truncated", "corrupt scan"])
def test_only_a_decode_to_the_end_finds_damage_below_the_box(damage: str) -> None:
    # Why CleanFiles exists: stopping after the box is safe only for a file known to be clean.
    intact = jpeg_bytes(photo(200, 160, seed=1), subsampling=2)
    data = bytearray(intact)
    if damage == "truncated":
        data = data[: len(data) * 2 // 3]
    else:
        data[len(data) * 2 // 3: len(data) * 2 // 3 + 40] = bytes(range(0xC0, 0xE8))
    above, inside = (0, 0, 40, 40), (0, 0, 200, 160)
    assert jpeg_crop.decode_box(data, 1, *above) is None
    stopped = jpeg_crop.decode_box(data, 1, *above, to_end=False)
    assert stopped is not None and np.array_equal(stopped, full_decode(intact, 1)[:40, :40])
    if damage == "truncated":  # data that ends inside the box: refused either way
        assert jpeg_crop.decode_box(data, 1, *inside, to_end=False) is None


@needs_extension
def test_what_one_worker_learns_the_others_know() -> None:
    # A real forkserver child, as the pool starts its workers: the table travels as a descriptor.
    table = CleanFiles(1000)
    assert not table.known_clean(999, 1234)
    ctx = multiprocessing.get_context("forkserver")
    child = ctx.Process(target=_record, args=(table, 999, 1234))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert table.known_clean(999, 1234)
    assert not table.known_clean(999, 1235) and not table.known_clean(998, 1234)  # another size, another sample
    table.record_clean(5, 1 << 32)  # too large to remember: checked every time
    assert not table.known_clean(5, 1 << 32) and not table.known_clean(5, 0)
    table.close()
    alone = CleanFiles(10, shared=False)  # a Ray worker's: pickled, it starts empty elsewhere
    alone.record_clean(3, 77)
    assert alone.known_clean(3, 77)


def _record(table: CleanFiles, sample: int, nbytes: int) -> None:
    table.record_clean(sample, nbytes)


def with_luma_sampling(data: bytearray, factors: int) -> bytearray:
    """``data`` with the first component's sampling factors in the frame header set to
    ``factors`` (0xHV): how to make the 4:4:0 and 4:1:1 files Pillow cannot write."""
    sof = data.index(b"\xff\xc0")
    out = bytearray(data)
    out[sof + 11] = factors  # marker 2, length 2, precision 1, height 2, width 2, count 1, then id, HV
    return out


@needs_extension
@pytest.mark.parametrize("factors", [0x12, 0x41])  # 4:4:0, 4:1:1
def test_rarer_subsamplings_decode_in_full(monkeypatch: pytest.MonkeyPatch, factors: int) -> None:
    data = with_luma_sampling(jpeg_bytes(photo(96, 64, seed=2), subsampling=0), factors)
    with Image.open(io.BytesIO(data)) as img:
        assert img.layer[0][1:3] == (factors >> 4, factors & 15)  # type: ignore[attr-defined]
    assert jpeg_crop.decode_box(data, 1, 0, 0, 16, 16) is None
    fast, whole = augment_both_ways(data, monkeypatch, 32, train=True, seed=0)
    assert same(fast, whole)


def augment_both_ways(data: bytearray, monkeypatch: pytest.MonkeyPatch, size: int, train: bool,
                      seed: int, tracked: TrackedFile | None = None) -> tuple[object, object]:
    """``augment_bytes`` with the crop-aware decoder (and ``tracked``) and without it: the array,
    or the exception type."""
    results: list[object] = []
    for extension in (jpeg_crop._extension, None):
        with monkeypatch.context() as m:
            m.setattr(jpeg_crop, "_extension", extension)
            try:
                results.append(augment_bytes(data, "x.jpg", size, train, sample_rng(seed, 0, 7) if train else None,
                                             tracked=tracked if extension else None))
            except Exception as exc:  # the file's verdict, compared below
                results.append(type(exc))
    return results[0], results[1]


def same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and bool(np.array_equal(a, b))
    return a == b


@needs_extension
@pytest.mark.parametrize("size", [64, 224])  # 64: most crops of a 600 px image are DCT-scaled
def test_augment_gives_the_same_bytes_with_or_without_the_extension(monkeypatch: pytest.MonkeyPatch,
                                                                    size: int) -> None:
    decoded: list[tuple[int, bool]] = []
    real = jpeg_crop.decode_box

    def counting(data: bytearray, scale: int, left: int, top: int, right: int, bottom: int,
                 to_end: bool = True) -> np.ndarray | None:
        decoded.append((scale, to_end))
        return real(data, scale, left, top, right, bottom, to_end)

    monkeypatch.setattr(jpeg_crop, "decode_box", counting)
    table = CleanFiles(len(ENCODINGS), shared=False)
    for i, encoding in enumerate(ENCODINGS):
        kw = dict(ENCODINGS[encoding])
        data = jpeg_bytes(photo(600, 450, seed=i), **kw)
        for seed in range(6):  # the first decode reads the file to its end, the others stop after the box
            fast, whole = augment_both_ways(data, monkeypatch, size, train=True, seed=seed, tracked=TrackedFile(table, i))
            assert isinstance(fast, np.ndarray) and same(fast, whole), (encoding, seed)
        fast, whole = augment_both_ways(data, monkeypatch, size, train=False, seed=0, tracked=TrackedFile(table, i))
        assert same(fast, whole), encoding
    assert len(decoded) == len(ENCODINGS) * 7  # every sample took the crop-aware path
    assert [to_end for _scale, to_end in decoded] == [True, *[False] * 6] * len(ENCODINGS)
    scales = {scale for scale, _to_end in decoded}
    assert {1} <= scales if size == 224 else {2, 4} <= scales  # unscaled and DCT-scaled both ran


@needs_extension
@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("size", [24, 64])  # 24: DCT-scaled crops of a 160 x 96 image
def test_exif_orientations_give_the_same_bytes(monkeypatch: pytest.MonkeyPatch, orientation: int, size: int) -> None:
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = jpeg_bytes(photo(161, 97, seed=orientation), exif=exif.tobytes())
    scales: list[int] = []
    real = jpeg_crop.decode_box

    def counting(data: bytearray, scale: int, left: int, top: int, right: int, bottom: int,
                 to_end: bool = True) -> np.ndarray | None:
        scales.append(scale)
        return real(data, scale, left, top, right, bottom, to_end)

    monkeypatch.setattr(jpeg_crop, "decode_box", counting)
    table = CleanFiles(1, shared=False)
    for seed in range(8):
        fast, whole = augment_both_ways(data, monkeypatch, size, train=True, seed=seed, tracked=TrackedFile(table, 0))
        assert isinstance(fast, np.ndarray) and same(fast, whole), seed
    fast, whole = augment_both_ways(data, monkeypatch, size, train=False, seed=0)
    assert same(fast, whole)
    assert len(scales) == 9 and (size == 64 or max(scales) > 1)


@needs_extension
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_the_bad_image_corpus_gets_the_same_verdicts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = make_bad_images(tmp_path / "corpus")
    files = [*corpus.valid, *corpus.undecodable]
    table = CleanFiles(len(files), shared=False)
    checked = 0
    for sample, relative in enumerate(files):
        try:
            data = read_bytes(corpus.root / relative)
        except (OSError, ImageRefused):
            continue  # a FIFO, a broken link, mode 000: refused before any decoder runs
        for train in (True, False, True):  # the second and third decode know what the first learnt
            fast, whole = augment_both_ways(data, monkeypatch, 32, train, seed=1, tracked=TrackedFile(table, sample))
            assert same(fast, whole), relative
        checked += 1
    assert checked >= len(corpus.valid)


def test_the_summary_names_the_decoder_and_how_to_get_the_fast_one(monkeypatch: pytest.MonkeyPatch) -> None:
    if jpeg_crop.available():
        assert "crop-aware (libjpeg-turbo " in jpeg_crop.decoder_summary()
    monkeypatch.setattr(jpeg_crop, "_extension", None)
    summary = jpeg_crop.decoder_summary()
    assert "whole-image" in summary and "libjpeg62-turbo-dev" in summary and "pip install -e . in a checkout" in summary
    # Not from a checkout: pip reinstalls the wheel it built without the extension, from its cache, unless told not to.
    assert "pip install --force-reinstall --no-deps --no-cache-dir --no-binary prefetchd prefetchd" in summary
    assert jpeg_crop.decode_box(jpeg_bytes(photo(32, 32, seed=0)), 1, 0, 0, 8, 8) is None



@needs_extension
@settings(max_examples=60, deadline=None)
@given(w=st.integers(1, 70), h=st.integers(1, 70), subsampling=st.sampled_from([0, 1, 2]),
       scale=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_any_size_any_box(w: int, h: int, subsampling: int, scale: int, data: st.DataObject) -> None:
    # Images narrower or shorter than one MCU, boxes of one pixel, boxes touching every edge.
    assume(min(w, h) >= scale)  # the daemon scales only crops of at least 2 x scale x output pixels
    jpeg = jpeg_bytes(photo(w, h, seed=w * 71 + h), subsampling=subsampling)
    full = full_decode(jpeg, scale)
    fh, fw = full.shape[:2]
    left = data.draw(st.integers(0, fw - 1))
    top = data.draw(st.integers(0, fh - 1))
    right = data.draw(st.integers(left + 1, fw))
    bottom = data.draw(st.integers(top + 1, fh))
    for to_end in (True, False):
        got = jpeg_crop.decode_box(jpeg, scale, left, top, right, bottom, to_end)
        assert got is not None and np.array_equal(got, full[top:bottom, left:right])
