"""Benchmark prefetchd against ImageFolder + DataLoader (and SPDL, if installed) on this machine.

    python tools/bench.py [--data DIR | --generate N] [--workers 1,2] [--batch-size 128]
                          [--image-size 224] [--seconds 8] [--out bench-out]

The same command as `prefetchd bench`; see docs/BENCHMARKS.md for what it measures.
"""

from __future__ import annotations

from prefetchd.bench import bench_command

if __name__ == "__main__":
    bench_command(prog_name="tools/bench.py")
