"""GPU.md from ``tools/gpu_check.py``'s results document (gpu.json): the tables a reader compares
between leases, as pure functions of that document, and the writing of both files."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gpu_check_plan import not_a_tool
from prefetchd.daemon.mounts import pages_of


def _buffer_line(machine: dict[str, Any]) -> str:
    """Where the batches lived, and in which pages (docs/BENCHMARKS.md, "Huge pages")."""
    pages = pages_of(machine["buffer_huge_pages"]) if "buffer_huge_pages" in machine else "pages not recorded"
    return f"{machine.get('buffer_fs', '?')} ({pages})"


def _cell(value: Any, fmt: str = "{}") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return fmt.format(value)


def _spread(rounds: list[float]) -> str:
    """" (low–high)" over a figure's rounds, where there were several (kept to 0.1 img/s: ``_rate``)."""
    return f" ({_rate(min(rounds))}–{_rate(max(rounds))})" if len(rounds) > 1 else ""


def _rate(images_per_s: float) -> str:
    """A rate in whole images/s as its rounds show it: rounded to 0.1 first, as they are kept, so that a
    median round's rate never shows outside their range."""
    return f"{round(images_per_s, 1):.0f}"


def _buffers(scaling: dict[str, Any]) -> str:
    """Where step 5's daemons put their buffers (absent from results written before it was recorded)."""
    if "buffer" not in scaling:
        return ""
    return f", the daemons' buffers in {scaling['buffer']} ({pages_of(scaling['buffer_huge_pages'])})"


def _rounds_said(rounds: int) -> str:
    return (f"Each count measured {rounds} times in a row, each time with its loops (the floor with the first count's): "
            "a figure is the median round's, the range of the rounds in brackets.  " if rounds > 1 else "")


