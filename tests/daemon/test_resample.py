"""The resize: torchvision's antialiased bilinear bytes, from the C extension or torch.

The C kernel (prefetchd/daemon/_resample.c) must give torch's uint8 kernel's bytes exactly, on
both of torch's x86 kernels (AVX2 intrinsics; the generic loop that AVX-512 builds and arm64 run)
and on both of its own paths (AVX2, portable C), so that a batch does not depend on whether a
machine has the extension or which CPU it has."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from prefetchd.daemon import jpeg_crop, resample, transforms

needs_extension = pytest.mark.skipif(not jpeg_crop.available(), reason="the C extension is not built here")


def _torchvisions(crop: np.ndarray, size: int, mirror: bool) -> np.ndarray:
    chw = F.resize(torch.from_numpy(crop).permute(2, 0, 1), [size, size],
                   interpolation=v2.InterpolationMode.BILINEAR, antialias=True)
    return (F.hflip(chw) if mirror else chw).permute(1, 2, 0).contiguous().numpy()


def _torchs_uint8_kernel(crop: np.ndarray, height: int, width: int) -> np.ndarray:
    chw = torch.from_numpy(crop).permute(2, 0, 1)[None]
    out = torch.nn.functional.interpolate(chw, size=[height, width], mode="bilinear", align_corners=False,
                                          antialias=True)
    return out[0].permute(1, 2, 0).contiguous().numpy()


def _pixels(seed: int, height: int, width: int, smooth: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if not smooth:  # noise: every weight matters, rounding is stressed
        return rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    steps = rng.integers(-4, 5, (height, width, 3))  # a photo's gradients, with clipping at both ends
    return np.clip(np.cumsum(steps, axis=1) + 128, 0, 255).astype(np.uint8)


@needs_extension
@given(h=st.integers(1, 600), w=st.integers(1, 600), out_h=st.integers(1, 300), out_w=st.integers(1, 300),
       mirror=st.booleans(), vectors=st.booleans(), smooth=st.booleans(), seed=st.integers(0, 2**16))
@settings(max_examples=150, deadline=None)
def test_the_c_kernel_is_torchs_uint8_kernel(h: int, w: int, out_h: int, out_w: int, mirror: bool, vectors: bool,
                                             smooth: bool, seed: int) -> None:
    """Any sizes, up and down, either axis alone (a pass skipped), mirrored or not, both C paths."""
    crop = _pixels(seed, h, w, smooth)
    expected = _torchs_uint8_kernel(crop, out_h, out_w)
    if mirror:
        expected = expected[:, ::-1]
    got = np.frombuffer(jpeg_crop._extension.resize(crop, h, w, out_h, out_w, mirror, vectors),  # type: ignore[union-attr]
                        np.uint8).reshape(out_h, out_w, 3)
    assert np.array_equal(got, expected)


@needs_extension
@pytest.mark.parametrize("shape", [(224, 224), (224, 300), (300, 224), (1, 1), (2, 500)])
def test_equal_sizes_and_single_rows(shape: tuple[int, int]) -> None:
    crop = _pixels(7, *shape, smooth=False)
    for mirror in (False, True):
        assert np.array_equal(resample.resize(crop, 224, mirror), _torchvisions(crop, 224, mirror))


@needs_extension
def test_bad_arguments_are_refused_not_read_past() -> None:
    ext = jpeg_crop._extension
    assert ext is not None
    with pytest.raises(ValueError, match="are not 10 x 10 x 3 pixels"):
        ext.resize(bytes(299), 10, 10, 5, 5, False)
    with pytest.raises(ValueError, match="below 1"):
        ext.resize(bytes(300), 10, 10, 0, 5, False)
    with pytest.raises(ValueError, match="a target of 74 bytes for 5 x 5 x 3"):
        ext.resize(bytes(300), 10, 10, 5, 5, False, True, bytearray(74))
    with pytest.raises(BufferError):
        ext.resize(bytes(300), 10, 10, 5, 5, False, True, bytes(75))  # read-only: not a slot


@needs_extension
def test_read_only_pixels_are_resized() -> None:
    """Pillow hands numpy read-only memory; the kernel only reads it."""
    crop = _pixels(3, 100, 80, smooth=True)
    crop.flags.writeable = False
    out = resample.resize(crop, 64, False)
    assert out.flags.writeable and np.array_equal(out, _torchvisions(crop.copy(), 64, False))


@given(h=st.integers(1, 700), w=st.integers(1, 700), size=st.sampled_from([8, 32, 64, 224, 256, 299]),
       mirror=st.booleans(), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_resize_is_torchvisions_bilinear_antialias_byte_for_byte(h: int, w: int, size: int, mirror: bool,
                                                                  seed: int) -> None:
    """What a worker runs (the C kernel where built, else torch) against torchvision's resize + hflip."""
    crop = _pixels(seed, h, w, smooth=bool(seed % 2))
    ours = resample.resize(crop, size, mirror)
    assert ours.flags.c_contiguous and ours.shape == (size, size, 3), "the slot's H x W x 3 layout"
    assert np.array_equal(ours, _torchvisions(crop, size, mirror))
    slot = np.full((size, size, 3), 77, np.uint8)  # a batch slot, written in place
    assert resample.resize(crop, size, mirror, slot) is slot and np.array_equal(slot, ours)


