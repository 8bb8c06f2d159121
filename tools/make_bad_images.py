"""Write the bad-image corpus (ImageFolder layout) that the bad-input tests run through a daemon.

    python tools/make_bad_images.py OUT [--filler 6]

Then run a daemon over it and see what happens to each file:

    prefetchd start --buffer /dev/shm/bad --data OUT --split val --epochs 1
    prefetchd status --buffer /dev/shm/bad       # the undecodable files, with reasons
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from prefetchd.bad_images import make_bad_images


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--filler", default=6, show_default=True, type=click.IntRange(min=1), help="Plain valid JPEGs per class.")
@click.option("--json", "as_json", is_flag=True, help="Print what each file is as JSON.")
def main(out: Path, filler: int, as_json: bool) -> None:
    """Write valid images in unusual encodings, undecodable files and non-images to OUT/<class>/."""
    if out.exists() and any(out.iterdir()):
        raise click.ClickException(f"{out} is not empty; pick a new folder")
    corpus = make_bad_images(out, filler=filler)
    if as_json:
        click.echo(json.dumps({"valid": sorted(corpus.valid), "undecodable": corpus.undecodable,
                               "ignored": corpus.ignored, "notes": corpus.notes}, indent=1))
        return
    for rel, what in sorted(corpus.undecodable.items()):
        click.echo(f"undecodable  {rel}: {what}")
    for rel, what in sorted(corpus.ignored.items()):
        click.echo(f"not indexed  {rel}: {what}")
    for note in corpus.notes:
        click.echo(f"note         {note}")
    click.echo(f"wrote {out}: {len(corpus.valid)} valid images, {len(corpus.undecodable)} undecodable files, "
               f"{len(corpus.ignored)} non-image files")


if __name__ == "__main__":
    main()
