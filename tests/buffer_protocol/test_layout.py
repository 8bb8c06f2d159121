"""The buffer directory: names, JSON documents and the one-daemon lock."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefetchd.buffer_protocol import (
    VERSION,
    BufferBusy,
    DaemonLock,
    JobRequest,
    JobResult,
    Manifest,
    Position,
    Progress,
    ProtocolError,
    RunningJob,
    State,
    Status,
    alive_since,
    batch_name,
    daemon_pid,
    list_batches,
    list_temp_files,
    map_batch,
    parse_batch_name,
    read_status,
    readable_status,
    stream_dir,
    write_batch,
    write_status,
)
from prefetchd.buffer_protocol.batch import temp_name
from prefetchd.buffer_protocol.json_files import MAX_DOCUMENT_LEN, MAX_PROGRESS_LEN, write_json
from prefetchd.buffer_protocol.layout import JOB_NAME, LOCK_NAME, MANIFEST_NAME, MAX_EPOCH, MAX_STEP, PROGRESS_NAME, STATUS_NAME
from prefetchd.buffer_protocol.manifest import CHANNELS, SPLITS
from tests.owners import owned
from tests.status_examples import ERRORS, bad_files, production, stream, write_status_at_heartbeat
from tests.status_examples import status as status_example

WAIT_S = 30.0  # generous: a cold interpreter importing numpy on a loaded 2-core box


# -- names --------------------------------------------------------------------


@settings(max_examples=100, deadline=500)
@given(a=st.tuples(st.integers(0, 10**6 - 1), st.integers(0, 10**8 - 1)),
       b=st.tuples(st.integers(0, 10**6 - 1), st.integers(0, 10**8 - 1)))
def test_batch_name_round_trip_and_order(a: tuple[int, int], b: tuple[int, int]) -> None:
    assert parse_batch_name(batch_name(*a)) == a
    assert batch_name(*a).endswith(".batch")
    # Zero padding makes a directory listing sort in (epoch, step) order.
    assert (batch_name(*a) < batch_name(*b)) == (a < b)


@pytest.mark.parametrize(
    "name",
    [
        "", "e000000-s00000000.tmp", "e000000-s00000000.batch.tmp", "e000000-s00000000.batch.tmp-12",
        "e0-s0.batch", "e000000-s0000000.batch", "e0000000-s00000000.batch", "e000000-s000000000.batch",
        "E000000-S00000000.batch", "e000000-s00000000.BATCH", "xe000000-s00000000.batch",
        "e000000-s00000000.batchx", " e000000-s00000000.batch", "e-00001-s00000000.batch",
        "e00000a-s00000000.batch", "e000000_s00000000.batch", "manifest.json", "progress.json.tmp-12",
        "daemon.lock",
    ],
)
def test_other_names_are_not_batches(name: str) -> None:
    assert parse_batch_name(name) is None


@pytest.mark.parametrize(
    "name",
    ["e000000-s00000000.batch\n", "e\u0660\u0660\u0660\u0660\u0660\u0660-s\u0660\u0660\u0660\u0660\u0660\u0660\u0660\u0660.batch",
     "e000000-s0000000\u0661.batch"],
    ids=["trailing-newline", "arabic-indic-digits", "one-non-ascii-digit"],
)
def test_only_canonical_names_parse(name: str) -> None:
    parsed = parse_batch_name(name)
    assert parsed is None or batch_name(*parsed) == name


@pytest.mark.parametrize("epoch,step", [(10**6, 0), (0, 10**8), (-1, 0), (0, -1)])
def test_batch_name_refuses_what_it_cannot_encode(epoch: int, step: int) -> None:
    # Seven epoch digits or nine step digits would sort wrongly and not parse back: refused, never encoded.
    with pytest.raises(ValueError, match=f"epoch {epoch} / step {step} outside"):
        batch_name(epoch, step)


@pytest.mark.parametrize("epoch,step", [(0, 0), (10**6 - 1, 0), (0, 10**8 - 1), (10**6 - 1, 10**8 - 1)])
def test_batch_name_encodes_its_whole_range(epoch: int, step: int) -> None:
    assert parse_batch_name(batch_name(epoch, step)) == (epoch, step)


def test_the_protocols_functions_name_what_they_cannot_take(tmp_path: Path) -> None:
    """A walk of the API: batch_name(1.5, 0) said "Unknown format code 'd'", stream_dir(B, 0, 0) "rank 0 is outside a
    world of 0" without naming world_size, and map_batch(the buffer) to remove the buffer."""
    with pytest.raises(TypeError, match=r"epoch 1.5 / step 0: a batch is named by two integers"):
        batch_name(1.5, 0)  # type: ignore[arg-type]
    assert batch_name(np.int64(3), np.int32(4)) == batch_name(3, 4)
    with pytest.raises(ValueError, match=r"world_size=0: a job has at least one rank"):
        stream_dir(tmp_path, 0, 0)
    with pytest.raises(ProtocolError, match=rf"{tmp_path}: a folder, not a batch file; pass one of its batches"):
        map_batch(tmp_path)


