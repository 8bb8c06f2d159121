"""A local worker that dies on one image (a decoder that segfaults on it): the file kills the worker that retries
its task too, and is then taken for an undecodable one: replaced, counted and named as a file whose decode fails
is, in the same batch, so the run goes on to its end.  Not a worker the OOM killer kills: memory, not the file."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from prefetchd.buffer_protocol import list_batches, read_status
from prefetchd.buffer_protocol.status import BadFile
from prefetchd.daemon.dataset import scan_class_folders
from prefetchd.daemon.worker_health import CRASHES_TO_BLAME, MAX_WORKER_RESTARTS
from prefetchd.daemon.workers import OOM_SCORE_VOLUNTEER
from prefetchd.launch import launch, start_argv, stop_daemon_process
from prefetchd.trainer import BufferLoader
from tests.cgroups import cgroup_v1, in_cgroup
from tests.daemon_workers import worker_server
from tests.waiting import wait_for

BASE = ["--batch-size", "8", "--image-size", "32", "--seed", "7", "--high-water", "3", "--low-water", "1",
        "--workers", "2", "--transform", "tests.integration.crash_hook:segfaults_on_magenta"]
JOB = [*BASE, "--epochs", "2"]


def received(batch: Any) -> tuple[int, int, list[int], int, str]:
    images = np.ascontiguousarray(batch.images.numpy())
    return batch.epoch, batch.step, batch.indices.tolist(), batch.replaced, hashlib.sha256(images.tobytes()).hexdigest()


def read_all(buffer: Path) -> list[tuple[int, int, list[int], int, str]]:
    loader = BufferLoader(buffer, normalize=False, timeout=60)  # the code before: DaemonGone, workers kept dying
    try:
        return [received(batch) for _epoch in range(2) for batch in loader]
    finally:
        loader.close()


def test_a_file_that_segfaults_its_worker_is_replaced_as_one_that_cannot_be_decoded(
        magenta_data: tuple[Path, Path], shm_dir: Path, start_daemon: Any) -> None:
    data, magenta = magenta_data
    # The reference: the same dataset with that file not an image at all, found bad by its decode.
    undecodable = shm_dir / "undecodable"
    shutil.copytree(data, undecodable)
    (undecodable / magenta.relative_to(data)).write_bytes(b"not a JPEG")
    ref = start_daemon(shm_dir / "ref", *JOB, "--data", undecodable)
    reference = read_all(shm_dir / "ref")
    assert ref.wait_exit(30) == 0, ref.log

    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, *JOB, "--data", data)
    got = read_all(buffer)
    assert got == reference, daemon.log  # each (epoch, step) once, in order, the same samples and pixels
    index = scan_class_folders(data)
    (sample,) = [i for i in range(len(index)) if index.path(i) == magenta]
    with_it = [b for b in got if b[3]]
    assert len(with_it) == 2 and all(sample not in b[2] and b[3] == 1 for b in with_it), "replaced, once an epoch"
    assert daemon.wait_exit(30) == 0, daemon.log

    final = read_status(buffer)
    assert final.production is not None, daemon.log
    errors = final.production.errors
    reason = f"crashed its worker {CRASHES_TO_BLAME} times (signal SIGSEGV)"
    assert errors.undecodable == (BadFile(path=str(magenta), reason=reason),), errors.undecodable
    assert errors.undecodable_files == 1 and errors.replaced_samples == 2, errors
    assert errors.worker_restarts >= CRASHES_TO_BLAME, errors
    # Each death said with the file it was on, and the file once, as a bad file is.
    assert daemon.log.count("died (signal SIGSEGV) on batch") >= CRASHES_TO_BLAME, daemon.log
    assert daemon.log.count(f"{magenta} {reason}; replacing it with the next sample of the split") == 1, daemon.log


def test_files_that_crash_workers_count_as_bad_files_not_towards_the_restart_limit(
        magenta_data: tuple[Path, Path], shm_dir: Path, start_daemon: Any) -> None:
    """Six such files cost at least 12 worker deaths within seconds, more than the restart limit allows
    (MAX_WORKER_RESTARTS in RESTART_WINDOW_SECONDS), which is for workers that die for their own reasons:
    the bad-sample limits judge bad files, and --max-bad-samples 6 lets the job end."""
    data, magenta = magenta_data
    for n, folder in enumerate(sorted(p for p in data.iterdir()) * 2):
        if n:
            shutil.copy(magenta, folder / f"zz_magenta{n}.jpg")
    crashing = sorted(data.glob("*/zz_magenta*.jpg"))
    assert len(crashing) == 6
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, *BASE, "--epochs", "1", "--data", data, "--max-bad-samples", "6")
    # Each death costs a worker start that imports torch for the hook (~3 s of a loaded core): the first batch
    # came after ~70 s once under a full suite's load, past a 60 s timeout, which is not what this test is about.
    loader = BufferLoader(buffer, normalize=False, timeout=240)
    try:
        got = [received(batch) for batch in loader]
    finally:
        loader.close()
    assert [b[:2] for b in got] == [(0, step) for step in range(4)] and sum(b[3] for b in got) == 6, daemon.log
    assert daemon.wait_exit(30) == 0, daemon.log
    errors = read_status(buffer).production.errors  # type: ignore[union-attr]
    assert sorted(Path(bad.path) for bad in errors.undecodable) == crashing, errors.undecodable
    assert errors.worker_restarts >= 2 * len(crashing) > MAX_WORKER_RESTARTS, errors


def test_workers_the_oom_killer_kills_blame_no_file_and_stop_the_job_saying_so(
        shapes_data: Path, shm_dir: Path, tmp_path: Path) -> None:
    """40 batches of 9.2 MiB fit a 400 MiB cgroup's limit (the start refuses more), its processes not.  Before,
    the OOM killer took the controller, the largest process, and the daemon died without a word; or it took
    workers, whose deaths fell on the same images again (the task writing the same pages each time), and healthy
    files were replaced as ones that kill their worker (29 within 15 s in a 600 MiB cgroup, the workers
    volunteering).  Now the workers are the
    OOM killer's first choice, their deaths blame no file, and the restart limit stops the job saying why."""
    buffer, log = shm_dir / "bf", tmp_path / "daemon.log"
    argv = start_argv(buffer, extra=["--data", str(shapes_data / "train"), "--batch-size", "64", "--image-size", "224",
                                     "--workers", "2", "--high-water", "40", "--drop-last"])  # full batches
    with cgroup_v1("memory", {"memory.limit_in_bytes": str(400 << 20)}) as group:
        proc = launch(in_cgroup(group, argv), log=log)
        try:
            code = proc.wait(120)
        finally:
            stop_daemon_process(proc, 15)
            shutil.rmtree(buffer, ignore_errors=True)  # its tmpfs pages are charged to the cgroup
    text = log.read_text()
    assert code == 1, text  # the controller lived to say it (a SIGKILL is -9)
    assert re.search(rf"ERROR   prefetchd: {MAX_WORKER_RESTARTS + 1} workers died within 60 s, \d+ of them killed by "
                     r"the kernel's out-of-memory killer \(the daemon's memory cgroup is limited to 400\.0 MiB\): lower "
                     r"--workers or --high-water, or give the daemon more memory", text), text[-3000:]
    assert "died (signal SIGKILL, from the kernel's out-of-memory killer) on batch" in text
    assert "(not that file's fault)" in text
    assert "crashed its worker" not in text and "replacing it" not in text, text[-3000:]


