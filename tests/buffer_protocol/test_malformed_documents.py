"""Malformed manifests, job files and status documents, and files of the wrong kind under
every protocol name: readers raise ProtocolError (FileNotFoundError for a missing file)
and nothing else, never block, never write through a planted link.

Progress documents and batch files have their own properties in test_layout.py and
test_batch.py; this file adds the documents those leave out and the special files.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefetchd.buffer_protocol import (
    BadJobRequest,
    VERSION,
    DaemonLock,
    JobRequest,
    Manifest,
    Progress,
    ProtocolError,
    State,
    StorageWait,
    batch_name,
    daemon_pid,
    map_batch,
    read_status,
    write_batch,
    write_status,
)
from prefetchd.buffer_protocol.job_request import JOB_ID_RE
from prefetchd.buffer_protocol.json_files import write_json
from prefetchd.buffer_protocol.layout import ACCEPTED_JOB_NAME, JOB_NAME, LOCK_NAME, MANIFEST_NAME, PROGRESS_NAME, STATUS_NAME
from prefetchd.buffer_protocol.manifest import CHANNELS, SPLITS
from tests.status_examples import CONSUMER, ERRORS, STORAGE_WAIT, TRAINER, WORKER_STALL, bad_files, production, stream
from tests.status_examples import write_status_at_heartbeat
from tests.status_examples import status as status_example

FUZZ = settings(max_examples=120, deadline=1000, suppress_health_check=[HealthCheck.function_scoped_fixture])

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)

VALID_MANIFEST = Manifest(
    dataset_root="/data/shapes", fingerprint="abc123", classes=["circle", "square"], num_samples=400,
    split="train", seed=0, batch_size=32, image_size=64, samples_per_epoch=400, steps_per_epoch=13,
    epochs=2, producer="0123456789ab", val_fraction=0.1, augmentation="color_jitter=0.4", created=1700000000.5,
).to_doc()
VALID_JOB = {"format": "prefetchd.job", "version": VERSION, "settings": {"data": "/data", "batch_size": 64},
             "replace": False, "job_id": "0123456789ab", "submitted": 1700000000.5}


@st.composite
def mutated(draw: st.DrawFn, valid: dict[str, Any]) -> Any:
    """``valid`` with a few fields dropped or replaced by any JSON value; now and then any JSON at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(_json)
    doc = copy.deepcopy(valid)
    for key in draw(st.lists(st.sampled_from(sorted(doc)), max_size=3, unique=True)):
        if draw(st.booleans()):
            del doc[key]
        else:
            doc[key] = draw(_json)
    if draw(st.integers(0, 4)) == 0:
        doc[draw(st.text(max_size=6))] = draw(_json)
    return doc