def _interrupted_json_write(path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """Name of the temp file write_json leaves when it dies before its rename."""
    left: list[str] = []
    with monkeypatch.context() as m:
        m.setattr(os, "replace", lambda src, dst, **_: left.append(Path(src).name))
        write_json(path, {"format": "prefetchd.test"})
    assert len(left) == 1 and (path.parent / left[0]).exists()
    return left[0]


def test_listing_a_real_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    batches = [(0, 0), (0, 1), (1, 0)]
    for key in batches:
        (tmp_path / batch_name(*key)).write_bytes(b"")
    temps = ["e000000-s00000002.tmp", temp_name(tmp_path / batch_name(7, 9)).name]
    others = ["notes.txt", "x.tmp", "e000000-s00000004.batch.bak", "progress.json.tmp-abc",
              MANIFEST_NAME, PROGRESS_NAME, LOCK_NAME, STATUS_NAME]
    for name in temps + others:
        (tmp_path / name).write_bytes(b"")
    temps += [_interrupted_json_write(tmp_path / name, monkeypatch) for name in (PROGRESS_NAME, MANIFEST_NAME)]
    (tmp_path / "subdir").mkdir()
    assert list_batches(tmp_path) == {key: tmp_path / batch_name(*key) for key in batches}
    assert sorted(p.name for p in list_temp_files(tmp_path)) == sorted(temps)


# -- JSON documents -----------------------------------------------------------


def fill_up(path: Path) -> None:
    """Write ``path`` until its filesystem has no page left."""
    with open(path, "wb", buffering=0) as out:
        with contextlib.suppress(OSError):
            while True:
                out.write(b"\0" * 4096)


def test_a_daemon_on_a_full_filesystem_keeps_its_heartbeat(small_tmpfs: Path) -> None:
    """A full tmpfs stops status.json's rewrite; its mtime, set without space, carries the
    heartbeat, so a trainer does not take a healthy daemon for stuck (and --spawn-daemon kill it)."""
    old = time.time() - 100
    write_status(small_tmpfs, Status(pid=os.getpid(), state=State.FILLING, heartbeat=old))
    os.utime(small_tmpfs / STATUS_NAME, (old, old))
    fill_up(small_tmpfs / "ballast")
    before = time.time()
    with pytest.raises(OSError, match="No space left"):
        write_status(small_tmpfs, Status(pid=os.getpid(), state=State.FULL, heartbeat=before, message="x" * 8192))
    status = read_status(small_tmpfs)
    assert status is not None and status.state == State.FILLING  # the document as it was
    assert before - 1 <= status.heartbeat <= time.time()  # but alive as of now


def test_on_a_full_filesystem_a_status_is_written_over_the_one_there(small_tmpfs: Path) -> None:
    """A daemon restarted on a full tmpfs has no page for a new status.json: written over the earlier daemon's, in
    that file's pages, it says its own pid and state at once.  Only the mtime of the earlier one's was set: a
    trainer waiting on the buffer then found a status of another pid than the lock's, so no heartbeat of the new
    daemon's, and called it stuck."""
    write_status(small_tmpfs, status_example(State.FULL, pid=os.getpid() + 1, heartbeat=time.time() - 100))
    fill_up(small_tmpfs / "ballast")
    waiting = Status(pid=os.getpid(), state=State.PAUSED_LOW_SPACE, heartbeat=time.time(),
                     message="waiting for room: no room to write manifest.json")
    write_status(small_tmpfs, waiting)  # shorter than the one there: padded with blanks to its length
    assert read_status(small_tmpfs) == waiting
    grown = dataclasses.replace(waiting, message="x" * 3000)  # longer than the one there, within its page
    write_status(small_tmpfs, grown)
    assert read_status(small_tmpfs) == grown
    assert os.statvfs(small_tmpfs).f_bavail == 0  # in no new page
    # A second name of status.json (a group member's link): not written through, which would change that file too.
    os.link(small_tmpfs / STATUS_NAME, small_tmpfs / "second-name")
    with pytest.raises(OSError, match="No space left"):
        write_status(small_tmpfs, waiting)
    kept = read_status(small_tmpfs)
    assert kept is not None and kept.message == grown.message  # as it was; its mtime beats


@pytest.mark.parametrize("renamed", ["batch", "lock"])
def test_on_a_full_filesystem_no_other_file_of_the_daemon_renamed_to_status_json_is_written_over(
        small_tmpfs: Path, renamed: str) -> None:
    """A member of a --group-access buffer's group may rename any file of the buffer's folders, the daemon's too:
    one of its batches that a trainer has mapped, renamed to status.json, had its pages written over (images of
    spaces, labels 0x2020202020202020) in the trainer's private mapping once the member filled the tmpfs; its
    daemon.lock, renamed back after, named no pid.  Only a status document is written in place."""
    if renamed == "batch":
        victim = small_tmpfs / batch_name(0, 0)
        write_batch(victim, np.full((2, 8, 8, 3), 7, np.uint8), np.arange(2), np.arange(2), epoch=0, step=0, seed=0,
                    producer="0123456789ab")
    else:
        victim = small_tmpfs / LOCK_NAME
        victim.write_text(f"{os.getpid()}\n")
    before = victim.read_bytes()
    mapped = map_batch(victim) if renamed == "batch" else None
    victim.rename(small_tmpfs / STATUS_NAME)
    fill_up(small_tmpfs / "ballast")
    with pytest.raises(OSError, match="No space left"):
        write_status(small_tmpfs, Status(pid=os.getpid(), state=State.PAUSED_LOW_SPACE, heartbeat=time.time()))
    assert (small_tmpfs / STATUS_NAME).read_bytes() == before
    if mapped is not None:
        assert (mapped.images == 7).all() and mapped.labels.tolist() == [0, 1]


def test_a_failed_json_write_leaves_no_temp_file(tmp_path: Path, small_tmpfs: Path) -> None:
    """A loader retries its progress write every half second: a failure must not leave a file each time."""
    (tmp_path / "doc.json").mkdir()  # replaced by someone with a directory
    with pytest.raises(IsADirectoryError):
        write_json(tmp_path / "doc.json", {"format": "prefetchd.test"})
    assert os.listdir(tmp_path) == ["doc.json"]
    fill_up(small_tmpfs / "ballast")
    with pytest.raises(OSError, match="No space left"):
        write_json(small_tmpfs / "doc.json", {"format": "prefetchd.test", "pad": "x" * 8192})
    assert os.listdir(small_tmpfs) == ["ballast"]


def test_write_json_replaces_atomically(tmp_path: Path) -> None:
    path = tmp_path / "doc.json"
    write_json(path, {"format": "prefetchd.test", "n": 1})
    with open(path, "rb") as old:
        write_json(path, {"format": "prefetchd.test", "n": 2})
        # A reader that opened the old document keeps reading it whole: the new
        # one is a different inode, not a rewrite in place.
        assert json.loads(old.read())["n"] == 1
    assert json.loads(path.read_text())["n"] == 2
    assert os.listdir(tmp_path) == ["doc.json"]


def _manifest(**changes: Any) -> Manifest:
    base = Manifest(
        dataset_root="/data/shapes", fingerprint="abc123", classes=["circle", "square"], num_samples=400,
        split="train", seed=0, batch_size=32, image_size=64, samples_per_epoch=400, steps_per_epoch=13,
        epochs=None, producer="host-1234-0", created=1700000000.5,
    )
    return dataclasses.replace(base, **changes)


_json_text = st.text(max_size=20)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    samples, batch_size = draw(st.integers(0, 2**40)), draw(st.integers(1, 4096))
    drop_last = draw(st.booleans())
    return Manifest(
        dataset_root=draw(_json_text), fingerprint=draw(_json_text), classes=draw(st.lists(_json_text, max_size=5)),
        num_samples=draw(st.integers(0, 2**53)), split=draw(st.sampled_from(SPLITS)),
        seed=draw(st.integers(0, 2**63 - 1)), batch_size=batch_size, image_size=draw(st.integers(1, 1024)),
        samples_per_epoch=samples, steps_per_epoch=samples // batch_size if drop_last else -(-samples // batch_size),
        drop_last=drop_last,
        epochs=draw(st.none() | st.integers(0, 10**6)), producer=draw(_json_text),
        channels=draw(st.sampled_from(CHANNELS)), rank=draw(st.integers(0, 63)), world_size=draw(st.integers(1, 64)),
        val_fraction=draw(st.none() | st.floats(0, 0.99)), augmentation=draw(st.text(max_size=40)), created=draw(st.floats(0, 4e9)),
    )


@settings(max_examples=60, deadline=500)
@given(m=manifests())
def test_manifest_round_trip(m: Manifest, tmp_path_factory: pytest.TempPathFactory) -> None:
    buffer = tmp_path_factory.getbasetemp()
    assert Manifest.from_doc(m.to_doc(), buffer / MANIFEST_NAME) == m
    m.write(buffer)
    assert Manifest.read(buffer) == m


def _write_doc(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "change",
    [
        {"format": "prefetchd.progress"}, {"format": None}, {"version": VERSION + 1}, {"version": None},
        {"version": "1"},
    ],
    ids=lambda c: f"{next(iter(c))}={next(iter(c.values()))!r}",
)
def test_manifest_refuses_other_format_or_version(tmp_path: Path, change: dict[str, Any]) -> None:
    _write_doc(tmp_path / MANIFEST_NAME, {**_manifest().to_doc(), **change})
    with pytest.raises(ProtocolError, match=MANIFEST_NAME):
        Manifest.read(tmp_path)


@pytest.mark.parametrize("doc", [[], "manifest", 3, None], ids=repr)
def test_manifest_refuses_non_maps(tmp_path: Path, doc: Any) -> None:
    _write_doc(tmp_path / MANIFEST_NAME, doc)
    with pytest.raises(ProtocolError, match=MANIFEST_NAME):
        Manifest.read(tmp_path)


_BAD_FIELDS: list[Any] = [
    ("seed", "0"), ("seed", -1), ("seed", True), ("seed", 1.0), ("num_samples", 1.5),
    ("batch_size", 0), ("image_size", 0), ("world_size", 0), ("rank", -1), ("channels", "3"),
    ("classes", "circle"), ("classes", None), ("dataset_root", 5), ("fingerprint", None), ("split", ["train"]),
    ("producer", 7), ("created", "yesterday"), ("epochs", -1), ("epochs", "3"), ("epochs", False),
    ("steps_per_epoch", None), ("steps_per_epoch", 12), ("val_fraction", "0.1"), ("classes", ["circle", 3]),
    ("drop_last", 1), ("drop_last", "true"), ("drop_last", None),
]


@pytest.mark.parametrize("field,value", _BAD_FIELDS)
def test_manifest_refuses_wrong_field_types(tmp_path: Path, field: str, value: Any) -> None:
    _write_doc(tmp_path / MANIFEST_NAME, {**_manifest().to_doc(), field: value})
    with pytest.raises(ProtocolError, match=MANIFEST_NAME) as info:
        Manifest.read(tmp_path)
    assert field in str(info.value) or field in ("batch_size", "image_size", "world_size")


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("split", "bogus", "'train' or 'val'"), ("split", "Train", "'train' or 'val'"), ("split", "", "'train' or 'val'"),
    ("channels", 7, "3 or 1"), ("channels", 0, "3 or 1"), ("channels", 4, "3 or 1"),
])
def test_manifest_refuses_a_split_or_channels_the_spec_does_not_name(tmp_path: Path, field: str, value: Any,
                                                                       allowed: str) -> None:
    """Well typed, but no value a daemon writes: a trainer would read batches it cannot tell how to use."""
    _write_doc(tmp_path / MANIFEST_NAME, {**_manifest().to_doc(), field: value})
    with pytest.raises(ProtocolError) as info:
        Manifest.read(tmp_path)
    assert str(info.value).startswith(f"{tmp_path / MANIFEST_NAME}: field {field!r} is {value!r}, expected {allowed}")


