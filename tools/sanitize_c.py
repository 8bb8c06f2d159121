"""Build the C extension with AddressSanitizer and UndefinedBehaviorSanitizer, and feed it hostile input.

    python tools/sanitize_c.py [--seconds 20] [--seed 0] [--source prefetchd/daemon]

The extension reads bytes nobody vouches for: a dataset's JPEGs (``plain_header``, ``decode_box``)
and the sizes the daemon passes to ``resize``.  This builds ``_cropjpeg.c`` and ``_resample.c``
from ``--source`` with ``-fsanitize=address,undefined`` into a temporary folder and runs, in a
child process with the sanitizer runtimes preloaded and ``PYTHONMALLOC=malloc`` (so that every
Python buffer is an allocation of its own and a read one byte past it is caught), for
``--seconds`` in all:

* ``plain_header`` over JPEG headers with bytes changed, cut or inserted anywhere before the
  first scan, and cut short;
* ``decode_box`` over JPEGs damaged the same way anywhere, with random boxes and scales;
* ``resize`` over random sizes, mirrored or not, with and without the vector kernels.

It exits non-zero with the sanitizer's report on the first error, and names what is missing
(a C compiler, libasan, libjpeg-turbo's headers) when it cannot build.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

SOURCES = ("_cropjpeg.c", "_resample.c")
REPO = Path(__file__).resolve().parents[1]


def runtime(compiler: str, name: str) -> str | None:
    """The path of the compiler's sanitizer runtime ``name`` (libasan.so), or None."""
    found = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return found if os.path.isabs(found) and os.path.exists(found) else None


def build(source: Path, out: Path) -> Path:
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise SystemExit("no C compiler (gcc) on PATH: install one, or set CC")
    target = out / "_cropjpeg.so"
    done = subprocess.run([compiler, "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                           "-fno-sanitize-recover=undefined", "-shared", "-fPIC",
                           f"-I{sysconfig.get_paths()['include']}", *(str(source / s) for s in SOURCES),
                           "-ljpeg", "-o", str(target)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"building {source}/_cropjpeg.c with the sanitizers failed (libjpeg-turbo's headers: "
                         f"apt-get install libjpeg62-turbo-dev):\n{done.stderr}")
    return target


def seeds() -> list[bytes]:
    """A few JPEGs of the layouts the decoder takes: 4:2:0, 4:4:4, grayscale, progressive, restart
    markers, an EXIF orientation."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = Image.fromarray(rng.integers(0, 256, (61, 83, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6
    out = []
    for mode, kw in (("RGB", {}), ("RGB", {"subsampling": 0}), ("L", {}), ("RGB", {"progressive": True}),
                     ("RGB", {"restart_marker_blocks": 2}), ("RGB", {"exif": exif.tobytes()})):
        buf = io.BytesIO()
        pixels.convert(mode).save(buf, "JPEG", quality=85, **kw)
        out.append(buf.getvalue())
    return out


def child(folder: Path, seconds: float, seed: int) -> None:
    sys.path.insert(0, str(folder))
    import _cropjpeg as ext  # the sanitized build

    from prefetchd.bad_images import damage

    rng, jpegs = random.Random(seed), seeds()
    counts = {"plain_header": 0, "decode_box": 0, "resize": 0}
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        data = rng.choice(jpegs)
        ext.plain_header(damage(rng, data, data.index(b"\xff\xda") + 4, cut=0.2))
        counts["plain_header"] += 1
        damaged = damage(rng, data, cut=0.2)
        left, top = rng.randrange(0, 60), rng.randrange(0, 40)
        try:
            ext.decode_box(damaged, rng.choice((1, 2, 4, 8)), left, top, left + rng.randint(1, 30),
                           top + rng.randint(1, 30), rng.random() < 0.5)
        except ext.DecodeError:
            pass  # refusing is the answer to damage; reading out of bounds is not
        counts["decode_box"] += 1
        h, w = rng.randint(1, 300), rng.randint(1, 300)
        ext.resize(rng.randbytes(h * w * 3), h, w, rng.randint(1, 256), rng.randint(1, 256), rng.random() < 0.5,
                   rng.random() < 0.5)
        counts["resize"] += 1
    print("no sanitizer report: " + ", ".join(f"{name} {n} calls" for name, n in counts.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--source", type=Path, default=REPO / "prefetchd" / "daemon",
                        help="the folder with _cropjpeg.c, _resample.c and _resample.h")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.seconds, args.seed)
        return
    compiler = shutil.which(os.environ.get("CC", "gcc")) or "gcc"
    preload = [runtime(compiler, name) for name in ("libasan.so", "libubsan.so")]
    if None in preload:
        raise SystemExit(f"{compiler} has no libasan/libubsan runtime: install gcc's (Debian: libasan8 libubsan1)")
    with tempfile.TemporaryDirectory(prefix="prefetchd-sanitize-") as folder:
        build(args.source, Path(folder))
        env = {**os.environ, "LD_PRELOAD": ":".join(p for p in preload if p), "PYTHONMALLOC": "malloc",
               # Python's own allocations are not ours to report, and its exit leaks by design.
               "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"}
        done = subprocess.run([sys.executable, __file__, "--child", folder, "--seconds", str(args.seconds),
                               "--seed", str(args.seed)], env=env)
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
