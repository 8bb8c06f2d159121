"""The worker pool under a real daemon: a worker killed mid-run is replaced and its batches still arrive."""

from __future__ import annotations

import multiprocessing.context
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefetchd.buffer_protocol import Production, Progress, ProtocolError, State, list_batches, read_status
from prefetchd.daemon import pool as pool_module
from prefetchd.daemon.pool import ORPHAN_SECONDS, TEMP_PREFIX
from prefetchd.daemon.dataset import scan_class_folders
from prefetchd.daemon.errors import EXIT_USAGE, DaemonError
from prefetchd.daemon.tasks import WorkerJob
from prefetchd.trainer import BufferLoader
from prefetchd.launch import launch, start_argv, stop_daemon_process
from tests.waiting import wait_for
from tests.daemon_workers import daemon_workers
from tests.status_examples import production_of


def _production(buffer: Path) -> Production | None:
    try:
        return production_of(buffer)
    except ProtocolError:  # being replaced
        return None


def test_a_killed_worker_is_replaced_and_its_tasks_requeued(
    shapes_data: Path, shm_dir: Path, start_daemon: Callable[..., Any]
) -> None:
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", "--batch-size", "8", "--image-size", "32",
                          "--workers", "2", "--high-water", "3", "--low-water", "1")
    daemon.wait_until(lambda: (p := _production(buffer)) is not None and p.workers == 2, 120, "two workers")
    workers = daemon_workers(daemon.proc.pid)
    assert len(workers) == 2, workers
    workers[0].kill()
    daemon.wait_until(lambda: (p := _production(buffer)) is not None and p.errors.worker_restarts == 1
                      and p.workers == 2, 60, "the killed worker replaced")
    Progress(0, 5).write(buffer)  # the trainer moves on: the new window is built by the pool
    daemon.wait_until(lambda: set(list_batches(buffer)) == {(0, 5), (0, 6), (0, 7)}, 60, "the window after the kill")
    assert "requeuing" in daemon.log



def test_workers_draw_other_numbers_from_the_global_generators(
    shapes_data: Path, shm_dir: Path, start_daemon: Callable[..., Any]
) -> None:
    """Workers forked from one worker server began with the same np.random and torch states: a hook drawing from
    them (instead of the Generator it is handed) gave the k-th image of each worker the same noise (a walk)."""
    buffer = shm_dir / "bf"
    start_daemon(buffer, "--data", shapes_data / "train", "--batch-size", "8", "--image-size", "16", "--epochs", "1",
                 "--workers", "2", "--transform", "tests.integration.global_random_hook:noise")
    with BufferLoader(buffer, normalize=False, timeout=120) as loader:
        images = np.concatenate([batch.images.numpy() for batch in loader])
    assert len(images) == 72
    for channel in (1, 2):  # np.random's, torch's
        planes = images[:, channel].reshape(len(images), -1)
        assert len(np.unique(planes, axis=0)) == len(images), f"channel {channel}: repeated draws"

