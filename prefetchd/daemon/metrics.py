"""Prometheus metrics, drawn from the same status the daemon writes to status.json.

The collector reads the latest status when scraped, so the numbers in
`prefetchd status`, status.json and /metrics can never disagree.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefetchd.access import cannot_read, no_access
from prefetchd.buffer_protocol import Production, State, Status
from prefetchd.buffer_protocol.json_files import replace_file
from prefetchd.daemon.errors import ConfigError
from prefetchd.throttle import Throttle

log = logging.getLogger(__name__)

QUANTILES = {"p50": "0.5", "p90": "0.9", "p99": "0.99"}  # Quantiles fields -> Prometheus quantile labels
STATES = tuple(State)

# (metric name, the value in a producing daemon's status, help); gauges unless the name ends in _total.
_SERIES: tuple[tuple[str, Callable[[Production], float | None], str], ...] = (
    ("prefetchd_batches_waiting", lambda p: p.waiting, "Finished batches waiting for the trainer."),
    ("prefetchd_batches_building", lambda p: p.building, "Batches being decoded and augmented."),
    ("prefetchd_high_water_batches", lambda p: p.high_water, "Production stops at this many waiting batches."),
    ("prefetchd_low_water_batches", lambda p: p.low_water, "Production resumes at this many waiting batches."),
    ("prefetchd_buffer_bytes", lambda p: p.buffer_bytes, "Bytes of batches in the buffer, finished or being built."),
    ("prefetchd_filesystem_free_bytes", lambda p: p.free_bytes, "Free bytes on the buffer's filesystem."),
    ("prefetchd_workers", lambda p: p.workers, "Worker processes."),
    ("prefetchd_workers_cpu_percent", lambda p: p.workers_cpu_percent, "CPU used by the workers, percent of one core."),
    ("prefetchd_produce_samples_per_second", lambda p: p.rates.samples_per_s, "Samples produced per second, last ~10 s."),
    ("prefetchd_consume_batches_per_second", lambda p: p.rates.consumed_batches_per_s, "Batches consumed per second, last ~10 s."),
    ("prefetchd_trainer_wait_share", lambda p: p.progress.trainer_wait_share, "Share of the trainer's recent time spent waiting for data."),
    ("prefetchd_produced_batches_total", lambda p: p.totals.batches, "Batches produced since the daemon started the job."),
    ("prefetchd_produced_samples_total", lambda p: p.totals.samples, "Samples produced since the daemon started the job."),
    ("prefetchd_consumed_batches_total", lambda p: p.totals.consumed_batches, "Batches the trainers consumed by reading them (not those a resume jumped over): each consumer's, summed."),
    ("prefetchd_replaced_samples_total", lambda p: p.errors.replaced_samples, "Samples replaced because their file could not be decoded (or read: missing or unreadable)."),
    ("prefetchd_undecodable_files", lambda p: p.errors.undecodable_files, "Distinct files that could not be decoded, or read (missing or unreadable)."),
    ("prefetchd_worker_restarts_total", lambda p: p.errors.worker_restarts, "Workers that died and were replaced."),
    ("prefetchd_worker_hangs_total", lambda p: p.errors.worker_hangs,
     "Workers killed because one image took longer than --task-timeout, or their start than --worker-start-timeout."),
    ("prefetchd_write_failures_total", lambda p: p.errors.write_failures, "Batch builds that failed and were retried: a write (no space) or a read of the dataset (an unreachable store)."),
    # What tells the two apart, and the other waits the status names (a walk found them in status.json alone).
    ("prefetchd_storage_waiting", lambda p: float(p.storage_wait is not None),
     "1 while builds wait for the dataset's storage (an object store that does not answer, a root unmounted): trainers wait on."),
    ("prefetchd_storage_wait_since_timestamp_seconds", lambda p: p.storage_wait.since if p.storage_wait else None,
     "Unix time the builds began waiting for the dataset's storage; absent while they do not wait."),
    ("prefetchd_worker_stalled", lambda p: float(p.worker_stall is not None),
     "1 while a worker (or a Ray slice) has made no progress for a while: it is killed at its timeout."),
    ("prefetchd_low_space_pauses_total", lambda p: p.errors.low_space_pauses,
     "Times production paused because the buffer's filesystem was short of space."),
    ("prefetchd_vanished_batches_total", lambda p: p.errors.vanished_batches,
     "Published batches whose files someone else removed; each was built again."),
    ("prefetchd_progress_rejected_total", lambda p: p.errors.progress_rejected,
     "Distinct problems with the trainers' progress.json files (unreadable, malformed, out of range), each ignored."),
    ("prefetchd_progress_rewinds_total", lambda p: p.errors.progress_rewinds,
     "Times a trainer moved its position back (a resume from an earlier checkpoint)."),
    ("prefetchd_trainer_progress_age_seconds", lambda p: p.trainer.progress_age_s,
     "Seconds since the trainer last wrote its progress, moved or not (a waiting trainer rewrites it every 2 s, so a stalled one keeps it low; one that is gone keeps it growing); of several consumers, the slowest one that holds batches."),
    # --ray: where batches are built (absent without a cluster).
    ("prefetchd_remote_connected", lambda p: float(p.remote.connected) if p.remote else None,
     "1 while the Ray cluster takes slices, 0 while it is lost and the local workers build alone."),
    ("prefetchd_remote_cluster_cpus", lambda p: p.remote.cluster_cpus if p.remote else None,
     "CPUs of the Ray cluster's nodes that get slices (all but the ones that cannot read --data)."),
    ("prefetchd_remote_unfit_nodes", lambda p: len(p.remote.unfit_nodes) if p.remote else None,
     "Alive Ray nodes that get no slices because they cannot read --data (prefetchd status names them)."),
    ("prefetchd_remote_slices_in_flight", lambda p: p.remote.in_flight if p.remote else None,
     "Slices of batches submitted to the Ray cluster and not yet back."),
    ("prefetchd_remote_images_total", lambda p: p.remote.images if p.remote else None, "Images built on the Ray cluster."),
    ("prefetchd_remote_retries_total", lambda p: p.remote.retries if p.remote else None,
     "Slices submitted again after Ray failed them (their Ray worker or node lost, or their task unable to run on a node)."),
    ("prefetchd_remote_stragglers_total", lambda p: p.remote.stragglers if p.remote else None,
     "Slices started a second time because they took far longer than the median."),
    ("prefetchd_remote_copied_bytes_total", lambda p: p.remote.copied_bytes if p.remote else None,
     "Pixel bytes copied from Ray's object store into batch files."),
    ("prefetchd_remote_copy_seconds_total", lambda p: p.remote.copy_seconds if p.remote else None,
     "Seconds those copies took (rate(bytes) / rate(seconds): the copy rate)."),
    ("prefetchd_remote_disconnects_total", lambda p: p.remote.disconnects if p.remote else None,
     "Times the whole Ray cluster was lost."),
)


class StatusCollector(Collector):
    def __init__(self, buffer: Path, latest: Callable[[], Status | None]) -> None:
        self.buffer = str(buffer)
        self.latest = latest
        # The last job's production, whose counters stay until the next job starts: they left with it, and what
        # it did after the last scrape was never seen (a service's job that ends between two scrapes).
        self.last: Production | None = None

    def collect(self) -> Iterator[Metric]:
        status = self.latest()
        state = GaugeMetricFamily("prefetchd_state", "1 for the daemon's current state.", labels=["buffer", "state"])
        for each in STATES:
            state.add_metric([self.buffer, str(each)], 1.0 if status is not None and status.state == each else 0.0)
        yield state
        if status is not None:
            # A killed or stopped (SIGSTOP) daemon's textfile kept its last state, "full": its age is the tell.
            beat = GaugeMetricFamily("prefetchd_heartbeat_timestamp_seconds",
                                     "Unix time of the daemon's last status (about once a second while it lives).",
                                     labels=["buffer"])
            beat.add_metric([self.buffer], status.heartbeat)
            yield beat
        production = status.production if status is not None else None
        if production is None:  # waiting for a job or starting one: the state, and the last job's counters
            if self.last is not None:
                yield from self._series(self.last, counters_only=True)
            return
        self.last = production
        yield from self._series(production)
        if production.trainer.alive is not None:
            alive = GaugeMetricFamily("prefetchd_trainer_alive",
                                      "1 while the process that wrote progress.json exists, 0 once it is gone; of several consumers, the slowest one that holds batches (prefetchd_consumer_alive has each).",
                                      labels=["buffer"])
            alive.add_metric([self.buffer], 1.0 if production.trainer.alive else 0.0)
            yield alive
        yield from _consumer_metrics(self.buffer, production)
        yield from _remote_node_metrics(self.buffer, production)
        if production.stages:
            quant = GaugeMetricFamily("prefetchd_stage_seconds", "Per-sample time of a stage, by quantile over recent samples.",
                                      labels=["buffer", "stage", "quantile"])
            for stage, qs in production.stages.items():
                for q, label in QUANTILES.items():
                    quant.add_metric([self.buffer, stage, label], float(getattr(qs, q)))
            yield quant

    def _series(self, production: Production, counters_only: bool = False) -> Iterator[Metric]:
        """The ``_SERIES`` families; the counters count from the job's start, their ``_created`` sample (a new
        job's counters start again at 0, and a scraper tells that from a daemon's restart by it)."""
        for name, value_of, text in _SERIES:
            value = value_of(production)
            counter = name.endswith("_total")
            if value is None or counters_only and not counter:
                continue
            family: GaugeMetricFamily | CounterMetricFamily
            if counter:
                family = CounterMetricFamily(name[: -len("_total")], text, labels=["buffer"])
                family.add_metric([self.buffer], float(value), created=production.started)
            else:
                family = GaugeMetricFamily(name, text, labels=["buffer"])
                family.add_metric([self.buffer], float(value))
            yield family


def _consumer_metrics(buffer: str, production: Production) -> Iterator[Metric]:
    """Per consumer of each rank (several trainers sharing the buffer): position, data-wait share,
    alive, batches held for it.  Nothing before a trainer wrote progress."""
    entries = [(str(s.rank), c) for s in production.streams for c in s.consumers]
    if not entries:
        return
    labels = ["buffer", "rank", "consumer"]
    families = {
        "epoch": GaugeMetricFamily("prefetchd_consumer_epoch", "The epoch the consumer needs next.", labels=labels),
        "step": GaugeMetricFamily("prefetchd_consumer_step", "The step of that epoch the consumer needs next.", labels=labels),
        "wait": GaugeMetricFamily("prefetchd_consumer_wait_share", "Share of the consumer's recent time spent waiting for data.",
                                  labels=labels),
        "alive": GaugeMetricFamily("prefetchd_consumer_alive", "1 while the consumer's writer exists, 0 once it is gone.",
                                   labels=labels),
        "closed": GaugeMetricFamily("prefetchd_consumer_closed",
                                    "1 once the consumer closed its loader (it left, its run over), 0 while it reads or "
                                    "if it went away without closing it.", labels=labels),
        "window": GaugeMetricFamily("prefetchd_consumer_window_batches", "Batches the daemon keeps for the consumer.",
                                    labels=labels),
    }
    for rank, c in entries:
        key = [buffer, rank, c.name]
        families["epoch"].add_metric(key, float(c.progress.epoch))
        families["step"].add_metric(key, float(c.progress.step))
        if c.progress.trainer_wait_share is not None:
            families["wait"].add_metric(key, c.progress.trainer_wait_share)
        if c.trainer.alive is not None:
            families["alive"].add_metric(key, 1.0 if c.trainer.alive else 0.0)
        families["closed"].add_metric(key, 1.0 if c.closed else 0.0)
        families["window"].add_metric(key, float(c.window))
    yield from families.values()


def _remote_node_metrics(buffer: str, production: Production) -> Iterator[Metric]:
    """Per node of the Ray cluster that built slices (--ray): its recent img/s and slice latency."""
    nodes = production.remote.nodes if production.remote is not None else ()
    if not nodes:
        return
    rate = GaugeMetricFamily("prefetchd_remote_node_images_per_second", "Images a Ray node built per second, last ~10 s.",
                             labels=["buffer", "node"])
    latency = GaugeMetricFamily("prefetchd_remote_node_slice_latency_seconds",
                                "Median seconds from submitting a slice to its result, recent slices of a Ray node.",
                                labels=["buffer", "node"])
    for n in nodes:
        rate.add_metric([buffer, n.node], n.images_per_s)
        latency.add_metric([buffer, n.node], n.latency_p50_s)
    yield rate
    yield latency


# node-exporter runs as another user, and the service's UMask=0007 would make the file 0660,
# unreadable to it (metrics are no secret).  prometheus_client's write_to_textfile renames too, but
# creates its temp file with the umask's mode; the temp name does not end in .prom, so the
# textfile collector never reads a half-written one.
TEXTFILE_MODE = 0o644
TEXTFILE_WARN_SECONDS = 60.0  # a textfile that cannot be written is said this often


def unwritable_textfile(textfile: Path) -> str | None:
    """Why this user may not write the metrics ``textfile``, which is replaced by a rename (its folder must take a
    new file): a folder on the way it may not enter, or one it may not write in (whose it is, what to do), or a
    folder that is not there (not created); None where it may.  `prefetchd config` says it: it said a textfile the
    daemon would warn of once a minute was valid (a walk as a non-root user)."""
    folder = textfile.absolute().parent
    denied = cannot_read(folder)
    if denied is None and not os.path.isdir(folder):
        return f"its folder {folder} does not exist (the daemon does not create it)"
    return denied or no_access(folder, write=True)


# A textfile whose heartbeat is this recent, of a daemon not stopped, is another daemon's that runs (a second each).
TEXTFILE_LIVE_SECONDS = 10.0


def _refuse_a_textfile_in_use(textfile: Path, buffer: Path) -> None:
    """Refuse ``textfile`` where another daemon that runs writes it: each rewrote it once a second over the other's,
    and a dashboard saw one of the two buffers at a time, without a word in either log (a walk, with a config file
    shared by a train and a val daemon)."""
    try:
        samples = {f.name: f.samples for f in text_string_to_metric_families(textfile.read_text(errors="replace"))}
    except (OSError, ValueError):
        return  # none yet, not this user's to read, or not ours: its write says so, or replaces it
    states = [s for s in samples.get("prefetchd_state", []) if s.value == 1]
    beats = samples.get("prefetchd_heartbeat_timestamp_seconds", [])
    if not states or not beats:
        return
    other, state, age = states[0].labels["buffer"], states[0].labels["state"], time.time() - beats[0].value
    if other != str(buffer) and state not in (State.STOPPED, State.FAILED) and age < TEXTFILE_LIVE_SECONDS:
        raise ConfigError(f"metrics textfile {textfile} is written by the daemon on {other}, which runs (state "
                          f"{state}, {age:.0f} s ago): two daemons on one textfile overwrite each other's metrics "
                          "every second; give each daemon its own --metrics-textfile")


class Metrics:
    """The registry, the optional HTTP endpoint and the optional textfile."""

    def __init__(self, buffer: Path, port: int | None, address: str, textfile: Path | None) -> None:
        self.latest: Status | None = None
        self.registry = CollectorRegistry()
        self.registry.register(StatusCollector(buffer, lambda: self.latest))
        self.textfile = textfile
        if textfile is not None:
            _refuse_a_textfile_in_use(textfile, buffer)
        # A textfile that cannot be written is said once a minute, not at each status (once a second: 86,000 lines
        # a day for a path under a folder the daemon's user may not enter, a walk as a non-root user).
        self._unwritten_lines = Throttle(TEXTFILE_WARN_SECONDS)
        self._server: Any = None
        if port is not None:
            try:
                self._server, _thread = start_http_server(port, addr=address, registry=self.registry)
            except OSError as exc:
                hint = "it is in use" if exc.errno == errno.EADDRINUSE else exc.strerror
                raise ConfigError(f"cannot serve metrics on {address}:{port}: {hint}; pick another --metrics-port") from None
            log.info("serving Prometheus metrics on http://%s:%d/metrics", address, port)

    def update(self, status: Status) -> None:
        self.latest = status
        if self.textfile is not None:
            try:
                replace_file(self.textfile, generate_latest(self.registry), TEXTFILE_MODE)
            except OSError as exc:
                self._unwritten_lines.log(log, logging.WARNING, "cannot write metrics to %s: %s; pass a "
                                          "--metrics-textfile in a folder this daemon's user may write", self.textfile,
                                          exc.strerror, others="other failure")

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
