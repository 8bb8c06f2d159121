"""Where a GPU check's host went while it trained: memory (this process tree's PSS, the system's
used memory), the GPU's utilisation by NVML, and CPU time (this tree, every other process, the
hypervisor's steal).  ``tools/gpu_check.py`` samples these beside each training round."""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from typing import TYPE_CHECKING, Any

import psutil

from gpu_check_plan import not_a_tool
from prefetchd.bench.monitor import process_tree

if TYPE_CHECKING:
    import torch

SAMPLE_SECONDS = 0.25


class HostSampler:
    """Samples, in a thread, this process tree's PSS, the system's used memory and NVML's GPU utilisation."""

    def __init__(self, device: torch.device) -> None:
        self.baseline_used = _system_used()
        self.peak_used = self.baseline_used
        self.peak_tree = 0
        self.gpu_util: list[int] = []
        self._nvml: Any = None
        if device.type == "cuda":
            with contextlib.suppress(Exception):  # no pynvml, or no NVML library: events still give a busy share
                import pynvml

                pynvml.nvmlInit()
                self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(device.index or 0))
        self._measuring = threading.Event()
        self._stop = threading.Event()
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="gpu-check-sampler", daemon=True)
        self._thread.start()

    def measure(self) -> None:
        self._measuring.set()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sample()  # a run shorter than one period still has its end state
        doc: dict[str, Any] = {
            "tree_pss_peak_mib": round(self.peak_tree / 2**20),
            "system_used_above_start_peak_mib": round((self.peak_used - self.baseline_used) / 2**20),
        }
        if self._nvml is not None:
            doc["nvml_gpu_util_mean"] = round(statistics.mean(self.gpu_util), 1) if self.gpu_util else None
        return doc

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self._sample()

    def _sample(self) -> None:
        self.peak_tree = max(self.peak_tree, _tree_pss(os.getpid()))
        self.peak_used = max(self.peak_used, _system_used())
        if self._nvml is not None and self._measuring.is_set() and not self._stop.is_set():
            with contextlib.suppress(Exception):
                nvml, handle = self._nvml
                self.gpu_util.append(int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))


def _system_used() -> int:
    memory = psutil.virtual_memory()
    return int(memory.total - memory.available)  # tmpfs batch files included: they are not available


def _tree_pss(pid: int) -> int:
    # PSS splits shared pages between their users, so DataLoader workers forked from
    # this process are not each charged the whole parent, as RSS would.
    total = 0
    for proc in process_tree(pid):
        with contextlib.suppress(psutil.Error, AttributeError):
            info = proc.memory_full_info()
            total += getattr(info, "pss", info.rss)
    return total


class CpuUse:
    """Where the machine's CPU time went from creation to ``stop()``, in cores: this process tree
    (trainer, daemon, workers), every other process, and the share the hypervisor took (steal).
    Written for the first daemon-fed round, the slowest in every lease (1689, 2625, 2479 and
    2878 img/s against up to 4344, 3539, 4298 and 4002 later): on the H100 it showed no other
    process and no steal, which sent the search inside the run (``timeline``, ``prefetchd_feed``).

    A process seen in the tree stays the tree's after it leaves it.  A daemon that stops leaves
    its worker server (and the workers it has not reaped) to another reaper, so their CPU time
    never reaches this process's ``children_*`` times: counted from the tree at ``stop()``
    alone, step 5's daemons' workers were booked as other processes' CPU.  So a thread samples
    every process of the tree every ``SAMPLE_SECONDS`` and keeps following it; one that dies
    while its parent is outside the tree counts with its last sample (what it ran after that
    sample is lost, as is a process that lived and left between two samples, and a child that
    dies with its parent between two samples is taken to have died unreaped)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, float], _Seen] = {}
        self._lost = 0.0  # CPU seconds of followed processes that died where no follower sees it
        self._lock = threading.Lock()
        self._me = psutil.Process()  # its own CPU, with that of the children it reaped
        self._sample(baseline=True)
        self._begin = self._now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gpu-check-cpu-use", daemon=True)
        self._thread.start()

    def _now(self) -> tuple[float, float, float, float, float]:
        t = psutil.cpu_times()
        steal = getattr(t, "steal", 0.0)
        busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        total = busy + t.idle + getattr(t, "iowait", 0.0) + steal
        with self._lock:
            followed = self._lost + sum(seen.last - seen.base for seen in self._seen.values() if seen.alive)
        return time.perf_counter(), busy, steal, total, _cpu(self._me) + followed

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self._sample()

    def _sample(self, baseline: bool = False) -> None:
        me = os.getpid()
        with self._lock:
            for proc in process_tree(me)[1:]:
                with contextlib.suppress(psutil.Error):
                    key = (proc.pid, proc.create_time())
                    if key not in self._seen:
                        self._seen[key] = _Seen(proc, 0.0, 0.0, proc.ppid())
            alive = {seen.proc.pid for seen in self._seen.values() if seen.alive and seen.proc.is_running()}
            for seen in self._seen.values():
                if not seen.alive:
                    continue
                try:
                    with seen.proc.oneshot():
                        seen.last, seen.parent = _cpu(seen.proc), seen.proc.ppid()
                    if baseline:
                        seen.base = seen.last
                except psutil.Error:
                    seen.alive = False
                    # Reaped by a parent this object follows (or this process): its time is in that
                    # parent's children_* now, its time before creation included; else it is gone.
                    if seen.parent == me or seen.parent in alive:
                        self._lost -= seen.base
                    else:
                        self._lost += seen.last - seen.base

    def close(self) -> None:
        """End the sampling thread without a result (``stop()`` does it too)."""
        self._stop.set()
        self._thread.join(timeout=10)

    def stop(self) -> dict[str, float]:
        self.close()
        self._sample()
        (t0, busy0, steal0, total0, tree0), (t1, busy1, steal1, total1, tree1) = self._begin, self._now()
        span, tree = max(t1 - t0, 1e-9), tree1 - tree0
        others = max(busy1 - busy0 - tree, 0.0)
        return {"cpu_tree_cores": round(tree / span, 2), "cpu_other_cores": round(others / span, 2),
                "cpu_steal_share": round((steal1 - steal0) / max(total1 - total0, 1e-9), 4)}


class _Seen:
    """A process ``CpuUse`` follows: its CPU seconds at the start (or 0, born after) and at its last sample."""

    def __init__(self, proc: psutil.Process, base: float, last: float, parent: int) -> None:
        self.proc, self.base, self.last, self.parent, self.alive = proc, base, last, parent, True


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system + t.children_user + t.children_system)


if __name__ == "__main__":  # imported by tools/gpu_check.py; run alone it has nothing to do
    not_a_tool(__file__)