def test_torchs_resize_writes_into_a_slot_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the C extension torch resizes; into a slot, the same bytes as into a new array."""
    monkeypatch.setattr(jpeg_crop, "_extension", None)
    for shape, mirror in (((90, 70), True), ((32, 32), False), ((20, 300), True)):
        crop = _pixels(sum(shape), *shape, smooth=True)
        slot = np.zeros((32, 32, 3), np.uint8)
        assert resample.resize(crop, 32, mirror, slot) is slot
        assert np.array_equal(slot, _torchvisions(crop, 32, mirror))


ON_ANOTHER_KERNEL = """
import hashlib, sys
import numpy as np, torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F
from prefetchd.daemon import jpeg_crop, resample
capability = torch.backends.cpu.get_cpu_capability()
assert capability == sys.argv[1], capability
rng = np.random.default_rng(3)
digest, torchvisions = hashlib.sha256(), True
for i in range(60):
    h, w = (int(x) for x in rng.integers(1, 500, 2))
    size, mirror = int(rng.choice([16, 224, 256])), bool(i % 2)
    crop = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    ours = resample.resize(crop, size, mirror)
    with jpeg_crop.whole_image_only():  # torch's kernel, as where the extension is not built
        assert np.array_equal(resample.resize(crop, size, mirror), ours), (h, w, size)
    digest.update(ours.tobytes())
    chw = F.resize(torch.from_numpy(crop).permute(2, 0, 1), [size, size], interpolation=v2.InterpolationMode.BILINEAR,
                   antialias=True)
    torchvisions = torchvisions and np.array_equal(ours, (F.hflip(chw) if mirror else chw).permute(1, 2, 0).numpy())
print(digest.hexdigest(), torchvisions)
"""


def _cpu_has(*flags: str) -> bool:
    with open("/proc/cpuinfo") as cpuinfo:
        return any(line.startswith("flags") and set(flags) <= set(line.partition(":")[2].split()) for line in cpuinfo)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="torch's x86 CPU capabilities")
def test_a_resize_has_the_same_bytes_on_every_cpu_kernel() -> None:
    """ATEN_CPU_CAPABILITY=avx2: torch's AVX2 intrinsics kernel (this machine may run the AVX-512 build, whose uint8
    resize is the generic loop); =default, a CPU without AVX2, where torchvision resizes in float32 and rounds.  The
    daemon resized in float32 there too, as torchvision does: a batch built there was up to 1 apart on 7 % of its
    bytes, and a daemon restarted with ATEN_CPU_CAPABILITY=default mixed both kinds in one job (a walk).  Now it has
    the same bytes on every kernel, with the C extension or torch's, and they are torchvision's where torchvision
    resizes in uint8."""
    capabilities = ["DEFAULT", *(["AVX2"] if _cpu_has("avx2", "fma") else [])]
    said = {}
    for capability in capabilities:
        run = subprocess.run([sys.executable, "-c", ON_ANOTHER_KERNEL, capability], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "ATEN_CPU_CAPABILITY": capability.lower()})
        assert run.returncode == 0, run.stderr[-3000:]
        said[capability] = run.stdout.split()
    assert len({digest for digest, _ in said.values()}) == 1, said
    assert said["DEFAULT"][1] == "False", "torchvision resized in uint8 on the generic kernel: nothing was checked"
    if "AVX2" in said:
        assert said["AVX2"][1] == "True", said


UNDER_ASAN = """
import io, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from PIL import Image
import _cropjpeg as ext
rng = np.random.default_rng(0)
# The resize: every small shape, where reads past a row's end or the image's would show; then random ones.
shapes = [(h, w, oh, ow) for h in (1, 2, 3, 4, 5) for w in (1, 2, 3, 5, 33) for oh, ow in ((1, 1), (3, 2), (8, 8), (2, 7))]
shapes += [tuple(int(x) for x in rng.integers(1, 120, 4)) for _ in range(200)]
for h, w, oh, ow in shapes:
    for mirror in (False, True):
        for vectors in (False, True):
            pixels = bytes(rng.integers(0, 256, h * w * 3, dtype=np.uint8))  # exactly the image: no slack
            ext.resize(pixels, h, w, oh, ow, mirror, vectors)
            ext.resize(pixels, h, w, oh, ow, mirror, vectors, bytearray(oh * ow * 3))  # into a slot: no slack either
