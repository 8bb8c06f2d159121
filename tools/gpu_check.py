"""One command that proves the GPU path on a GPU machine and writes docs/GPU.md + docs/gpu.json.

    python tools/gpu_check.py [--out docs/gpu.json] [--commit HASH] [--steps 200] [--rounds 3]
                              [--data IMAGEFOLDER] [--workers 15,12] [--skip-tests] [--skip-scaling]
                              [--scaling-rounds 1] [--scaling-buffer-root DIR] [--time-limit SECONDS] [--dry-run]

Steps, each recorded in the JSON (rewritten after every step, so a run cut short
still leaves what it measured) and in GPU.md beside it.  Step 1 runs while the
dataset is generated and ends before step 2 times the copies; step 5 (~1.5 min a
round on 16 cores) runs before 3 and 4, the longest:

1. ``pytest -m gpu``: the GPU tests, their counts;
2. host-to-device copies of batch files (``tools/h2d_bench.py`` used as a module) at
   batch 128 and 256, 224 px: pageable, staging (pinned ring) and registered mapping,
   the transfer alone and ``BufferLoader`` end to end, against torch's own copy from
   pinned memory of the same size (the ceiling of a host-to-device copy);
3. ResNet-50 (channels_last, bf16 autocast, batch 256, SGD) for a fixed number of
   steps, fed three ways: by a prefetchd daemon with all cores but one, by
   ImageFolder + DataLoader with as many workers, and by synthetic tensors already on
   the GPU (the ceiling).  Per feed: images/s, data-wait share (time blocked in
   ``next()`` over wall time, as prefetchd-train defines it), GPU busy share (CUDA
   events around each step), GPU utilisation (NVML, when ``pynvml`` imports), host
   memory (PSS of this process tree, the system's used memory above the start).  The
   dataset is written back and read once first, and each feed trains three times in
   rotated order; its row is the median round;
4. the same model fed by DALI's GPU pipeline when ``nvidia.dali`` imports;
5. the producer alone on more cores than the 2 of the development machine:
   ``prefetchd bench``'s prefetchd row (no GPU, a null consumer) at 1, 2, 4, ... workers
   up to every core, with the floor (the daemon's ``augment()`` alone on one core) and
   each count's share of k times it; and at each count, k independent ``augment()`` loops
   on the same cores (the bench's independent loops): what the machine allows, so the
   producer's share of it is what the producer loses on its own.  ``--scaling-rounds N``
   measures each count (and its loops, and the floor) N times, a row the median round:
   one 5 s round per count cannot tell a change of the producer's from the host's.
   ``--scaling-buffer-root DIR`` puts its buffers there instead of /dev/shm (a tmpfs with
   2 MiB pages, to see what the page faults of writing batches cost at 16 workers).

``--dry-run`` runs every step on the CPU at toy sizes (a small model, 16 images, a
few steps) and writes into a temporary folder unless ``--out`` is given: it keeps
this script working in CI, and its numbers mean nothing.

On the GPU machine the checkout is a copy without ``.git``: pass ``--commit`` with
the hash of the checkout that was sent (README, "On a GPU").

Its modules beside it in tools/, in the order of a run: ``gpu_check_plan.py`` the sizes and
the time limit, ``gpu_check_machine.py`` the machine and checkout, ``gpu_check_steps.py`` steps
1, 2 and 5, ``gpu_check_feeds.py`` and ``gpu_check_training.py`` steps 3 and 4 (``host_use.py``
samples the host while a feed trains: memory, NVML, where the CPU went), and
``gpu_report.py`` writes gpu.json and GPU.md from the results.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

# tools/ is sys.path[0] when this file runs as a script: the modules beside it import by their names.
from gpu_check_machine import (buffer_root_saying_where, cli_problem, cores_but_one, describe_gpu, git_commit,
                               warm_page_cache)
from gpu_check_plan import DRY, FULL, REPO, Sizes, TimeLimit
from gpu_check_steps import TESTS_PASSED, h2d_rows, run_gpu_tests, scaling_counts, scaling_rows
from gpu_check_training import training_rows
from gpu_report import write_outputs
from h2d_bench import image_bytes
from prefetchd.bench import describe_machine
from prefetchd.bench.report import describe_dataset
from prefetchd.bench.run import buffers_in
from prefetchd.daemon.config import usable_cpus
from prefetchd.launch import stops_cleanly
from prefetchd.synthetic import make_imagenet_like, progress_lines
from prefetchd.words import binary_size, counted

log = logging.getLogger("gpu_check")

RESULTS_FORMAT = "prefetchd.gpu_check"
# 2: training rows are medians over rounds (rounds_images_per_s, failed_rounds); sizes.workers is a list.
RESULTS_VERSION = 2


def worker_counts(text: str) -> list[int]:
    """``--workers 15,12`` as [15, 12]."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give worker counts of 1 or more, separated by commas (15,12)")
    return counts


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="the JSON; GPU.md goes beside it [default: docs/gpu.json, "
                        "or a temporary folder with --dry-run]")
    parser.add_argument("--dry-run", action="store_true", help="every step on the CPU at toy sizes")
    parser.add_argument("--commit", help="the commit measured, where the checkout has no .git")
    parser.add_argument("--steps", type=int, help="measured training steps per feed")
    parser.add_argument("--data", type=Path, help="an ImageFolder tree to train on instead of generating one")
    parser.add_argument("--skip-tests", action="store_true", help="leave out `pytest -m gpu`")
    parser.add_argument("--skip-scaling", action="store_true", help="leave out step 5, the producer alone "
                        "(~1.5 min a --scaling-round on 16 cores): for a short lease that looks only at the training")
    parser.add_argument("--rounds", type=int, help="times each feed trains; its row is the median round")
    parser.add_argument("--scaling-rounds", type=int, help="times step 5 measures each worker count, and its "
                        "independent loops; a row is the median round (~1.5 min a round on 16 cores) [default: 1]")
    parser.add_argument("--scaling-buffer-root", type=Path, metavar="DIR",
                        help="the folder step 5's daemons put their buffers in, e.g. a tmpfs mounted with "
                        "huge=within_size [default: /dev/shm, as the training's]")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        help="seconds for the whole run: after the first training round, a round whose feeds would "
                        "end past it (by their last round's times) is not started, so a lease's call ends with "
                        "every feed at as many rounds and says so; the steps before the training and its first "
                        "round always run, and a run past the limit says by how much [default: none]")
    parser.add_argument("--workers", type=worker_counts, help="the daemon's worker counts to train with, e.g. "
                        "15,12 (DataLoader and DALI get the first) [default: all cores but one]")
    args = parser.parse_args(argv)
    # Every flag is checked here, before the GPU tests and the copies (a bad --data failed after them, a lease's
    # minutes in, and --steps 0 trained nothing and passed).
    if args.time_limit is not None and args.time_limit <= 0:
        parser.error(f"--time-limit {args.time_limit:g}: give a number of seconds above 0")
    for flag, value in (("--rounds", args.rounds), ("--scaling-rounds", args.scaling_rounds), ("--steps", args.steps)):
        if value is not None and value < 1:
            parser.error(f"{flag} {value}: give 1 or more")
    if args.workers is not None and max(args.workers) > (cores := usable_cpus()):
        parser.error(f"--workers {max(args.workers)} is more than the {cores} usable cores")
    if args.data is not None:
        if not args.data.is_dir():
            parser.error(f"--data {args.data} is not a folder; pass an ImageFolder tree (class folders of images), "
                         "or leave --data out to generate one")
        try:
            args.described = describe_dataset(args.data)  # what GPU.md says the rows ran on
        except (ValueError, OSError) as exc:
            parser.error(f"--data {args.data}: {exc}")
    if args.scaling_buffer_root is not None:
        try:
            buffers_in(args.scaling_buffer_root, flag="--scaling-buffer-root")
        except ValueError as exc:
            parser.error(str(exc))
    return args


