#!/usr/bin/env bash
# Download, into the git-ignored .whl/, the wheels that the lent GPU machine lacks for
# `pip install --no-deps -e .` and tools/gpu_check.py, for its Python (3.12, x86-64 manylinux).
# That machine reaches no package registry, so they travel with the checkout (`carry: [".whl"]`).
#
# What it lacks: of the project's dependencies (pyproject.toml) watchdog and tomli-w. Its image
# already holds IMAGE_HAS below and pytest, pytest-xdist, pytest-timeout, hypothesis and
# nvidia-ml-py (pynvml), per the package list of the device notes (KINDS.md, read 2026-11-25);
# tomli is for Python < 3.11 only. The script first checks that every dependency is in one of
# the two lists (`--check` does only that): tomli-w was missed once and the daemon could not start.
# Beside them, where apt-get works, the Debian packages of libjpeg-turbo (library and headers):
# that image's package list has none, and without them `pip install -e .` skips the crop-aware
# decoder there and the figures measure the whole-image path (README "On a GPU"). Its C
# compiler built the extension from them on the first H200 run (2026-11-26).
# And setuptools: the install there runs without build isolation (no registry to fetch a build
# backend from), and pyproject.toml needs setuptools >= 77, which the image's may not be.
# Not fetched: nvidia-dali (its wheel is far over the 64 MiB a call may carry), so the DALI
# step records itself as skipped; s3fs and moto (the object-storage tests, not marked gpu).
#
#   bash tools/fetch_gpu_wheels.sh            # then carry .whl, see README "On a GPU"
#
# Override the list with WHEELS="watchdog==7.1.0 other==1.0" or the interpreter with PYTHON=...
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-"watchdog==7.1.0 tomli_w==1.2.0 setuptools==80.9.0"}
IMAGE_HAS="torch torchvision pillow numpy psutil msgpack click prometheus-client"
"$PYTHON" - "$WHEELS" "$IMAGE_HAS" <<'PY'
import re, sys, tomllib
from packaging.requirements import Requirement
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
have = {norm(w.split("==")[0]) for w in sys.argv[1].split()} | {norm(n) for n in sys.argv[2].split()}
deps = [Requirement(d) for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]]
needed = {norm(r.name) for r in deps if r.marker is None or r.marker.evaluate({"python_version": "3.12"})}
if needed - have:
    sys.exit(f"fetch_gpu_wheels: pyproject.toml needs {', '.join(sorted(needed - have))}, which the GPU image "
             "lacks and WHEELS does not fetch: add it to WHEELS (or IMAGE_HAS, if the image has it)")
PY
[ "${1:-}" = --check ] && exit 0
mkdir -p .whl
# pip matches each manylinux_2_N tag exactly, so name the common ones.
# shellcheck disable=SC2086  # WHEELS is a space-separated list on purpose
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $WHEELS
if command -v apt-get >/dev/null; then
    (cd .whl && apt-get download libjpeg62-turbo libjpeg62-turbo-dev)
else
    echo "fetch_gpu_wheels: no apt-get here: the GPU machine will build without the crop-aware decoder" >&2
fi
ls -l .whl
