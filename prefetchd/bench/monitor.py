"""The prefetchd contender's daemon: a `prefetchd start` on a fresh buffer (prefetchd.launch),
and a thread that samples its status, the buffer's real size and its process tree's memory."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from prefetchd.bench.measure import WAIT_SECONDS
from prefetchd.launch import launch, start_argv, stop_daemon_process, wait_ready

if TYPE_CHECKING:
    from prefetchd.bench.contenders import Run

log = logging.getLogger(__name__)

DAEMON_STOP_SECONDS = 20.0
MONITOR_SECONDS = 0.2
# How often the monitor lists the daemon's processes again.  psutil finds a process's children by
# reading every process on the machine (1.3 ms of CPU here, 0.008 cores at 5 samples a second, on
# the cores being measured) for a tree that changes only when a worker is replaced.
TREE_SECONDS = 2.0


class BenchDaemon:
    """A `prefetchd start` subprocess on a fresh buffer, stopped and cleaned up on exit."""

    def __init__(self, run: Run, workers: int, tag: str, ray: bool = False) -> None:
        """``ray``: no local workers, and a private Ray cluster of ``workers`` CPUs (the daemon's CPU mask) instead."""
        self.buffer = run.buffers / f"prefetchd-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.log_path = run.out_dir / "logs" / f"daemon-{tag}.log"
        self.cmd = start_argv(self.buffer, {
            "data": run.data, "workers": 0 if ray else workers, "batch_size": run.batch_size,
            "image_size": run.image_size, "high_water": run.high_water, "seed": 0, "reset": True,
            "ray": "local" if ray else None,
        })
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.launched = 0.0  # time.time() at the start, for launch.wait_ready
        self.monitor: BufferMonitor

    def __enter__(self) -> BenchDaemon:
        self.started = time.perf_counter()
        self.launched = time.time()
        # Inherits this process's CPU mask, and its spawned workers inherit the daemon's.
        self.proc = launch(self.cmd, log=self.log_path)
        self.monitor = BufferMonitor(self.buffer, self.proc.pid)
        self.monitor.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.monitor.stop()
        if self.proc is not None and stop_daemon_process(self.proc, DAEMON_STOP_SECONDS):
            log.warning("the daemon (pid %d) did not stop within %.0f s; killed it", self.proc.pid, DAEMON_STOP_SECONDS)
        shutil.rmtree(self.buffer, ignore_errors=True)

    def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_SECONDS
        while not _safe(predicate):
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with code {self.proc.returncode} while waiting for {what}; "
                                   f"see {self.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {WAIT_SECONDS:.0f} s for {what}; see {self.log_path}")
            time.sleep(0.02)

    def wait_for_manifest(self) -> None:
        # BufferLoader would wait out its whole timeout for a daemon that died at
        # start; this wait notices the exit.
        assert self.proc is not None
        wait_ready(self.proc, self.buffer, since=self.launched, timeout=WAIT_SECONDS, log=self.log_path)

    def affinity_check(self, cores: list[int]) -> dict[str, Any]:
        assert self.proc is not None
        masks: dict[str, list[int]] = {}
        for p in process_tree(self.proc.pid):
            with contextlib.suppress(psutil.Error):
                masks[str(p.pid)] = sorted(p.cpu_affinity() or [])
        return {"pinned": bool(masks) and all(set(m) <= set(cores) for m in masks.values()), "processes": len(masks)}


def _safe(predicate: Callable[[], bool]) -> bool:
    try:
        return predicate()
    except (OSError, ValueError):  # a status file between writes, or not there yet
        return False


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and its descendants now; none if it is gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _tree_memory(pid: int, kind: str, tree: list[psutil.Process] | None = None) -> int | None:
    """``kind`` ("rss" or "pss") summed over ``pid`` and its descendants (``tree``: them, listed already).

    RSS counts shared library pages once per process; PSS splits shared pages between
    their users, so its sum is the tree's real share.
    """
    total = 0
    for p in tree if tree is not None else process_tree(pid):
        with contextlib.suppress(psutil.Error, AttributeError):
            info = p.memory_info() if kind == "rss" else p.memory_full_info()
            total += getattr(info, kind, 0)
    return total or None


def _disk_bytes(buffer: Path) -> int:
    """Bytes the buffer's batch files (finished, being written, spares) really occupy on the tmpfs."""
    blocks: dict[int, int] = {}  # by inode: a listing may meet a file the daemon renames under both names
    with contextlib.suppress(OSError), os.scandir(buffer) as entries:
        for entry in entries:
            # Not the documents (manifest, status, progress, lock) nor their NAME.json.tmp-PID-HEX
            # copies while they are replaced: a few KiB each, not the buffer.
            if not entry.name.endswith((".batch", ".tmp")):
                continue
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                blocks[st.st_ino] = st.st_blocks * 512
    return sum(blocks.values())


