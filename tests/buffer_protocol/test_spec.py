"""SPEC.md and the code say the same thing.

Each ``*_mismatches`` function compares one part of the spec with the code and
returns what differs; the tests assert there is nothing.  The code is looked up
on the modules at call time, so ``test_check_can_fail`` can change a constant
(or the spec text) and see each check catch it.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import msgpack
import numpy as np
import pytest

from prefetchd.buffer_protocol import (ProtocolError, State, batch, job_request, json_files, layout, manifest, ownership,
                                      progress)
from prefetchd.buffer_protocol import status as status_module
from tests.status_examples import REMOTE, STORAGE_WAIT, WORKER_STALL, bad_files, production
from tests.status_examples import status as status_example

SPEC_PATH = Path(batch.__file__).with_name("SPEC.md")
SPEC = SPEC_PATH.read_text()


# -- reading the spec ---------------------------------------------------------


def section(spec: str, title: str) -> str:
    """Text under the ``## title`` heading, up to the next ``## ``."""
    m = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", spec, re.M | re.S)
    if m is None:
        raise AssertionError(f"SPEC.md has no '## {title}' section")
    return m.group(1)


def tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table in ``text``, as rows keyed by the header cells."""
    found: list[list[dict[str, str]]] = []
    block: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.lstrip().startswith("|"):
            block.append(line.strip())
            continue
        if block:
            cells = [[c.strip() for c in row.strip("|").split("|")] for row in block]
            head, rows = cells[0], cells[2:]  # cells[1] is the |---| rule
            found.append([dict(zip(head, row)) for row in rows])
            block = []
    return found


def table(spec: str, title: str, first_column: str) -> list[dict[str, str]]:
    for t in tables(section(spec, title)):
        if t and first_column in t[0]:
            return t
    raise AssertionError(f"SPEC.md section {title!r} has no table with a {first_column!r} column")


def literal(cell: str) -> str:
    return cell.strip().strip("`")


def code_attr(name: str) -> object:
    """The value of ``name`` in batch.py, layout.py or json_files.py; all must agree where several define it."""
    values = [getattr(mod, name) for mod in (batch, layout, json_files) if hasattr(mod, name)]
    if not values:
        raise LookupError(name)
    if any(v != values[0] for v in values[1:]):
        raise LookupError(f"{name} differs between batch.py, layout.py and json_files.py: {values}")
    return values[0]


# -- the checks ---------------------------------------------------------------


def constant_mismatches(spec: str) -> list[str]:
    out = []
    for row in table(spec, "Constants", "name"):
        name, text = literal(row["name"]), literal(row["value"])
        try:
            value = code_attr(name)
        except LookupError as exc:
            out.append(f"{name}: not found in the code ({exc})")
            continue
        if isinstance(value, bytes):
            expected: object = text.encode()
        elif isinstance(value, str):
            expected = text
        else:
            expected = int(text)
        if value != expected:
            out.append(f"{name}: spec says {expected!r}, code has {value!r}")
    return out


def limit_mismatches(spec: str) -> list[str]:
    """Every ``MAX_*`` limit of the protocol modules is in the constants table."""
    listed = {literal(row["name"]) for row in table(spec, "Constants", "name")}
    limits = {n for mod in (batch, layout) for n in vars(mod) if n.startswith("MAX_")}
    return [f"{n}: in the code but not in the spec's constants table" for n in sorted(limits - listed)]


def docstring_header(doc: str) -> list[tuple[int, int, str, str]]:
    """(offset, size, field, struct) rows of the header table in batch.py's docstring."""
    rows = []
    for m in re.finditer(r"^\s+(\d+)\s+(\S+)\s+(\w+)\s+(\S+)", doc, re.M):
        if not m[2].isdigit():  # "32  ...  metadata": the end of the fixed header
            break
        rows.append((int(m[1]), int(m[2]), m[3], m[4]))
    return rows