def _write(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc))  # NaN and Infinity too: Python's json reads them back


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@FUZZ
@given(doc=mutated(VALID_MANIFEST))
def test_a_mutated_manifest_is_refused_or_well_typed(doc: Any, tmp_path: Path) -> None:
    _write(tmp_path / MANIFEST_NAME, doc)
    try:
        m = Manifest.read(tmp_path)
    except ProtocolError as exc:
        assert MANIFEST_NAME in str(exc)
        return
    for name in ("num_samples", "seed", "batch_size", "image_size", "samples_per_epoch", "steps_per_epoch",
                 "channels", "rank", "world_size"):
        value = getattr(m, name)
        assert type(value) is int and value >= 0, name
    assert m.batch_size >= 1 and m.image_size >= 1 and m.world_size >= 1
    assert m.steps_per_epoch == -(-m.samples_per_epoch // m.batch_size)
    assert all(isinstance(c, str) for c in m.classes)
    assert all(isinstance(getattr(m, s), str) for s in ("dataset_root", "fingerprint", "split", "producer", "augmentation"))
    assert m.split in SPLITS and m.channels in CHANNELS
    assert m.epochs is None or (type(m.epochs) is int and m.epochs >= 0)
    assert m.val_fraction is None or _is_number(m.val_fraction)
    assert isinstance(m.created, float)


@FUZZ
@given(doc=mutated(VALID_JOB))
def test_a_mutated_job_is_refused_or_well_typed(doc: Any, tmp_path: Path) -> None:
    _write(tmp_path / JOB_NAME, doc)
    try:
        job = JobRequest.read(tmp_path)
    except BadJobRequest as exc:
        assert JOB_NAME in str(exc)
        # Echoed only as the document wrote it, and only when it is a short plain name.
        assert exc.job_id is None or (exc.job_id == doc.get("job_id") and JOB_ID_RE.fullmatch(exc.job_id))
        return
    assert job is not None and isinstance(job.settings, dict) and isinstance(job.replace, bool)
    assert all(isinstance(k, str) for k in job.settings)
    assert all(v is None or isinstance(v, (str, int, float, bool)) for v in job.settings.values())
    assert isinstance(job.job_id, str) and isinstance(job.submitted, float)


@pytest.mark.parametrize("value", ["no", 0, 1, "true"])
def test_replace_is_a_json_boolean_or_absent(value: Any, tmp_path: Path) -> None:
    """"replace": "no" read as true, and replaced a job whose trainer was reading (SPEC review)."""
    _write(tmp_path / JOB_NAME, {**VALID_JOB, "replace": value})
    with pytest.raises(BadJobRequest, match=r"field 'replace' is .*, expected a bool") as info:
        JobRequest.read(tmp_path)
    assert info.value.job_id == VALID_JOB["job_id"]
    absent = {k: v for k, v in VALID_JOB.items() if k != "replace"}
    for doc, replace in ((absent, False), ({**VALID_JOB, "replace": True}, True), ({**VALID_JOB, "replace": None}, False)):
        _write(tmp_path / JOB_NAME, doc)
        job = JobRequest.read(tmp_path)
        assert job is not None and job.replace is replace


@pytest.mark.parametrize("how", ["list setting", "hard link", "symlink"])
def test_a_malformed_job_is_refused_under_its_job_id(how: str, tmp_path: Path) -> None:
    """'job ? refused' / 'last job None refused': whoever submitted it could not tell it was theirs."""
    written = tmp_path / "elsewhere.json"
    _write(written, {**VALID_JOB, "settings": {"batch_size": [8]}} if how == "list setting" else VALID_JOB)
    if how == "symlink":
        (tmp_path / JOB_NAME).symlink_to(written)
    else:
        os.link(written, tmp_path / JOB_NAME) if how == "hard link" else written.rename(tmp_path / JOB_NAME)
    with pytest.raises(BadJobRequest) as info:
        JobRequest.read(tmp_path)
    assert isinstance(info.value, ProtocolError)
    # A link is not followed, so its document is never read: no job_id to echo.
    assert info.value.job_id == (None if how == "symlink" else VALID_JOB["job_id"])


def test_a_job_id_that_is_no_plain_name_is_not_echoed(tmp_path: Path) -> None:
    _write(tmp_path / JOB_NAME, {**VALID_JOB, "job_id": "x\n" * 100, "settings": {"batch_size": [8]}})
    with pytest.raises(BadJobRequest) as info:
        JobRequest.read(tmp_path)
    assert info.value.job_id is None


def test_a_job_json_renamed_back_long_after_it_was_written_is_refused(tmp_path: Path) -> None:
    """Any member of a --group-access buffer's group may rename its files: one kept another user's job.json aside
    and renamed it back later, and the daemon ran that old request again as that user's.  The rename sets the
    file's ctime; its mtime, which only the owner may set, still says when it was written."""
    request = JobRequest({"data": "/data", "batch_size": 64})
    request.write(tmp_path)
    read = JobRequest.read(tmp_path)
    assert read is not None and read.written_ns == os.stat(tmp_path / JOB_NAME).st_mtime_ns
    hour_ago = (tmp_path / JOB_NAME).stat().st_mtime_ns - 3600 * 10**9
    (tmp_path / JOB_NAME).rename(tmp_path / "kept.json")
    os.utime(tmp_path / "kept.json", ns=(hour_ago, hour_ago))  # as its owner wrote it, an hour ago
    (tmp_path / "kept.json").rename(tmp_path / JOB_NAME)
    with pytest.raises(BadJobRequest) as info:
        JobRequest.read(tmp_path)
    said = str(info.value)
    assert str(tmp_path / JOB_NAME) in said and "renamed back" in said and re.search(r"\(36\d\d s ago\)", said), said
    assert re.search(r"put in place 36\d\d s after it was written", said), said
    assert f"uid {os.geteuid()}" in said and f"prefetchd submit --buffer {tmp_path}" in said, said
    # Answered under its own id, as its owner's: the refusal reaches whoever wrote it.
    assert (info.value.job_id, info.value.owner) == (request.job_id, os.geteuid())

    # Its owner submits it again: a new file, read.
    JobRequest(request.settings).write(tmp_path)
    assert JobRequest.read(tmp_path) is not None


def test_a_job_request_written_from_python_takes_paths_as_they_are_given(tmp_path: Path) -> None:
    """JobRequest({"data": Path(...)}).write failed with "Object of type PosixPath is not JSON serializable"."""
    JobRequest({"data": tmp_path / "data", "batch_size": 8}).write(tmp_path)
    read = JobRequest.read(tmp_path)
    assert read is not None and read.settings == {"data": str(tmp_path / "data"), "batch_size": 8}


def test_a_job_json_others_may_write_is_refused(tmp_path: Path) -> None:
    """Whoever may write a job.json may write its request, or give it a fresh mtime (a request put back would pass
    for a new one): its owner need not have written it."""
    JobRequest({"data": "/data"}).write(tmp_path)
    assert (tmp_path / JOB_NAME).stat().st_mode & 0o777 == 0o644
    for mode in (0o664, 0o646):
        os.chmod(tmp_path / JOB_NAME, mode)
        with pytest.raises(BadJobRequest, match=rf"writable by others than its owner.*\(mode 0{mode:o}\)"):
            JobRequest.read(tmp_path)
    os.chmod(tmp_path / JOB_NAME, 0o600)
    assert JobRequest.read(tmp_path) is not None


def test_the_daemons_record_of_an_accepted_job_renamed_to_job_json_is_no_request(tmp_path: Path) -> None:
    """The daemon's record of the job it accepted (job.accepted.json) is its own file, in the job document's format:
    any member of the buffer's group may rename it to job.json at once, where it passed for a request of the
    daemon's user, held to no allow-list (tests/integration/test_job_owner.py does it with real users)."""
    request = JobRequest({"data": "/data", "batch_size": 64}, owner=12345)
    os.close(request.record(tmp_path))
    (tmp_path / ACCEPTED_JOB_NAME).rename(tmp_path / JOB_NAME)
    with pytest.raises(BadJobRequest) as info:
        JobRequest.read(tmp_path)
    said = str(info.value)
    assert str(tmp_path / JOB_NAME) in said and ACCEPTED_JOB_NAME in said and "not run" in said, said
    assert f"prefetchd submit --buffer {tmp_path}" in said, said


VALID_STATUS = status_example(production=production(streams=(stream(0), stream(1)),
                                                    errors=dataclasses.replace(ERRORS, undecodable=bad_files(2)),
                                                    storage_wait=STORAGE_WAIT, worker_stall=WORKER_STALL)).to_doc()


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into ``doc``'s objects and lists (status.json nests: rates, errors, streams[1].trainer ...)."""
    found = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        found.append((*prefix, key))
        found += _paths(value, (*prefix, key))
    return found


@st.composite
def mutated_deep(draw: st.DrawFn, valid: dict[str, Any]) -> Any:
    """``valid`` with a few fields at any depth dropped or replaced by any JSON value."""
    doc = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p[0] not in ("format", "version")]
        path = draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(_json)
    return doc


