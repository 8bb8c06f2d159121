"""The C extension as an install leaves it: built from the sources beside it, or not used (and said why).

A checkout pulled since `pip install -e .` kept its old ``_cropjpeg``: every worker called a function it lacked,
and the daemon stopped telling the user to remove the images it could not decode (a packaging walk)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from prefetchd.daemon import jpeg_crop

ROOT = Path(__file__).resolve().parents[2]
SAY = ("from prefetchd.daemon import jpeg_crop\n"
       "print(jpeg_crop.available())\n"
       "print(jpeg_crop.decoder_summary())\n")

needs_extension = pytest.mark.skipif(not jpeg_crop.available(), reason="the C extension is not built here")


def _package_copy(tmp_path: Path) -> Path:
    """prefetchd as this checkout has it, extension included, under ``tmp_path``: the folder for PYTHONPATH."""
    shutil.copytree(ROOT / "prefetchd", tmp_path / "prefetchd",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return tmp_path


def _said(path: Path) -> list[str]:
    done = subprocess.run([sys.executable, "-c", SAY], capture_output=True, text=True, timeout=60, cwd=path,
                          env={"PYTHONPATH": str(path), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@needs_extension
def test_an_extension_built_from_other_sources_is_not_used_and_the_start_says_how_to_build_it(tmp_path: Path) -> None:
    package = _package_copy(tmp_path)
    assert _said(package)[0] == "True"  # the copy as built: the same sources
    source = package / "prefetchd" / "daemon" / "_cropjpeg.c"
    source.write_text(source.read_text() + "/* a later commit */\n")
    available, summary = _said(package)
    assert available == "False"
    assert "whole-image (torchvision/Pillow); the crop-aware decoder" in summary
    assert "was built from other sources than this prefetchd's" in summary and "_cropjpeg" in summary
    assert "build it again: pip install -e . in the checkout" in summary and "is not built" not in summary


@needs_extension
def test_an_extension_that_does_not_load_is_said_with_its_error(tmp_path: Path) -> None:
    """As where its libjpeg is missing (a wheel built elsewhere): it said "not built, install a compiler"."""
    package = _package_copy(tmp_path)
    (built,) = (package / "prefetchd" / "daemon").glob("_cropjpeg*.so")
    built.write_bytes(b"not a shared object")
    available, summary = _said(package)
    assert available == "False"
    assert "is built but does not load (" in summary and "install the libjpeg-turbo library" in summary, summary


@pytest.mark.parametrize("in_place", [True, False], ids=["pip install -e", "pip install"])
def test_a_failed_build_leaves_no_extension_of_earlier_sources(tmp_path: Path, in_place: bool) -> None:
    """An upgrade's build without a compiler installed the extension an earlier build had left in build/ (a walk),
    and an editable one's kept the checkout's."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, checkout / name)
    _package_copy(checkout)
    daemon = checkout / "prefetchd" / "daemon"
    for stale in daemon.glob("_cropjpeg*.so"):
        stale.unlink()
    name = f"_cropjpeg{sysconfig.get_config_var('EXT_SUFFIX')}"
    built = (daemon if in_place else
             checkout / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}" / "prefetchd" / "daemon")
    built.mkdir(parents=True, exist_ok=True)
    (built / name).write_bytes(b"an earlier build")
    (daemon / "_cropjpeg.c").write_text((daemon / "_cropjpeg.c").read_text() + "/* changed */\n")
    done = subprocess.run([sys.executable, "setup.py", "build_ext", *(["--inplace"] if in_place else [])],
                          cwd=checkout, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "CC": "/bin/false"})
    assert done.returncode == 0, done.stdout + done.stderr  # optional: the install goes on
    assert "failed" in done.stderr + done.stdout
    assert not (built / name).exists(), "the earlier build's extension was left to be installed"