def header_mismatches(spec: str) -> list[str]:
    out = []
    rows = table(spec, "Batch file", "offset")
    fields = [literal(r["field"]) for r in rows]
    codes = [literal(r["struct"]) for r in rows]
    expected_offset = 0
    for r in rows:
        offset, size, code = int(r["offset"]), int(r["size"]), literal(r["struct"])
        if offset != expected_offset:
            out.append(f"{r['field']}: offset {offset}, but the fields before it end at {expected_offset}")
        if size != struct.calcsize("<" + code):
            out.append(f"{r['field']}: size {size}, but struct {code!r} is {struct.calcsize('<' + code)} bytes")
        expected_offset = offset + size
    fmt = "<" + "".join(codes)
    if fmt != batch.HEADER_FORMAT:
        out.append(f"header struct: spec's fields make {fmt!r}, code has HEADER_FORMAT {batch.HEADER_FORMAT!r}")
    if expected_offset != batch.HEADER_SIZE or batch.HEADER.size != batch.HEADER_SIZE:
        out.append(f"header size: spec's fields end at {expected_offset}, code has HEADER_SIZE {batch.HEADER_SIZE}")
    magic = literal(next((r["meaning"] for r in rows if literal(r["field"]) == "magic"), ""))
    if magic.encode() != batch.MAGIC:
        out.append(f"magic: spec's table says {magic!r}, code has {batch.MAGIC!r}")

    doc_rows = docstring_header(batch.__doc__ or "")
    spec_rows = [(int(r["offset"]), int(r["size"]), literal(r["field"]), literal(r["struct"])) for r in rows]
    if [row[2] for row in doc_rows] != fields:
        out.append(f"field order: spec {fields}, batch.py docstring {[row[2] for row in doc_rows]}")
    elif doc_rows != spec_rows:
        out.append(f"header table: spec {spec_rows}, batch.py docstring {doc_rows}")
    return out


def metadata_mismatches(spec: str) -> list[str]:
    """Keys of the metadata map and of each tensor entry, as the writer emits them."""
    out = []
    rows = table(spec, "Batch file", "key")
    spec_keys = [literal(r["key"]) for r in rows]
    layout_ = batch.BatchLayout.plan(2, 3, 4, 3)
    raw = layout_.encode_header(epoch=1, step=2, seed=3, producer="p", job="7ce11fc278a4f287", rank=0)  # as the daemon
    magic, version, flags, meta_len, header_len, file_len = batch.HEADER.unpack_from(raw)
    meta = msgpack.unpackb(raw[batch.HEADER_SIZE : batch.HEADER_SIZE + meta_len])
    if sorted(spec_keys) != sorted(meta):
        out.append(f"metadata keys: spec {sorted(spec_keys)}, writer {sorted(meta)}")
    fmt = literal(next((r["meaning"] for r in rows if literal(r["key"]) == "format"), ""))
    if fmt != batch.BATCH_FORMAT:
        out.append(f"metadata format: spec {fmt!r}, code BATCH_FORMAT {batch.BATCH_FORMAT!r}")
    tensor_row = next((r for r in rows if literal(r["key"]) == "tensors"), None)
    if tensor_row is not None:
        m = re.search(r"\{(.*?)\}", tensor_row["meaning"])
        spec_fields = sorted(f.strip() for f in m[1].split(",")) if m else []
        for name, entry in meta.get("tensors", {}).items():
            if sorted(entry) != spec_fields:
                out.append(f"tensor {name} fields: spec {spec_fields}, writer {sorted(entry)}")
    return out


def directory_mismatches(spec: str) -> list[str]:
    out = []
    rows = table(spec, "Buffer directory", "file")
    names = [literal(r["file"]) for r in rows]
    named = [n for n in names if "NAME" in n]  # a consumer's progress file: see consumer_mismatches
    names = [n for n in names if n not in named]
    consumer = [layout.progress_name("trial-3"), layout.consumer_lock_name("trial-3")]
    if [n.replace("NAME", "trial-3") for n in named] != consumer:
        out.append(f"consumer progress and lock files: spec {named}, code {consumer} for 'trial-3'")
    spares = [n for n in names if re.fullmatch(r"[a-z]+-N+\.\w+", n)]  # the daemon's spare files
    names = [n for n in names if n not in spares]
    for pattern in spares:
        width = pattern.count("N")
        for n in (0, 7, 10**width - 1):
            expected = pattern.replace("N" * width, f"{n:0{width}d}")
            if layout.spare_name(n) != expected:
                out.append(f"{pattern}: spec gives {expected!r} for spare {n}, code gives {layout.spare_name(n)!r}")
    if len(spares) != 1:
        out.append(f"spare files: spec names {spares}, expected one pattern")
    fixed = {n for n in names if not re.search(r"E+-s?S+", n)}
    constants = {layout.LOCK_NAME, layout.MANIFEST_NAME, layout.PROGRESS_NAME, layout.consumer_lock_name(),
                 layout.STATUS_NAME, layout.JOB_NAME, layout.ACCEPTED_JOB_NAME}
    if fixed != constants:
        out.append(f"fixed file names: spec {sorted(fixed)}, code {sorted(constants)}")

    patterns = [n for n in names if n not in fixed]
    for pattern in patterns:
        m = re.fullmatch(r"e(E+)-s(S+)(\.\w+)", pattern)
        if m is None:
            out.append(f"cannot read the name pattern {pattern!r}")
            continue
        ew, sw, suffix = len(m[1]), len(m[2]), m[3]
        for epoch, step in ((0, 0), (3, 17), (10**ew - 1, 10**sw - 1)):
            expected = f"e{epoch:0{ew}d}-s{step:0{sw}d}{suffix}"
            final = layout.batch_name(epoch, step)
            if suffix == layout.BATCH_SUFFIX:
                got = final
                if layout.parse_batch_name(expected) != (epoch, step):
                    out.append(f"parse_batch_name({expected!r}) is not {(epoch, step)}")
            else:
                got = batch.temp_name(Path(final)).name
                if layout.TEMP_MARK not in got or layout.parse_batch_name(got) is not None:
                    out.append(f"temp name {got!r} is not recognisable as a temp name")
            if got != expected:
                out.append(f"{pattern}: spec gives {expected!r} for {(epoch, step)}, code gives {got!r}")
    suffixes = {re.sub(r".*?(\.\w+)$", r"\1", p) for p in patterns}
    if layout.BATCH_SUFFIX not in suffixes or layout.TEMP_MARK not in suffixes:
        out.append(f"name suffixes: spec {sorted(suffixes)}, code {layout.BATCH_SUFFIX!r} and {layout.TEMP_MARK!r}")
    return out


