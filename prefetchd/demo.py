"""`prefetchd demo`: the whole product in one command.

Generates a small learnable dataset, starts a daemon for its train split and
one for its val split on buffers under /dev/shm, runs `prefetchd-train`
alongside them, then stops the daemons and removes the buffers.  Everything
goes through the real command-line entry points, as a user would run them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from prefetchd.daemon.cgroup_limits import out_of_memory_where
from prefetchd.daemon.config import usable_cpus
from prefetchd.launch import (LaunchError, buffer_root, launch, start_argv, stop_daemon_process, stops_cleanly,
                              wait_ready)
from prefetchd.oom import oom_kills
from prefetchd.synthetic import DatasetSummary, make_shapes_dataset
from prefetchd.words import counted, ended

CLASSES = 4
VAL_PER_CLASS = 40
DAEMON_STOP_SECONDS = 30.0
DAEMON_READY_SECONDS = 120.0  # its start, index and first manifest; the trainer's own wait was as long


def _start_daemon(buffer: Path, data: Path, split: str, common: dict[str, int], log: Path) -> subprocess.Popen[bytes]:
    return launch(start_argv(buffer, {"data": data, "split": split, "reset": True, **common}), log=log)


# Written beside a dataset the demo generated, with what it was generated for: a second demo in the same --workdir
# uses it again (it was a traceback, "pass overwrite=True (--overwrite)", an option the demo has not: a walk).
MADE_BY_DEMO = ".prefetchd-demo.json"


def generate_data(data: Path, train_per_class: int) -> DatasetSummary | None:
    """Step 1, with a progress bar on a terminal.  The count is in the bar's label, not only in the bar:
    written elsewhere (a pipe, a log), click prints the label alone, once.  None where ``data`` holds the
    dataset an earlier demo generated for the same settings, used again; another one the demo generated is
    replaced, and a folder that holds files of anything else is refused (click.UsageError)."""
    recipe = {"classes": CLASSES, "train_per_class": train_per_class, "val_per_class": VAL_PER_CLASS, "seed": 0}
    marker = data / MADE_BY_DEMO
    try:
        earlier = json.loads(marker.read_text())
    except (OSError, ValueError):
        earlier = None
    if earlier == recipe:
        click.echo(f"[1/3] using the dataset an earlier demo generated in {data}")
        return None
    if earlier is None and data.is_dir() and any(data.iterdir()):
        raise click.UsageError(f"{data} holds files the demo did not generate; pick another --workdir, or remove "
                               f"{data} to have it generated there")
    click.echo(f"[1/3] generating {CLASSES} classes of coloured shapes in {data}")
    marker.unlink(missing_ok=True)  # half a dataset, should this be cut short, is no earlier demo's
    total = CLASSES * (train_per_class + VAL_PER_CLASS)
    with click.progressbar(length=total, label=f"      {counted(total, 'image')}") as bar:
        summary = make_shapes_dataset(
            data, classes=CLASSES, train_per_class=train_per_class, val_per_class=VAL_PER_CLASS, seed=0,
            progress=lambda done, total: bar.update(done - bar.pos), overwrite=earlier is not None,
        )
    marker.write_text(json.dumps(recipe))
    counts = ", ".join(f"{split} {n}" for split, n in summary.counts.items())
    click.echo(f"      classes: {', '.join(summary.classes)} ({counts})")
    return summary


# Its peak, the trainer, the two daemons and their workers together: 877 MiB in a 2 GiB cgroup on this project's
# machine; in a 700 MiB one the kernel killed the trainer, and the demo said only "exited with code -9".
DEMO_MEMORY = "about 0.9 GiB"


def _ended(code: int, oom_before: int | None) -> str:
    """How the trainer ended, from its exit code (-N: signal N); a SIGKILL while the machine's count of OOM
    kills rose is the kernel's out-of-memory killer's."""
    if code >= 0:
        return f"exited with code {code}"
    if code == -signal.SIGKILL and oom_before is not None and (oom_kills() or 0) > oom_before:
        where = out_of_memory_where("the demo")
        return f"was killed by the kernel's out-of-memory killer ({where}; it needs {DEMO_MEMORY})"
    return f"was killed by {ended(code)}"


@stops_cleanly
def run_demo(*, workdir: Path | None, epochs: int, image_size: int, batch_size: int,
             train_per_class: int, keep: bool) -> int:
    started = time.monotonic()
    work = workdir or Path(tempfile.mkdtemp(prefix="prefetchd-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    buffers = buffer_root() / f"prefetchd-demo-{os.getpid()}"
    data = work / "data"
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        generate_data(data, train_per_class)

        # On a small machine the trainer needs most of the cores; the buffers are
        # pre-filled before it starts, so one worker per daemon keeps up.
        workers = max(1, usable_cpus() // 4)
        common = {"batch_size": batch_size, "image_size": image_size, "epochs": epochs,
                  "workers": workers, "high_water": 32, "low_water": 16}
        click.echo(f"[2/3] starting daemons on {buffers}/train and {buffers}/val (logs in {work})")
        since = time.time()
        for split in ("train", "val"):
            daemons.append(_start_daemon(buffers / split, data / split, split, common, work / f"daemon-{split}.log"))
        for proc, split in zip(daemons, ("train", "val")):
            try:  # a daemon that refuses its settings is said now, in its words, not after a trainer's 120 s wait
                wait_ready(proc, buffers / split, since=since, timeout=DAEMON_READY_SECONDS,
                           log=work / f"daemon-{split}.log")
            except LaunchError as exc:
                click.echo(f"demo failed: {exc}", err=True)
                keep = True
                return 1

        click.echo(f"[3/3] training ResNet-18 for {counted(epochs, 'epoch')} at {image_size}px alongside the daemons")
        metrics = work / "metrics.json"
        oom_before = oom_kills()
        # In a session of its own: a Ctrl-C reaches the demo alone, which kills the trainer (subprocess.call does,
        # on the KeyboardInterrupt) and says "interrupted"; the trainer's own words, reaching it too, named
        # --checkpoint-dir, which the demo has not, or were a traceback while it imported torch (a walk).
        code = subprocess.call([
            sys.executable, "-m", "prefetchd.trainer.train", "--buffer", str(buffers / "train"),
            "--val-buffer", str(buffers / "val"), "--epochs", str(epochs), "--metrics-json", str(metrics),
        ], start_new_session=True)
        for proc, name in zip(daemons, ("train", "val")):
            if proc.poll() not in (None, 0):
                click.echo(f"the {name} daemon failed (exit code {proc.returncode}); see {work}/daemon-{name}.log", err=True)
                code = code or 1
        if code != 0:
            click.echo(f"demo failed: the trainer {_ended(code, oom_before)}; logs are in {work}", err=True)
            keep = True
            return code if code > 0 else 1
        result = json.loads(metrics.read_text())
        top1 = result["final_val_top1"]
        wait_share = result["data_wait_share"]
        click.echo(
            f"\ndone in {time.monotonic() - started:.0f} s: validation top-1 {top1:.1%} "
            f"(chance is {1 / CLASSES:.0%}), time waiting for data {wait_share:.1%} of training"
        )
        return 0
    finally:
        for proc in daemons:
            stop_daemon_process(proc, DAEMON_STOP_SECONDS)
        shutil.rmtree(buffers, ignore_errors=True)
        if keep:
            click.echo(f"kept {work}")
        elif workdir is None:
            shutil.rmtree(work, ignore_errors=True)
