"""Pictures for the daemon's decode, pipeline and hook tests: smooth content that shows a
misplaced crop without the pixel noise on which two correct resamplers disagree, saved as JPEG,
and the per-pixel difference of two outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter


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


def diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.astype(np.int16) - b.astype(np.int16))