class CpuSplit:
    """Where the cores went over a throughput window: the daemon's controller, its other
    processes (the workers; the worker server and resource tracker idle beside them), the
    consumer (this process: the loader, less the monitor's thread) and the bench's monitor
    thread (``monitor_thread``, its native id).  What k workers lose against k independent loops
    splits into these cores taken beside them and the workers' own CPU time per image above the
    floor's.  A process that exits inside the window is not counted."""

    def __init__(self, pid: int, monitor_thread: int | None = None) -> None:
        self.pid, self.monitor_thread = pid, monitor_thread
        self._begin: tuple[float, float, dict[int, float], float, float] | None = None
        self.result: dict[str, float] | None = None

    def _now(self) -> tuple[float, float, dict[int, float], float, float]:
        controller, others = 0.0, {}
        for proc in process_tree(self.pid):
            with contextlib.suppress(psutil.Error):
                t = proc.cpu_times()
                if proc.pid == self.pid:
                    controller = t.user + t.system
                else:
                    others[proc.pid] = t.user + t.system
        monitor = sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id == self.monitor_thread)
        return time.perf_counter(), controller, others, time.process_time() - monitor, monitor

    def begin(self) -> None:
        self._begin = self._now()

    def end(self, images: int) -> None:
        assert self._begin is not None, "begin() first"
        (t0, controller0, others0, consumer0, monitor0), (t1, controller1, others1, consumer1, monitor1) = (
            self._begin, self._now())
        span = max(t1 - t0, 1e-9)
        workers = sum(cpu - others0[pid] for pid, cpu in others1.items() if pid in others0)
        self.result = {
            "window_s": round(span, 3),
            "controller_cores": round((controller1 - controller0) / span, 3),
            "workers_cores": round(workers / span, 3),
            "consumer_cores": round((consumer1 - consumer0) / span, 3),
            "monitor_cores": round((monitor1 - monitor0) / span, 3),
            "worker_ms_per_image": round(workers / max(images, 1) * 1e3, 4),
        }


class BufferMonitor:
    """Samples the daemon's status, the buffer's real size and the daemon tree's RSS in a thread."""

    def __init__(self, buffer: Path, pid: int) -> None:
        self.buffer, self.pid = buffer, pid
        self.peak_status_bytes = 0
        self.peak_disk_bytes = 0
        self.peak_waiting = 0
        self.high_water: int | None = None
        self.batch_bytes: int | None = None
        self.rss_start: int | None = None
        self.rss_end: int | None = None
        self.rss_peak = 0
        self.pss_start: int | None = None
        self.pss_end: int | None = None
        self._stop = threading.Event()
        self._measuring = False
        self._thread = threading.Thread(target=self._loop, name="bench-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def thread_id(self) -> int | None:
        """The sampling thread's native id (``CpuSplit`` tells its CPU time from the consumer's)."""
        return self._thread.native_id

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def mark_start(self) -> None:
        self.rss_start = _tree_memory(self.pid, "rss")
        self.pss_start = _tree_memory(self.pid, "pss")
        self._measuring = True
        self.rss_peak = max(self.rss_peak, self.rss_start or 0)

    def mark_end(self) -> None:
        self.rss_end = _tree_memory(self.pid, "rss")
        self.pss_end = _tree_memory(self.pid, "pss")
        # The samples' tree is listed every TREE_SECONDS, this one now: with processes new since (a Ray node's), the
        # end was above the peak ("1461 MiB at end (peak 1419 MiB)").
        self.rss_peak = max(self.rss_peak, self.rss_end or 0)

    def _loop(self) -> None:
        from prefetchd.buffer_protocol import ProtocolError, read_status

        tree: list[psutil.Process] = []
        listed = -math.inf
        while not self._stop.wait(MONITOR_SECONDS):
            try:
                status = read_status(self.buffer)
            except (OSError, ProtocolError, ValueError):
                status = None
            production = status.production if status is not None else None
            if production is not None:
                self.peak_status_bytes = max(self.peak_status_bytes, production.buffer_bytes)
                self.peak_waiting = max(self.peak_waiting, production.waiting)
                self.high_water = production.high_water
                self.batch_bytes = production.batch_bytes
            self.peak_disk_bytes = max(self.peak_disk_bytes, _disk_bytes(self.buffer))
            if self._measuring:
                if time.monotonic() - listed >= TREE_SECONDS:
                    tree, listed = process_tree(self.pid), time.monotonic()
                rss = _tree_memory(self.pid, "rss", tree)
                if rss is not None:
                    self.rss_peak = max(self.rss_peak, rss)

    def summary(self) -> dict[str, Any]:
        planned = self.high_water * self.batch_bytes if self.high_water and self.batch_bytes else None
        return {
            "high_water": self.high_water,
            "batch_bytes": self.batch_bytes,
            "planned_bytes": planned,
            "peak_status_bytes": self.peak_status_bytes,
            "peak_disk_bytes": self.peak_disk_bytes,
            "peak_waiting_batches": self.peak_waiting,
            "within_plan": planned is not None and max(self.peak_status_bytes, self.peak_disk_bytes) <= planned,
            "rss_start_bytes": self.rss_start,
            "rss_end_bytes": self.rss_end,
            "rss_peak_bytes": self.rss_peak or None,
            "pss_start_bytes": self.pss_start,
            "pss_end_bytes": self.pss_end,
        }