def _numbers(doc: Any) -> list[int | float]:
    if isinstance(doc, dict):
        return [n for v in doc.values() for n in _numbers(v)]
    if isinstance(doc, list):
        return [n for v in doc for n in _numbers(v)]
    return [doc] if _is_number(doc) else []


@FUZZ
@given(doc=mutated_deep(VALID_STATUS) | mutated(VALID_STATUS))
def test_a_mutated_status_is_refused_or_well_typed(doc: Any, tmp_path: Path) -> None:
    _write(tmp_path / STATUS_NAME, doc)
    try:
        status = read_status(tmp_path)
    except ProtocolError as exc:
        assert STATUS_NAME in str(exc)
        return
    assert status is not None and status.state in set(State)
    written = status.to_doc()
    assert all(math.isfinite(n) and (not isinstance(n, int) or n >= 0) for n in _numbers(written))
    write_status(tmp_path, status)
    assert read_status(tmp_path) == status  # what was accepted is what the daemon could have written
    p = status.production
    if p is not None:
        assert all(isinstance(s.progress.epoch, int) and isinstance(s.trainer.alive, (bool, type(None))) for s in p.streams)
        assert all(isinstance(b.path, str) for b in p.errors.undecodable)
        assert p.progress.trainer_wait_share is None or 0.0 <= p.progress.trainer_wait_share <= 1.0


