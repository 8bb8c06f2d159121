"""What a run of `prefetchd bench` writes: the machine and dataset it ran on, the table
(bench.txt), the plot (bench.png) and the document (bench.json)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib
import json
import os
import platform
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from prefetchd.bench.dali import DALI_CONTENDERS
from prefetchd.bench.results import ALL_CONTENDERS, BenchmarkResults
from prefetchd.daemon.config import usable_cpus
from prefetchd.daemon.jpeg_crop import decoder_summary
from prefetchd.daemon.mounts import filesystem_of, huge_pages, pages_of
from prefetchd.launch import buffer_root
from prefetchd.words import counted

def core_list(cores: Sequence[int]) -> str:
    return ",".join(str(c) for c in cores)


# Contenders that run only where their library imports: name -> (module, pip package).
LIBRARY_CONTENDERS: dict[str, tuple[str, str]] = {
    "spdl": ("spdl.pipeline", "spdl-core"),
    **{name: ("nvidia.dali", "nvidia-dali-cuda130") for name in DALI_CONTENDERS},
}


def why_not_runnable(contender: str) -> str:
    """Why an optional contender cannot run here ("" when it can): its row's note."""
    if contender not in LIBRARY_CONTENDERS:
        return ""
    module, package = LIBRARY_CONTENDERS[contender]
    try:
        importlib.import_module(module)
    except ImportError:
        return f"not installed (pip install {package})"
    except Exception as exc:  # e.g. a wheel whose shared libraries do not load on this machine
        return f"import {module} failed: {type(exc).__name__}: {exc}"
    return ""


def describe_machine(buffers: Path | None = None) -> dict[str, Any]:
    import numpy
    import PIL
    import torch
    import torchvision

    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    shm = buffers or buffer_root()  # where the daemons' buffers go (`prefetchd bench --buffer-root`)
    du, mount = shutil.disk_usage(shm), filesystem_of(shm)
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu_model": model or platform.processor() or "unknown",
        "cpus": os.cpu_count(),
        "usable_cpus": usable_cpus(),
        "ram_bytes": psutil.virtual_memory().total,
        "buffer_fs": str(shm),
        "buffer_fs_bytes": du.total,
        "buffer_fs_type": mount.fstype,
        "buffer_huge_pages": huge_pages(mount),  # None: not a tmpfs
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "pillow": PIL.__version__,
        "numpy": numpy.__version__,
        "jpeg_decoder": decoder_summary(),
        "load_average_start": round(os.getloadavg()[0], 2),
    }


def describe_cpu(machine: dict[str, Any]) -> str:
    return (f"{counted(machine['usable_cpus'], 'usable core')} ({machine['cpu_model']}), "
            f"{machine['ram_bytes'] / 2**30:.0f} GiB RAM, load average {machine['load_average_start']}")


def describe_dataset(root: Path) -> dict[str, Any]:
    from torchvision.datasets.folder import IMG_EXTENSIONS

    classes = [d for d in sorted(os.scandir(root), key=lambda e: e.name) if d.is_dir()]
    sizes = []
    for d in classes:
        for dirpath, _dirs, files in os.walk(d.path):
            for f in files:
                if f.lower().endswith(IMG_EXTENSIONS):
                    sizes.append(os.path.getsize(os.path.join(dirpath, f)))
    if not sizes:
        raise ValueError(f"{root} holds no images in class folders; pass an ImageFolder-style dataset, or leave "
                         "out --data to have an ImageNet-like one generated")
    return {
        "root": str(root),
        "classes": len(classes),
        "images": len(sizes),
        "total_bytes": sum(sizes),
        "mean_kb": round(sum(sizes) / len(sizes) / 1024, 1),
    }


def _mib(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 2**20:.0f} MiB" if n >= 10 * 2**20 else f"{n / 2**20:.2g} MiB"


def worker_count(k: int) -> str:
    return counted(k, "worker")


def _buffer_pages(machine: dict[str, Any]) -> str:
    """The buffer's tmpfs pages, which the daemon's writes depend on ("Huge pages" in docs/BENCHMARKS.md)."""
    if "buffer_huge_pages" not in machine:  # results written before it was recorded
        return ""
    huge, kind = machine["buffer_huge_pages"], machine.get("buffer_fs_type")
    pages = f"{kind}, not a tmpfs" if huge is None and kind else pages_of(huge)
    return f"; buffer in {machine['buffer_fs']} ({pages})"