def render_markdown(doc: dict[str, Any]) -> str:
    machine, gpu, sizes = doc["machine"], doc["gpu"], doc["sizes"]
    lines = ["# prefetchd on a GPU", ""]
    if doc["dry_run"]:
        lines += ["**Dry run**: toy sizes on the CPU to keep `tools/gpu_check.py` working; these figures measure "
                  "nothing.", ""]
    lines += [
        f"Written by `python tools/gpu_check.py` on {machine.get('date', '?')} at commit `{doc['commit']}`; the "
        f"figures are in [{doc['json_name']}]({doc['json_name']}).", "",
        "## Machine", "",
        "| | |", "|---|---|",
        f"| GPU | {gpu.get('name', 'none')} ({_cell(gpu.get('memory_gib'), '{} GiB')}, "
        f"{_cell(gpu.get('multiprocessors'))} SMs, capability {_cell(gpu.get('capability'))}) |",
        f"| nvidia-smi | {gpu.get('nvidia_smi', 'not available')} |",
        f"| CPU | {machine.get('usable_cpus')} usable cores ({machine.get('cpu_model')}), "
        f"{machine.get('ram_bytes', 0) / 2**30:.0f} GiB RAM |",
        f"| software | Python {machine.get('python')}, torch {machine.get('torch')} (CUDA {gpu.get('torch_cuda')}, "
        f"cuDNN {gpu.get('cudnn')}), torchvision {machine.get('torchvision')}, Pillow {machine.get('pillow')} |",
        f"| decoder | {machine.get('jpeg_decoder', 'not recorded')} |",
        f"| buffer | {_buffer_line(machine)} |",
        f"| platform | {machine.get('platform')} |", "",
    ]
    tests = doc.get("tests")
    skipped = doc.get("skipped") or []
    if tests is not None:
        lines += ["## GPU tests", "", f"`python {tests['command']}`: {tests.get('summary') or 'no summary'} "
                  f"(exit code {tests.get('returncode')}).", ""]
    elif "--skip-tests" in skipped:  # said, not left out without a word (a review)
        lines += ["## GPU tests", "", "Not run this time (`--skip-tests`).", ""]
    if doc.get("h2d") is not None:
        lines += ["## Host to device", "",
                  "Median per batch of uint8 images from fresh mappings of batch files (`tools/h2d_bench.py`); "
                  "`torch pinned` copies one pinned tensor of the same size, the ceiling; `BufferLoader` rows "
                  "are end to end (map, copy, uint8 -> float, normalise) with no model step.", "",
                  "| batch | mode | µs per batch | GB/s | vs torch pinned |", "|---|---|---:|---:|---:|"]
        for row in doc["h2d"]:
            size = f"{row['batch_size']}×{row['image_size']}² ({row['bytes'] / 1e6:.1f} MB)"
            if "note" in row:
                lines.append(f"| {size} | {row['mode']} | {row['note']} | | |")
            else:
                lines.append(f"| {size} | {row['mode']} | {row['us_per_batch']:.0f} | {row['gb_per_s']:.2f} | "
                             f"{_cell(row.get('vs_torch_pinned'), '{:.2f}')} |")
        lines.append("")
    if doc.get("training") is not None:
        lines += ["## Training", "",
                  f"{sizes['model']}, channels_last, bf16 autocast, SGD, batch {sizes['batch_size']}, "
                  f"{sizes['image_size']} px, {sizes['steps']} measured steps after {sizes['warmup_steps']} warm-up "
                  f"steps, on {doc['dataset']}.  Each feed trained {sizes.get('rounds', 1)} times, the ceiling first "
                  "in every round and the others in rotated order; every feed gives full batches (the daemon with "
                  "`--drop-last`, DataLoader with `drop_last=True`, DALI padding the last); a row is the feed's "
                  "median round (at an even count the lower of the two middle ones: of 2 rounds, the slower), and "
                  "`rounds` "
                  "lists every round's images/s.  Data wait: time blocked in `next()` over wall time (for the "
                  "daemon's loader that includes mapping the batch file and copying it into pinned memory, work "
                  "DataLoader's pin-memory thread does beside the loop).  GPU busy: CUDA "
                  "events around each step over wall time.  Memory: peak PSS of this process tree (trainer, "
                  "daemon, workers) and peak system memory in use above the start (tmpfs batches included).", "",
                  *([f"**Cut short by `--time-limit`**: {doc['training_stopped']}.", ""]
                    if doc.get("training_stopped") else []),
                  "| feed | images/s | vs synthetic | data wait | GPU busy | GPU util (NVML) | tree PSS MiB | "
                  "system +MiB | first batch s | rounds |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for row in doc["training"]:
            if "note" in row:
                lines.append(f"| {row['feed']} | {row['note']} | | | | | | | | |")
                continue
            each = " / ".join("failed" if v is None else f"{v:.0f}" for v in row.get("rounds_images_per_s", []))
            lines.append(
                f"| {row['feed']} | {row['images_per_s']:.0f} | {_cell(row.get('vs_synthetic'), '{:.2f}')} | "
                f"{row['data_wait_share']:.1%} | {_cell(row.get('gpu_busy_share'), '{:.1%}')} | "
                f"{_cell(row.get('nvml_gpu_util_mean'), '{:.0f}%')} | {row['tree_pss_peak_mib']} | "
                f"{row['system_used_above_start_peak_mib']} | {row['first_batch_s']:.1f} | {each} |")
        lines.append("")
        lines += _by_round(doc["training"])
    scaling = doc.get("scaling")
    if scaling is not None:
        floor = scaling["floor"]
        lines += ["## The producer on more cores", "",
                  f"`prefetchd bench`'s prefetchd row: the daemon with k workers and a null consumer, all pinned to "
                  f"k cores, batch {scaling['batch_size']}, {sizes['image_size']} px, {scaling['seconds']:g} s per "
                  f"count, on {doc['dataset']}{_buffers(scaling)}.  Floor: the daemon's `augment()` alone on one core over "
                  f"{floor['files']} of the files, each decoded once before (a worker's steady state): "
                  f"{floor['ms_per_image']:.2f} ms per image, {_rate(floor['images_per_s'])} img/s"
                  f"{_spread(floor.get('rounds', []))}.  {_rounds_said(scaling.get('rounds', 1))}Independent "
                  "loops: the floor's loop in k processes at once on the same k cores, wall-clock images/s summed "
                  "(what the machine allows k workers; the producer's share of it is what it loses on its own).  "
                  "Where that goes, over the producer's window: the workers' CPU time per image against the "
                  "floor's, and the cores the daemon's controller, the consumer and the bench's monitor took beside them.",
                  "", "| workers | images/s | scaling (vs k × 1 worker) | of k × floor | first batch s | "
                  "independent loops img/s (of k × floor) | producer / loops | workers' CPU ms per image "
                  "(vs floor) | controller + consumer + monitor cores |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for row in scaling["rows"]:
            loops = row.get("independent_loops_per_s")
            loops_cell = "" if loops is None else (f"{_rate(loops)}{_spread(row.get('loops_rounds', []))} "
                                                   f"({_cell(row.get('loops_vs_floor'), '{:.0%}')})")
            if row["images_per_s"] is None:
                lines.append(f"| {row['workers']} | {row['note'] or 'failed'} | | | | {loops_cell} | | | |")
                continue
            cpu = row.get("cpu")
            cpu_cells = "| |" if not cpu else (
                f"| {cpu['worker_ms_per_image']:.2f} ({cpu['worker_ms_per_image'] / floor['ms_per_image'] - 1:+.0%}) "
                f"| {cpu['controller_cores'] + cpu['consumer_cores'] + cpu['monitor_cores']:.2f} |")
            lines.append(f"| {row['workers']} | {_rate(row['images_per_s'])}{_spread(row.get('rounds_images_per_s', []))} "
                         f"| {_cell(row['scaling'], '{:.0%}')} | "
                         f"{_cell(row['vs_floor'], '{:.0%}')} | {_cell(row['first_batch_s'], '{:.2f}')} | "
                         f"{loops_cell} | {_cell(row.get('vs_loops'), '{:.0%}')} {cpu_cells}")
        lines.append("")
        if "cpu_tree_cores" in scaling:
            lines += [f"Over the whole step, in cores on average: this process tree {scaling['cpu_tree_cores']:.1f}, "
                      f"other processes {scaling['cpu_other_cores']:.1f}; steal {scaling['cpu_steal_share']:.1%} "
                      "of all CPU time.", ""]
    if "--skip-scaling" in skipped:
        lines += ["## The producer on more cores", "", "Not measured this time (`--skip-scaling`).", ""]
    ran = f"  This run: `{doc['command']}`." if doc.get("command") else ""
    lines += ["## Reproduce", "", "See README.md, \"On a GPU\": the wheels to carry, the install, and "
              f"`python tools/gpu_check.py --out DIR/gpu.json --commit HASH --time-limit 540`.{ran}", ""]
    return "\n".join(lines)


def _round_cells(rate: float | None, detail: dict[str, Any]) -> str:
    fifths = " / ".join(f"{v:.0f}" for v in detail.get("fifths_images_per_s", []))
    longest = (f"{detail['longest_wait_s']:.2f} ({detail['longest_wait_step'] + 1})"
               if "longest_wait_s" in detail else "")
    between = detail.get("between_epochs_images_per_s")
    between_cell = "" if between is None else f"{between:.0f} ({detail.get('epoch_starts', 0)})"
    return " | ".join([_cell(rate, "{:.0f}"), between_cell, fifths,
                       _cell(detail.get("data_wait_share"), "{:.1%}"), longest,
                       _cell(detail.get("gpu_busy_share"), "{:.1%}"), _cell(detail.get("cpu_tree_cores"), "{:.1f}"),
                       _cell(detail.get("cpu_other_cores"), "{:.1f}"), _cell(detail.get("cpu_steal_share"), "{:.1%}")])


def _by_round(rows: list[dict[str, Any]]) -> list[str]:
    """Each round's images/s beside where its time went (``timeline``) and where the machine's
    CPU went meanwhile (``CpuUse``)."""
    body = [f"| {row['feed']} | {i} | {_round_cells(rate, detail)} |"
            for row in rows for i, (rate, detail) in enumerate(zip(row.get("rounds_images_per_s", []),
                                                                    row.get("rounds_detail", [])), 1) if detail]
    if not body:
        return []
    return ["By round, over the measured steps: images/s in all, between epoch starts (over the steps whose "
            "batch did not open an epoch: what a run over a large dataset sees; in brackets, how many did) and over "
            "each fifth of the steps, the data wait, the longest time one step "
            "waited for its batch (and which step), the GPU's busy share, and where the machine's CPU went, in "
            "cores on average: this process tree (trainer, daemon, workers), every other process, and the "
            "hypervisor's steal as a share of all CPU time.", "",
            "| feed | round | images/s | between epoch starts (starts) | by fifth | data wait | longest wait s (step) | GPU busy | "
            "tree cores | other cores | steal |", "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|", *body, ""]


def write_outputs(doc: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    for path, text in ((out, json.dumps(doc, indent=2) + "\n"), (out.parent / "GPU.md", render_markdown(doc))):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)


if __name__ == "__main__":  # imported by tools/gpu_check.py; run alone it has nothing to do
    not_a_tool(__file__)