@pytest.mark.parametrize("field", ["fingerprint", "seed", "classes", "created", "producer"])
def test_manifest_refuses_missing_fields(tmp_path: Path, field: str) -> None:
    doc = _manifest().to_doc()
    del doc[field]
    _write_doc(tmp_path / MANIFEST_NAME, doc)
    with pytest.raises(ProtocolError, match=field) as info:
        Manifest.read(tmp_path)
    if field in ("seed", "created"):  # read by checked_field: "missing", not "is None" (a review)
        assert f"field {field!r} is missing, expected a " in str(info.value), info.value


def test_manifest_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Manifest.read(tmp_path)


def test_drop_last_counts_only_full_batches_and_is_false_where_absent(tmp_path: Path) -> None:
    # 400 samples in batches of 32: 13 steps with the short last one, 12 without it.
    dropping = _manifest(drop_last=True, steps_per_epoch=12)
    assert Manifest.from_doc(dropping.to_doc(), tmp_path / MANIFEST_NAME) == dropping
    with pytest.raises(ProtocolError, match="short last batch left out"):
        Manifest.from_doc({**dropping.to_doc(), "steps_per_epoch": 13}, tmp_path / MANIFEST_NAME)
    with pytest.raises(ProtocolError, match="steps_per_epoch 12 does not match"):
        Manifest.from_doc({**dropping.to_doc(), "drop_last": False}, tmp_path / MANIFEST_NAME)
    # A manifest from a daemon that predates the field keeps every batch.
    older = _manifest().to_doc()
    del older["drop_last"]
    assert Manifest.from_doc(older, tmp_path / MANIFEST_NAME).drop_last is False