def oom_score_adj(proc: psutil.Process) -> int:
    return int(Path(f"/proc/{proc.pid}/oom_score_adj").read_text())


def test_the_worker_server_volunteers_for_the_oom_killer_and_its_workers_from_birth_even_after_its_death(
        shapes_data: Path, shm_dir: Path, start_daemon: Any) -> None:
    """Before, a worker was the controller's equal for the OOM killer until its own code began, and the worker
    server always: a memory cgroup that ran out as both workers had just been replaced killed the controller (the
    OOM test above failed so once under a full suite's load).  Now the server volunteers and its workers inherit
    that, and volunteer once more.  A killed server ends its workers' reports at once: they are said so, a new
    server volunteers too, and the job ends with every batch once."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", "--batch-size", "8", "--image-size", "32",
                          "--workers", "2", "--high-water", "3", "--epochs", "2", "--seed", "7")
    daemon.wait_until(lambda: len(list_batches(buffer)) == 3, 60, "the buffer to fill")
    controller = psutil.Process(daemon.proc.pid)
    base = oom_score_adj(psutil.Process())  # the daemon inherits the test's
    server = worker_server(controller.pid)
    scores = (oom_score_adj(controller), oom_score_adj(server), sorted(oom_score_adj(w) for w in server.children()))
    volunteer, twice = min(1000, base + OOM_SCORE_VOLUNTEER), min(1000, base + 2 * OOM_SCORE_VOLUNTEER)
    assert scores == (base, volunteer, [twice, twice]), scores

    server.kill()
    daemon.wait_until(lambda: "its worker server" in daemon.log, 30, "the workers' ends to be said")
    got = [b[:2] for b in read_all(buffer)]
    assert got == [(epoch, step) for epoch in range(2) for step in range(9)], daemon.log
    assert daemon.wait_exit(30) == 0, daemon.log
    said = re.findall(r"worker pid \d+ died \(its worker server, pid (\d+), ended\)[^;\n]*; requeuing", daemon.log)
    assert said == [str(server.pid)] * 2, daemon.log


def test_a_daemon_started_with_a_high_oom_score_says_its_workers_cannot_come_before_it(
        shapes_data: Path, shm_dir: Path, tmp_path: Path, start_daemon: Any) -> None:
    """Started from a process that volunteered already (as the test processes did, inheriting 1000 from an
    in-process worker_main), its workers can volunteer no higher than the controller: said at start."""
    buffer, log = shm_dir / "bf", tmp_path / "high.log"
    argv = start_argv(buffer, extra=["--data", str(shapes_data / "train"), "--batch-size", "8", "--image-size", "32",
                                     "--workers", "1", "--high-water", "2"])
    proc = launch(["sh", "-c", 'echo 600 > /proc/self/oom_score_adj && exec "$@"', "sh", *argv], log=log)
    try:
        wait_for(lambda: "producing train split" in log.read_text(), 60, "the job to start", proc)
    finally:
        stop_daemon_process(proc, 15)
    assert ("this daemon's oom_score_adj is 600 (inherited from the process that started it): its workers, which "
            "volunteer for the kernel's out-of-memory killer (+500 each), cannot come before it") in log.read_text()
    quiet = start_daemon(shm_dir / "quiet", "--data", shapes_data / "train", "--batch-size", "8", "--image-size", "32",
                         "--workers", "1", "--high-water", "2")  # from this process's score, 0
    quiet.wait_until(lambda: "producing train split" in quiet.log, 60, "the job to start")
    assert "oom_score_adj" not in quiet.log, quiet.log