def sizes_of(args: argparse.Namespace) -> Sizes:
    """The run's sizes: a full run's or ``--dry-run``'s, with ``--steps``, ``--rounds`` and ``--scaling-rounds``
    where given."""
    given = {"steps": args.steps, "rounds": args.rounds, "scaling_rounds": args.scaling_rounds}
    return dataclasses.replace(DRY if args.dry_run else FULL, **{k: v for k, v in given.items() if v is not None})


@stops_cleanly
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = None if args.time_limit is None else TimeLimit(args.time_limit, time.monotonic())
    # The clock in every line: a lease's one call must hold the whole run, so show where its time goes.
    logging.basicConfig(level=logging.INFO, format="gpu_check %(asctime)s: %(message)s", datefmt="%H:%M:%S")
    sizes = sizes_of(args)
    device = torch.device(sizes.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine, or pass --dry-run", file=sys.stderr)
        return 2
    problem = cli_problem()
    if problem:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 2
    out = args.out or (Path(tempfile.mkdtemp(prefix="gpu-check-")) / "gpu.json" if args.dry_run
                       else REPO / "docs" / "gpu.json")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    else:
        # Toy sizes on a shared CPU: more intra-op threads than free cores spin against
        # each other (seen here: 30x slower steps with 2 threads on a busy 2-core box).
        torch.set_num_threads(1)
    workers = args.workers or [cores_but_one()]
    doc: dict[str, Any] = {
        "format": RESULTS_FORMAT, "version": RESULTS_VERSION, "dry_run": args.dry_run, "json_name": out.name,
        "commit": git_commit(args.commit), "machine": describe_machine(), "gpu": describe_gpu(device),
        "sizes": {**dataclasses.asdict(sizes), "workers": workers}, "tests": None, "h2d": None, "training": None,
        "scaling": None, "training_stopped": None,
        # The options of this run, which GPU.md's generated part records (they were only in the hand-written one).
        "command": shlex.join(["python", "tools/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]),
        "skipped": [flag for flag, on in (("--skip-tests", args.skip_tests), ("--skip-scaling", args.skip_scaling)) if on],
    }
    write_outputs(doc, out)
    log.info("writing %s and %s", out, out.parent / "GPU.md")
    # The tests run beside the data's generation (the sixth lease ran them one after the other:
    # 28 s, then 94 s) and end before the copies are timed, which want a quiet machine.
    background = ThreadPoolExecutor(max_workers=1)
    tests = None if args.skip_tests else background.submit(run_gpu_tests, sizes)
    if tests is not None:
        log.info("1. pytest -m gpu, beside step 3")
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-data-"))
    try:
        data = args.data
        if data is None:
            data = scratch / "imagenet-like"
            log.info("3. generating %d images in %s", sizes.classes * sizes.per_class, data)
            summary = make_imagenet_like(data, classes=sizes.classes, per_class=sizes.per_class, seed=0,
                                         workers=usable_cpus(), progress=progress_lines())
            doc["dataset"] = summary.line()
            classes = sizes.classes
        else:
            described = args.described
            doc["dataset"] = (f"{data}: {counted(described['classes'], 'class')}, {counted(described['images'], 'image')}, "
                              f"mean {described['mean_kb']:.0f} KB, {binary_size(described['total_bytes'])} in all")
            classes = described["classes"]
        if tests is not None:
            doc["tests"] = tests.result()
            log.info("1. %s", doc["tests"]["summary"])
            write_outputs(doc, out)
        batch_bytes = image_bytes(max(sizes.h2d_batch_sizes), sizes.h2d_image_size)
        root = buffer_root_saying_where(max(sizes.h2d_batches * batch_bytes, (sizes.high_water + 4) * batch_bytes))
        log.info("2. host-to-device copies, batches %s", sizes.h2d_batch_sizes)
        doc["h2d"] = h2d_rows(sizes, device, root)
        write_outputs(doc, out)
        warm_page_cache(data)
        # Step 5 runs before the training: it takes about 1.5 minutes a round where the training takes
        # four to six, and a run cut short by the device's time limit then still has it.
        if not args.skip_scaling:
            counts = scaling_counts(usable_cpus()) if not args.dry_run else [1]
            log.info("5. the producer alone at %s workers", ", ".join(map(str, counts)))
            doc["scaling"] = scaling_rows(data, sizes, scratch / "bench", counts, args.scaling_buffer_root)
            write_outputs(doc, out)

        def save(rows: list[dict[str, Any]]) -> None:
            doc["training"] = rows
            write_outputs(doc, out)

        doc["training"], doc["training_stopped"] = training_rows(data, sizes, classes, device, workers, root,
                                                                 done=save, deadline=deadline)
    finally:
        background.shutdown(wait=True)  # a step that failed leaves the tests to end first
        shutil.rmtree(scratch, ignore_errors=True)
    write_outputs(doc, out)
    log.info("done: %s", out.parent / "GPU.md")
    failed = [row["feed"] for row in doc["training"]
              if str(row.get("note", "")).startswith("failed") or row.get("failed_rounds")]
    failed += [f"producer at {row['workers']} workers" for row in (doc["scaling"] or {}).get("rows", [])
               if row["images_per_s"] is None]
    tests_failed = doc["tests"] is not None and doc["tests"]["returncode"] not in TESTS_PASSED
    return 1 if failed or tests_failed else 0


if __name__ == "__main__":
    sys.exit(main())