def test_status_errors_name_the_field_and_the_value(tmp_path: Path) -> None:
    doc = copy.deepcopy(VALID_STATUS)
    doc["streams"][1]["trainer"]["alive"] = "yes"
    _write(tmp_path / STATUS_NAME, doc)
    with pytest.raises(ProtocolError, match=r"status\.json: field 'streams\[1\]\.trainer\.alive' is 'yes', expected true, false"):
        read_status(tmp_path)
    doc = {**VALID_STATUS, "state": "sleeping"}
    _write(tmp_path / STATUS_NAME, doc)
    with pytest.raises(ProtocolError, match="field 'state' is 'sleeping', expected one of waiting-for-job, starting"):
        read_status(tmp_path)


def test_a_storage_wait_is_read_back_and_an_older_status_without_one_is_read_as_none(tmp_path: Path) -> None:
    """What a loader waits on past its timeout: typed, checked, and absent from a daemon of an earlier build."""
    _write(tmp_path / STATUS_NAME, VALID_STATUS)
    status = read_status(tmp_path)
    assert status is not None and status.production is not None and status.production.storage_wait == STORAGE_WAIT
    assert VALID_STATUS["storage_wait"] == {"since": STORAGE_WAIT.since, "reason": STORAGE_WAIT.reason, "ranks": [0],
                                            "ranks_since": [STORAGE_WAIT.since]}
    for older in ({k: v for k, v in VALID_STATUS.items() if k != "storage_wait"}, {**VALID_STATUS, "storage_wait": None}):
        _write(tmp_path / STATUS_NAME, older)
        status = read_status(tmp_path)
        assert status is not None and status.production is not None and status.production.storage_wait is None
    # A daemon of a build before the ranks were named: its wait is every rank's.
    _write(tmp_path / STATUS_NAME, {**VALID_STATUS, "storage_wait": {"since": 1.0, "reason": "down"}})
    status = read_status(tmp_path)
    assert status is not None and status.production is not None
    assert status.production.storage_wait == StorageWait(since=1.0, reason="down", ranks=None)
    assert status.production.storage_wait.since_of(3) == 1.0
    # One after the ranks were named and before each had its own time: `since` for each of them.
    _write(tmp_path / STATUS_NAME, {**VALID_STATUS, "storage_wait": {"since": 1.0, "reason": "down", "ranks": [0, 2]}})
    status = read_status(tmp_path)
    assert status is not None and status.production is not None and status.production.storage_wait is not None
    wait = status.production.storage_wait
    assert wait.ranks_since is None and (wait.since_of(0), wait.since_of(1), wait.since_of(2)) == (1.0, None, 1.0)
    _write(tmp_path / STATUS_NAME, {**VALID_STATUS, "storage_wait": {"since": 1.0, "reason": "down", "ranks": [0, 2],
                                                                     "ranks_since": [1.0, 301.5]}})
    status = read_status(tmp_path)
    assert status is not None and status.production is not None and status.production.storage_wait is not None
    wait = status.production.storage_wait
    assert wait.ranks_since == (1.0, 301.5) and (wait.since_of(0), wait.since_of(1), wait.since_of(2)) == (1.0, None, 301.5)
    ranks, times = "a list of non-negative integers or null", "a list of finite numbers or null"
    for bad, field, expected in (({"since": "now", "reason": ""}, "storage_wait.since", "a finite number"),
                                 ({"since": 1.0, "reason": "", "ranks": [0], "ranks_since": 1.0},
                                  "storage_wait.ranks_since", times),
                                 ({"since": 1.0, "reason": "", "ranks": [0], "ranks_since": ["1.0"]},
                                  "storage_wait.ranks_since", times),
                                 ({"since": 1.0, "reason": "", "ranks": [0, 1], "ranks_since": [1.0]},
                                  "storage_wait.ranks_since", re.escape("one time for each of ranks [0, 1]")),
                                 ({"since": 1.0, "reason": "", "ranks_since": [1.0]},
                                  "storage_wait.ranks_since", "one time for each of ranks None"),
                                 ({"since": 1.0}, "storage_wait.reason", "a string"),
                                 ("storage", "storage_wait", "an object"),
                                 ({"since": 1.0, "reason": "", "ranks": 0}, "storage_wait.ranks", ranks),
                                 ({"since": 1.0, "reason": "", "ranks": [0, -1]}, "storage_wait.ranks", ranks),
                                 ({"since": 1.0, "reason": "", "ranks": [True]}, "storage_wait.ranks", ranks),
                                 ({"since": 1.0, "reason": "", "ranks": ["0"]}, "storage_wait.ranks", ranks)):
        _write(tmp_path / STATUS_NAME, {**VALID_STATUS, "storage_wait": bad})
        with pytest.raises(ProtocolError, match=rf"field '{re.escape(field)}' is .*, expected {expected}"):
            read_status(tmp_path)


