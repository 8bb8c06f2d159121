"""The controller's status.json document: its state, each stream's, the rates, stage timings and error counters,
assembled from the controller's books once a status period (``producer.Producer.status``)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import psutil

from prefetchd.buffer_protocol.status import Errors, Production, Quantiles, Rates, State, Status, Totals
from prefetchd.daemon.buffer_dir import free_bytes
from prefetchd.daemon.pool import Worker

if TYPE_CHECKING:
    from prefetchd.daemon.producer import Producer

STATUS_SECONDS = 1.0  # how often the producer writes its status (the heartbeat readers judge it by)


def production_status(p: Producer) -> Status:
    """``p``'s state; for one rank its stream's fields are also at the top level."""
    p.stats.consumed = sum(s.consumed for s in p.streams)
    for stream in p.streams:
        stream.check_trainer()
    # A daemon's last status lasts (status.json, a metrics textfile node-exporter serves on): a stopped one at 300
    # img/s looked alive on a dashboard (a walk).  Its counters and the rest stay as they ended.
    ended = p.state in (State.STOPPED, State.FAILED, State.SWITCHING)
    produce_rate, consume_rate = (0.0, 0.0) if ended else p.stats.rates()
    streams = [s.status() for s in p.streams]
    first = streams[0]
    production = Production(
        producer=p.streams[0].manifest.producer,
        started=p.stats.started,
        progress=first.progress,
        trainer=first.trainer,
        streams=tuple(streams),
        waiting=sum(s.waiting for s in streams),
        building=sum(s.building for s in streams),
        high_water=p.streams[0].high * len(p.streams),
        low_water=p.streams[0].low * len(p.streams),
        batch_bytes=p.cfg.batch_bytes,
        buffer_bytes=p.space.held_bytes(),
        # Through the locked folder's fd where there is one: the last status of a daemon whose buffer was removed
        free_bytes=free_bytes(p.buffer_fd if p.buffer_fd is not None else p.buffer),
        workers=len(p.workers),
        workers_cpu_percent=round(sum(cpu_percent(w) for w in p.workers), 1),
        rates=Rates(samples_per_s=round(produce_rate, 1), consumed_batches_per_s=round(consume_rate, 2)),
        stages={stage: Quantiles(**q) for stage, q in p.stats.stage_quantiles().items()},
        totals=Totals(batches=p.stats.batches, samples=p.stats.samples, consumed_batches=p.stats.consumed),
        errors=Errors(
            replaced_samples=p.stats.replaced,
            undecodable_files=len(p.bad.files),
            undecodable=p.bad.listed,
            worker_restarts=p.stats.worker_restarts,
            worker_hangs=p.stats.worker_hangs,
            write_failures=p.stats.write_failures,
            low_space_pauses=p.stats.low_space_pauses,
            vanished_batches=sum(s.vanished_batches for s in streams),
            progress_rejected=sum(s.progress_rejected for s in streams),
            progress_rewinds=sum(s.progress_rewinds for s in streams),
            progress_file="; ".join(s.progress_file for s in streams if s.progress_file),
        ),
        remote=p.remote.status() if p.remote is not None else None,
        storage_wait=p.failures.wait,
        worker_stall=p.health.stall,
    )
    return Status(pid=os.getpid(), state=State(p.state), heartbeat=time.time(), message=p.status_message(),
                  job_result=p.job_result(), running_job=p.running_job(), production=production)


def cpu_percent(worker: Worker) -> float:
    """``worker``'s CPU use since the previous call (one status period), percent of one core; 0 once it is gone."""
    try:
        return float(worker.ps.cpu_percent(None))
    except psutil.Error:
        return 0.0


__all__ = ["production_status"]