def tensor_mismatches(spec: str) -> list[str]:
    out = []
    rows = table(spec, "Batch file", "name")
    spec_tensors = {literal(r["name"]): literal(r["dtype"]) for r in rows}
    if spec_tensors != dict(batch.REQUIRED_TENSORS):
        out.append(f"required tensors: spec {spec_tensors}, code {dict(batch.REQUIRED_TENSORS)}")
    dims = {"N": 5, "H": 6, "W": 7, "C": 3}
    planned = batch.BatchLayout.plan(5, 6, 7, 3).tensors
    for r in rows:
        name = literal(r["name"])
        symbols = [s.strip() for s in r["shape"].split("(")[0].split(" x ")]
        expected = tuple(dims[s] for s in symbols if s in dims)
        got = planned[name].shape if name in planned else None
        if got != expected:
            out.append(f"tensor {name}: spec shape {r['shape']!r} means {expected}, BatchLayout.plan gives {got}")
    return out


def dtype_mismatches(spec: str) -> list[str]:
    out = []
    m = re.search(r"^Allowed dtypes:(.*)$", section(spec, "Batch file"), re.M)
    if m is None:
        return ["no 'Allowed dtypes:' line in the Batch file section"]
    allowed = re.findall(r"`([^`]+)`", m[1])
    if sorted(allowed) != sorted(batch.DTYPES):
        out.append(f"allowed dtypes: spec {sorted(allowed)}, code DTYPES {sorted(batch.DTYPES)}")
    if "little-endian" in m[1]:
        for name, dt in batch.DTYPES.items():
            if dt != dt.newbyteorder("<") or dt != np.dtype(name).newbyteorder("<"):
                out.append(f"dtype {name}: code has {dt.str}, spec says little-endian {name}")
    return out


def document_mismatches(spec: str) -> list[str]:
    """Rule 2: the format names of the JSON documents and their temp names."""
    out = []
    rules = section(spec, "Buffer directory")
    m = re.search(r'"format": "prefetchd\.<kind>"` \(([^)]*)\)', rules)
    kinds = sorted(re.findall(r"`(\w+)`", m[1])) if m else []
    if kinds != sorted(layout.DOCUMENT_KINDS):
        out.append(f"document kinds in rule 2: {kinds}")
    if f"`\"version\": {batch.VERSION}`" not in rules:
        out.append(f"rule 2 does not say documents carry version {batch.VERSION}")
    return out


