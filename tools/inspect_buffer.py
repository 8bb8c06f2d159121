"""Print what is in a batch file or a buffer directory.

    python tools/inspect_buffer.py FILE.batch    header, metadata, tensors, label histogram
    python tools/inspect_buffer.py BUFFER_DIR    daemon, manifest, progress, status, batches

Exits with 1 and the protocol's own message when a file breaks the protocol.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click
import numpy as np

from prefetchd.buffer_protocol import (
    HEADER,
    Manifest,
    Progress,
    ProtocolError,
    daemon_owner,
    list_batches,
    list_temp_files,
    map_batch,
    read_status,
)
from prefetchd.words import counted

_HIDDEN_DOC_KEYS = ("format", "version")


def describe_batch(path: str | os.PathLike[str]) -> str:
    """Header, metadata, tensor table and label histogram of one batch file.

    Raises ProtocolError when the file is not a valid batch.
    """
    path = Path(path)
    batch = map_batch(path)  # validates everything before anything is printed
    with open(path, "rb") as f:
        magic, version, flags, meta_len, header_len, file_len = HEADER.unpack(f.read(HEADER.size))
    meta = batch.meta
    lines = [
        f"batch: {path}",
        f"header: magic={magic.decode('ascii', 'replace')} version={version} meta_len={meta_len} "
        f"header_len={header_len} file_len={file_len}" + (f" flags={flags:#06x}" if flags else ""),
        f"meta: epoch={meta.epoch} step={meta.step} seed={meta.seed} producer={meta.producer!r} "
        f"replaced={meta.replaced}" + (f" job={meta.job} rank={meta.rank}" if (meta.job, meta.rank) != (None, None) else ""),
    ]
    specs = sorted(meta.tensors.items(), key=lambda item: (item[1].offset, item[0]))
    shapes = {name: str(list(spec.shape)) for name, spec in specs}
    nw = max(len(name) for name, _ in specs)
    dw = max(len(spec.dtype) for _, spec in specs)
    sw = max(len(s) for s in shapes.values())
    ow = max(len(str(spec.offset)) for _, spec in specs)
    for name, spec in specs:
        lines.append(
            f"{name:<{nw}} {spec.dtype:<{dw}} {shapes[name]:<{sw}} offset={spec.offset:<{ow}} length={spec.length}"
        )
    lines.append(f"labels histogram: {_histogram(batch.labels)}")
    if batch.indices.size:
        lines.append(
            f"indices: {int(batch.indices.min())}..{int(batch.indices.max())}, "
            f"{np.unique(batch.indices).size} distinct of {batch.indices.size}"
        )
    return "\n".join(lines)


def describe_buffer(buffer: str | os.PathLike[str]) -> str:
    """Owner, manifest, progress, status, batch files and leftovers of a buffer directory.

    Raises ProtocolError when one of its documents breaks the protocol.
    """
    buffer = Path(buffer)
    lines = [f"buffer: {buffer}"]
    owner = daemon_owner(buffer)
    lines.append(f"daemon: {owner}" if owner is not None else "daemon: none running")

    try:
        m = Manifest.read(buffer)
    except FileNotFoundError:
        lines.append("manifest: none (no daemon has started a job here)")
    else:
        lines.append(
            f"manifest: split={m.split} seed={m.seed} batch_size={m.batch_size} image_size={m.image_size} "
            f"channels={m.channels} classes={len(m.classes)} samples/epoch={m.samples_per_epoch} "
            f"steps/epoch={m.steps_per_epoch} epochs={m.epochs if m.epochs is not None else 'unbounded'} "
            f"rank={m.rank}/{m.world_size} producer={m.producer}"
        )
        lines.append(f"  dataset: {m.dataset_root} ({m.num_samples} samples, fingerprint {m.fingerprint})")

    progress = Progress.read(buffer)
    if progress is None:
        lines.append("progress: none (no trainer has written progress.json yet)")
    else:
        lines.append(f"progress: next needed epoch {progress.epoch} step {progress.step}")

    status = read_status(buffer)
    if status is None:
        lines.append("status: none")
    else:
        lines.append("status:")
        doc = status.to_doc()
        for field in sorted(k for k in doc if k not in _HIDDEN_DOC_KEYS):
            lines.append(f"  {field}: {json.dumps(doc[field], sort_keys=True)}")

    batches = sorted(list_batches(buffer).items())
    sizes = {key: _size(path) for key, path in batches}
    total = sum(s for s in sizes.values() if s is not None)
    lines.append(f"batches: {counted(len(batches), 'file')}, {_human(total)}")
    for key, path in batches:
        size = sizes[key]
        consumed = progress is not None and key < (progress.epoch, progress.step)
        lines.append(
            f"  {path.name}  {size if size is not None else '(gone)':>10}"
            + ("  consumed, awaiting deletion" if consumed else "")
        )
    temps = sorted(p.name for p in list_temp_files(buffer))
    lines.append(f"temp files: {len(temps)}" + (f" ({', '.join(temps)})" if temps else ""))
    return "\n".join(lines)


def _histogram(labels: np.ndarray) -> str:
    if labels.size == 0:
        return "(empty batch)"
    values, counts = np.unique(labels, return_counts=True)
    return " ".join(f"{int(v)}:{int(c)}" for v, c in zip(values, counts))


def _size(path: Path) -> int | None:
    # The daemon deletes consumed batches while we list them.
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("path", type=click.Path(exists=True, path_type=Path))
def main(path: Path) -> None:
    """Describe a batch file or a buffer directory."""
    if path.is_file() and path.suffix == ".json":  # manifest.json, progress.json: documents, not damaged batches
        click.echo(f"error: {path} is a JSON document, not a batch file (*.batch); pass the buffer directory "
                   f"{path.parent} to see its documents", err=True)
        sys.exit(1)
    try:
        text = describe_buffer(path) if path.is_dir() else describe_batch(path)
    except ProtocolError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    click.echo(text)


if __name__ == "__main__":
    main()
