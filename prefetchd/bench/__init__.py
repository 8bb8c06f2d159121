"""`prefetchd bench` / `python tools/bench.py`: prefetchd against the loaders users have today.

One run, one dataset, the same cores for every contender:

    prefetchd          a real `prefetchd start` subprocess, consumed by BufferLoader(normalize=False)
    dataloader         ImageFolder + DataLoader, RandomResizedCrop + flip + ToTensor + Normalize (float32)
    dataloader-uint8   the same with PILToTensor (uint8, no normalisation)
    spdl               an SPDL thread pipeline with the uint8 transforms, if `import spdl` works
    dali               DALI's CPU pipeline (device_id=None) with its crop-aware decoder, if
                       `import nvidia.dali` works
    dali-fulldecode    the same decoding whole images, then fn.random_resized_crop

Each contender runs with k = 1 .. cores workers, and the whole contender (its
consumer, the daemon's controller, every worker) is pinned to the same k cores,
so "k workers" always means "k cores' worth of CPU", consumer included.  The
consumer is a null consumer: it takes each batch and drops it.

What is measured (see docs/BENCHMARKS.md for how to read it):

- throughput: images/s after the first batch and a short warm-up, so start-up is
  excluded from the rate and reported separately as "first batch";
- warm start: the time from constructing a BufferLoader to holding the first
  batch when the daemon has already filled its buffer (target <= 20 ms);
- data-wait share: a simulated trainer whose steps are twice as fast as the
  producer and which pauses for "evaluation" every few steps, sized so that the
  producer's *average* rate exceeds the trainer's by 30 %.  A producer that keeps
  working during the pause (prefetchd, up to its high-water mark) hides the
  deficit; one with a small queue (DataLoader: prefetch_factor x workers batches)
  makes the trainer wait after each pause;
- memory: the daemon's peak buffer bytes against high_water x batch bytes, and
  the RSS of the daemon's process tree at the first batch and at the end.

DataLoaders iterate one long shuffled epoch (a RandomSampler drawing fresh
permutations of the dataset), so that a small benchmark dataset behaves like a
large one; with persistent_workers=False every real epoch start costs the
"first batch" time again, which the table reports.

Heavy imports (torch, torchvision, spdl, nvidia.dali, matplotlib) happen inside the
functions, so importing this module for the CLI stays cheap.
"""

from __future__ import annotations

from prefetchd.bench.command import bench_command
from prefetchd.bench.report import describe_machine, format_table
from prefetchd.bench.results import CONTENDERS, RESULTS_FORMAT, RESULTS_VERSION, BenchmarkResults, Throughput
from prefetchd.bench.run import run_benchmark

__all__ = ["CONTENDERS", "RESULTS_FORMAT", "RESULTS_VERSION", "BenchmarkResults", "Throughput", "bench_command",
           "describe_machine", "format_table", "run_benchmark"]