def consumer_mismatches(spec: str) -> list[str]:
    """Rule 9: the consumer name pattern and the refresh period are the code's, and names
    outside the pattern are refused."""
    out = []
    rules = section(spec, "Buffer directory")
    m = re.search(r"Consumer names match `([^`]+)`", rules)
    if m is None or m[1] != layout.CONSUMER_NAME_RE.pattern:
        out.append(f"consumer name pattern: spec {m and m[1]!r}, code {layout.CONSUMER_NAME_RE.pattern!r}")
    m = re.search(r"`PROGRESS_REFRESH_SECONDS` \(([\d.]+) s\)", rules)
    if m is None or float(m[1]) != progress.PROGRESS_REFRESH_SECONDS:
        out.append(f"progress refresh: spec {m and m[1]!r}, code {progress.PROGRESS_REFRESH_SECONDS}")
    said = re.findall(r"`LOCK_RETRY_SECONDS` \(([\d.]+) s", rules)  # rule 4 (daemon.lock) and rule 9 (consumers)
    if len(said) < 2 or any(float(v) != ownership.LOCK_RETRY_SECONDS for v in said):
        out.append(f"lock retry: spec {said}, code {ownership.LOCK_RETRY_SECONDS}")
    for bad in ("", "a/b", "x" * 33, "sp ace", ".hidden"):
        try:
            name = layout.progress_name(bad)
        except ValueError:
            continue
        if bad or name != layout.PROGRESS_NAME:
            out.append(f"consumer name {bad!r} is outside the spec's pattern but gives {name!r}")
    return out


def json_temp_mismatches(spec: str) -> list[str]:
    """Rule 2's temp name (``NAME.tmp-PID``...) against what write_json really leaves behind."""
    m = re.search(r"`(NAME\.tmp-[^`]*)`", section(spec, "Buffer directory"))
    if m is None:
        return ["rule 2 names no `NAME.tmp-...` temp file"]
    pattern = re.escape(m[1]).replace("NAME", re.escape(layout.PROGRESS_NAME)).replace("PID", str(os.getpid()))
    pattern = re.sub(r"[A-Z]{2,}", "[0-9A-Za-z]+", pattern)  # RANDOM, HEX, ...: any token
    with tempfile.TemporaryDirectory() as d, mock.patch.object(os, "replace", lambda src, dst, **_: None):
        json_files.write_json(Path(d) / layout.PROGRESS_NAME, {"format": "prefetchd.progress"})
        left = os.listdir(d)
        listed = [p.name for p in layout.list_temp_files(Path(d))]
    out = []
    if len(left) != 1 or not re.fullmatch(pattern, left[0]):
        out.append(f"write_json's temp file is {left}, spec says `{m[1]}`")
    if listed != left:
        out.append(f"list_temp_files does not list write_json's temp file {left} (lists {listed})")
    return out


_SPEC_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "null": type(None), "object": dict, "list": list}


def _flatten(doc: object, prefix: str = "") -> dict[str, object]:
    """Dotted keys of a status document as the spec's table names them: ``streams[].rank``, ``stages.STAGE.p50``."""
    out: dict[str, object] = {}
    if isinstance(doc, dict):
        for key, value in doc.items():
            name = f"{prefix}.{key}" if prefix else key
            if prefix == "stages":
                name = "stages.STAGE"
            out[name] = value
            out.update(_flatten(value, name))
    elif isinstance(doc, list):
        for value in doc:
            out.update(_flatten(value, f"{prefix}[]"))
    return out


def status_mismatches(spec: str) -> list[str]:
    """Every key the daemon writes into status.json is in the spec's table with its type, and no other;
    the keys marked "always" are all a daemon waiting for a job writes; the states are the code's."""
    out = []
    rows = {literal(r["key"]): r for r in table(spec, "Status document", "key")}
    errors = dataclasses.replace(production().errors, undecodable=bad_files(1))
    producing = status_example(production=production(errors=errors, remote=REMOTE, storage_wait=STORAGE_WAIT,
                                                     worker_stall=WORKER_STALL)).to_doc()
    waiting = status_example(State.WAITING_FOR_JOB, production=None).to_doc()
    written = _flatten(producing)
    if sorted(rows) != sorted(written):
        out.append(f"status keys: only in the spec {sorted(set(rows) - set(written))}, "
                   f"only in the code {sorted(set(written) - set(rows))}")
    for key, value in written.items():
        if key not in rows:
            continue
        kinds = [_SPEC_TYPES.get(t.strip()) for t in rows[key]["type"].split(" or ")]
        if not any(k is not None and isinstance(value, k) and not (k is int and isinstance(value, bool)) for k in kinds):
            out.append(f"status key {key}: spec says {rows[key]['type']!r}, the daemon writes {value!r}")
    always = sorted(k for k, r in rows.items() if r["when"] == "always")
    if always != sorted(_flatten(waiting)):
        out.append(f"status keys written in every state: spec {always}, code {sorted(_flatten(waiting))}")
    spec_states = [literal(row["state"]) for row in table(spec, "Status document", "state")]
    code_states = [s.value for s in status_module.State]
    if spec_states != code_states:
        out.append(f"states: spec {spec_states}, code {code_states}")
    return out