def format_table(results: BenchmarkResults) -> str:
    m, d, c = results.machine, results.dataset, results.config
    window = f"{c['seconds']:g} s" if c.get("seconds") is not None else f"{c['batches']} batches"
    lines = [
        f"prefetchd bench, {m['date']}",
        f"machine: {describe_cpu(m)}; {m['platform']}; python {m['python']}, torch {m['torch']}, "
        f"torchvision {m['torchvision']}, pillow {m['pillow']}{_buffer_pages(m)}",
        f"dataset: {d['images']} images, {d['classes']} classes, mean {d['mean_kb']:.0f} KB ({d['root']})",
        f"batch {c['batch_size']}, image {c['image_size']}px, {window} per measurement; every contender pinned to "
        "as many cores as it has workers (consumer included)",
        "",
    ]
    header = ("contender", "workers", "img/s", "vs dataloader", "scaling", "first batch")
    rows = []
    for r in results.throughput:
        if r.images_per_s is None:
            rows.append((r.contender, str(r.workers), "-", "-", "-", r.note or "-"))
            continue
        rates = [x["images_per_s"] for x in r.extra.get("rounds", []) if x["images_per_s"] is not None]
        spread = f" ({min(rates):.0f}-{max(rates):.0f})" if len(rates) > 1 else ""
        rows.append((
            r.contender, str(r.workers), f"{r.images_per_s:.0f}{spread}",
            f"{r.vs_baseline:.2f}x" if r.vs_baseline is not None else "-",
            f"{r.scaling:.0%}" if r.scaling is not None else "-",
            f"{r.first_batch_s:.2f} s" if r.first_batch_s is not None else "-",
        ))
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines.append(fmt.format(*header))
    lines.append("  ".join("-" * w for w in widths))
    lines += [fmt.format(*row) for row in rows]
    if c.get("rounds", 1) > 1:
        lines.append(f"img/s: the median round's of {c['rounds']} (the lower of two middle ones; lowest-highest), "
                     "the contenders taking turns; vs dataloader: medians compared (bench.json has each round's "
                     "ratio); first batch: median (the lower of two middle ones)")
    fl = results.floor
    if fl is not None:
        shares = [f"{r.vs_floor:.0%} of {r.workers} x that at {worker_count(r.workers)}" for r in results.throughput
                  if r.vs_floor is not None]
        spread = f", rounds {min(fl['rounds']):.0f}-{max(fl['rounds']):.0f}" if len(fl["rounds"]) > 1 else ""
        lines.append(f"floor: the daemon's augment() alone on one core (files known clean, {fl['files']} files) "
                     f"{fl['ms_per_image']:.2f} ms per image = {fl['images_per_s']:.0f} img/s{spread}"
                     + (f"; prefetchd {', '.join(shares)}" if shares else ""))
        if fl.get("undecodable"):
            lines.append(f"  left out of the floor: {counted(fl['undecodable'], 'file')} that did not decode (the "
                         f"daemon replaces them), e.g. {'; '.join(fl['undecodable_files'])}")
        for r in results.throughput:
            if r.loops and r.vs_loops is not None and r.loops_vs_floor is not None:
                lines.append(f"independent loops: {r.workers} x the floor's loop at once on the same cores "
                             f"{r.loops:.0f} img/s ({r.loops_vs_floor:.0%} of {r.workers} x the floor); "
                             f"prefetchd {r.vs_loops:.0%} of that at {worker_count(r.workers)}")
    for r in results.throughput:
        cpu = r.extra.get("cpu")
        if r.contender == "prefetchd" and cpu:
            vs = f", {cpu['worker_ms_per_image'] / fl['ms_per_image'] - 1:+.0%} on the floor" if fl is not None else ""
            used = sum(cpu[f"{part}_cores"] for part in ("workers", "controller", "consumer", "monitor"))
            lines.append(f"cores over prefetchd's window at {worker_count(r.workers)}: workers "
                         f"{cpu['workers_cores']:.2f} ({cpu['worker_ms_per_image']:.2f} ms of CPU per image{vs}), "
                         f"controller {cpu['controller_cores']:.2f}, consumer {cpu['consumer_cores']:.2f}, the bench's "
                         f"monitor {cpu['monitor_cores']:.2f}; {max(0.0, len(r.cores) - used):.2f} of {len(r.cores)} left "
                         "(idle, or other processes)")
    lines.append("first batch: prefetchd = daemon start -> first batch (cold); DataLoader = iter() -> first batch, "
                 "paid again at every epoch start with persistent_workers=False; SPDL = pipeline start -> first "
                 "batch; DALI = pipeline build -> first batch")
    ws = results.warm_start
    if ws and "error" in ws:
        lines += ["", f"warm start ({worker_count(ws['workers'])}): failed: {ws['error']}"]
    elif ws:
        verdict = "ok" if ws["ok"] else "above target"
        lines += ["", f"warm start ({worker_count(ws['workers'])}, buffer filled in {ws['fill_s']:.1f} s): "
                      f"BufferLoader() -> first batch {ws['first_ms']:.1f} ms (median of {len(ws['first_batch_ms'])}: "
                      f"{ws['median_ms']:.1f} ms; target <= {ws['target_ms']:.0f} ms: {verdict})"]
    dw = results.data_wait
    if dw:
        lines += ["", f"data-wait share ({worker_count(dw['workers'])}; step = {dw['step_share']} x producer batch time, "
                      f"evaluation pause every {dw['eval_every_steps']} steps, producer average "
                      f"{dw['average_headroom']} x the trainer's):"]
        for name, s in dw["contenders"].items():
            queue = f", queue {s['queue_batches']} batches" if "queue_batches" in s else ""
            lines.append(f"  {name:<12} {s['wait_share']:6.1%} of {s['wall_s']:.1f} s waiting for data "
                         f"(step {s['step_s'] * 1e3:.0f} ms, pause {s['pause_s']:.2f} s, {s['cycles']} cycles{queue})")
    if results.memory:
        lines += ["", "prefetchd memory (RSS and PSS summed over the daemon's process tree; buffer bytes vs "
                      "high_water x batch bytes):"]
        for mem in results.memory:
            phase = mem.get("phase", "throughput run")
            lines.append(
                f"  {worker_count(mem['workers'])}, {phase}: RSS {_mib(mem['rss_start_bytes'])} at first batch -> "
                f"{_mib(mem['rss_end_bytes'])} at end (peak {_mib(mem['rss_peak_bytes'])}; PSS "
                f"{_mib(mem['pss_start_bytes'])} -> {_mib(mem['pss_end_bytes'])}); buffer peak "
                f"{_mib(mem['peak_status_bytes'])} by status, {_mib(mem['peak_disk_bytes'])} on tmpfs, plan "
                f"{mem['high_water']} x {_mib(mem['batch_bytes'])} = {_mib(mem['planned_bytes'])}"
                f"{'' if mem['within_plan'] else ' (ABOVE PLAN)'}"
            )
    for note in results.notes:
        lines.append(note)
    return "\n".join(lines)