def test_a_worker_stall_is_read_back_and_an_older_status_without_one_is_read_as_none(tmp_path: Path) -> None:
    """What a loader waits on past its timeout while the daemon is to kill a stalled worker: typed, checked, and
    absent from a daemon of an earlier build."""
    _write(tmp_path / STATUS_NAME, VALID_STATUS)
    status = read_status(tmp_path)
    assert status is not None and status.production is not None and status.production.worker_stall == WORKER_STALL
    without = {k: v for k, v in VALID_STATUS.items() if k != "worker_stall"}
    for older in (without, {**VALID_STATUS, "worker_stall": None}):
        _write(tmp_path / STATUS_NAME, older)
        status = read_status(tmp_path)
        assert status is not None and status.production is not None and status.production.worker_stall is None
    good = VALID_STATUS["worker_stall"]
    for bad, field, expected in (({**good, "since": "now"}, "worker_stall.since", "a finite number"),
                                 ({**good, "timeout": math.inf}, "worker_stall.timeout", "a finite number"),
                                 ({**good, "starting": 1}, "worker_stall.starting", "true or false"),
                                 ({k: v for k, v in good.items() if k != "reason"}, "worker_stall.reason", "a string"),
                                 ("stalled", "worker_stall", "an object")):
        _write(tmp_path / STATUS_NAME, {**VALID_STATUS, "worker_stall": bad})
        with pytest.raises(ProtocolError, match=rf"field '{re.escape(field)}' is .*, expected {expected}"):
            read_status(tmp_path)