# The crop-aware decode: boxes at every scale in JPEGs of each layout, whole and cut short or damaged.
jpegs = []
for i in range(120):
    w, h = (int(x) for x in rng.integers(1, 90, 2))
    image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert("L" if i % 7 == 0 else "RGB")
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90, subsampling=i % 3, progressive=i % 5 == 0, restart_marker_blocks=i % 4)
    data = out.getvalue()
    for variant in (data, data[: int(rng.integers(2, len(data)))], data[:40] + bytes(rng.integers(0, 256, 30, dtype=np.uint8)) + data[70:]):
        for scale in (1, 2, 4, 8):
            sw, sh = -(-w // scale), -(-h // scale)
            left, top = int(rng.integers(0, sw)), int(rng.integers(0, sh))
            box = (left, top, int(rng.integers(left + 1, sw + 1)), int(rng.integers(top + 1, sh + 1)))
            for b in (box, (0, 0, sw + 1, sh)):  # and one the image does not hold
                try:
                    ext.decode_box(variant, scale, *b)
                except ext.DecodeError:
                    pass
    jpegs.append(data)
# The header reader: the headers of those JPEGs and of an EXIF-oriented one, damaged and cut short anywhere.
import random
from prefetchd.bad_images import damage
exif = Image.Exif()
exif[0x0112] = 6
out = io.BytesIO()
image.save(out, "JPEG", exif=exif.tobytes())
jpegs.append(out.getvalue())
headers = random.Random(0)
for _ in range(20000):
    data = headers.choice(jpegs)
    ext.plain_header(damage(headers, data, data.find(b"\\xff\\xda") + 4, cut=0.2))
print("ok")
"""


SOURCE = Path(jpeg_crop.__file__).parent  # _cropjpeg.c, _resample.c, _resample.h


def _under_sanitizers(source: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """UNDER_ASAN against the extension built from ``source`` with AddressSanitizer and
    UndefinedBehaviorSanitizer, every Python buffer an allocation of its own (PYTHONMALLOC=malloc)."""
    runtimes = [subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
                for name in ("libasan.so", "libubsan.so")]
    if not all(os.path.isabs(runtime) for runtime in runtimes):
        pytest.skip("gcc has no AddressSanitizer or UndefinedBehaviorSanitizer runtime here")
    built = subprocess.run(["gcc", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-g", "-O1",
                            "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(source / "_cropjpeg.c"),
                            str(source / "_resample.c"), "-ljpeg", "-o", str(out / "_cropjpeg.so")],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    return subprocess.run([sys.executable, "-c", UNDER_ASAN, str(out)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "LD_PRELOAD": ":".join(runtimes), "PYTHONMALLOC": "malloc",
                                            "ASAN_OPTIONS": "detect_leaks=0"})


@needs_extension
def test_the_c_extension_reads_and_writes_only_its_buffers(tmp_path: Path) -> None:
    """Built with the sanitizers, the kernel resizes every small shape (1-pixel rows and columns,
    where the vector path's 8-byte loads could run past the image), the crop-aware decoder
    decodes boxes of whole, truncated and damaged JPEGs, and the header reader reads damaged and
    cut headers, without touching a byte outside their buffers."""
    run = _under_sanitizers(SOURCE, tmp_path)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


@needs_extension
def test_the_sanitizer_run_reports_a_planted_overread(tmp_path: Path) -> None:
    """The same run on the sources with the header reader's marker walk allowed one byte past the file."""
    planted = tmp_path / "source"
    planted.mkdir()
    for name in ("_cropjpeg.c", "_resample.c", "_resample.h"):
        (planted / name).write_bytes((SOURCE / name).read_bytes())
    code = (planted / "_cropjpeg.c").read_text()
    bounds = "if (pos + 4 > n || b[pos] != 0xFF)"
    assert bounds in code, "the marker walk's bounds check moved: plant the over-read elsewhere"
    (planted / "_cropjpeg.c").write_text(code.replace(bounds, "if (pos + 1 > n || b[pos] != 0xFF)"))
    run = _under_sanitizers(planted, tmp_path)
    assert run.returncode != 0 and "AddressSanitizer: heap-buffer-overflow" in run.stderr, run.stderr[-3000:]


def test_the_start_line_says_what_resizes_and_so_whether_workers_import_torch() -> None:
    with jpeg_crop.whole_image_only():
        assert "torch's uint8 kernel; workers import torch" in resample.resize_summary()
    if jpeg_crop.available():
        assert "C extension's copy" in resample.resize_summary()
        assert "torch" not in transforms.needed_modules(), "what the line promises"
