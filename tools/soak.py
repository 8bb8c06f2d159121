"""Whether a long-lived daemon holds steady: its memory, open files and threads over many batches, epochs and jobs.

    python tools/soak.py [--minutes 20] [--jobs 60] [--workers 2] [--every 60] [--data ROOT]

Two phases, each on a real ``prefetchd start`` and a small generated dataset (64 px images in batches of 16, so
that batches go by in the hundreds of thousands and epochs in the tens of thousands):

1. ``--minutes``: one job with no end of epochs, read as fast as it comes by a ``BufferLoader`` in this process;
   every ``--every`` seconds a row.
2. ``--jobs``: a daemon started without a dataset takes that many jobs, written as ``prefetchd submit`` writes
   them (alternating seeds and batch sizes, one epoch each), each read to its end by a new loader; a row after
   each tenth, taken once the daemon waits for the next job.

A row: what was read, the controller's RSS and USS, its open files and threads, and the RSS of the rest of its
process tree (fork server, workers).  A leak is a column that keeps growing with the rows; the last line of each
phase sets its last row against its first after warm-up.  Linux only (psutil reads /proc).  A benchmark, not a
test: the figures depend on the machine.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click
import psutil

from prefetchd.buffer_protocol import JobRequest, State, read_status
from prefetchd.launch import buffer_root, daemon_for_a_run, option_args, stops_cleanly, wait_ready
from prefetchd.options import FiniteFloat
from prefetchd.synthetic import make_shapes_dataset
from prefetchd.trainer import BufferLoader
from prefetchd.words import counted

MIB = 1 << 20
IMAGE, BATCH = 64, 16


@dataclass(frozen=True)
class Row:
    read: str  # what was read by then: "1234 batches, epoch 56", "job 10"
    rss: int  # the controller's, bytes
    uss: int
    files: int  # the controller's open file descriptors
    threads: int
    tree_rss: int  # the rest of its process tree, summed

    def line(self) -> str:
        return (f"{self.read:>28}  {self.rss / MIB:8.1f}  {self.uss / MIB:8.1f}  {self.files:6d}  {self.threads:7d}  "
                f"{self.tree_rss / MIB:9.1f}")


HEADER = f"{'read':>28}  {'RSS MiB':>8}  {'USS MiB':>8}  {'files':>6}  {'threads':>7}  {'tree MiB':>9}"


def measure(daemon: psutil.Process, read: str) -> Row:
    info = daemon.memory_full_info()
    tree = 0
    for child in daemon.children(recursive=True):
        try:
            tree += child.memory_info().rss
        except psutil.Error:  # a worker that ended meanwhile
            pass
    return Row(read, info.rss, info.uss, daemon.num_fds(), daemon.num_threads(), tree)


def compare(first: Row, last: Row) -> str:
    """The phase's last line: its last row against its first after warm-up."""
    return (f"from {first.read.strip()} to {last.read.strip()}: controller RSS {first.rss / MIB:.1f} -> "
            f"{last.rss / MIB:.1f} MiB ({(last.rss - first.rss) / MIB:+.1f}), USS {(last.uss - first.uss) / MIB:+.1f} "
            f"MiB, open files {first.files} -> {last.files}, threads {first.threads} -> {last.threads}, "
            f"the rest of the tree {(last.tree_rss - first.tree_rss) / MIB:+.1f} MiB")


def report(rows: list[Row]) -> None:
    click.echo(compare(rows[1] if len(rows) > 2 else rows[0], rows[-1]))