def test_a_trainers_pid_namespace_is_read_back_and_one_a_status_lacks_is_read_as_none(tmp_path: Path) -> None:
    """The namespace the trainer's pid is of, for the lead trainer, a rank's and a consumer's: without it a reader
    of another namespace than the trainer's took the pid for one of its own processes."""
    trainer = dataclasses.replace(TRAINER, pid_namespace=4026532001)
    written = status_example(production=production(
        trainer=trainer, streams=(stream(0, trainer=trainer, consumers=(dataclasses.replace(CONSUMER, trainer=trainer),)),)))
    write_status_at_heartbeat(tmp_path, written)
    assert read_status(tmp_path) == written

    def trainers(doc: dict[str, Any]) -> list[dict[str, Any]]:
        rank = doc["streams"][0]
        return [doc["trainer"], rank["trainer"], rank["consumers"][0]["trainer"]]

    assert [t["pid_namespace"] for t in trainers(written.to_doc())] == [4026532001] * 3
    for predates in (True, False):  # absent: a daemon that predates the field; null: a progress document without it
        doc = written.to_doc()
        for t in trainers(doc):
            if predates:
                del t["pid_namespace"]
            else:
                t["pid_namespace"] = None
        _write(tmp_path / STATUS_NAME, doc)
        status = read_status(tmp_path)
        assert status is not None and status.production is not None
        p = status.production
        assert [p.trainer, p.streams[0].trainer, p.streams[0].consumers[0].trainer] == [TRAINER] * 3, predates
    for i, field in enumerate(("trainer", "streams[0].trainer", "streams[0].consumers[0].trainer")):
        for bad in ("4026532001", -1, 1.5, True, [1]):
            doc = written.to_doc()
            trainers(doc)[i]["pid_namespace"] = bad
            _write(tmp_path / STATUS_NAME, doc)
            with pytest.raises(ProtocolError, match=rf"field '{re.escape(field)}\.pid_namespace' is .*, expected a "
                                                    "non-negative integer or null"):
                read_status(tmp_path)


@FUZZ
@given(garbage=st.binary(max_size=300), name=st.sampled_from([MANIFEST_NAME, JOB_NAME, STATUS_NAME]))
def test_garbage_documents_are_protocol_errors(garbage: bytes, name: str, tmp_path: Path) -> None:
    (tmp_path / name).write_bytes(garbage)
    read: dict[str, Callable[[Path], object]] = {MANIFEST_NAME: Manifest.read, JOB_NAME: JobRequest.read,
                                                 STATUS_NAME: read_status}
    with pytest.raises(ProtocolError, match=name):
        read[name](tmp_path)


def test_non_finite_numbers_do_not_pass_as_positions(tmp_path: Path) -> None:
    for value in (math.nan, math.inf, 1e300):
        _write(tmp_path / PROGRESS_NAME, {"format": "prefetchd.progress", "version": VERSION, "epoch": value, "step": 0})
        with pytest.raises(ProtocolError, match="epoch"):
            Progress.read(tmp_path)


@pytest.mark.parametrize("key", ["epoch", "step", "read_batches", "pid"])
def test_integers_past_int64_are_refused_quoted_short(key: str, tmp_path: Path) -> None:
    """A trainer's (or a group member's) progress.json with read_batches 10**4000 stopped the daemon: its
    rates turned the count into a float (OverflowError).  Every integer of a document fits an int64."""
    doc = {"format": "prefetchd.progress", "version": VERSION, "epoch": 0, "step": 3, "pid": os.getpid()}
    _write(tmp_path / PROGRESS_NAME, {**doc, key: 10**3000})  # within MAX_PROGRESS_LEN
    with pytest.raises(ProtocolError, match=rf"field '{key}' is 10{{59}}\.\.\. \(3001 characters\), expected a "
                                            r"non-negative int below 2\*\*63"):
        Progress.read(tmp_path)
    if key in ("read_batches", "pid"):  # an epoch and a step have bounds of their own
        _write(tmp_path / PROGRESS_NAME, {**doc, key: 2**63 - 1})
        assert getattr(Progress.read(tmp_path), key) == 2**63 - 1