def _typed_rows(spec: str, title: str, written: dict[str, object]) -> list[str]:
    """The keys of a document table against a document the code wrote: the same keys, each value of a listed type."""
    rows = {literal(r["key"]): r for r in table(spec, title, "key")}
    out = []
    if sorted(rows) != sorted(written):
        out.append(f"{title} keys: only in the spec {sorted(set(rows) - set(written))}, "
                   f"only in the code {sorted(set(written) - set(rows))}")
    for key, value in written.items():
        if key in rows:
            kinds = [_SPEC_TYPES.get(t.strip()) for t in rows[key]["type"].split(" or ")]
            if not any(k is not None and isinstance(value, k) and not (k is int and isinstance(value, bool))
                       for k in kinds):
                out.append(f"{title} key {key}: spec says {rows[key]['type']!r}, the code writes {value!r}")
    return out


def _required(spec: str, title: str) -> list[str]:
    return sorted(literal(r["key"]) for r in table(spec, title, "key") if r["required"] == "yes")


_EXAMPLE_MANIFEST = manifest.Manifest(
    dataset_root="/data/train", fingerprint="9c1185a5", classes=["a", "b"], num_samples=10, split="train", seed=3,
    batch_size=4, image_size=8, samples_per_epoch=10, steps_per_epoch=3, epochs=2, producer="p", val_fraction=0.1,
    augmentation="flip", drop_last=False, keyed_batches=True,
)


def manifest_mismatches(spec: str) -> list[str]:
    """The Manifest document's table: the keys and types the daemon writes, and which a reader requires."""
    doc = {k: v for k, v in _EXAMPLE_MANIFEST.to_doc().items() if k not in ("format", "version")}
    out = _typed_rows(spec, "Manifest document", doc)
    required = []
    for key in doc:
        try:
            manifest.Manifest.from_doc({k: v for k, v in _EXAMPLE_MANIFEST.to_doc().items() if k != key}, Path("m"))
        except (ProtocolError, KeyError, TypeError):
            required.append(key)
    if sorted(required) != _required(spec, "Manifest document"):
        out.append(f"manifest keys a reader requires: spec {_required(spec, 'Manifest document')}, code {sorted(required)}")
    return out


def _manifest_refusal(key: str, value: object) -> str | None:
    """Why a reader refuses the example manifest with ``key`` set to ``value``; None when it takes it."""
    try:
        manifest.Manifest.from_doc({**_EXAMPLE_MANIFEST.to_doc(), key: value}, Path("m"))
    except ProtocolError as exc:
        return str(exc)
    return None


def manifest_value_mismatches(spec: str) -> list[str]:
    """The values the Manifest table's rows name for `split` and `channels` (the backquoted ones) are
    those the code allows, and a reader takes each of them and refuses another."""
    rows = {literal(r["key"]): r for r in table(spec, "Manifest document", "key")}
    out = []
    for key, allowed in (("split", manifest.SPLITS), ("channels", manifest.CHANNELS)):
        named = re.findall(r"`([^`]+)`", rows[key]["meaning"]) if key in rows else []
        if sorted(named) != sorted(str(v) for v in allowed):
            out.append(f"manifest {key}: spec names {named}, code allows {list(allowed)}")
        for text in named:
            refusal = _manifest_refusal(key, int(text) if key == "channels" and text.isdigit() else text)
            if refusal is not None:
                out.append(f"manifest {key}: spec names {text!r}, a reader refuses it ({refusal})")
        other = max(manifest.CHANNELS) + 1 if key == "channels" else "-".join(manifest.SPLITS) + "-other"
        if _manifest_refusal(key, other) is None:
            out.append(f"manifest {key}: a reader takes {other!r}, which the spec does not name")
    return out


def progress_mismatches(spec: str) -> list[str]:
    """The Progress document's table: every key a writer may write, and those it always writes."""
    with tempfile.TemporaryDirectory() as d:
        progress.Progress(1, 2, wait_share=0.5, closed=True, job="7ce11fc278a4f287", read_batches=3,
                           locked=True).write(d)
        full = json_files.read_json(Path(d) / layout.PROGRESS_NAME, "progress")
        with mock.patch.object(progress, "pid_namespace", lambda: None):  # a writer without /proc
            progress.Progress(1, 2).write(d)
        least = json_files.read_json(Path(d) / layout.PROGRESS_NAME, "progress")
    drop = ("format", "version")
    out = _typed_rows(spec, "Progress document", {k: v for k, v in full.items() if k not in drop})
    always = sorted(k for k in least if k not in drop)
    if always != _required(spec, "Progress document"):
        out.append(f"progress keys always written: spec {_required(spec, 'Progress document')}, code {always}")
    return out