def test_identity_diff() -> None:
    old = _manifest()
    assert old.identity_diff(old) == []
    # Fields outside the job identity may change freely.
    assert _manifest(producer="other", created=1.0, epochs=90, dataset_root="/moved", num_samples=1).identity_diff(old) == []
    assert _manifest(seed=1).identity_diff(old) == ["seed: 0 -> 1"]
    assert _manifest(augmentation="color_jitter=0.4").identity_diff(old) == ["augmentation: '' -> 'color_jitter=0.4'"]
    assert _manifest(drop_last=True, steps_per_epoch=12).identity_diff(old) == ["drop_last: False -> True"]
    changed = _manifest(batch_size=64, val_fraction=0.1, fingerprint="def")
    assert sorted(changed.identity_diff(old)) == sorted(
        ["fingerprint: 'abc123' -> 'def' (the files of /data/shapes changed)", "batch_size: 32 -> 64",
         "val_fraction: None -> 0.1"])
    # A digest alone does not say which dataset: the roots are named.
    assert _manifest(fingerprint="def", dataset_root="/data/other").identity_diff(old) == [
        "fingerprint: 'abc123' -> 'def' (dataset /data/shapes -> /data/other)"]
    # Classes added or renamed move the labels after them: said beside the digest (a walk renamed a class folder).
    renamed = _manifest(fingerprint="def", classes=["circle", "hexagon", "square", "star2"])
    assert renamed.identity_diff(_manifest(classes=["circle", "square", "star"]))[-1] == (
        "classes: added 'hexagon', 'star2'; removed 'star' (a label is its class's place in the sorted list: the "
        "labels of the classes after it change)")
    for field in Manifest.IDENTITY:
        assert field in Manifest.__dataclass_fields__