def test_the_worker_server_starts_under_a_tmpdir_too_long_for_its_socket(tmp_path: Path) -> None:
    """A scheduler's per-job TMPDIR can be longer than a Unix socket path allows: the forkserver's
    socket folder goes under /tmp instead of the bind failing with 'AF_UNIX path too long'."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    script = ("import multiprocessing.util; from prefetchd.daemon.pool import start_worker_server; "
              "start_worker_server(); print(multiprocessing.util.get_temp_dir())")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TMPDIR": str(deep)})
    assert run.returncode == 0, run.stderr[-3000:]
    folder = Path(run.stdout.strip())
    assert folder.name.startswith("pymp-") and folder.parent.name.startswith(TEMP_PREFIX), run.stdout
    assert folder.parent.parent == Path("/tmp"), run.stdout
    assert not folder.parent.exists(), "removed at exit, as multiprocessing's own folder is"
    assert list(deep.iterdir()) == []


def test_the_socket_folders_of_killed_daemons_are_removed_and_no_other(shm_dir: Path) -> None:
    """A daemon killed with SIGKILL cannot remove its worker server's socket folder: the next to start does, from
    the folder's free flock; a held one belongs to a daemon that runs (maybe in another pid namespace), a young one
    to one that is about to hold it, and a folder of another prefix is not ours."""
    tmpdir = shm_dir / "t"  # short: the socket's path must fit in 107 bytes, or it goes to /tmp
    tmpdir.mkdir()
    orphan, held, young, other = (tmpdir / name for name in (
        f"{TEMP_PREFIX}orphan", f"{TEMP_PREFIX}held", f"{TEMP_PREFIX}young", "pymp-someone"))
    for folder in (orphan, held, young, other):
        (folder / "pymp-x").mkdir(parents=True)
        if folder is not young:
            os.utime(folder, (time.time() - 2 * ORPHAN_SECONDS,) * 2)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print(flush=True); sys.stdin.read()", str(held)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "\n"
        script = ("import logging, multiprocessing.util; from prefetchd.daemon.pool import start_worker_server; "
                  "logging.basicConfig(level=logging.INFO); start_worker_server(); "
                  "print(multiprocessing.util.get_temp_dir())")
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "TMPDIR": str(tmpdir)})
    finally:
        holder.kill()
        holder.wait()
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in tmpdir.iterdir()) == sorted(p.name for p in (held, young, other)), run.stderr
    assert f"removed {orphan}, the worker server's socket folder of a daemon that was killed" in run.stderr
    assert Path(run.stdout.strip()).parent.parent == tmpdir, run.stdout



def test_a_soft_open_file_limit_too_low_for_the_workers_is_raised_and_a_hard_one_refused(
    shapes_data: Path, shm_dir: Path, tmp_path: Path
) -> None:
    """4 workers hold ~33 files in the controller.  Under a soft limit of 28 the start failed with "Too many open
    files", an internal error: what a box of ~330 CPUs met at the usual soft limit of 1024 with the default
    --workers."""
    def start(limits: str, name: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
        buffer, log = shm_dir / name, tmp_path / f"{name}.log"
        argv = ["prlimit", f"--nofile={limits}", "--", *start_argv(buffer, extra=[
            "--data", str(shapes_data / "train"), "--batch-size", "8", "--image-size", "32", "--workers", "4",
            "--epochs", "1", "--high-water", "100"])]
        return launch(argv, log=log), buffer, log

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # as it is: raising it takes CAP_SYS_RESOURCE
    proc, buffer, log = start(f"28:{'unlimited' if hard == resource.RLIM_INFINITY else hard}", "raised")
    try:
        # Every batch of its epoch built (9 of 8 from 72 samples): then it waits for a trainer that never comes.
        wait_for(lambda: (st := read_status(buffer)) is not None and st.state == State.DONE, 120,
                 "the daemon to build its epoch", proc)
        assert len(list_batches(buffer)) == 9
    finally:
        stop_daemon_process(proc, 15)
    assert proc.returncode == 0, log.read_text()
    assert "raised the open-file limit from 28 to 44 for 4 workers" in log.read_text()

    proc, buffer, log = start("38:38", "refused")  # the hard limit: no process may raise it but root's
    assert proc.wait(120) == EXIT_USAGE, log.read_text()  # not restarted by the unit: a restart would not help
    assert ("4 workers need about 44 open files in the daemon, but its limit is 38 (`ulimit -Hn`): raise it "
            "(LimitNOFILE=44 in a systemd unit; `ulimit -n 44` as root in a shell), or pass --workers 2 or fewer"
            in log.read_text())
    assert "Traceback" not in log.read_text()


def test_a_hard_open_file_limit_no_worker_count_fits_says_so() -> None:
    """Under a hard limit of 32 open files no --workers fits, and the refusal named only the limit to raise, where
    README promises "the LimitNOFILE= or --workers that fits" (a walk under OS limits)."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))\n"
            "from prefetchd.daemon.pool import make_room_for_files\n"
            "try:\n    make_room_for_files(2)\nexcept Exception as exc:\n    print(exc)")
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.strip()
    assert said == ("2 workers need about 38 open files in the daemon, but its limit is 32 (`ulimit -Hn`): raise it "
                    "(LimitNOFILE=38 in a systemd unit; `ulimit -n 38` as root in a shell); fewer workers do not help: "
                    "one needs 35"), said


def test_a_worker_start_that_meets_a_dead_worker_server_not_yet_reaped_tries_again(
        shapes_data: Path, monkeypatch: Any) -> None:
    """A worker server just killed (the OOM killer takes it once no worker is left), its socket closed but its
    process not yet reaped: multiprocessing takes it for alive, and the start fails reading from it
    (EOFError: 'unexpected EOF', or a refused connection).  That was an internal error that stopped the job
    (twice under a full suite's load); it is tried again, with new pipes, until the server is reaped and a
    start starts another, and after SERVER_RESTART_SECONDS the job stops saying so."""
    index = scan_class_folders(shapes_data / "train")
    pool = pool_module.WorkerPool(WorkerJob(index, np.arange(len(index), dtype=np.int64), 32, True, 7), 1)
    real_start = multiprocessing.context.ForkServerProcess.start
    failures = [EOFError("unexpected EOF"), ConnectionRefusedError(111, "Connection refused")]
    pipes: list[Any] = []
    real_pipe = pool._ctx.Pipe

    def pipe(*args: Any) -> Any:
        pipes.append(real_pipe(*args))
        return pipes[-1]

    def start(self: Any) -> None:
        if failures:
            raise failures.pop(0)
        real_start(self)

    monkeypatch.setattr(pool._ctx, "Pipe", pipe)
    monkeypatch.setattr(multiprocessing.context.ForkServerProcess, "start", start)
    try:
        pool.start(lambda: None, 1.0)
        assert len(pool.workers) == 1 and pool.workers[0].process.is_alive()
        assert len(pipes) == 3 and all(p.closed and c.closed for p, c in pipes[:2]), "each try's own pipes, closed"
        failures.extend([ConnectionRefusedError(111, "Connection refused")] * 1000)
        monkeypatch.setattr(pool_module, "SERVER_RESTART_SECONDS", 0.2)
        with pytest.raises(DaemonError, match=r"cannot start a worker: the worker server died and did not start "
                                              r"again within 0\.2 s \(ConnectionRefusedError: "):
            pool.add_worker()
    finally:
        pool.stop()
