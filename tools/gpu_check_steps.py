"""The short steps of ``tools/gpu_check.py``, each a section of gpu.json: 1. the GPU tests
(``pytest -m gpu``), 2. host-to-device copies of batch files (``tools/h2d_bench.py`` used as a
module), 5. the producer alone on more cores (``prefetchd bench``'s prefetchd row).  Steps 3
and 4, the training, are ``gpu_check_training.py``."""

from __future__ import annotations

import logging
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

import h2d_bench  # tools/ is sys.path[0] when gpu_check.py runs as a script
from gpu_check_plan import REPO, Sizes, not_a_tool
from host_use import CpuUse
from prefetchd.bench import run_benchmark
from prefetchd.buffer_protocol import batch_name, map_batch

log = logging.getLogger(__name__)

TESTS_SECONDS = 300.0
TESTS_PASSED = (0, 5)  # pytest's exit codes where no test failed; 5: no test collected (the marker matched nothing)


# -- 1. the GPU tests ------------------------------------------------------------------------


def run_gpu_tests(sizes: Sizes) -> dict[str, Any]:
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *sizes.pytest_args]
    started = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=TESTS_SECONDS)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(errors="replace")
        return {"command": " ".join(command[1:]), "returncode": None, "counts": {},
                "summary": f"timed out after {TESTS_SECONDS:.0f} s", "tail": out.splitlines()[-30:]}
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    summary = lines[-1].strip("= ") if lines else ""
    counts = {word: int(n) for n, word in
              re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)", summary)}
    doc: dict[str, Any] = {"command": " ".join(command[1:]), "returncode": proc.returncode, "counts": counts,
                           "summary": summary, "seconds": round(time.perf_counter() - started, 1)}
    if proc.returncode not in TESTS_PASSED:
        doc["tail"] = (proc.stdout + proc.stderr).splitlines()[-40:]
    return doc


# -- 2. host-to-device copies -----------------------------------------------------------------


def h2d_rows(sizes: Sizes, device: torch.device, root: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for batch_size in sizes.h2d_batch_sizes:
        nbytes = h2d_bench.image_bytes(batch_size, sizes.h2d_image_size)
        buffer = h2d_bench.make_buffer(root, sizes.h2d_batches, batch_size, sizes.h2d_image_size)
        try:
            if device.type == "cuda":
                measured = _h2d_cuda(buffer, sizes.h2d_batches, nbytes, device)
            else:
                measured = _h2d_host(buffer, sizes.h2d_batches)
        finally:
            shutil.rmtree(buffer, ignore_errors=True)
        reference = next((ms for name, ms, _ in measured if name == "torch pinned"), None)
        for name, ms, parts in measured:
            row: dict[str, Any] = {"batch_size": batch_size, "image_size": sizes.h2d_image_size, "bytes": nbytes,
                                   "mode": name}
            if ms is None:
                row["note"] = str(parts.get("error", "failed"))
            else:
                # Three significant digits, not two decimals: the dry run's 12 KiB batch at 2.5 ms (a slow CI
                # host, beside the suite) was "0.0 GB/s".
                row.update(us_per_batch=round(ms * 1e3, 1), gb_per_s=float(f"{nbytes / ms / 1e6:.3g}"),
                           parts_ms={k: round(float(v), 3) for k, v in parts.items()})
                if reference:
                    row["vs_torch_pinned"] = round(reference / ms, 3)
            rows.append(row)
    return rows


def _h2d_cuda(buffer: Path, batches: int, nbytes: int,
              device: torch.device) -> list[tuple[str, float | None, dict[str, Any]]]:
    """h2d_bench's transfer alone and BufferLoader end to end, and torch's pinned copy of the same size."""
    out: list[tuple[str, float | None, dict[str, Any]]] = []
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    clock = h2d_bench.Clock(device)
    for _ in range(batches):
        with clock.part("total"):
            pinned.to(device, non_blocking=True)
    out.append(("torch pinned", clock.median("total"), {}))
    names = {"plain": "pageable", "staging": "staging (pinned copy)", "register": "registered mapping"}
    done = set()
    for name, ms, parts in h2d_bench.transfer_parts(buffer, batches, device):
        out.append((names.get(name, name), ms, parts))
        done.add(name)
    out += [(names[name], None, {"error": "failed; its message is in the log"}) for name in names if name not in done]
    for pin in ("none", "staging", "register"):
        try:
            ms = h2d_bench.loader_per_batch(buffer, batches, device, pin, 0)
        except Exception as exc:  # e.g. registration unsupported: say so, keep the table
            out.append((f"BufferLoader pin={pin}", None, {"error": f"{type(exc).__name__}: {exc}"}))
        else:
            out.append((f"BufferLoader pin={pin}", ms, {}))
    return out


def _h2d_host(buffer: Path, batches: int) -> list[tuple[str, float | None, dict[str, Any]]]:
    """--dry-run without CUDA: map each batch file and copy it into a tensor, to exercise the plumbing."""
    times = []
    for step in range(batches):
        start = time.perf_counter()
        torch.from_numpy(map_batch(buffer / batch_name(0, step)).images).clone()
        times.append((time.perf_counter() - start) * 1e3)
    return [("host copy (no CUDA)", statistics.median(times), {})]


# -- 5. the producer on more cores ------------------------------------------------------------


def scaling_counts(cores: int) -> list[int]:
    """1, 2, 4, ... up to ``cores``, and ``cores`` itself."""
    return sorted({1 << i for i in range(cores.bit_length()) if 1 << i <= cores} | {cores})


def scaling_rows(data: Path, sizes: Sizes, out_dir: Path, counts: list[int], buffers: Path | None = None
                 ) -> dict[str, Any]:
    """Step 5: ``prefetchd bench``'s prefetchd row at each of ``counts``, its daemons' buffers in ``buffers``
    (``--scaling-buffer-root``; default /dev/shm)."""
    cpu = CpuUse()  # follows each daemon's worker server and workers after the daemon stops
    try:
        results = run_benchmark(data, workers_list=counts, batch_size=sizes.scaling_batch_size,
                                image_size=sizes.image_size, seconds=sizes.scaling_seconds, out_dir=out_dir,
                                contenders=("prefetchd",), warm_start=False, data_wait=False, rounds=sizes.scaling_rounds,
                                buffer_root=buffers,
                                report=lambda line: log.info("  %s", line))
    except BaseException:
        cpu.close()
        raise
    rows = [{"workers": r.workers, "images_per_s": r.images_per_s, "scaling": r.scaling, "vs_floor": r.vs_floor,
             "first_batch_s": r.first_batch_s, "note": r.note, "independent_loops_per_s": r.loops,
             "loops_vs_floor": r.loops_vs_floor, "vs_loops": r.vs_loops, "cpu": r.extra.get("cpu"),
             # every round's, where there were several: a row is the median round (`prefetchd bench --rounds`)
             "rounds_images_per_s": [round(each["images_per_s"], 1) for each in r.extra.get("rounds", [])
                                     if each["images_per_s"] is not None],
             "loops_rounds": r.extra.get("loops_rounds", [])}
            for r in results.throughput]
    return {"floor": results.floor, "batch_size": sizes.scaling_batch_size, "seconds": sizes.scaling_seconds,
            "rounds": sizes.scaling_rounds, "rows": rows, "buffer": results.machine["buffer_fs"],
            "buffer_huge_pages": results.machine["buffer_huge_pages"], **cpu.stop()}


if __name__ == "__main__":  # imported by tools/gpu_check.py; run alone it has nothing to do
    not_a_tool(__file__)