def wait_until(what: str, ready: Callable[[], bool], daemon: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if daemon.poll() is not None:
            raise click.ClickException(f"the daemon exited with code {daemon.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise click.ClickException(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.05)


def state_is(buffer: Path, daemon: subprocess.Popen[bytes], *states: State) -> Callable[[], bool]:
    def ready() -> bool:
        status = read_status(buffer) if buffer.is_dir() else None
        return status is not None and status.pid == daemon.pid and status.state in states
    return ready


def one_job(buffer: Path, data: Path, workers: int, minutes: float, every: float, log: Path) -> list[Row]:
    """Phase 1: one job read as fast as it comes for ``minutes``."""
    args = option_args({"data": data, "batch_size": BATCH, "image_size": IMAGE, "workers": workers})
    since = time.time()
    with daemon_for_a_run(buffer, args, log, 30) as daemon:
        wait_ready(daemon, buffer, since=since, timeout=300, log=log)
        proc = psutil.Process(daemon.pid)
        rows = [measure(proc, "started")]
        click.echo(rows[-1].line())
        batches, start = 0, time.monotonic()
        next_row = start + every
        with BufferLoader(buffer, normalize=False, timeout=60) as loader:
            while time.monotonic() - start < minutes * 60:
                for batch in loader:
                    batches += 1
                    if time.monotonic() >= next_row:
                        next_row += every
                        rows.append(measure(proc, f"{batches} batches, epoch {batch.epoch}"))
                        click.echo(rows[-1].line())
                    if time.monotonic() - start >= minutes * 60:
                        break
        rows.append(measure(proc, f"{batches} batches, the end"))
        click.echo(rows[-1].line())
        return rows


def many_jobs(buffer: Path, data: Path, workers: int, jobs: int, log: Path) -> list[Row]:
    """Phase 2: ``jobs`` jobs submitted one after another to a daemon that waits for jobs."""
    with daemon_for_a_run(buffer, option_args({"workers": workers}), log, 30) as daemon:
        waiting = state_is(buffer, daemon, State.WAITING_FOR_JOB)
        wait_until("the daemon to wait for a job", waiting, daemon)
        proc = psutil.Process(daemon.pid)
        rows = [measure(proc, "no job yet")]
        click.echo(rows[-1].line())
        for job in range(1, jobs + 1):
            request = JobRequest({"data": str(data), "seed": job, "batch_size": BATCH + 8 * (job % 3),
                                  "image_size": IMAGE, "epochs": 1})
            request.write(buffer)
            wait_until(f"the answer to job {job}", lambda: (s := read_status(buffer)) is not None
                       and s.job_result is not None and s.job_result.job_id == request.job_id, daemon)
            answer = read_status(buffer)
            if answer is None or answer.job_result is None or not answer.job_result.accepted:
                raise click.ClickException(f"job {job} was refused: {answer.job_result if answer else None}")
            with BufferLoader(buffer, normalize=False, timeout=60) as loader:
                if sum(1 for _ in loader) == 0:
                    raise click.ClickException(f"job {job} gave no batch")
            if job % 10 == 0 or job in (1, jobs):
                wait_until(f"job {job} to end", waiting, daemon)
                rows.append(measure(proc, f"job {job}"))
                click.echo(rows[-1].line())
        return rows


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--minutes", default=20.0, show_default=True, type=FiniteFloat(min=0),
              help="Phase 1's length (0: skip it).")
@click.option("--jobs", default=60, show_default=True, type=click.IntRange(min=0), help="Phase 2's jobs (0: skip it).")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(min=1), help="The daemons' --workers.")
@click.option("--every", default=60.0, show_default=True, type=FiniteFloat(min=0.1),
              help="Seconds between phase 1's rows.")
@click.option("--data", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Class folders [default: a generated dataset of 3 x 40 small images].")
@stops_cleanly
def main(minutes: float, jobs: int, workers: int, every: float, data: Path | None) -> None:
    """Run a daemon through many batches and many jobs, and watch its memory, open files and threads."""
    work = Path(tempfile.mkdtemp(prefix="prefetchd-soak-"))
    buffers = Path(tempfile.mkdtemp(prefix="prefetchd-soak-bf-", dir=buffer_root()))
    try:
        if data is None:
            make_shapes_dataset(work / "data", classes=3, train_per_class=40, val_per_class=0, seed=0)
            data = work / "data" / "train"
        click.echo(f"prefetchd soak: {data}, batch {BATCH} x {IMAGE}px, {counted(workers, 'worker')}, "
                   f"python {sys.version.split()[0]}")
        if minutes > 0:
            click.echo(f"\none job read as fast as it comes, {minutes:g} min:\n{HEADER}")
            report(one_job(buffers / "one", data, workers, minutes, every, work / "one.log"))
        if jobs > 0:
            click.echo(f"\n{jobs} jobs one after another:\n{HEADER}")
            report(many_jobs(buffers / "jobs", data, workers, jobs, work / "jobs.log"))
    finally:
        shutil.rmtree(buffers, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