def job_mismatches(spec: str) -> list[str]:
    """The Job document's table: the keys and types a writer writes, and which the daemon requires."""
    request = job_request.JobRequest({"data": "/data/train", "batch_size": 8, "reset": True}, replace=True)
    with tempfile.TemporaryDirectory() as d:
        request.write(d)
        doc = json_files.read_json(Path(d) / layout.JOB_NAME, "job")
        out = _typed_rows(spec, "Job document", {k: v for k, v in doc.items() if k not in ("format", "version")})
        required = []
        for key in (k for k in doc if k not in ("format", "version")):
            json_files.write_json(Path(d) / layout.JOB_NAME, {k: v for k, v in doc.items() if k != key})
            try:
                job_request.JobRequest.read(d)
            except job_request.BadJobRequest:
                required.append(key)
    if sorted(required) != _required(spec, "Job document"):
        out.append(f"job keys the daemon requires: spec {_required(spec, 'Job document')}, code {sorted(required)}")
    m = re.search(r"`MAX_JOB_RENAME_SECONDS` \(([\d.]+) s\)", section(spec, "Buffer directory"))  # rule 5
    if m is None or float(m[1]) != job_request.MAX_JOB_RENAME_SECONDS:
        out.append(f"job rename delay: spec {m and m[1]!r}, code {job_request.MAX_JOB_RENAME_SECONDS}")
    m = re.search(r"`MAX_RECORD_RENAME_SECONDS` \(([\d.]+) s\)", section(spec, "Buffer directory"))  # job.accepted.json
    if m is None or float(m[1]) != job_request.MAX_RECORD_RENAME_SECONDS:
        out.append(f"record rename delay: spec {m and m[1]!r}, code {job_request.MAX_RECORD_RENAME_SECONDS}")
    return out


CHECKS: dict[str, Callable[[str], list[str]]] = {
    "constants": constant_mismatches,
    "limits": limit_mismatches,
    "header": header_mismatches,
    "metadata": metadata_mismatches,
    "directory": directory_mismatches,
    "tensors": tensor_mismatches,
    "dtypes": dtype_mismatches,
    "documents": document_mismatches,
    "json temp names": json_temp_mismatches,
    "consumers": consumer_mismatches,
    "status": status_mismatches,
    "manifest": manifest_mismatches,
    "manifest values": manifest_value_mismatches,
    "progress": progress_mismatches,
    "job": job_mismatches,
}


# -- the tests ----------------------------------------------------------------


@pytest.mark.parametrize("check", list(CHECKS))
def test_spec_matches_code(check: str) -> None:
    assert CHECKS[check](SPEC) == []


def test_spec_tables_are_read() -> None:
    """Guards the parser: an empty table would make every check pass vacuously."""
    assert len(table(SPEC, "Constants", "name")) >= 9
    assert len(table(SPEC, "Batch file", "offset")) == 6
    assert len(table(SPEC, "Batch file", "key")) == 9
    assert len(table(SPEC, "Batch file", "name")) == 3
    assert len(table(SPEC, "Buffer directory", "file")) == 12
    assert len(table(SPEC, "Status document", "key")) >= 60
    assert len(table(SPEC, "Manifest document", "key")) == 20
    assert len(table(SPEC, "Progress document", "key")) == 10
    assert len(table(SPEC, "Job document", "key")) == 4
    assert len(docstring_header(batch.__doc__ or "")) == 6


def _replace(old: str, new: str) -> Callable[[str], str]:
    def edit(spec: str) -> str:
        assert old in spec, f"mutation target {old!r} is no longer in SPEC.md"
        return spec.replace(old, new, 1)

    return edit


def _changed_docstring() -> str:
    doc = batch.__doc__ or ""
    return doc.replace("meta_len     I", "meta_size    I")


_TO_DOC = status_module.Status.to_doc
_MANIFEST_TO_DOC = manifest.Manifest.to_doc