def _plot(results: BenchmarkResults, path: Path) -> str | None:
    """Write the img/s vs workers plot; return why not, or None when written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'prefetchd[bench]'); skipped the plot"
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    workers = results.config["workers"]
    for name in ALL_CONTENDERS:
        points = [(r.workers, r.images_per_s) for r in results.throughput
                  if r.contender == name and r.images_per_s is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=name)
    ax.set_xlabel("workers (= pinned cores)")
    ax.set_ylabel("images / s")
    ax.set_xticks(workers)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    m, c = results.machine, results.config
    ax.set_title(f"{c['batch_size']} x {c['image_size']}px batches from {results.dataset['images']} images "
                 f"({Path(results.dataset['root']).name}, mean {results.dataset['mean_kb']:.0f} KB)\n"
                 f"{m['usable_cpus']} cores, {m['cpu_model']}, {m['date'][:10]}", fontsize=9)
    if ax.lines:  # every contender failed or is not installed: no lines, no legend
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return None


def write_outputs(results: BenchmarkResults, out_dir: Path) -> None:
    png = out_dir / "bench.png"
    why = _plot(results, png)
    if why is None:
        results.files["plot"] = str(png)
    else:
        results.notes.append(why)  # the table's notes say it, once
    results.files["json"] = str(out_dir / "bench.json")
    results.files["table"] = str(out_dir / "bench.txt")
    results.files["logs"] = str(out_dir / "logs")
    (out_dir / "bench.txt").write_text(results.table() + "\n")
    (out_dir / "bench.json").write_text(json.dumps(results.to_dict(), indent=2) + "\n")
