"""A slice that hangs on a Ray cluster, or kills the Ray worker building it, is judged as a local worker's task
is (``worker_health``): after --task-timeout without progress its Ray worker is killed and the slice built again
(3 hangs stop the job, naming the file), and a quarter of the way there the status says the stall, so that a
trainer waits on; a file that kills its Ray worker twice is replaced as undecodable; Ray workers that all die
before their first image stop the job, saying so (beside a local worker, the cluster is given up and the job
goes on; and local workers that die so beside a cluster are given up, the cluster building alone); a slice whose Ray worker's start blocks is bounded by
--worker-start-timeout, as a local worker's start is.

Each test runs a remote-only daemon (``--workers 0 --ray local``: a private cluster of its own; one test a
daemon with a local worker beside it, whose cluster is given up when its workers cannot start, and one whose
local worker is given up) in a
loopback-only network namespace (``ray_namespace``), beside a trainer outside it that reads the buffer,
and compares every batch with a local daemon's.  Before, such a slice stayed in flight for good (a hang)
or went round between the bridge and the controller for good (a crash): the trainer timed out.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefetchd.buffer_protocol import ProtocolError, State, WorkerStall, read_status
from prefetchd.daemon.errors import EXIT_FAILURE
from prefetchd.daemon.worker_health import CRASHES_TO_BLAME, MAX_TASK_HANGS, MAX_WORKER_RESTARTS
from prefetchd.launch import launch, start_argv
from prefetchd.trainer import BufferLoader
from prefetchd.trainer.errors import DaemonGone, LoaderTimeout
from tests.conftest import Daemon, started_daemons
from tests.integration.hung_hook import HANG_ONCE
from tests.integration.killing_import_hook import KILL_LOCAL
from tests.integration.ray_namespace import in_namespace, namespace_problem

# A private cluster starts in ~8 s here, and each Ray worker imports torch for the hook (seconds on 2 busy cores).
# Each test takes 25-45 s on the 2 idle cores of the slow host; one took more than 240 s there in CI beside the
# rest of the suite and the Ray scenarios (stop 71), whose cluster no longer runs beside it (tests/conftest.py).
pytestmark = [pytest.mark.ray, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
JOB = ["--batch-size", "8", "--image-size", "32", "--seed", "7", "--high-water", "3", "--low-water", "1",
       "--epochs", "1"]
# The trainer's wait for a batch: past a cluster's start and three hangs (3 s each), or three deaths, each
# followed by a Ray worker's start (seconds: it imports torch for the hook; 90 s were once not enough for
# three beside three other test processes on the 2 cores); before, the hung batch never came and this is what
# the test failed with.
LOADER_TIMEOUT = 150
# The wait for eleven Ray (or local) workers dead in a row at their start, each after importing torch for the hook:
# 5-20 s each beside other test processes on the 2 cores, a few at once (13 deaths took 150 s in a CI run).
START_DEATHS_SECONDS = 360
# A daemon's exit once its trainer has read everything, or once it failed: stopping its Ray bridge alone may take
# BRIDGE_STOP_SECONDS (ray.shutdown of its private cluster) and a second more; in a full run on the 2 cores a
# failed daemon once took more than 30 s to exit where it takes under one alone.
EXIT_SECONDS = 60


class RayDaemon(Daemon):
    """A daemon on a private Ray cluster, in a network namespace with loopback only: remote-only unless
    ``args`` give --workers (a later option wins)."""

    def __init__(self, buffer: Path, args: list[str], log: Path) -> None:
        self.buffer = buffer
        self.log_path = log
        self.proc = launch(in_namespace(start_argv(buffer, extra=["--workers", "0", *args, "--ray", "local"])),
                           log=log)


@pytest.fixture
def start_ray_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    problem = namespace_problem()
    if problem:
        pytest.skip(problem)
    # The hooks' module, for the Ray workers, which the daemon's private cluster starts with its environment.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    yield from started_daemons(RayDaemon, tmp_path, "ray-daemon")


def received(batch: Any) -> tuple[int, int, list[int], int, str]:
    images = np.ascontiguousarray(batch.images.numpy())
    return batch.epoch, batch.step, batch.indices.tolist(), batch.replaced, hashlib.sha256(images.tobytes()).hexdigest()


def read_all(buffer: Path, timeout: float = LOADER_TIMEOUT) -> list[tuple[int, int, list[int], int, str]]:
    loader = BufferLoader(buffer, normalize=False, timeout=timeout)
    try:
        return [received(batch) for batch in loader]
    finally:
        loader.close()


def reference(start_daemon: Callable[..., Daemon], buffer: Path, *args: str | os.PathLike[str]) -> list[Any]:
    """Every batch of the job as a local worker builds it."""
    daemon = start_daemon(buffer, *JOB, "--workers", "1", *args)
    batches = read_all(buffer)
    assert daemon.wait_exit(EXIT_SECONDS) == 0, daemon.log
    return batches


def test_a_slice_that_hangs_on_the_cluster_every_time_stops_the_job_naming_the_file(
        magenta_data: tuple[Path, Path], shm_dir: Path, start_ray_daemon: Any) -> None:
    data, magenta = magenta_data
    buffer = shm_dir / "bf"
    daemon = start_ray_daemon(buffer, *JOB, "--data", data, "--task-timeout", "3",
                              "--transform", "tests.integration.hung_hook:never_returns_on_magenta")
    with pytest.raises(DaemonGone) as gone:
        read_all(buffer)
    assert f"its task hung {MAX_TASK_HANGS} times" in str(gone.value) and str(magenta) in str(gone.value), gone.value
    assert daemon.wait_exit(EXIT_SECONDS) == EXIT_FAILURE, daemon.log
    final = read_status(buffer)
    assert final.state == State.FAILED and final.production is not None, daemon.log
    assert final.production.errors.worker_hangs == MAX_TASK_HANGS, daemon.log
    # The first hang's slice was built whole, so which of its files hung was not known; the slice was then
    # built an item at a time, and each later hang names the file.
    assert final.message.count(str(magenta)) >= MAX_TASK_HANGS - 1, final.message
    kills = [line for line in daemon.log.splitlines() if "a Ray worker made no progress for" in line]
    assert len(kills) == MAX_TASK_HANGS and "that task hung 3 times: the job stops" in kills[-1], daemon.log
    assert all(f"{magenta} (file " in line for line in kills[1:]), kills


def test_a_file_that_kills_its_ray_worker_even_as_a_replacement_is_the_one_replaced_as_undecodable(
        magenta_data: tuple[Path, Path], shm_dir: Path, start_daemon: Any, start_ray_daemon: Any) -> None:
    """A file that kills the Ray worker building it went round between the bridge and the queue for good; now
    its slice is built an item at a time after the first death, and 2 deaths on the file replace it as
    undecodable, the batches as a local worker builds them with that file not an image at all.

    A slice built an item at a time said each item's own sample before it built it, not the replacements it
    tried once that sample failed to decode.  Where the file that kills its Ray worker is such a replacement (the
    split's next sample after an undecodable one), each death was counted on the undecodable sample, which was
    then taken for one that crashes workers, and the slice went round for good, dying on the same replacement:
    the trainer's batch never came.  Now every sample begun is said, a replacement too, as a local worker's
    whereabouts say it, and the file that kills is the one found out."""
    from torchvision.datasets import ImageFolder

    data, magenta = magenta_data
    paths = [Path(p) for p, _label in ImageFolder(str(data)).samples]
    killer = paths.index(magenta)
    bad = paths[killer - 1]  # tried before the killer: its replacement is the split's next sample, the killer
    assert bad.parent == magenta.parent
    # A seed whose first batch holds the undecodable sample and whose last (short) batch the killer: with
    # --high-water 3 that batch is not built while the first waits, so the killer is met as a replacement only.
    seed = next(s for s in range(10_000) if bad_first_killer_last(s, len(paths), paths.index(bad), killer))
    job = [*JOB, "--seed", str(seed)]
    undecodable = shm_dir / "undecodable"  # the reference: both files not images at all
    shutil.copytree(data, undecodable)
    for path in (bad, magenta):
        (undecodable / path.relative_to(data)).write_bytes(b"not a JPEG")
    bad.write_bytes(b"not a JPEG")
    hook = ["--transform", "tests.integration.crash_hook:killed_on_magenta"]
    daemon = start_daemon(shm_dir / "ref", *job, "--workers", "1", *hook, "--data", undecodable)
    expected = read_all(shm_dir / "ref")
    assert daemon.wait_exit(EXIT_SECONDS) == 0, daemon.log
    daemon = start_ray_daemon(shm_dir / "bf", *job, *hook, "--data", data)
    assert read_all(shm_dir / "bf") == expected, daemon.log  # each (epoch, step) once, the same samples and pixels
    assert daemon.wait_exit(EXIT_SECONDS) == 0, daemon.log
    errors = {b.path: b.reason for b in read_status(shm_dir / "bf").production.errors.undecodable}  # type: ignore[union-attr]
    assert errors.get(str(magenta)) == f"crashed its worker {CRASHES_TO_BLAME} times (Ray: WorkerCrashedError)", errors
    assert str(bad) in errors and not errors[str(bad)].startswith("crashed"), errors
    deaths = [line for line in daemon.log.splitlines() if "a Ray worker died (Ray: WorkerCrashedError) on batch" in line]
    assert len(deaths) == CRASHES_TO_BLAME and all(str(magenta) in line for line in deaths), daemon.log
    assert "Unhandled error" not in daemon.log, daemon.log  # Ray's own words of the deaths the daemon said


def bad_first_killer_last(seed: int, samples: int, bad: int, killer: int) -> bool:
    from prefetchd.daemon.sampler import global_order

    order = global_order(np.arange(samples), seed, 0, shuffle=True)
    return bad in order[:8] and order[-1] == killer and samples % 8 == 1


def test_a_slice_that_hangs_once_on_the_cluster_is_said_then_built_again_and_every_batch_arrives_once_the_same(
        magenta_data: tuple[Path, Path], shm_dir: Path, start_daemon: Any, start_ray_daemon: Any,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A slice hung on the cluster stayed in flight for good, and the trainer timed out.  Now the bridge reports it
    a quarter of the way to --task-timeout, and the daemon says it as a local worker's stall (its message and
    worker_stall), so that a trainer whose timeout is shorter waits on (before, with the defaults of 120 s and
    600 s, it raised LoaderTimeout first: here 12 s into its wait, the slice handed back at 24 s); at
    --task-timeout its Ray worker is killed and the slice built again, each batch arriving once, bit-identical
    to a local worker's."""
    data, magenta = magenta_data
    hook = ["--transform", "tests.integration.hung_hook:hangs_once_on_magenta", "--data", data]
    expected = reference(start_daemon, shm_dir / "ref", *hook)  # no marker named: it never hangs
    monkeypatch.setenv(HANG_ONCE, str(shm_dir / "hung-once"))
    buffer = shm_dir / "bf"
    daemon = start_ray_daemon(buffer, *JOB, *hook, "--task-timeout", "24")
    # The cluster's start (seconds) is not what this trainer's timeout is about: it starts once a batch is there.
    daemon.wait_until(lambda: any(buffer.glob("*.batch")), 120, "published no batch")
    loader = BufferLoader(buffer, normalize=False, timeout=12)
    with caplog.at_level(logging.WARNING):
        try:
            got = [received(batch) for batch in loader]
        finally:
            loader.close()
    assert got == expected, daemon.log  # each (epoch, step) once, bit-identical
    assert daemon.wait_exit(EXIT_SECONDS) == 0, daemon.log
    assert (shm_dir / "hung-once").exists(), "it did hang"
    notes = [line for line in daemon.log.splitlines() if "a slice on the Ray cluster has made no progress for" in line]
    assert len(notes) == 1 and " on batch " in notes[0] and "at 24 s (--task-timeout) it is cancelled" in notes[0], \
        daemon.log
    said = [r.getMessage() for r in caplog.records if "says that a worker building its batches is stalled" in r.getMessage()]
    # (On a loaded box a Ray worker's start may be said first, as a slice that has not begun.)
    assert any("a slice on the Ray cluster has made no progress" in s for s in said), said
    kill = [line for line in daemon.log.splitlines() if "a Ray worker made no progress for" in line]
    assert len(kill) == 1 and "(--task-timeout 24) on batch" in kill[0] and str(magenta) in kill[0], daemon.log
    assert "cancelled its slice, killing the worker; its task is queued again (hang 1 of 3" in kill[0], kill[0]
    final = read_status(buffer)
    assert final.production is not None and final.production.errors.worker_hangs == 1, daemon.log


@pytest.mark.timeout(START_DEATHS_SECONDS + 2 * EXIT_SECONDS)
def test_ray_workers_that_die_before_their_first_image_stop_the_job_saying_where_to_look(
        magenta_data: tuple[Path, Path], shm_dir: Path, start_ray_daemon: Any) -> None:
    """A Ray worker that died before its first image (here the hook's module kills it when imported) blamed no
    file, so its slice went round for good: 3 attempts at the bridge, back to the daemon's queue, to the bridge
    again, and with --workers 0 the trainer timed out.  Now such deaths are counted as the
    restart limit counts a local worker's: more than 10 in a row, with no slice built on the cluster in between,
    stop the job with what to look at."""
    data, _magenta = magenta_data
    buffer = shm_dir / "bf"
    hook = "tests.integration.killing_import_hook"
    daemon = start_ray_daemon(buffer, *JOB, "--data", data, "--transform", f"{hook}:identity")
    with pytest.raises(DaemonGone) as gone:
        read_all(buffer, START_DEATHS_SECONDS)
    assert "the Ray cluster's workers die before their first image" in str(gone.value), gone.value
    assert f"`python -c 'import {hook}'`" in str(gone.value) and "Ray worker logs" in str(gone.value), gone.value
    assert daemon.wait_exit(EXIT_SECONDS) == EXIT_FAILURE, daemon.log
    final = read_status(buffer)
    assert final.state == State.FAILED and "die before their first image" in final.message, daemon.log
    deaths = [line for line in daemon.log.splitlines() if "a Ray worker died (Ray: " in line]
    assert len(deaths) == MAX_WORKER_RESTARTS, daemon.log  # each said; the next one stops the job
    assert any("before the first image of its slice of batch " in line for line in deaths), deaths


@pytest.mark.timeout(START_DEATHS_SECONDS + LOADER_TIMEOUT + 2 * EXIT_SECONDS)
def test_ray_workers_that_die_before_their_first_image_beside_a_local_worker_give_the_cluster_up_and_the_job_goes_on(
        magenta_data: tuple[Path, Path], shm_dir: Path, start_daemon: Any, start_ray_daemon: Any) -> None:
    """Beside local workers, Ray workers that all die before their first image (a hook's module missing or broken on
    the nodes only) stopped the job as with --workers 0, though the local workers could build every batch.  Now the
    cluster is given up for the job: the local worker builds alone, every batch arriving once and as a local
    daemon's, and the status says why."""
    data, _magenta = magenta_data
    hook = ["--data", data, "--transform", "tests.integration.killing_import_hook:identity"]
    expected = reference(start_daemon, shm_dir / "ref", *hook)  # the hook's module harms no local worker
    buffer = shm_dir / "bf"
    daemon = start_ray_daemon(buffer, *JOB, *hook, "--workers", "1")
    # The local worker fills the buffer (--high-water 3) while the cluster's workers die, at its probe or slices.
    daemon.wait_until(lambda: "given up" in _remote_message(buffer), START_DEATHS_SECONDS, "gave up no cluster")
    message = _remote_message(buffer)
    assert message.startswith("given up for this job, 1 local worker builds alone: the Ray cluster's workers die "
                              f"before their first image: {MAX_WORKER_RESTARTS + 1} in a row"), message
    assert read_all(buffer) == expected, daemon.log  # each (epoch, step) once, the same samples and pixels
    assert daemon.wait_exit(EXIT_SECONDS) == 0, daemon.log
    final = read_status(buffer)
    assert final.remote is not None and not final.remote.connected, daemon.log
    assert final.remote.message == message, final.remote.message
    given_up = [line for line in daemon.log.splitlines() if "is given up for this job, " in line]
    assert len(given_up) == 1 and "1 local worker builds alone" in given_up[0], daemon.log
    assert "connecting to the Ray cluster" not in daemon.log.split(given_up[0])[1], "connected again"


@pytest.mark.timeout(START_DEATHS_SECONDS + LOADER_TIMEOUT + 2 * EXIT_SECONDS)
def test_local_workers_that_die_again_and_again_beside_a_cluster_are_given_up_and_the_cluster_builds_alone(
        magenta_data: tuple[Path, Path], shm_dir: Path, start_daemon: Any, start_ray_daemon: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The mirror of the test above: local workers that die as they start, more than the restart limit's 10 in a row
    (a hook's module broken on the daemon's box only), stopped the job though a Ray cluster beside them could build
    every batch.  Now the local workers are given up for the job: the cluster builds
    alone, every batch arriving once and as a local daemon's, and the status says why."""
    data, _magenta = magenta_data
    hook = ["--data", data, "--transform", "tests.integration.killing_import_hook:identity"]
    expected = reference(start_daemon, shm_dir / "ref", *hook)  # unset, the module harms no local worker
    monkeypatch.setenv(KILL_LOCAL, "1")  # now it kills every local worker, and no Ray worker
    buffer = shm_dir / "bf"
    daemon = start_ray_daemon(buffer, *JOB, *hook, "--workers", "1")
    # Before the trainer reads: the job's last batch is still to build (--high-water 3 of its 4), so it goes on after.
    daemon.wait_until(lambda: "the local workers are given up for this job" in _status_message(buffer),
                      START_DEATHS_SECONDS, "gave up no local workers")
    message = _status_message(buffer)
    # In a row, not within 60 s: each death follows the worker's import of torch, seconds on a slow machine.
    assert f"({MAX_WORKER_RESTARTS + 1} workers in a row died before they were ready" in message, message
    assert message.endswith(": the Ray cluster builds alone") or " and the Ray cluster is " in message, message
    assert read_all(buffer) == expected, daemon.log  # each (epoch, step) once, the same samples and pixels
    assert daemon.wait_exit(EXIT_SECONDS) == 0, daemon.log
    given_up = [line for line in daemon.log.splitlines() if "the local workers are given up for this job" in line]
    assert len(given_up) == 1, daemon.log
    final = read_status(buffer)
    assert final.production is not None and final.production.errors.worker_restarts == MAX_WORKER_RESTARTS + 1
    samples = sum(len(indices) for _epoch, _step, indices, _replaced, _digest in expected)
    assert final.production.remote is not None and final.production.remote.images == samples, daemon.log  # them all
    assert final.production.workers == 0, final.production


def _status_message(buffer: Path) -> str:
    status = read_status(buffer)  # None: not written yet
    return status.message if status is not None else ""


def _remote_message(buffer: Path) -> str:
    status = read_status(buffer)  # None: not written yet
    return status.remote.message if status is not None and status.remote is not None else ""


START_TIMEOUT = 5  # a Ray worker's start that blocks is cut after this; a quarter of it (1.25 s) it is said


def test_ray_workers_whose_start_blocks_are_said_as_a_stall_then_cut_and_their_node_taken_for_unfit(
        magenta_data: tuple[Path, Path], shm_dir: Path, start_ray_daemon: Any, caplog: pytest.LogCaptureFixture
        ) -> None:
    """A slice was timed only once it had begun on the cluster, and a node's probe not at all: where a Ray worker's
    start blocked (here the hook's module never finishes importing in a Ray worker, as one on a node's hung mount
    would), the slices held their batches for good, the node stayed fit, the status said nothing, and the trainer
    ended with LoaderTimeout.  Now both are bounded by --worker-start-timeout, as a local worker's start is: a slice
    not begun is said as a starting worker's stall a quarter of the way there (a trainer waits on past its own
    timeout), then cancelled, its Ray worker killed, and submitted again; the node whose probe did not answer is
    unfit, so no slice goes there, and with --workers 0 the status says why production waits, which is what the
    trainer's timeout quotes.  (3 starts of one slice in a row, where the probe answers, stop the job:
    test_remote_slice.)"""
    data, _magenta = magenta_data
    buffer = shm_dir / "bf"
    hook = "tests.integration.blocking_ray_import_hook"
    daemon = start_ray_daemon(buffer, *JOB, "--data", data, "--worker-start-timeout", str(START_TIMEOUT),
                              "--transform", f"{hook}:identity")
    stalls: list[WorkerStall] = []

    def stalled() -> bool:
        try:
            status = read_status(buffer)
        except (ProtocolError, OSError):  # being replaced
            return False
        production = status.production if status is not None else None
        if production is not None and production.worker_stall is not None:
            stalls.append(production.worker_stall)
        return bool(stalls)

    daemon.wait_until(stalled, 120, "the status to say that a slice on the cluster has not begun")
    stall = stalls[0]
    assert stall.starting and stall.timeout == START_TIMEOUT, stall
    assert stall.reason.startswith("a slice on the Ray cluster has not begun in ") and " of batch " in stall.reason
    assert f"at {START_TIMEOUT} s (--worker-start-timeout) it is cancelled, its Ray worker killed" in stall.reason
    loader = BufferLoader(buffer, normalize=False, timeout=8)
    with caplog.at_level(logging.WARNING), pytest.raises(LoaderTimeout) as gone:
        try:
            for _batch in loader:
                pass
        finally:
            loader.close()
    unfit = f"did not answer its probe in {START_TIMEOUT} s (--worker-start-timeout): a Ray worker's start there"
    assert "remote only (--workers 0) and no node of the Ray cluster gets slices: node " in str(gone.value), gone.value
    assert unfit in str(gone.value), gone.value
    waited = [r.getMessage() for r in caplog.records if "says that a worker building its batches is stalled" in
              r.getMessage()]
    assert waited and "--worker-start-timeout" in waited[0], waited
    status = read_status(buffer)
    assert status.state != State.FAILED and status.remote is not None, daemon.log  # it waits for a node to mend
    assert [node for node in status.remote.unfit_nodes if unfit in node], status.remote
    assert status.production is not None and status.production.errors.worker_hangs >= 1, daemon.log
    cut = [line for line in daemon.log.splitlines() if "did not begin in" in line]
    assert cut and f"(--worker-start-timeout {START_TIMEOUT}): cancelled it, killing its Ray worker; submitted it " \
        f"again (start hang 1 of {MAX_TASK_HANGS} in a row" in cut[0], daemon.log
    assert f"did not answer its probe in {START_TIMEOUT} s" in daemon.log and "it gets no slices" in daemon.log