# (check, edit of the spec text or None, (module, attribute, new value) or None)
MUTATIONS = {
    "constant in code": ("constants", None, (batch, "PAGE_SIZE", 8192)),
    "magic in code": ("constants", None, (batch, "MAGIC", b"PFDBATCX")),
    "layout constant in code": ("constants", None, (layout, "MAX_DOCUMENT_LEN", 1 << 21)),
    "constant in spec": ("constants", _replace("| MAX_DIMS | 8 |", "| MAX_DIMS | 9 |"), None),
    "unknown constant in spec": ("constants", _replace("| MAX_DIMS | 8 |", "| MAX_DIMS | 8 |\n| MAX_BOGUS | 1 |"), None),
    "new limit in code": ("limits", None, (layout, "MAX_WHATEVER", 3)),
    "header offset in spec": ("header", _replace("| 16 | 8 | header_len", "| 17 | 8 | header_len"), None),
    "header size in spec": ("header", _replace("| 12 | 4 | meta_len", "| 12 | 2 | meta_len"), None),
    "header struct in spec": ("header", _replace("| file_len | Q |", "| file_len | I |"), None),
    "header format in code": ("header", None, (batch, "HEADER_FORMAT", "<8sHHIQI")),
    "field order in docstring": ("header", None, (batch, "__doc__", "")),
    "field name in docstring": ("header", None, (batch, "__doc__", _changed_docstring())),
    "magic in header table": ("header", _replace("| 8s | `PFDBATCH` |", "| 8s | `PFDBATCX` |"), None),
    "metadata key in spec": ("metadata", _replace("| replaced | int |", "| substituted | int |"), None),
    "metadata format in code": ("metadata", None, (batch, "BATCH_FORMAT", "prefetchd.batches")),
    "tensor fields in spec": ("metadata", _replace("{dtype, shape, offset, length}", "{dtype, shape, offset}"), None),
    "status name in code": ("directory", None, (layout, "STATUS_NAME", "state.json")),
    "lock name in spec": ("directory", _replace("| `daemon.lock` |", "| `owner.lock` |"), None),
    "batch name in code": ("directory", None, (layout, "batch_name", lambda e, s: f"e{e:07d}-s{s:08d}.batch")),
    "name widths in spec": ("directory", _replace("| `eEEEEEE-sSSSSSSSS.batch` |", "| `eEEEEE-sSSSSSSSS.batch` |"), None),
    "temp name in code": ("directory", None, (batch, "temp_name", lambda p: p.with_suffix(".partial"))),
    "required tensors in code": ("tensors", None, (batch, "REQUIRED_TENSORS", {**batch.REQUIRED_TENSORS, "masks": "uint8"})),
    "tensor dtype in spec": ("tensors", _replace("| labels | int64 |", "| labels | int32 |"), None),
    "tensor shape in spec": ("tensors", _replace("| labels | int64 | N |", "| labels | int64 | N x C |"), None),
    "dtypes in code": ("dtypes", None, (batch, "DTYPES", {**batch.DTYPES, "float64": np.dtype("<f8")})),
    "dtype byte order in code": ("dtypes", None, (batch, "DTYPES", {**batch.DTYPES, "int64": np.dtype(">i8")})),
    "dtypes in spec": ("dtypes", _replace("`float32`, all", "`float16`, all"), None),
    "document kinds in spec": ("documents", _replace("(`manifest`, `progress`, `status`, `job`)", "(`manifest`, `progress`, `job`)"), None),
    "document version in code": ("documents", None, (batch, "VERSION", 2)),
    "consumer file in spec": ("directory", _replace("| `progress.NAME.json` |", "| `progress-NAME.json` |"), None),
    "consumer pattern in spec": ("consumers", _replace("match `[A-Za-z0-9_-]{1,32}`", "match `[A-Za-z0-9_-]{1,64}`"), None),
    "consumer refresh in code": ("consumers", None, (progress, "PROGRESS_REFRESH_SECONDS", 5.0)),
    "consumer check in code": ("consumers", None, (layout, "check_consumer", lambda name: name)),
    "lock retry in code": ("consumers", None, (ownership, "LOCK_RETRY_SECONDS", 2.0)),
    "daemon lock retry in spec": ("consumers", _replace("`LOCK_RETRY_SECONDS` (0.5 s) when", "`LOCK_RETRY_SECONDS` (1 s) when"),
                                  None),
    "status namespace in spec": ("status", _replace("| `pid_namespace` | int | always |", "| `pid_namespace` | str | always |"),
                                 None),
    "progress namespace in spec": ("progress", _replace("| `pid_namespace` | int | no |", "| `pid_namespace` | str | no |"), None),
    "progress namespace requirement in spec": ("progress", _replace("| `pid_namespace` | int | no |", "| `pid_namespace` | int | yes |"), None),
    "json temp name in spec": ("json temp names", _replace("`NAME.tmp-", "`NAME.partial-"), None),
    "json temp name in code": ("json temp names", None, (layout, "TEMP_MARK", ".part")),
    "status key in spec": ("status", _replace("| `rates.samples_per_s` |", "| `rates.images_per_s` |"), None),
    "status type in spec": ("status", _replace("| `heartbeat` | float |", "| `heartbeat` | int |"), None),
    "status key's presence in spec": ("status", _replace("| `producer` | str | producing |", "| `producer` | str | always |"), None),
    "state in spec": ("status", _replace("| `paused-low-space` |", "| `paused` |"), None),
    "state in code": ("status", None, (status_module, "State", enum.Enum("State", {"STARTING": "starting"}, type=str))),
    "status key in code": ("status", None, (status_module.Status, "to_doc",
                                            lambda self: {**_TO_DOC(self), "fill": 3})),
    "manifest key in spec": ("manifest", _replace("| `num_samples` | int |", "| `samples` | int |"), None),
    "manifest type in spec": ("manifest", _replace("| `seed` | int |", "| `seed` | str |"), None),
    "manifest requirement in spec": ("manifest", _replace("| `drop_last` | bool | no |", "| `drop_last` | bool | yes |"), None),
    "manifest key in code": ("manifest", None, (manifest.Manifest, "to_doc", lambda self: {**_MANIFEST_TO_DOC(self), "x": 1})),
    "manifest split in spec": ("manifest values", _replace("| `train` or `val` |", "| `train`, `val` or `test` |"), None),
    "manifest channels in spec": ("manifest values", _replace("`3`, or `1` for grayscale", "`3`"), None),
    "manifest channels in code": ("manifest values", None, (manifest, "CHANNELS", (3, 1, 4))),
    "manifest value check in code": ("manifest values", None, (manifest, "_one_of", lambda doc, key, allowed, path: None)),
    "progress key in spec": ("progress", _replace("| `wait_share` | float |", "| `waiting` | float |"), None),
    "progress requirement in spec": ("progress", _replace("| `job` | str | no |", "| `job` | str | yes |"), None),
    "job key in spec": ("job", _replace("| `submitted` | float |", "| `sent` | float |"), None),
    "job requirement in spec": ("job", _replace("| `replace` | bool or null | no |", "| `replace` | bool or null | yes |"), None),
    "job type in spec": ("job", _replace("| `job_id` | str |", "| `job_id` | int |"), None),
    "job rename delay in spec": ("job", _replace("`MAX_JOB_RENAME_SECONDS` (10 s)", "`MAX_JOB_RENAME_SECONDS` (60 s)"), None),
    "job rename delay in code": ("job", None, (job_request, "MAX_JOB_RENAME_SECONDS", 60.0)),
    "record rename delay in spec": ("job", _replace("`MAX_RECORD_RENAME_SECONDS` (1 s)", "`MAX_RECORD_RENAME_SECONDS` (5 s)"),
                                    None),
    "record rename delay in code": ("job", None, (job_request, "MAX_RECORD_RENAME_SECONDS", 5.0)),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_check_can_fail(mutation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check, edit, patch = MUTATIONS[mutation]
    spec = edit(SPEC) if edit is not None else SPEC
    if patch is not None:
        module, attr, value = patch
        monkeypatch.setattr(module, attr, value, raising=False)
    assert CHECKS[check](spec) != [], f"{check} check did not notice: {mutation}"


def test_the_keys_status_json_adds_are_those_the_spec_lists(tmp_path: Path) -> None:
    """`prefetchd status --json` wraps the status document: SPEC names the wrapper's keys, the same for
    a buffer and for a rank's directory its daemon does not write."""
    from prefetchd.buffer_protocol.layout import LOCK_NAME
    from prefetchd.daemon.status_view import describe_status, status_json

    text = " ".join(section(SPEC, "Status document").split())
    said = re.search(r"under its `status` key, beside what the command found itself: (.*?`problems`)", text)
    assert said is not None, "SPEC no longer says what `prefetchd status --json` wraps the document in"
    listed = set(re.findall(r"`(\w+)`", said.group(1)))
    (tmp_path / LOCK_NAME).touch()  # makes tmp_path/rank-00007 a rank's directory of tmp_path
    assert describe_status(tmp_path / "rank-00007").no_rank
    for buffer in (tmp_path, tmp_path / "rank-00007"):
        assert listed | {"status"} == set(json.loads(status_json(describe_status(buffer)))), buffer
