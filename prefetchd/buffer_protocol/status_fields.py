"""A status document read from its JSON (``status_from_doc``), field by field.

status.json is writable by the buffer's group (``--group-access``), so every field is checked for its type,
ints are non-negative, floats finite, ``state`` one of the states, and anything else is a ProtocolError naming
the file and the dotted field (``streams[1].trainer.alive``).  Keys added within a version read as what their
absence means (a counter 0, a list empty).  The types are ``status``'s; the file is ``status_file``'s.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NoReturn

from prefetchd.buffer_protocol.errors import MAX_INT, ProtocolError, shown
from prefetchd.buffer_protocol.status import (BadFile, ConsumerStatus, Errors, JobResult, Position, Production, Quantiles,
                                              Rates, RemoteNode, RemoteStatus, RunningJob, State, Status, StorageWait,
                                              StreamStatus, Totals, TrainerStatus, WorkerStall)


def status_from_doc(doc: dict[str, Any], path: Path) -> Status:
    """Check and convert a document ``json_files.read_json_stat`` has accepted (format and version are checked
    there)."""
    top = _Fields(doc, path)
    job = top.optional_map("job_result")
    running = top.optional_map("running_job")  # absent from a daemon of an earlier 0.1 build
    production = None
    if "progress" in doc:  # absent while waiting for a job and while starting one
        production = Production(
            producer=top.text("producer"),
            started=top.num("started"),
            progress=_position(top.map("progress")),
            trainer=_trainer(top.map("trainer")),
            streams=tuple(_stream(s) for s in top.maps("streams")),
            waiting=top.nat("waiting"),
            building=top.nat("building"),
            high_water=top.nat("high_water"),
            low_water=top.nat("low_water"),
            batch_bytes=top.nat("batch_bytes"),
            buffer_bytes=top.nat("buffer_bytes"),
            free_bytes=top.nat("free_bytes"),
            workers=top.nat("workers"),
            workers_cpu_percent=top.num("workers_cpu_percent"),
            rates=_rates(top.map("rates")),
            stages={name: _quantiles(q) for name, q in top.map("stages").items_as_maps()},
            totals=_totals(top.map("totals")),
            errors=_errors(top.map("errors")),
            remote=_remote(remote) if (remote := top.optional_map("remote")) is not None else None,
            storage_wait=_storage_wait(wait) if (wait := top.optional_map("storage_wait")) is not None else None,
            worker_stall=_worker_stall(stall) if (stall := top.optional_map("worker_stall")) is not None else None,
        )
    return Status(
        pid=top.nat("pid"),
        state=top.state("state"),
        heartbeat=top.num("heartbeat"),
        message=top.text("message", default=""),
        job_result=JobResult(job.optional_text("job_id"), job.flag("accepted"), job.text("reason"), job.num("time"),
                             job.optional_nat("submitter")) if job is not None else None,
        production=production,
        pid_namespace=top.optional_nat("pid_namespace"),
        running_job=RunningJob(running.text("job_id"), running.optional_nat("submitter"), running.num("submitted"),
                               running.text("answer")) if running is not None else None,
        running_job_known="running_job" in doc,
    )


_STATE_NAMES = tuple(s.value for s in State)


class _Fields:
    """Typed access to one JSON object of the document; errors name the file and the dotted field."""

    def __init__(self, value: Any, path: Path, where: str = "") -> None:
        if not isinstance(value, dict):
            self._fail(path, where.rstrip(".") or "the document", value, "an object")
        self.doc: dict[str, Any] = value
        self.path = path
        self.where = where

    @staticmethod
    def _fail(path: Path, name: str, value: Any, expected: str) -> NoReturn:
        raise ProtocolError(
            f"{path}: field {name!r} is {shown(value)}, expected {expected}; the daemon rewrites status.json about once a "
            "second, so if this stays, another program or another prefetchd version writes it: check who can write the buffer"
        )

    def fail(self, key: str, value: Any, expected: str) -> NoReturn:
        self._fail(self.path, self.where + key, value, expected)

    def _get(self, key: str, check: Any, expected: str, optional: bool = False) -> Any:
        value = self.doc.get(key)
        if (value is None and optional) or check(value):
            return value
        self.fail(key, value, expected)

    def nat(self, key: str) -> int:
        return int(self._get(key, lambda v: type(v) is int and 0 <= v <= MAX_INT, "a non-negative integer"))

    def count(self, key: str) -> int:
        """A counter; 0 when absent (counters added within a version)."""
        return self.nat(key) if key in self.doc else 0

    def optional_nat(self, key: str) -> int | None:
        value = self._get(key, lambda v: type(v) is int and 0 <= v <= MAX_INT, "a non-negative integer or null",
                          optional=True)
        return None if value is None else int(value)

    def num(self, key: str) -> float:
        return float(self._get(key, _is_finite, "a finite number"))

    def optional_num(self, key: str) -> float | None:
        value = self._get(key, _is_finite, "a finite number or null", optional=True)
        return None if value is None else float(value)

    def text(self, key: str, default: str | None = None) -> str:
        if default is not None and key not in self.doc:
            return default
        return str(self._get(key, lambda v: isinstance(v, str), "a string"))

    def optional_text(self, key: str) -> str | None:
        value = self._get(key, lambda v: isinstance(v, str), "a string or null", optional=True)
        return None if value is None else str(value)

    def flag(self, key: str) -> bool:
        return bool(self._get(key, lambda v: isinstance(v, bool), "true or false"))

    def optional_flag(self, key: str) -> bool | None:
        value = self._get(key, lambda v: isinstance(v, bool), "true, false or null", optional=True)
        return None if value is None else bool(value)

    def state(self, key: str) -> State:
        names = ", ".join(_STATE_NAMES)
        return State(self._get(key, lambda v: v in _STATE_NAMES, f"one of {names}"))

    def map(self, key: str) -> _Fields:
        return _Fields(self.doc.get(key), self.path, f"{self.where}{key}.")

    def optional_map(self, key: str) -> _Fields | None:
        return None if self.doc.get(key) is None else self.map(key)

    def maps(self, key: str) -> list[_Fields]:
        items = self._get(key, lambda v: isinstance(v, list), "a list")
        return [_Fields(item, self.path, f"{self.where}{key}[{i}].") for i, item in enumerate(items)]

    def texts(self, key: str) -> tuple[str, ...]:
        """A list of strings; empty when absent (lists added within a version)."""
        if key not in self.doc:
            return ()
        return tuple(self._get(key, lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                               "a list of strings"))

    def optional_nats(self, key: str) -> tuple[int, ...] | None:
        """A list of non-negative integers; None when absent or null (a list added within a version: the
        caller says what its absence means)."""
        value = self._get(key, lambda v: isinstance(v, list) and all(type(x) is int and x >= 0 for x in v),
                          "a list of non-negative integers or null", optional=True)
        return None if value is None else tuple(int(x) for x in value)

    def optional_nums(self, key: str) -> tuple[float, ...] | None:
        """A list of finite numbers; None when absent or null (as ``optional_nats``)."""
        value = self._get(key, lambda v: isinstance(v, list) and all(_is_finite(x) for x in v),
                          "a list of finite numbers or null", optional=True)
        return None if value is None else tuple(float(x) for x in value)

    def items_as_maps(self) -> list[tuple[str, _Fields]]:
        return [(k, _Fields(v, self.path, f"{self.where}{k}.")) for k, v in self.doc.items()]


def _is_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _position(f: _Fields) -> Position:
    share = f.optional_num("trainer_wait_share")
    if share is not None and not 0.0 <= share <= 1.0:
        f.fail("trainer_wait_share", share, "a fraction between 0 and 1")
    return Position(f.nat("epoch"), f.nat("step"), share)


def _trainer(f: _Fields) -> TrainerStatus:
    return TrainerStatus(f.optional_nat("pid"), f.optional_flag("alive"), f.optional_num("progress_age_s"),
                         f.optional_nat("pid_namespace"))


def _stream(f: _Fields) -> StreamStatus:
    return StreamStatus(f.nat("rank"), _trainer(f.map("trainer")), _position(f.map("progress")),
                        f.nat("waiting"), f.nat("building"), f.text("progress_file", default=""),
                        f.count("vanished_batches"), f.count("progress_rejected"), f.count("progress_rewinds"),
                        tuple(_consumer(c) for c in f.maps("consumers")) if "consumers" in f.doc else ())


def _consumer(f: _Fields) -> ConsumerStatus:
    return ConsumerStatus(f.text("name"), _position(f.map("progress")), _trainer(f.map("trainer")),
                          f.flag("holding"), f.nat("window"), f.flag("closed") if "closed" in f.doc else False)


def _rates(f: _Fields) -> Rates:
    return Rates(f.num("samples_per_s"), f.num("consumed_batches_per_s"))


def _quantiles(f: _Fields) -> Quantiles:
    return Quantiles(f.num("p50"), f.num("p90"), f.num("p99"))


def _totals(f: _Fields) -> Totals:
    return Totals(f.nat("batches"), f.nat("samples"), f.nat("consumed_batches"))


def _errors(f: _Fields) -> Errors:
    return Errors(
        replaced_samples=f.nat("replaced_samples"),
        undecodable_files=f.nat("undecodable_files"),
        undecodable=tuple(BadFile(b.text("path"), b.text("reason")) for b in f.maps("undecodable")),
        worker_restarts=f.nat("worker_restarts"),
        write_failures=f.nat("write_failures"),
        progress_file=f.text("progress_file", default=""),
        low_space_pauses=f.count("low_space_pauses"),
        vanished_batches=f.count("vanished_batches"),
        progress_rejected=f.count("progress_rejected"),
        progress_rewinds=f.count("progress_rewinds"),
        worker_hangs=f.count("worker_hangs"),
    )


def _storage_wait(f: _Fields) -> StorageWait:
    ranks, since = f.optional_nats("ranks"), f.optional_nums("ranks_since")
    if since is not None and (ranks is None or len(since) != len(ranks)):
        f.fail("ranks_since", list(since), f"one time for each of ranks {None if ranks is None else list(ranks)}")
    return StorageWait(since=f.num("since"), reason=f.text("reason"), ranks=ranks, ranks_since=since)


def _worker_stall(f: _Fields) -> WorkerStall:
    return WorkerStall(since=f.num("since"), timeout=f.num("timeout"), starting=f.flag("starting"),
                       reason=f.text("reason"))


def _remote(f: _Fields) -> RemoteStatus:
    return RemoteStatus(
        address=f.text("address"), connected=f.flag("connected"), cluster_nodes=f.nat("cluster_nodes"),
        cluster_cpus=f.nat("cluster_cpus"), in_flight=f.nat("in_flight"), images=f.nat("images"),
        slices=f.nat("slices"), retries=f.nat("retries"), stragglers=f.nat("stragglers"),
        disconnects=f.nat("disconnects"), message=f.text("message"), copied_bytes=f.nat("copied_bytes"),
        copy_seconds=f.num("copy_seconds"),
        nodes=tuple(RemoteNode(n.text("node"), n.nat("images"), n.nat("slices"), n.num("images_per_s"),
                               n.num("latency_p50_s")) for n in f.maps("nodes")),
        unfit_nodes=f.texts("unfit_nodes"),
    )
