"""What a daemon costs while it waits: CPU and wake-ups of a full buffer with no trainer.

    python tools/idle_cpu.py [--seconds 20] [--workers 2] [--high-water 4] [--data ROOT]

Starts a real ``prefetchd start`` on a small generated dataset (or ``--data``), lets it
fill the buffer to the high-water mark with nobody consuming, then measures every
process of the daemon (controller, fork server, workers, resource tracker) over
``--seconds``: CPU time (user + system, from psutil) as a share of one core, and
voluntary context switches per second summed over all threads (from
``/proc/PID/task/*/status``; psutil's count covers the main thread only), which is
how often the process went to sleep, i.e. how often something woke it.  A daemon
that busy-waits shows up as CPU; one that polls too often as wake-ups.

Linux only (``/proc``).  A benchmark, not a test: numbers depend on the machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import click
import psutil

from prefetchd.buffer_protocol import State, read_status
from prefetchd.launch import buffer_root, launch, start_argv, stop_daemon_process, stops_cleanly
from prefetchd.options import FiniteFloat
from prefetchd.synthetic import make_shapes_dataset
from prefetchd.words import counted


@dataclass
class Sample:
    cpu: float  # user + system seconds
    switches: int  # voluntary context switches, all threads


def sample(proc: psutil.Process) -> Sample | None:
    try:
        times = proc.cpu_times()
        switches = 0
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            try:
                with open(f"/proc/{proc.pid}/task/{tid}/status") as fh:
                    for line in fh:
                        if line.startswith("voluntary_ctxt_switches:"):
                            switches += int(line.split()[1])
            except FileNotFoundError:  # the thread ended meanwhile
                pass
        return Sample(times.user + times.system, switches)
    except (psutil.Error, FileNotFoundError):
        return None


def role(proc: psutil.Process, daemon_pid: int) -> str:
    if proc.pid == daemon_pid:
        return "controller"
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return "?"
    if "forkserver" in cmd and proc.ppid() == daemon_pid:
        return "fork server"
    if "resource_tracker" in cmd:
        return "resource tracker"
    return "worker"


def headline(fill: str, state: object, workers: int, elapsed: float) -> str:
    """The line above the table: the buffer's fill ("waiting/high-water"), its state, the workers."""
    return f"idle daemon, buffer full ({fill} batches, state {state}), no trainer, {counted(workers, 'worker')}, over {elapsed:.1f} s:"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--seconds", default=20.0, show_default=True, type=FiniteFloat(min=1), help="Measuring time.")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(min=1), help="The daemon's --workers.")
@click.option("--high-water", default=4, show_default=True, type=click.IntRange(min=1), help="The daemon's --high-water.")
@click.option("--data", type=click.Path(file_okay=False, path_type=Path), default=None, help="Class folders [default: a generated dataset].")
@click.option("--settle", default=2.0, show_default=True, type=FiniteFloat(min=0), help="Seconds to wait after the buffer is full.")
@stops_cleanly
def main(seconds: float, workers: int, high_water: int, data: Path | None, settle: float) -> None:
    """Measure the idle cost of a daemon whose buffer is full and whose trainer is away."""
    work = Path(tempfile.mkdtemp(prefix="prefetchd-idle-"))
    buffer = Path(tempfile.mkdtemp(prefix="prefetchd-idle-bf-", dir=buffer_root())) / "bf"
    daemon: subprocess.Popen[bytes] | None = None
    try:
        if data is None:
            make_shapes_dataset(work / "data", classes=3, train_per_class=40, val_per_class=0, seed=0)
            data = work / "data" / "train"
        daemon = launch(start_argv(buffer, {"data": data, "batch_size": 16, "image_size": 64, "workers": workers,
                                            "high_water": high_water, "log_level": "warning"}))
        deadline = time.monotonic() + 300
        while True:
            status = read_status(buffer) if buffer.is_dir() else None
            if status is not None and status.state == State.FULL and status.pid == daemon.pid:
                break
            if daemon.poll() is not None:
                raise click.ClickException(f"the daemon exited with code {daemon.returncode} before its buffer was full")
            if time.monotonic() > deadline:
                raise click.ClickException("the buffer did not fill within 300 s")
            time.sleep(0.1)
        time.sleep(settle)
        root = psutil.Process(daemon.pid)
        procs = [root, *root.children(recursive=True)]
        before = {p.pid: sample(p) for p in procs}
        t0 = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        after = {p.pid: sample(p) for p in procs}
        final = read_status(buffer)
        production = final.production if final is not None else None
        rows = []
        for p in procs:
            a, b = before.get(p.pid), after.get(p.pid)
            if a is None or b is None:
                continue
            rows.append((role(p, daemon.pid), p.pid, (b.cpu - a.cpu) / elapsed * 100, (b.switches - a.switches) / elapsed))
        fill = f"{production.waiting}/{production.high_water}" if production is not None else "?/?"
        click.echo(headline(fill, final.state if final is not None else None, workers, elapsed))
        click.echo(f"{'process':<18}{'pid':>8}{'CPU % of a core':>17}{'wake-ups/s':>12}")
        for name, pid, cpu, wakeups in rows:
            click.echo(f"{name:<18}{pid:>8}{cpu:>17.2f}{wakeups:>12.1f}")
        click.echo(f"{'total':<18}{'':>8}{sum(r[2] for r in rows):>17.2f}{sum(r[3] for r in rows):>12.1f}")
    finally:
        if daemon is not None:
            stop_daemon_process(daemon, 30)
        shutil.rmtree(buffer.parent, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