@pytest.mark.parametrize("value", [-math.inf, math.inf, math.nan])
def test_non_finite_times_are_refused(value: float, tmp_path: Path) -> None:
    """A progress time of -Infinity (which Python's JSON reader takes) made a trainer silent for inf
    seconds: the daemon wrote that into status.json, whose readers then refused the whole status."""
    _write(tmp_path / PROGRESS_NAME, {"format": "prefetchd.progress", "version": VERSION, "epoch": 0, "step": 3,
                                      "pid": os.getpid(), "time": value})
    with pytest.raises(ProtocolError, match="field 'time' is .*, expected a finite number"):
        Progress.read(tmp_path)


# -- files of the wrong kind under a protocol name ----------------------------------------

READERS: dict[str, Callable[[Path], object]] = {
    PROGRESS_NAME: Progress.read, MANIFEST_NAME: Manifest.read, JOB_NAME: JobRequest.read, STATUS_NAME: read_status,
    batch_name(0, 0): lambda buffer: map_batch(buffer / batch_name(0, 0)),
}


def _plant(buffer: Path, name: str, kind: str, victim: Path) -> None:
    path = buffer / name
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        os.symlink(victim, path)
    elif kind == "directory":
        path.mkdir()


def _in_time(call: Callable[[], object], seconds: float = 30.0) -> BaseException | None:
    """Run ``call`` in a thread; fail if it blocks (a FIFO opened without O_NONBLOCK would)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the reader blocked"
    return outcome[0]


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
@pytest.mark.parametrize("name", sorted(READERS))
def test_special_files_are_protocol_errors_without_blocking(tmp_path: Path, name: str, kind: str) -> None:
    buffer = tmp_path / "bf"
    buffer.mkdir()
    victim = tmp_path / "victim"  # a valid document or batch, reachable only through the link
    if name.endswith(".batch"):
        import numpy as np

        write_batch(victim, np.zeros((1, 2, 2, 3), np.uint8), np.zeros(1, np.int64), np.zeros(1, np.int64),
                    epoch=0, step=0, seed=0, producer="p")
    else:
        write_json(victim, VALID_MANIFEST if name == MANIFEST_NAME else VALID_JOB if name == JOB_NAME else
                   {"format": f"prefetchd.{name.split('.')[0]}", "version": VERSION, "epoch": 0, "step": 0})
    _plant(buffer, name, kind, victim)
    error = _in_time(lambda: READERS[name](buffer))
    assert isinstance(error, ProtocolError), repr(error)
    assert name in str(error)
    if kind == "symlink" and name.endswith(".batch"):  # not "check the buffer's permissions"
        assert "a symbolic link, not a batch: remove it from the buffer" in str(error), error


@pytest.mark.parametrize("kind", ["fifo", "symlink", "hardlink", "other-owner"])
def test_the_lock_is_never_one_the_daemon_did_not_make(tmp_path: Path, kind: str) -> None:
    buffer = tmp_path / "bf"
    buffer.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    if kind == "hardlink":
        os.link(victim, buffer / LOCK_NAME)
    elif kind == "other-owner":
        if os.geteuid() != 0:
            pytest.skip("making a file of another user needs root")
        (buffer / LOCK_NAME).write_text("")
        os.chown(buffer / LOCK_NAME, 65534, 65534)
    else:
        _plant(buffer, LOCK_NAME, kind, victim)
    assert _in_time(lambda: daemon_pid(buffer)) is None  # status and stop just see no daemon
    error = _in_time(DaemonLock(buffer).acquire)
    assert isinstance(error, ProtocolError) and LOCK_NAME in str(error), repr(error)
    assert victim.read_text() == "precious\n"


def test_json_temp_files_are_never_written_through_a_planted_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import secrets

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    monkeypatch.setattr(secrets, "token_hex", lambda n: "guessed0")  # as if the random name were guessed
    os.symlink(victim, tmp_path / f"{PROGRESS_NAME}.tmp-{os.getpid()}-guessed0")
    with pytest.raises(FileExistsError):
        Progress(1, 2).write(tmp_path)
    assert victim.read_text() == "precious\n"
    assert not (tmp_path / PROGRESS_NAME).exists()


def test_listing_skips_what_only_looks_like_a_batch(tmp_path: Path) -> None:
    from prefetchd.buffer_protocol import list_batches

    (tmp_path / batch_name(0, 0)).write_bytes(b"")  # a regular file: listed, and refused when mapped
    (tmp_path / batch_name(0, 1)).mkdir()
    os.mkfifo(tmp_path / batch_name(0, 2))
    os.symlink(tmp_path / batch_name(0, 0), tmp_path / batch_name(0, 3))
    assert list(list_batches(tmp_path)) == [(0, 0)]


@settings(max_examples=60, deadline=1000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(0, 3 * 4096 + 200))
def test_a_batch_file_cut_or_grown_on_disk_is_refused_by_the_mapper(size: int, tmp_path: Path) -> None:
    import numpy as np

    path = tmp_path / batch_name(0, 0)
    write_batch(path, np.ones((2, 8, 8, 3), np.uint8), np.zeros(2, np.int64), np.arange(2), epoch=0, step=0,
                seed=0, producer="p")
    full = path.stat().st_size
    os.truncate(path, size)  # a damaged tmpfs page, a stray writer: the header's offsets no longer hold
    if size == full:
        assert map_batch(path).images.shape == (2, 8, 8, 3)
    else:
        with pytest.raises(ProtocolError, match=batch_name(0, 0)):
            map_batch(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file another owner")
def test_a_batch_someone_else_owns_is_refused_by_the_mapper(tmp_path: Path) -> None:
    """Only the daemon writes batches, as the owner of the buffer's folders; a member of a --group-access
    buffer's group may rename a file of their own in under a batch's name, to be read by others' trainers."""
    import numpy as np

    path = tmp_path / batch_name(0, 0)
    write_batch(path, np.ones((2, 8, 8, 3), np.uint8), np.zeros(2, np.int64), np.arange(2), epoch=0, step=0,
                seed=0, producer="p")
    assert map_batch(path).images.shape == (2, 8, 8, 3)  # the folder's owner wrote it
    os.chown(path, 65534, -1)
    with pytest.raises(ProtocolError, match=rf"{batch_name(0, 0)}: belongs to \S+ \(uid 65534\), not to \S+ \(uid 0\) "
                                            rf"who owns the buffer {tmp_path} and writes its batches: someone else "
                                            r"\(a member of the buffer's group\?\) put it there; remove it"):
        map_batch(path)
    # Looked up in a folder's fd (the daemon's, a loader's), it is refused by that folder's owner, who is named.
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(ProtocolError, match=rf"{batch_name(0, 0)}: belongs to \S+ \(uid 65534\), not to \S+ "
                                                rf"\(uid 0\) who owns its folder {tmp_path} and writes its batches"):
            map_batch(path, dir_fd=fd)
    finally:
        os.close(fd)


def test_the_accepted_job_is_read_back_with_its_submitter_and_only_from_the_daemons_own_file(tmp_path: Path) -> None:
    """``job.accepted.json`` is what a restarted daemon resumes: a member of a --group-access buffer's group
    who could put one there would have their job run over the one another member's trainer reads."""
    request = JobRequest({"data": "/data", "seed": 3}, owner=1234)
    os.close(request.record(tmp_path))
    assert JobRequest.recorded(tmp_path) == request  # the submitter (owner) kept, though the file is the daemon's
    if os.geteuid() != 0:
        return
    os.chown(tmp_path / "job.accepted.json", 65534, -1)
    with pytest.raises(ProtocolError, match="belongs to uid 65534 .* so the daemon .* did not write it; remove it"):
        JobRequest.recorded(tmp_path)


def test_the_sweep_lists_no_directory_as_a_leftover(tmp_path: Path) -> None:
    from prefetchd.buffer_protocol import list_temp_files

    (tmp_path / "e000000-s00000000.tmp").write_bytes(b"half")
    (tmp_path / "e000000-s00000001.tmp").mkdir()
    assert [p.name for p in list_temp_files(tmp_path)] == ["e000000-s00000000.tmp"]
