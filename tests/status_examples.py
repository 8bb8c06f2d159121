"""Status documents as a daemon writes them, for tests of the code that reads them."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefetchd.buffer_protocol import (
    BadFile,
    ConsumerStatus,
    Errors,
    JobResult,
    Position,
    Production,
    Quantiles,
    Rates,
    RemoteNode,
    RemoteStatus,
    RunningJob,
    State,
    Status,
    StorageWait,
    StreamStatus,
    Totals,
    TrainerStatus,
    WorkerStall,
    read_status,
    write_status,
)
from prefetchd.buffer_protocol.layout import STATUS_NAME

if TYPE_CHECKING:  # the trainer's tests use these examples too, and the trainer is blind to the daemon
    from prefetchd.daemon.status_view import StatusReport

TRAINER = TrainerStatus(pid=777, alive=True, progress_age_s=0.4)
NO_TRAINER = TrainerStatus(pid=None, alive=None, progress_age_s=None)  # no progress file read yet
POSITION = Position(epoch=1, step=40, trainer_wait_share=None)
ERRORS = Errors(replaced_samples=0, undecodable_files=0, undecodable=(), worker_restarts=0, write_failures=0,
                progress_file="")


REMOTE = RemoteStatus(address="ray://head:10001", connected=True, cluster_nodes=3, cluster_cpus=96, in_flight=40,
                      images=1664, slices=104, retries=2, stragglers=1, disconnects=0, message="",
                      copied_bytes=250478592, copy_seconds=0.12,
                      nodes=(RemoteNode(node="cpu-1/3f2a9c1d", images=1664, slices=104, images_per_s=1900.5,
                                        latency_p50_s=0.41),),
                      unfit_nodes=("cpu-2/77ab01c3: cannot read 8 of the 8 samples probed: n01/a.jpg (FileNotFoundError: "
                                   "...); mount the same --data at the same path on every node",))
# A daemon whose builds of rank 0 wait for the store (what its loader waits on past its timeout).
STORAGE_WAIT = StorageWait(since=1700000050.25, reason="batch e000001-s00000041.tmp: reading s3://b/d/x.jpg: still "
                           "failing after 6 tries (OSError: [Errno 16] Please reduce your request rate.)", ranks=(0,),
                           ranks_since=(1700000050.25,))
WORKER_STALL = WorkerStall(since=1700000040.5, timeout=600.0, starting=False,
                           reason="worker pid 4321 has made no progress for 75 s on batch e000001-s00000041.batch "
                                  "(epoch 1, step 41), /data/train/a/x.jpg (file 3 of its task's 32); at 600 s "
                                  "(--task-timeout) it is killed and its task retried; the task's files: ...")
CONSUMER = ConsumerStatus(name="trial-3", progress=POSITION, trainer=TRAINER, holding=True, window=32)


def stream(rank: int = 0, **changes: Any) -> StreamStatus:
    base = StreamStatus(rank=rank, trainer=TRAINER, progress=POSITION, waiting=12, building=2, progress_file="",
                        consumers=(CONSUMER,))
    return dataclasses.replace(base, **changes)


def production_without_trainer(ranks: int = 1, **changes: Any) -> Production:
    """What a daemon writes before any trainer has written progress: its start position, no pid, no consumers."""
    start = Position(epoch=0, step=0, trainer_wait_share=None)
    streams = tuple(stream(r, trainer=NO_TRAINER, progress=start, consumers=()) for r in range(ranks))
    return production(**{"progress": start, "trainer": NO_TRAINER, "streams": streams, **changes})


def production(**changes: Any) -> Production:
    """One rank filling: 12 of 32 batches waiting, 850 img/s."""
    base = Production(
        producer="0123456789ab", started=1700000000.0, progress=POSITION, trainer=TRAINER, streams=(stream(),),
        waiting=12, building=2, high_water=32, low_water=16, batch_bytes=1 << 20, buffer_bytes=14 << 20,
        free_bytes=1 << 30, workers=15, workers_cpu_percent=1400.5,
        rates=Rates(samples_per_s=850.4, consumed_batches_per_s=0.0),
        stages={"read": Quantiles(0.0001, 0.0002, 0.0004), "decode": Quantiles(0.001, 0.002, 0.003)},
        totals=Totals(batches=52, samples=3328, consumed_batches=40), errors=ERRORS,
    )
    return dataclasses.replace(base, **changes)


def status(state: State = State.FILLING, **changes: Any) -> Status:
    """A producing daemon's status (pass ``production=None`` for one waiting for a job or starting)."""
    base = Status(pid=4242, state=state, heartbeat=1700000100.5, message="",
                  job_result=JobResult(job_id="0123456789ab", accepted=True, reason="producing /data", time=1700000000.0,
                                       submitter=1001),
                  running_job=RunningJob(job_id="0123456789ab", submitter=1001, submitted=1699999999.5,
                                         answer="producing /data"),
                  production=production())
    return dataclasses.replace(base, **changes)


def report(status: Status | None, **changes: Any) -> StatusReport:
    """`prefetchd status`'s report of a daemon running (pid 1) on /dev/shm/bf (or ``buffer=``, its own
    owner) whose status.json is ``status``."""
    from prefetchd.daemon.status_view import StatusReport

    buffer = Path(changes.get("buffer", "/dev/shm/bf"))
    base = StatusReport(buffer=buffer, owner=buffer, rank=None, running=True, pid=1, heartbeat_age_s=0.1, stale=False,
                        status=status, manifest=None, problems=())
    return dataclasses.replace(base, **{**changes, "buffer": buffer})


def write_status_at_heartbeat(buffer: Path, written: Status) -> None:
    """Write ``written`` as the daemon of its heartbeat would have: the file's mtime is that time too
    (readers take a later mtime for the heartbeat: a daemon on a full filesystem sets it)."""
    write_status(buffer, written)
    os.utime(Path(buffer) / STATUS_NAME, (written.heartbeat, written.heartbeat))


def bad_files(n: int) -> tuple[BadFile, ...]:
    return tuple(BadFile(path=f"/d/c/{i}.jpg", reason="empty") for i in range(n))


def state_of(buffer: Path) -> State | None:
    """The daemon's state in ``buffer``'s status.json; None before it wrote one."""
    status = read_status(buffer)
    return status.state if status is not None else None


def production_of(buffer: Path) -> Production | None:
    """The running job's part of ``buffer``'s status.json; None before there is one."""
    status = read_status(buffer)
    return status.production if status is not None else None


def job_result_of(buffer: Path) -> JobResult | None:
    """The daemon's answer to the last job.json; None before it wrote one."""
    status = read_status(buffer)
    return status.job_result if status is not None else None
