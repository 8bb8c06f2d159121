"""prefetchd.daemon.transforms: the pipeline end to end: augment() is torchvision's
RandomResizedCrop/flip and Resize+CenterCrop on the image ImageFolder's loader decodes,
deterministic per sample, with colour jitter and scale jitter applied where the job has them,
its stage times counted, and a worker importing torch only where it needs it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from prefetchd.daemon import jpeg_crop
from prefetchd.daemon.decode import load_rgb
from prefetchd.daemon.plan import AugmentOptions, plan_sample, random_resized_crop_box
from prefetchd.daemon.sampler import sample_rng
from prefetchd.daemon.transforms import StageTimes, augment
from tests.daemon.pictures import diff, save_jpeg, smooth_array

# torchvision 0.29 announces that its decoders move to TorchCodec; they still work.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning")


def smooth_image(path: Path, w: int, h: int, seed: int = 0) -> Path:
    """``smooth_array`` saved losslessly (PNG) or as the suffix says: detail that shows a
    misplaced crop, without the pixel noise on which two correct resamplers disagree."""
    Image.fromarray(smooth_array(w, h, seed)).save(path)
    return path


# -- augment (val) -------------------------------------------------------------------------


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


# -- augment (train) of a JPEG: torchvision's resized_crop on the uint8 decode -------------


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


# -- colour jitter applied -----------------------------------------------------------------


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


# -- scale jitter applied ------------------------------------------------------------------


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


# -- any JPEG ------------------------------------------------------------------------------


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
    extension a worker needs neither, unless it jitters colours (on any CPU: it imported torch to resize in
    float32 on one without torch's uint8 kernel, run here with ATEN_CPU_CAPABILITY=default)."""
    path = make_image(tmp_path / "a.jpg", size=(400, 300))
    imported = {}
    for mode, env in (("plain", {}), ("jitter", {}), ("plain", {"ATEN_CPU_CAPABILITY": "default"})):
        run = subprocess.run([sys.executable, "-c", IMPORTS_OF_A_WORKER, str(path), mode], capture_output=True,
                             text=True, timeout=120, env={**os.environ, **env})
        assert run.returncode == 0, run.stderr[-3000:]
        imported[mode + "".join(env.values())] = run.stdout.strip()
    assert imported == {"plain": "False False", "jitter": "True True", "plaindefault": "False False"}