@settings(max_examples=30, deadline=500)
@given(epoch=st.integers(0, 2**63 - 1), step=st.integers(0, 2**63 - 1))
def test_progress_round_trip(epoch: int, step: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    buffer = tmp_path_factory.getbasetemp()
    Progress(epoch, step).write(buffer)
    assert Progress.read(buffer) == Progress(epoch, step)
    doc = json.loads((buffer / PROGRESS_NAME).read_text())
    assert (doc["format"], doc["version"], doc["pid"]) == ("prefetchd.progress", VERSION, os.getpid())


def test_progress_names_its_writer(tmp_path: Path) -> None:
    before = time.time()
    Progress(3, 4).write(tmp_path)
    p = Progress.read(tmp_path)
    assert p is not None and p.pid == os.getpid() and p.time is not None and before <= p.time <= time.time()
    # Documents of writers that did not name themselves still read.
    (tmp_path / PROGRESS_NAME).write_text(json.dumps({"format": "prefetchd.progress", "version": VERSION,
                                                      "epoch": 1, "step": 2}))
    old = Progress.read(tmp_path)
    assert old == Progress(1, 2) and old is not None and old.pid is None and old.time is None


@pytest.mark.parametrize("umask", [0o077, 0o000])
def test_what_a_trainer_writes_is_0644_whatever_its_umask(tmp_path: Path, umask: int) -> None:
    """A service's daemon reads progress and job.json through the buffer's group: under umask 077 they were 0600."""
    old = os.umask(umask)
    try:
        Progress(0, 1).write(tmp_path)
        Progress(0, 1).write(tmp_path, "trial-3")
        JobRequest({"batch_size": 8}).write(tmp_path)
    finally:
        os.umask(old)
    for name in ("progress.json", "progress.trial-3.json", "job.json"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644, name


def test_alive_since_rules_out_dead_and_reused_pids() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert alive_since(os.getpid(), time.time())
    assert not alive_since(proc.pid, time.time())  # gone
    # Started long after the document it is asked about was written: the pid was reused.
    assert not alive_since(os.getpid(), psutil.Process().create_time() - 3600)


HIDDEN_PROC = """
import sys, time
from prefetchd.buffer_protocol import alive_since
live, dead = int(sys.argv[1]), int(sys.argv[2])
print(alive_since(live, time.time()), alive_since(dead, time.time()))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("setpriv"),
                    reason="needs root, unshare and setpriv to mount a /proc with hidepid")
def test_alive_since_sees_another_users_process_that_proc_hides() -> None:
    """The service's sandbox (ProtectProc=invisible) hides the trainers' processes from the daemon's
    /proc: a live trainer must not read as gone, a gone one still must.  Here: a process of uid 65534,
    checked from a private /proc mounted hidepid=invisible, by root without its root group (which a
    hidepid mount exempts by default), CAP_SYS_PTRACE and CAP_KILL."""
    other = subprocess.Popen(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "sleep", "60"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        check = (f"mount -t proc -o hidepid=invisible proc /proc && setpriv --regid 65533 --clear-groups "
                 f"--bounding-set -sys_ptrace,-kill {sys.executable} -c '{HIDDEN_PROC}' {other.pid} {gone.pid}")
        out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", check],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["True", "False"], out.stdout
    finally:
        other.kill()
        other.wait()


def test_progress_missing_is_none(tmp_path: Path) -> None:
    assert Progress.read(tmp_path) is None


def test_progress_orders_by_epoch_then_step() -> None:
    assert Progress(0, 99) < Progress(1, 0) < Progress(1, 1)


@settings(max_examples=100, deadline=500)
@given(garbage=st.binary(max_size=200))
def test_garbage_progress_is_a_protocol_error(garbage: bytes, tmp_path_factory: pytest.TempPathFactory) -> None:
    buffer = tmp_path_factory.getbasetemp()
    (buffer / PROGRESS_NAME).write_bytes(garbage)
    with pytest.raises(ProtocolError, match=PROGRESS_NAME):
        Progress.read(buffer)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


@settings(max_examples=100, deadline=500)
@given(doc=st.one_of(_json, st.fixed_dictionaries(
    {"format": st.just("prefetchd.progress"), "version": st.just(VERSION)},
    optional={"epoch": _json, "step": _json})))
def test_json_progress_is_valid_or_refused(doc: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    buffer = tmp_path_factory.getbasetemp()
    (buffer / PROGRESS_NAME).write_text(json.dumps(doc))
    try:
        progress = Progress.read(buffer)
    except ProtocolError:
        return
    assert isinstance(doc, dict) and progress == Progress(doc["epoch"], doc["step"])
    assert all(type(v) is int and v >= 0 for v in (doc["epoch"], doc["step"]))


def test_truncated_progress_is_a_protocol_error(tmp_path: Path) -> None:
    Progress(12, 345).write(tmp_path)
    data = (tmp_path / PROGRESS_NAME).read_bytes()
    for cut in range(len(data)):
        (tmp_path / PROGRESS_NAME).write_bytes(data[:cut])
        with pytest.raises(ProtocolError, match=PROGRESS_NAME):
            Progress.read(tmp_path)


def test_rewound_progress_reads_as_the_older_position(tmp_path: Path) -> None:
    # A trainer restarted from an older checkpoint writes an older position;
    # that is valid, and the daemon regenerates from there.
    Progress(5, 3).write(tmp_path)
    older = (tmp_path / PROGRESS_NAME).read_bytes()
    Progress(7, 0).write(tmp_path)
    assert Progress.read(tmp_path) == Progress(7, 0)
    (tmp_path / "restore").write_bytes(older)
    os.replace(tmp_path / "restore", tmp_path / PROGRESS_NAME)
    assert Progress.read(tmp_path) == Progress(5, 3)


def test_oversized_progress_is_a_protocol_error(tmp_path: Path) -> None:
    doc = {"format": "prefetchd.progress", "version": VERSION, "epoch": 0, "step": 0, "pad": "x" * MAX_DOCUMENT_LEN}
    _write_doc(tmp_path / PROGRESS_NAME, doc)
    with pytest.raises(ProtocolError, match="larger than"):
        Progress.read(tmp_path)


def test_a_progress_document_is_read_only_up_to_its_own_bound(tmp_path: Path) -> None:
    """The daemon reads every consumer's progress at each poll, and any member of a --group-access buffer's group
    may write one: 63 valid documents of 1 MiB (a list of numbers beside the position) took 110 ms each to parse,
    and the daemon's loop beat every 4.3 s instead of every second.  A writer's fullest one fits the bound."""
    doc = {"format": "prefetchd.progress", "version": VERSION, "epoch": 0, "step": 0, "pad": [0] * 50_000}
    _write_doc(tmp_path / PROGRESS_NAME, doc)
    with pytest.raises(ProtocolError, match=f"larger than {MAX_PROGRESS_LEN} bytes, not a progress document"):
        Progress.read(tmp_path)
    fullest = Progress(MAX_EPOCH, MAX_STEP, wait_share=0.1234, closed=True, job="f" * 64, read_batches=2**63 - 1,
                       locked=True)
    fullest.write(tmp_path)
    assert Progress.read(tmp_path) == fullest


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000, '{"format": "prefetchd.progress", "version": 1, "epoch": ' + "9" * 5000 + ', "step": 0}'],
    ids=["deep-nesting", "5000-digit-int"],
)
def test_pathological_json_is_a_protocol_error(tmp_path: Path, text: str) -> None:
    (tmp_path / PROGRESS_NAME).write_text(text)
    with pytest.raises(ProtocolError, match=PROGRESS_NAME):
        Progress.read(tmp_path)


HUGE = "x" * (MAX_DOCUMENT_LEN // 2)  # a field of half a document: two in status.json outgrew it
LONG = "x" * (MAX_PROGRESS_LEN - 200)  # as long as a field of a progress document gets (a longer one: too large)


@pytest.mark.parametrize("kind,doc", [
    ("progress", {"format": LONG}),
    ("progress", {"format": "prefetchd.progress", "version": LONG}),
    ("progress", {"format": "prefetchd.progress", "version": VERSION, "epoch": 0, "step": 0, "wait_share": LONG}),
    ("progress", {"format": "prefetchd.progress", "version": VERSION, "epoch": 0, "step": 0, "closed": LONG}),
    ("progress", {"format": "prefetchd.progress", "version": VERSION, "epoch": 0, "step": 0, "locked": LONG}),
    ("job", {"format": "prefetchd.job", "version": VERSION, "settings": {"data": [HUGE]}}),
    ("job", {"format": "prefetchd.job", "version": VERSION, "settings": {HUGE: [1]}}),
    ("manifest", {**_manifest().__dict__, "format": "prefetchd.manifest", "version": VERSION, "split": HUGE}),
], ids=["format", "version", "wait_share", "closed", "locked", "job-value", "job-key", "manifest-split"])
def test_a_refusal_quotes_a_megabyte_field_cut_short(tmp_path: Path, kind: str, doc: dict[str, Any]) -> None:
    """Any member of a --group-access buffer's group writes progress files and job.json: a refusal quoted
    such a field whole, and status.json, which carries it (a stream's progress_file, the job's answer),
    outgrew the MAX_DOCUMENT_LEN its readers take, so every trainer read the daemon as gone."""
    name = {"progress": PROGRESS_NAME, "job": "job.json", "manifest": MANIFEST_NAME}[kind]
    _write_doc(tmp_path / name, doc)
    read = {"progress": Progress.read, "job": JobRequest.read, "manifest": Manifest.read}[kind]
    with pytest.raises(ProtocolError, match=name) as info:
        read(tmp_path)
    assert len(str(info.value)) < 500 and "characters)" in str(info.value), str(info.value)[:1000]


def test_boolean_version_is_refused(tmp_path: Path) -> None:
    _write_doc(tmp_path / PROGRESS_NAME, {"format": "prefetchd.progress", "version": True, "epoch": 0, "step": 0})
    with pytest.raises(ProtocolError, match="version"):
        Progress.read(tmp_path)


@pytest.mark.parametrize("doc", [
    {"epoch": -1, "step": 0}, {"epoch": 0, "step": True}, {"epoch": 1.0, "step": 0}, {"epoch": 0}, {"step": 0},
], ids=repr)
def test_progress_refuses_bad_positions(tmp_path: Path, doc: dict[str, Any]) -> None:
    _write_doc(tmp_path / PROGRESS_NAME, {"format": "prefetchd.progress", "version": VERSION, **doc})
    with pytest.raises(ProtocolError, match=PROGRESS_NAME):
        Progress.read(tmp_path)


@pytest.mark.parametrize("written", [
    status_example(),
    status_example(production=production(streams=(stream(0), stream(1, progress=Position(0, 7, 0.25))),
                                         errors=dataclasses.replace(ERRORS, undecodable_files=2, undecodable=bad_files(2)))),
    status_example(State.WAITING_FOR_JOB, production=None, job_result=None, message="waiting for a job"),
    status_example(State.STARTING, production=None,
                   job_result=JobResult(job_id=None, accepted=False, reason="job.json: not valid JSON", time=5.0)),
], ids=["producing", "two ranks", "waiting", "starting"])
def test_status_round_trip(tmp_path: Path, written: Status) -> None:
    assert read_status(tmp_path) is None
    write_status_at_heartbeat(tmp_path, written)
    assert read_status(tmp_path) == written
    doc = json.loads((tmp_path / STATUS_NAME).read_text())
    assert doc["format"] == "prefetchd.status" and doc["version"] == VERSION
    assert doc == json.loads(json.dumps(written.to_doc()))
    # Flat on disk, as `prefetchd status --json` has always shown it: a running job's fields at the top.
    assert ("progress" in doc) == (written.production is not None) and "production" not in doc
    rank_dir = tmp_path / "rank-00001"
    rank_dir.mkdir()
    (tmp_path / "daemon.lock").touch()
    assert read_status(rank_dir) == written  # a rank's stream directory reads its buffer's status
    (tmp_path / STATUS_NAME).write_text('{"format": "prefetchd.manifest", "version": 1}')
    with pytest.raises(ProtocolError, match=STATUS_NAME):
        read_status(tmp_path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file another owner")
def test_a_status_json_not_of_the_buffers_owner_is_not_the_daemons(tmp_path: Path) -> None:
    """A member of a --group-access buffer's group may rename a file of theirs to status.json: a pid and state of
    their choosing (a trainer's DaemonStuck or JobEnded), or a running job another user submitted, which a trainer
    stopped by it names (JobReplaced: "bob replaced this loader's job").  Only the buffer folder's owner writes it."""
    forged = dataclasses.replace(status_example(), running_job=RunningJob("0123456789ab", 1002, 5.0, "producing"))
    write_status_at_heartbeat(tmp_path, forged)
    os.chown(tmp_path / STATUS_NAME, 65534, 65534)
    with pytest.raises(ProtocolError, match=rf"status.json: belongs to \S+ \(uid 65534\), not to \S+ \(uid {os.getuid()}\) "
                                            "who owns the buffer"):
        read_status(tmp_path)
    assert readable_status(tmp_path) is None
    os.chown(tmp_path / STATUS_NAME, os.getuid(), os.getgid())
    assert read_status(tmp_path) == forged


# -- the one-daemon lock ------------------------------------------------------

_HOLDER = """
import sys, time
from pathlib import Path
from prefetchd.buffer_protocol import DaemonLock
DaemonLock(Path(sys.argv[1])).acquire()
print("locked", flush=True)
time.sleep(120)
"""


@contextmanager
def lock_holder(buffer: Path) -> Iterator[subprocess.Popen[str]]:
    """A real separate process that takes the buffer's lock and sleeps."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(buffer)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], WAIT_S)
        assert ready, f"lock holder did not report within {WAIT_S} s"
        assert proc.stdout.readline().strip() == "locked", "lock holder failed to take the lock"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(WAIT_S)
        if proc.stdout is not None:
            proc.stdout.close()


def test_second_daemon_is_refused_with_the_owner_pid(tmp_path: Path) -> None:
    with lock_holder(tmp_path) as holder:
        with pytest.raises(BufferBusy, match=rf"pid {holder.pid}\b") as info:
            DaemonLock(tmp_path).acquire()
        assert isinstance(info.value, ProtocolError)
        assert "prefetchd stop" in str(info.value)
        assert daemon_pid(tmp_path) == holder.pid
        assert (tmp_path / LOCK_NAME).read_text().strip() == str(holder.pid)


def test_every_directory_may_be_given_as_a_string(tmp_path: Path) -> None:
    """The README's `JobRequest(settings).write(DIR)` with DIR a str was a TypeError (str / str)."""
    buffer = str(tmp_path)
    request = JobRequest({"batch_size": 8})
    request.write(buffer)
    assert JobRequest.read(buffer) == dataclasses.replace(request, owner=os.getuid(),
                                                          written_ns=(tmp_path / JOB_NAME).stat().st_mtime_ns)
    manifest = _manifest()
    manifest.write(buffer)
    assert Manifest.read(buffer) == manifest
    Progress(1, 2).write(buffer, "trial-3")
    assert Progress.read(buffer, "trial-3") == Progress(1, 2)
    write_status(buffer, status_example())
    assert read_status(buffer) is not None
    lock = DaemonLock(buffer)
    lock.acquire()
    try:
        assert daemon_pid(buffer) == os.getpid()
    finally:
        lock.release()
    assert stream_dir(buffer, 1, 2) == tmp_path / "rank-00001"


def test_a_lock_held_by_another_program_is_not_called_a_daemon(tmp_path: Path) -> None:
    """What a group member can do to the service (`flock -n BUF/daemon.lock sleep 25`): the refusal
    says a non-daemon holds the lock and how to find it, not `prefetchd stop`, which finds no daemon."""
    lock = tmp_path / LOCK_NAME
    holder = subprocess.Popen(["flock", "--nonblock", str(lock), "-c", "echo locked; exec sleep 30"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(BufferBusy) as info:
            DaemonLock(tmp_path).acquire()
        message = str(info.value)
        assert "not a running prefetchd daemon" in message and "pid unknown" in message
        assert f"fuser -v {lock}" in message and "prefetchd stop" not in message
    finally:
        holder.kill()
        holder.wait(WAIT_S)


def test_the_lock_file_is_readable_but_not_writable_by_others(tmp_path: Path) -> None:
    """Under the unit's UMask=0007 the lock was -rwxrwx---: the group could write it.  Readers need
    only its pid; one an older daemon made is narrowed when a daemon takes it."""
    old = os.umask(0o007)
    try:
        lock = DaemonLock(tmp_path)
        lock.acquire()
        lock.release()
    finally:
        os.umask(old)
    path = tmp_path / LOCK_NAME
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    os.chmod(path, 0o770)
    lock = DaemonLock(tmp_path)
    lock.acquire()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
        assert daemon_pid(tmp_path) == os.getpid()
    finally:
        lock.release()


def test_sigkilled_owner_releases_the_lock(tmp_path: Path) -> None:
    with lock_holder(tmp_path) as holder:
        holder.send_signal(signal.SIGKILL)
        holder.wait(WAIT_S)
        assert holder.returncode == -signal.SIGKILL
        # The dead owner's pid is still in the file, but it names no live process.
        assert (tmp_path / LOCK_NAME).read_text().strip() == str(holder.pid)
        assert daemon_pid(tmp_path) is None
        lock = DaemonLock(tmp_path)
        lock.acquire()
        try:
            assert daemon_pid(tmp_path) == os.getpid()
        finally:
            lock.release()
    assert daemon_pid(tmp_path) is None


def test_unreaped_dead_owner_is_not_live(tmp_path: Path) -> None:
    with lock_holder(tmp_path) as holder:
        os.kill(holder.pid, signal.SIGKILL)
        deadline = time.monotonic() + WAIT_S
        while psutil.Process(holder.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "holder did not die"
            time.sleep(0.01)
        # The kernel frees the lock as the owner dies (on some kernels a moment after the
        # zombie shows up); from then on nobody owns the buffer.
        while not _lock_is_free(tmp_path):
            assert time.monotonic() < deadline, "the dead holder's lock was never released"
            time.sleep(0.01)
        assert psutil.Process(holder.pid).status() == psutil.STATUS_ZOMBIE
        assert daemon_pid(tmp_path) is None


def _lock_is_free(buffer: Path) -> bool:
    fd = os.open(buffer / LOCK_NAME, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_lock_in_the_same_process_is_exclusive_too(tmp_path: Path) -> None:
    first = DaemonLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(BufferBusy, match=rf"pid {os.getpid()}\b"):
            DaemonLock(tmp_path).acquire()
    finally:
        first.release()
    assert (tmp_path / LOCK_NAME).read_text().strip() == ""  # blanked: it names no daemon
    second = DaemonLock(tmp_path)
    second.acquire()
    second.release()
    second.release()  # idempotent


def test_remove_deletes_only_a_lock_file_it_made(tmp_path: Path) -> None:
    """A refused start takes back the lock file it made, and leaves one it found (an earlier daemon's)."""
    lock = DaemonLock(tmp_path)
    lock.acquire()
    lock.remove()
    assert not (tmp_path / LOCK_NAME).exists()
    (tmp_path / LOCK_NAME).write_text("")
    found = DaemonLock(tmp_path)
    found.acquire()
    found.remove()
    assert (tmp_path / LOCK_NAME).read_text().strip() == ""  # kept, and let go
    again = DaemonLock(tmp_path)
    again.acquire()
    again.release()


def test_a_lock_let_go_keeps_its_page_for_the_next_daemons_pid(small_tmpfs: Path) -> None:
    """A daemon stopped cleanly emptied daemon.lock, which freed its page: started again while the tmpfs was full,
    the next one had nowhere to write its pid, and crashed.  Blanked instead, the file keeps its page."""
    lock = small_tmpfs / LOCK_NAME
    first = DaemonLock(small_tmpfs)
    first.acquire()
    first.release()
    assert lock.stat().st_size > 0 and lock.read_text().strip() == "" and daemon_pid(small_tmpfs) is None
    fill_up(small_tmpfs / "ballast")
    again = DaemonLock(small_tmpfs)
    again.acquire()  # into the page it kept
    try:
        assert lock.read_text() == f"{os.getpid()}\n" and daemon_pid(small_tmpfs) == os.getpid()
    finally:
        again.release()
    # An empty file (new, or emptied by an earlier build) has no page: refused, and one it made is gone again.
    lock.unlink()
    fill_up(small_tmpfs / "the page it had")
    with pytest.raises(OSError) as made:
        DaemonLock(small_tmpfs).acquire()
    assert made.value.errno == errno.ENOSPC and not lock.exists()
    lock.touch()
    with pytest.raises(OSError):
        DaemonLock(small_tmpfs).acquire()
    assert lock.exists() and lock.read_text() == "" and _lock_is_free(small_tmpfs)


def test_remove_never_deletes_the_lock_of_another_daemon(tmp_path: Path) -> None:
    """The file was removed while this held it and another daemon made and took a new one: that one stays."""
    lock = DaemonLock(tmp_path)
    lock.acquire()
    (tmp_path / LOCK_NAME).unlink()
    with lock_holder(tmp_path) as holder:
        lock.remove()
        assert daemon_pid(tmp_path) == holder.pid
        with pytest.raises(BufferBusy, match=rf"pid {holder.pid}\b"):
            DaemonLock(tmp_path).acquire()


def test_a_buffer_folder_removed_before_the_lock_is_taken_is_said_so(tmp_path: Path) -> None:
    """A daemon started beside another on a folder the other made sees it go when the other's start is refused
    (it removes what it made): a bare FileNotFoundError escaped (review)."""
    with pytest.raises(ProtocolError, match="the buffer folder was removed while this daemon took it"):
        DaemonLock(tmp_path / "gone").acquire()


def test_daemon_pid_without_a_live_owner(tmp_path: Path) -> None:
    assert daemon_pid(tmp_path) is None  # no lock file
    assert daemon_pid(tmp_path / "missing") is None
    with owned(tmp_path) as lock:  # held throughout, as by a live daemon: the pid in it decides
        for text in ("", "garbage\n", "-5\n"):
            lock.write_text(text)
            assert daemon_pid(tmp_path) is None, text
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait(WAIT_S)
        lock.write_text(f"{dead.pid}\n")
        assert daemon_pid(tmp_path) is None
        # A live process that started after the lock was written cannot be its owner (pid reuse).
        lock.write_text(f"{os.getpid()}\n")
        os.utime(lock, (0, 0))
        assert daemon_pid(tmp_path) is None
        os.utime(lock)
        assert daemon_pid(tmp_path) == os.getpid()
    assert daemon_pid(tmp_path) is None, "let go: whatever the pid in it names, no daemon holds the buffer"


def test_the_augmentation_field_reads_back_as_start_options() -> None:
    from prefetchd.buffer_protocol.manifest import augmentation_options, augmentation_text

    text = augmentation_text({"color_jitter": 1 / 3, "scale_jitter": "40,64", "transform": "pkg.mod:fn"})
    assert text == "color_jitter=0.3333333333333333;scale_jitter=40,64;transform=pkg.mod:fn"
    assert augmentation_options(text) == {"color_jitter": "0.3333333333333333", "scale_jitter": "40,64",
                                          "transform": "pkg.mod:fn"}
    assert augmentation_text({"color_jitter": 0.4}) == "color_jitter=0.4" and augmentation_options("") == {}
    with pytest.raises(ValueError, match="no ';'"):
        augmentation_text({"transform": "a;b"})
