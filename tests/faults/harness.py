"""Fault injection on real processes: a daemon and a trainer (``driver.py``) run a
multi-epoch job while a seeded schedule breaks things; the batches the trainer
received are then compared with a fault-free run of the same job.

The promise checked: whatever fails, the trainer gets every batch exactly
once, bit-identical to the fault-free run, or a clear error -- never a silent
gap, a duplicate, a hang or a crash loop.

Run the long version and print its table::

    PYTHONPATH=$PWD python -m tests.faults.harness --faults 260 --seed 1

The batches the trainer received are judged against the fault-free run by
``accounting.py`` (every position exactly once, in order, bit-identical).

Fault kinds (``KINDS``).  A fault is *detected* when the system said so in a structured
way -- a status.json field or counter (read with ``read_status``), an exit code
(``prefetchd.daemon.errors``), the lock's owner, or a typed event the trainer logged
-- never because some text appeared in a log:

=================== ===================================================== =================================
kind                what is done                                          detected when
=================== ===================================================== =================================
daemon_kill         SIGKILL the daemon (half the time while a ``.tmp``     the restarted daemon owns the
                    batch is being written), start another                buffer (the lock names its pid)
trainer_kill        SIGKILL the trainer; once the daemon's status says    status ``trainer``: the killed
                    it is gone (or 5 s), resume it from its checkpoint    pid with ``alive`` false
trainer_stop        SIGSTOP the trainer until the daemon reports the      status ``state`` was ``full``
                    buffer ``full``, a while longer, then SIGCONT         while the trainer was stopped,
                                                                          never past ``high_water``
enospc              fill the buffer's small tmpfs (root only) to less     ``errors.write_failures`` or
                    than a batch free, topped up as batches are consumed, ``errors.low_space_pauses`` rose,
                    until a write fails or production pauses; free it     or ``totals.batches`` while full
                                                                          (built in spares)
batch_corrupt       flip a byte of the header or metadata of a waiting    the trainer logged a
                    batch (not yet opened by the trainer)                 ``protocol_error`` event for it
batch_truncate      truncate a waiting batch (not yet opened)             as for batch_corrupt
batch_delete        delete a waiting batch                                ``errors.vanished_batches`` rose
progress_garbage    overwrite progress.json with garbage bytes, JSON of   ``errors.progress_rejected`` rose
                    another format, or a truncated document
progress_rewind     rewrite progress.json with an older position         ``errors.progress_rewinds`` rose
second_daemon       start a second daemon on the buffer                   it exited ``EXIT_BUFFER_BUSY`` and
                                                                          the first still owned the buffer
                                                                          after that refusal
dataset_delete      move a dataset file away until a batch that needed    a delivered batch's header counts
                    it was built, then put it back                        it ``replaced``, or
                                                                          ``errors.undecodable_files`` rose
daemon_stuck        SIGSTOP the daemon until the trainer raises           the trainer logged a
                    ``DaemonStuck`` (``--daemon-timeout`` 10 s), then     ``daemon_stuck`` event naming the
                    SIGCONT it                                            stopped pid
progress_planted    replace progress.json by a FIFO or a symlink to a     ``errors.progress_rejected`` rose
                    valid document (trainer stopped meanwhile)
batch_planted       replace a waiting batch by a FIFO or a symlink to a   a ``protocol_error`` event for it,
                    copy of it                                            or ``errors.vanished_batches`` rose
consumer_kill       a second, named consumer (``extra``, a driver run     status ``streams[].consumers[]``:
                    for 8-16 positions from where the trainer is)         ``extra`` with the killed pid and
                    SIGKILLed at a seeded point; once the status says     ``alive`` false; its batches are
                    it is gone (or 10 s) and a seeded delay passed, it    then checked as the trainer's
                    resumes from its checkpoint                           (exactly once, identical)
worker_kill         SIGKILL one of the daemon's workers (half the time     ``errors.worker_restarts`` rose
                    while a batch is being built)
worker_stop         SIGSTOP one of the daemon's workers (half the time     ``errors.worker_hangs`` rose: the
                    while a batch is being built) and leave it stopped:   daemon killed it after its
                    a hang (daemons run with ``--task-timeout``           ``--task-timeout`` and built its
                    ``Settings.task_timeout`` when the kind is planned)   tasks on a new worker
remote_node_lost    (``RAY_KINDS``, asked for by name) SIGKILL the Ray    the status names the node that
                    node that builds the daemon's remote slices (the      joined as one that built slices
                    head has no CPUs), then add another                   (``remote.nodes``)
bad_start           start daemons on: a missing dataset, a symlinked      each exited with its code
                    buffer, another user's buffer (root), an unwritable   (``EXIT_FAILURE``, ``EXIT_USAGE``),
                    buffer (a read-only tmpfs as root, mode 0500 else),   no traceback, last line names the
                    a copy of the job's manifest and batches (another     path; the other job's buffer is
                    seed)                                                 left as it was
=================== ===================================================== =================================

Any process exit that no fault caused fails the run (``Report.ok``), with the
process, its exit status and the tail of its log: a trainer or daemon that
exited on its own (``supervise`` restarts it so that the rest of the run still
shows), a spare trainer that died before use, a refused daemon that exited
with another code than the refusal's, a daemon that did not exit 0 at the end.
So does a ``daemon_stuck`` event no ``daemon_stuck`` fault explains.
``trainer_crash`` (``SELF_TEST_KINDS``) SIGTERMs the trainer behind the
harness's back; ``test_faults.py`` checks that such a run is reported failed.

Limits (see docs/RELIABILITY.md): payload bytes carry no checksum, so
``batch_corrupt`` only touches what the protocol checks (header and metadata);
a batch the trainer already mapped is never truncated (that is a SIGBUS by
design of mmap); ``enospc`` needs root for its small tmpfs (without root it is
listed in ``Report.unavailable`` and the test is skipped with that reason after
its checks pass); a deleted dataset
file is put back before the next fault (a daemon restarted while it is gone
sees another dataset fingerprint and refuses the buffer, by design).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

from prefetchd.buffer_protocol import Manifest, ProtocolError, State, Status, daemon_pid, list_batches, read_status
from prefetchd.buffer_protocol.batch import HEADER, parse_batch
from prefetchd.buffer_protocol.layout import MANIFEST_NAME
from prefetchd.daemon.errors import EXIT_BUFFER_BUSY, EXIT_FAILURE, EXIT_USAGE
from tests.faults.accounting import LogReader, account, read_log
from tests.daemon_workers import daemon_workers, worker_server

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).resolve().with_name("driver.py")

KINDS = (
    "daemon_kill", "trainer_kill", "trainer_stop", "enospc", "batch_corrupt", "batch_truncate",
    "batch_delete", "progress_garbage", "progress_rewind", "second_daemon", "dataset_delete",
    "daemon_stuck", "progress_planted", "batch_planted", "bad_start", "consumer_kill", "worker_kill", "worker_stop",
    "worker_server_kill",
)
# Faults that need a Ray cluster, which the harness then starts (2 nodes: a head without CPUs and one
# 1-CPU node) and the daemons build on with --ray beside their local worker.  Asked for by name only:
# Ray is an optional extra and its traffic must stay on loopback, so run the harness in a network
# namespace with only lo: unshare -n sh -c 'ip link set lo up && python -m tests.faults.harness --kinds ...'.
RAY_KINDS = ("remote_node_lost",)
# Not faults of the system: they break the run on purpose, so that a test sees the harness fail it.
SELF_TEST_KINDS = ("trainer_crash",)
TITLES = {
    "daemon_kill": "daemon SIGKILL + restart",
    "trainer_kill": "trainer SIGKILL + resume",
    "trainer_stop": "trainer SIGSTOP past full",
    "enospc": "tmpfs full (ENOSPC)",
    "batch_corrupt": "waiting batch corrupted",
    "batch_truncate": "waiting batch truncated",
    "batch_delete": "waiting batch deleted",
    "progress_garbage": "progress garbage/truncated",
    "progress_rewind": "progress rewound",
    "second_daemon": "second daemon started",
    "dataset_delete": "dataset file deleted",
    "daemon_stuck": "daemon stuck (SIGSTOP)",
    "progress_planted": "progress FIFO/symlink",
    "batch_planted": "batch FIFO/symlink",
    "bad_start": "bad dataset/buffer starts",
    "consumer_kill": "2nd consumer SIGKILL+resume",
    "worker_kill": "worker SIGKILL",
    "worker_stop": "worker SIGSTOP (a hang)",
    "worker_server_kill": "worker server SIGKILL",
    "remote_node_lost": "Ray node SIGKILL + new node",
    "trainer_crash": "trainer SIGTERM (self-test)",
}
# The counters a daemon keeps in status.json (read through read_status) that the checks compare.
COUNTERS = ("write_failures", "low_space_pauses", "vanished_batches", "progress_rejected", "progress_rewinds",
            "undecodable_files", "worker_restarts", "worker_hangs")
STATUS_POLL = 0.05  # seconds between looks at status.json; the daemon rewrites it about once a second
LOG_TAIL = 12  # lines of a process's log quoted when it exits unexpectedly
RECOVERY_TIMEOUT = 90.0  # no batch for this long after a fault is a hang
# Positions the trainer reads while a fault of a kind is handled, where it goes on meanwhile (measured with
# seed 3: consumer_kill ~170, bad_start ~80, batch_delete and batch_planted ~50); 25 for the others.
POSITIONS_PER_FAULT = {"consumer_kill": 250, "bad_start": 120, "batch_delete": 75, "batch_planted": 75}
EXTRA_CONSUMER = "extra"  # the second consumer's name (consumer_kill)
PAGE = 4096
BUILDING_GLOB = "e*.tmp"  # a batch being built (layout.temp_name); spares and document copies are *.tmp too


@dataclass
class Settings:
    workdir: Path
    faults: int = 25
    seed: int = 1
    kinds: tuple[str, ...] = KINDS
    batch_size: int = 4
    image_size: int = 32
    high_water: int = 6
    low_water: int = 2
    workers: int = 1
    step_seconds: float = 0.02
    gap: tuple[int, int] = (2, 10)  # batches the trainer receives between faults
    # The trainer's stall_timeout: short, so that daemon_stuck is quick, long enough that a daemon on a
    # loaded machine (the status is rewritten about once a second) never looks stuck when it is not.
    stall_timeout: float = 10.0
    # The daemons' --task-timeout where worker_stop is planned (else their default, 600 s): short, so that a
    # stopped worker is killed soon; far above the milliseconds a task of 4 small images takes, even on a loaded box.
    task_timeout: float = 5.0
    python: str = sys.executable


# The details (``Fault.detail``) of the only faults nobody has to notice: a metadata bit flip after which the batch
# reads the same to a reader (a producer id, say, which no reader checks), and a dataset file that no batch needed
# while it was gone.  Any other fault that went unnoticed fails the suite (``Report.missed``).
UNCHECKED_BYTE = "nothing a reader checks"
NOT_READ_WHILE_GONE = "not read while gone"
UNNOTICEABLE = {"batch_corrupt": UNCHECKED_BYTE, "dataset_delete": NOT_READ_WHILE_GONE}


def reads_the_same(before: bytes, after: bytes) -> bool:
    """Whether batch file ``after``, ``before`` with a metadata bit flipped, reads the same to a reader: it parses,
    to the same position, seed, job, rank and tensors (only the producer id or the count of replaced samples, which
    no reader checks, may differ).  Otherwise the flip is one for the reader to notice."""
    try:
        read = parse_batch(after)
    except ProtocolError:
        return False
    was = parse_batch(before)
    return dataclasses.replace(read, producer=was.producer, replaced=was.replaced) == was


@dataclass
class Fault:
    kind: str
    index: int
    t_inject: float
    t_ref: float = 0.0  # recovery is measured from here: the injection, or the end of a hold
    detail: str = ""
    check: Callable[[Fault, Harness], bool] | None = None
    detected: bool = False
    recovery: float | None = None
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def end(self) -> float:
        """When the next fault was injected (``t_end``): what this fault's checks may count up to."""
        return float(self.data.get("t_end", float("inf")))

    @property
    def missed(self) -> bool:
        """Nobody noticed it, though it was one to notice (``UNNOTICEABLE``)."""
        unnoticeable = UNNOTICEABLE.get(self.kind)
        return not self.detected and not (unnoticeable is not None and self.detail.endswith(unnoticeable))


def counter_rose(counter: str, base: StatusSample | None) -> Callable[[Fault, Harness], bool]:
    """A fault's check: the baseline's daemon counted more ``counter`` before the fault's end."""
    return lambda f, h: h.counter_rose(counter, base, f.end)


@dataclass
class Report:
    settings: dict[str, Any]
    faults: list[Fault]
    positions: int
    committed: int
    lost: int
    duplicated: int
    different: int
    out_of_order: int
    replayed: int
    replaced_by_policy: int
    protocol_errors: int
    trainer_crashes: list[str]
    daemon_exits: list[str]
    hangs: int
    unrecovered: int
    problems: list[str]
    seconds: float
    reference_seconds: float
    skipped: int = 0  # scheduled faults that found nothing to damage (no waiting batch)
    unavailable: dict[str, str] = field(default_factory=dict)  # kinds (or variants) not injected here, and why

    @property
    def missed(self) -> list[str]:
        """The faults nobody noticed that were to be noticed, with their details."""
        return [f"{f.kind} ({f.detail})" for f in self.faults if f.missed]

    @property
    def ok(self) -> bool:
        """Every batch once and identical, no hang, and no process exited that no fault made exit."""
        return not (self.lost or self.duplicated or self.different or self.out_of_order or self.hangs
                    or self.unrecovered or self.problems or self.trainer_crashes or self.daemon_exits)

    def table(self) -> str:
        by_kind: dict[str, list[Fault]] = {}
        for f in self.faults:
            by_kind.setdefault(f.kind, []).append(f)
        lines = [f"{'fault':<28} {'injected':>8} {'detected':>8} {'recovery p50 / max (s)':>24}"]
        for kind in (*KINDS, *RAY_KINDS, *SELF_TEST_KINDS):
            faults = by_kind.get(kind, [])
            if not faults:
                continue
            rec = [f.recovery for f in faults if f.recovery is not None]
            timing = f"{statistics.median(rec):.2f} / {max(rec):.2f}" if rec else "-"
            lines.append(f"{TITLES[kind]:<28} {len(faults):>8} {sum(f.detected for f in faults):>8} {timing:>24}")
        rec = [f.recovery for f in self.faults if f.recovery is not None]
        timing = f"{statistics.median(rec):.2f} / {max(rec):.2f}" if rec else "-"
        lines.append(f"{'total':<28} {len(self.faults):>8} {sum(f.detected for f in self.faults):>8} {timing:>24}")
        lines.append(
            f"batches: {self.positions} expected, {self.committed} committed; lost {self.lost}, duplicated "
            f"{self.duplicated}, different {self.different}, out of order {self.out_of_order}; "
            f"{self.replayed} replayed after a trainer kill (all compared); {self.replaced_by_policy} with a "
            f"sample replaced by the bad-sample policy; {self.protocol_errors} ProtocolErrors"
        )
        lines.append(
            f"unexpected: trainer exits {len(self.trainer_crashes)}, daemon exits {len(self.daemon_exits)}, "
            f"hangs {self.hangs}, faults without recovery {self.unrecovered}, skipped (nothing to damage) {self.skipped}; "
            f"faulted run {self.seconds:.0f} s; the reference trainer ran alongside for {self.reference_seconds:.0f} s"
        )
        for what, why in sorted(self.unavailable.items()):
            lines.append(f"not injected: {what}: {why}")
        for p in self.problems[:20]:
            lines.append(f"PROBLEM: {p}")
        for c in self.trainer_crashes[:5]:
            lines.append(f"UNEXPECTED trainer exit: {c}")
        for c in self.daemon_exits[:5]:
            lines.append(f"UNEXPECTED daemon exit: {c}")
        for m in self.missed:
            lines.append(f"MISSED (nobody noticed it): {m}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "faults"}
        doc["faults"] = [{"kind": f.kind, "detail": f.detail, "detected": f.detected, "recovery": f.recovery}
                         for f in self.faults]
        return doc


def log_tail(path: Path, lines: int = LOG_TAIL) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except FileNotFoundError:
        text = []
    return "\n    ".join(["", *text[-lines:]]) if text else " (its log is empty)"


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


@dataclass(frozen=True)
class StatusSample:
    """What the checks need of one status.json the daemon wrote (read with read_status)."""

    heartbeat: float
    pid: int
    state: str
    trainer_pid: int | None
    trainer_alive: bool | None
    counters: dict[str, int]
    consumers: tuple[tuple[str, int | None, bool | None], ...] = ()  # (name, pid, alive), every stream's
    remote_nodes: tuple[str, ...] = ()  # --ray: the nodes that built slices, as status.json names them
    waiting: int = 0  # finished batches waiting for the trainer
    high_water: int = 0


    @classmethod
    def of(cls, status: Status) -> StatusSample:
        job = status.production
        trainer = job.trainer if job is not None else None
        return cls(
            heartbeat=status.heartbeat, pid=status.pid, state=status.state,
            trainer_pid=trainer.pid if trainer is not None else None,
            trainer_alive=trainer.alive if trainer is not None else None,
            counters={**{k: getattr(job.errors, k) if job is not None else 0 for k in COUNTERS},
                      "batches": job.totals.batches if job is not None else 0},
            consumers=tuple((c.name, c.trainer.pid, c.trainer.alive)
                            for s in (job.streams if job is not None else ()) for c in s.consumers),
            remote_nodes=tuple(n.node for n in job.remote.nodes if n.slices)
            if job is not None and job.remote is not None else (),
            waiting=job.waiting if job is not None else 0, high_water=job.high_water if job is not None else 0,
        )


class Harness:
    def __init__(self, s: Settings) -> None:
        self.s = s
        self.work = s.workdir
        self.work.mkdir(parents=True, exist_ok=True)
        path = os.environ.get("PYTHONPATH")
        self.env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}
        self.mount: Path | None = None
        self.readonly: Path | None = None  # a read-only tmpfs (root only): an unwritable buffer for bad_start
        self.procs: list[subprocess.Popen[bytes]] = []
        self.daemon_logs: list[Path] = []
        self.daemon: subprocess.Popen[bytes] | None = None
        self.driver: subprocess.Popen[bytes] | None = None
        self.spare: subprocess.Popen[bytes] | None = None
        # consumer_kill's drivers: the next one, imports done, waits for its go file (see extra_driver).
        self.extra_spare: subprocess.Popen[bytes] | None = None
        self.extra_runs = 0
        self.problems: list[str] = []  # what a fault's own checks found wrong (consumer_kill's consumer)
        self.run_id = -1
        self.trainer_crashes: list[str] = []
        self.daemon_exits: list[str] = []
        self.pending_second: list[tuple[Fault, subprocess.Popen[bytes], Path]] = []
        self.hangs = 0
        self.skipped = 0
        self.finished = False
        self.unavailable: dict[str, str] = {}
        # Exits a fault caused, by pid: the harness's own kills, and refusals it asked for.
        self.expected_exits: set[int] = set()
        self.statuses: list[StatusSample] = []
        self._status_at = 0.0
        self.cluster: Any = None  # ray.cluster_utils.Cluster, for RAY_KINDS
        self.ray_node: Any = None  # its node with a CPU

    # -- setup -------------------------------------------------------------------

    def drop_unavailable_kinds(self) -> None:
        """Leave out the kinds this machine cannot inject, each with the reason, before the plan is drawn."""
        if "enospc" in self.s.kinds and (os.geteuid() != 0 or shutil.which("mount") is None):
            self.unavailable["enospc"] = "needs root and mount(8) for a tmpfs small enough to fill"
            self.s.kinds = tuple(k for k in self.s.kinds if k != "enospc")

    def prepare(self, plan: list[str]) -> None:
        from prefetchd.synthetic import make_shapes_dataset

        root = self.work / "data"
        if not (root / "train").is_dir():
            make_shapes_dataset(root, classes=3, train_per_class=24, val_per_class=1, seed=1)
        self.data = root / "train"
        self.samples = sorted_samples(self.data)
        self.steps = -(-len(self.samples) // self.s.batch_size)
        # Room for the gaps and for what the trainer consumes while each fault is being handled, twice
        # over: the trainer goes on at its pace while a fault is handled, which takes longer on a loaded
        # machine (under pytest-xdist, 17 faults once ran out of positions with 3 left).  What is left
        # after the last fault costs little: the trainer sprints through it (``sprint``).
        total = 2 * sum(sum(self.s.gap) // 2 + POSITIONS_PER_FAULT.get(kind, 25) for kind in plan) + 40
        self.epochs = -(-total // self.steps)
        self.positions = self.epochs * self.steps
        self.ref_buffer = self.work / "ref"
        self.buffer = self.work / "bf"
        self.removed = self.work / "removed"
        self.removed.mkdir(exist_ok=True)
        self.sprint = self.work / "sprint"  # touched after the last fault: the trainer stops pacing
        self.sprint.unlink(missing_ok=True)
        if set(RAY_KINDS) & set(self.s.kinds):
            self.start_cluster()
        if "enospc" in self.s.kinds:
            self.mount = self.work / "mnt"
            self.mount.mkdir(exist_ok=True)
            # Room for the high-water mark and the documents, little more: easy to fill.
            size = max(1 << 20, 4 * self.s.high_water * self.batch_bytes())
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(self.mount)],
                           check=True)
            self.buffer = self.mount / "bf"
        if "bad_start" in self.s.kinds and os.geteuid() == 0 and shutil.which("mount") is not None:
            self.readonly = self.work / "readonly"
            self.readonly.mkdir(exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(self.readonly)], check=True)

    def batch_bytes(self) -> int:
        n, size = self.s.batch_size, self.s.image_size
        return PAGE + -(-n * size * size * 3 // PAGE) * PAGE + 2 * -(-n * 8 // PAGE) * PAGE

    def daemon_args(self) -> list[str]:
        s = self.s
        return ["--data", str(self.data), "--batch-size", str(s.batch_size), "--image-size", str(s.image_size),
                "--workers", str(s.workers), "--seed", "7", "--epochs", str(self.epochs),
                "--high-water", str(s.high_water), "--low-water", str(s.low_water), "--min-free-mb", "0",
                *(["--task-timeout", str(s.task_timeout)] if "worker_stop" in s.kinds else []),
                *(["--ray", self.cluster.address] if self.cluster is not None else [])]

    def spawn(self, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.work)
        self.procs.append(proc)
        return proc

    def start_daemon(self, buffer: Path) -> subprocess.Popen[bytes]:
        log = self.work / f"daemon-{len(self.daemon_logs)}.log"
        self.daemon_logs.append(log)
        return self.spawn([self.s.python, "-m", "prefetchd", "start", "--buffer", str(buffer), *self.daemon_args()], log)

    def start_driver(self, buffer: Path, log: Path, checkpoint: Path, run: int, step_seconds: float,
                     go: Path | None = None, extra: list[str] | None = None,
                     err: Path | None = None) -> subprocess.Popen[bytes]:
        argv = [self.s.python, str(DRIVER), "--buffer", str(buffer), "--log", str(log), "--checkpoint",
                str(checkpoint), "--run", str(run), "--step-seconds", str(step_seconds), "--timeout", "120",
                "--daemon-timeout", str(self.s.stall_timeout), *(extra or [])]
        if go is not None:
            argv += ["--go", str(go)]
        return self.spawn(argv, err or self.work / f"driver-{run}.err")

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
                except ProcessLookupError:
                    pass
                proc.wait()
        for f in self.removed.iterdir():  # a dataset file still moved away
            dest = self.data / f.name.replace("__", "/")
            os.rename(f, dest)
        if self.cluster is not None:
            self.cluster.shutdown()
        for mount in (self.mount, self.readonly):
            if mount is not None and subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(mount)], capture_output=True)

    # -- the reference -----------------------------------------------------------

    def start_reference(self) -> None:
        """The fault-free run, alongside the faulted one (it only needs the CPU the other leaves).

        It reads its own copy of the dataset (same bytes, same mtimes): dataset_delete moves
        files of the faulted run's copy away.
        """
        ref_data = self.work / "data-ref" / "train"
        if not ref_data.is_dir():
            shutil.copytree(self.data, ref_data, copy_function=shutil.copy2)
        self.ref_log, ckpt = self.work / "reference.jsonl", self.work / "reference.ckpt"
        for p in (self.ref_log, ckpt):
            p.unlink(missing_ok=True)
        self.ref_started = time.monotonic()
        args = self.daemon_args()
        args[args.index("--data") + 1] = str(ref_data)
        args[args.index("--workers") + 1] = "2"  # not part of the job: batches are the same for any count
        if "--ray" in args:  # local workers only: the faulted run's remote batches must equal these
            del args[args.index("--ray"):args.index("--ray") + 2]
        log = self.work / "reference-daemon.log"
        self.ref_daemon = self.spawn([self.s.python, "-m", "prefetchd", "start", "--buffer", str(self.ref_buffer), *args], log)
        self.ref_driver = self.start_driver(self.ref_buffer, self.ref_log, ckpt, run=-1, step_seconds=0.0)

    def finish_reference(self) -> dict[int, dict[str, Any]]:
        try:
            rc = self.ref_driver.wait(600)
        finally:
            if self.ref_driver.poll() is None:
                self.ref_driver.kill()
        if rc != 0:
            raise RuntimeError(f"the fault-free reference run failed ({rc}): {(self.work / 'driver--1.err').read_text()[-2000:]}")
        rc = self.ref_daemon.wait(60)
        if rc != 0:
            raise RuntimeError(f"the fault-free reference daemon {describe_exit(rc)}:"
                               f"{log_tail(self.work / 'reference-daemon.log')}")
        lines = read_log(self.ref_log)
        ref = {r["epoch"] * self.steps + r["step"]: r for r in lines if "sha" in r}
        self.ref_seconds = lines[-1]["t"] - lines[0]["t"] if lines else 0.0  # the trainer's part, start to done
        if sorted(ref) != list(range(self.positions)):
            raise RuntimeError(f"the reference run logged {len(ref)} of {self.positions} batches")
        shutil.rmtree(self.ref_buffer, ignore_errors=True)
        return ref

    # -- the faulted run ---------------------------------------------------------

    def position(self) -> int:
        """The next position the trainer needs, from its newest line."""
        for r in reversed(self.log.records):
            if "sha" in r:
                return int(r["epoch"]) * self.steps + int(r["step"]) + 1
            if r.get("event") == "start":
                return int(r["epoch"]) * self.steps + int(r["step"])
        return 0

    def last_batch_time(self) -> float:
        for r in reversed(self.log.records):
            if "sha" in r:
                return float(r["t"])
        return 0.0

    def new_driver(self) -> None:
        """Start the next trainer run: the spare started earlier, whose imports are done, and a new spare.

        Importing torch takes seconds on a loaded machine; a real job would pay them on restart,
        but here they would only stretch the suite, not test anything.
        """
        self.run_id += 1
        spare = self.spare
        if spare is not None and spare.poll() is not None:  # it only waits for its go file: it must not exit
            self.trainer_crashes.append(f"spare trainer for run {self.run_id} (pid {spare.pid}) "
                                        f"{describe_exit(spare.returncode)} before it was used; its log:"
                                        f"{log_tail(self.work / f'driver-{self.run_id}.err')}")
            spare = None
        if spare is None:
            spare = self._spare(self.run_id)
        (self.work / f"go-{self.run_id}").touch()
        self.driver = spare
        self.spare = self._spare(self.run_id + 1)

    def _spare(self, run: int) -> subprocess.Popen[bytes]:
        return self.start_driver(self.buffer, self.log_path, self.ckpt, run, self.s.step_seconds,
                                 go=self.work / f"go-{run}", extra=["--sprint", str(self.sprint)])

    def extra_paths(self, session: int) -> tuple[Path, Path]:
        """consumer_kill's ``session``-th extra consumer: its log and its checkpoint."""
        return self.work / f"extra-{session}.jsonl", self.work / f"extra-{session}.ckpt"

    def _extra_spare(self, n: int) -> subprocess.Popen[bytes]:
        # Run n of the extra consumer: session n // 2 (each consumer_kill runs it twice: before and after the kill).
        log, ckpt = self.extra_paths(n // 2)
        return self.start_driver(self.buffer, log, ckpt, n % 2, self.s.step_seconds, go=self.work / f"go-extra-{n}",
                                 extra=["--consumer", EXTRA_CONSUMER, "--batches", str(self.extra_batches)],
                                 err=self.work / f"extra-{n}.err")

    def extra_driver(self) -> subprocess.Popen[bytes]:
        """Start the next run of the extra consumer (a spare, as for the trainer: see new_driver)."""
        n = self.extra_runs
        self.extra_runs += 1
        spare = self.extra_spare
        if spare is not None and spare.poll() is not None:
            self.trainer_crashes.append(f"spare extra consumer {n} (pid {spare.pid}) {describe_exit(spare.returncode)} "
                                        f"before it was used; its log:{log_tail(self.work / f'extra-{n}.err')}")
            spare = None
        if spare is None:
            spare = self._extra_spare(n)
        (self.work / f"go-extra-{n}").touch()
        self.extra_spare = self._extra_spare(n + 1)
        return spare

    def new_daemon(self) -> None:
        self.daemon = self.start_daemon(self.buffer)

    def supervise(self) -> None:
        """Notice processes that exited on their own, restart them, and read the trainer's log and status.json.

        An exit that no fault caused is recorded with the process, its exit status and its log's
        tail, and fails the run (``Report.ok``); the process is restarted so that the run still
        shows what else went wrong.
        """
        self.log.poll()
        self.poll_status()
        assert self.driver is not None and self.daemon is not None
        rc = self.driver.poll()
        # A process the harness itself ended is restarted by the injection that ended it, when it chooses.
        if rc is not None and not self.finished and self.driver.pid not in self.expected_exits:
            self.log.poll()
            if rc == 0 and any(r.get("event") == "done" for r in self.log.records):
                self.finished = True
            else:
                self.trainer_crashes.append(
                    f"trainer run {self.run_id} (pid {self.driver.pid}) {describe_exit(rc)}, no fault explains it; "
                    f"its log:{log_tail(self.work / f'driver-{self.run_id}.err')}")
                if len(self.trainer_crashes) > 20:
                    raise RuntimeError("crash loop: the trainer died more than 20 times: " + "; ".join(self.trainer_crashes[-3:]))
                self.new_driver()
        rc = self.daemon.poll()
        if rc is not None and not self.finished and self.daemon.pid not in self.expected_exits:
            if not (rc == 0 and self.position() >= self.positions):
                self.daemon_exits.append(f"daemon {len(self.daemon_logs) - 1} (pid {self.daemon.pid}) {describe_exit(rc)}, "
                                         f"no fault explains it; its log:{log_tail(self.daemon_logs[-1])}")
                if len(self.daemon_exits) > 20:
                    raise RuntimeError("crash loop: the daemon died more than 20 times")
                self.new_daemon()
        for item in list(self.pending_second):
            fault, proc, log = item
            if proc.poll() is not None:
                fault.data["rc"] = proc.returncode
                # After the refusal, not at injection: the first daemon still owns the buffer.
                first = fault.data["first"]
                fault.data["first_alive_after"] = first.poll() is None and daemon_pid(self.buffer) == first.pid
                if proc.returncode != EXIT_BUFFER_BUSY:
                    self.daemon_exits.append(f"second daemon (pid {proc.pid}) {describe_exit(proc.returncode)}, not "
                                             f"the refusal ({EXIT_BUFFER_BUSY}); its log:{log_tail(log)}")
                self.pending_second.remove(item)

    def poll_status(self) -> None:
        """Keep each status.json the daemon writes (a new heartbeat) that the checks may need."""
        now = time.monotonic()
        if now - self._status_at < STATUS_POLL:
            return
        self._status_at = now
        try:
            status = read_status(self.buffer)
        except (ProtocolError, OSError):
            return  # being replaced: the next look gets it
        if status is None:
            return
        sample = StatusSample.of(status)
        if not self.statuses or sample.heartbeat != self.statuses[-1].heartbeat:
            self.statuses.append(sample)

    def fresh_status(self, timeout: float = 5.0) -> StatusSample | None:
        """The first status the current daemon writes from now on: a baseline no earlier event is missing from.

        The trainer is stopped meanwhile (about a second): it would take some 50 batches otherwise.
        """
        assert self.daemon is not None
        t, pid = time.time(), self.daemon.pid
        seen = len(self.statuses)
        self._stopped()
        try:
            if self.wait_until(lambda: any(x.pid == pid and x.heartbeat > t for x in self.statuses[seen:]), timeout):
                return next(x for x in self.statuses[seen:] if x.pid == pid and x.heartbeat > t)
            return None
        finally:
            self._cont()

    def counter_rose(self, counter: str, base: StatusSample | None, until: float = float("inf")) -> bool:
        """Whether a status of the baseline's daemon written after it, before ``until``, counts more ``counter``."""
        if base is None:
            return False
        return any(x.pid == base.pid and base.heartbeat < x.heartbeat < until
                   and x.counters[counter] > base.counters[counter] for x in self.statuses)

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.supervise()
            time.sleep(min(0.01, max(0.0, end - time.monotonic())))

    def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.supervise()
            if predicate():
                return True
            time.sleep(0.01)
        return False

    def run(self) -> Report:
        self.drop_unavailable_kinds()
        rng = random.Random(self.s.seed)
        plan: list[str] = []
        while len(plan) < self.s.faults:
            round_ = list(self.s.kinds)
            rng.shuffle(round_)
            plan += round_
        plan = plan[: self.s.faults]
        self.prepare(plan)
        self.start_reference()
        self.log_path, self.ckpt = self.work / "trainer.jsonl", self.work / "trainer.ckpt"
        for p in (self.log_path, self.ckpt):
            p.unlink(missing_ok=True)
        self.log = LogReader(self.log_path)
        faults: list[Fault] = []
        started = time.monotonic()
        self.new_daemon()
        self.new_driver()
        margin = 2 * self.s.high_water + 4
        # consumer_kill's extra consumer reads this many positions, all before the trainer's end.
        self.extra_batches = min(16, margin)
        if "consumer_kill" in plan:  # only then: each spare costs a torch import
            self.extra_spare = self._extra_spare(0)
        for i, kind in enumerate(plan):
            target = self.position() + rng.randint(*self.s.gap)
            if not self.wait_until(lambda: self.position() >= target or self.finished, RECOVERY_TIMEOUT):
                self.hangs += 1
                break
            # A second daemon still starting would race a restarted one for the lock after a kill (and win:
            # one daemon still serves, but not the one the harness restarted); let it be refused first.
            self.wait_until(lambda: not self.pending_second, 60)
            if self.finished or self.position() >= self.positions - margin:
                break
            fault = Fault(kind, i, time.time())
            getattr(self, f"inject_{kind}")(fault, rng)
            if not fault.t_ref:
                fault.t_ref = fault.t_inject
            if fault.detail == "no waiting batch":  # nothing was damaged: not counted as injected
                self.skipped += 1
                continue
            faults.append(fault)
            if not self.wait_until(lambda: self.last_batch_time() > fault.t_ref or self.finished, RECOVERY_TIMEOUT):
                self.hangs += 1
                break
        if not self.hangs:
            self.sprint.touch()
            remaining = self.positions - self.position()
            if not self.wait_until(lambda: self.finished, 120 + remaining * (self.s.step_seconds + 0.05)):
                self.hangs += 1
        self.wait_until(lambda: not self.pending_second, 60)
        if self.daemon is not None and self.finished:
            try:
                rc = self.daemon.wait(30)
                if rc != 0:
                    self.daemon_exits.append(f"daemon (pid {self.daemon.pid}) {describe_exit(rc)} at the end of the "
                                             f"job, not 0; its log:{log_tail(self.daemon_logs[-1])}")
            except subprocess.TimeoutExpired:
                self.daemon_exits.append("the daemon did not exit after the last epoch was consumed")
        seconds = time.monotonic() - started
        self.log.poll()
        ref = self.finish_reference()
        return self.evaluate(ref, faults, seconds, self.ref_seconds)

    # -- injections --------------------------------------------------------------

    def inject_daemon_kill(self, fault: Fault, rng: random.Random) -> None:
        assert self.daemon is not None
        if rng.random() < 0.5:
            # Mid-write: wait (briefly) for a batch under construction.
            self.wait_until(self.building, 1.0)
        mid = self.building()
        fault.t_inject = time.time()
        self.expected_exits.add(self.daemon.pid)
        self.daemon.send_signal(signal.SIGKILL)
        self.daemon.wait()
        fault.detail = "mid-write" if mid else "idle"
        self.new_daemon()
        pid = self.daemon.pid
        fault.check = lambda f, h: f.data.get("owned", False)
        fault.data["owned"] = self.wait_until(lambda: daemon_pid(self.buffer) == pid, 60)

    def building(self) -> bool:
        """Whether a batch is being built: its temp file (not a spare's, nor a JSON document's) is there."""
        return any(self.buffer.glob(BUILDING_GLOB))

    def inject_worker_kill(self, fault: Fault, rng: random.Random) -> None:
        """SIGKILL one of the daemon's workers, half the time while a batch is being built: the
        daemon requeues its tasks and starts another, and the batches stay the same."""
        victim, base = self._signal_worker(fault, rng, signal.SIGKILL)
        fault.detail = "no worker to kill" if victim is None else fault.detail
        fault.check = counter_rose("worker_restarts", base)
        # Until a status counts it (about a second): a next fault that kills or stops the daemon
        # would otherwise leave no status of this one's daemon that could.
        self.wait_until(lambda: fault.check is not None and fault.check(fault, self), 5.0)

    def inject_worker_server_kill(self, fault: Fault, rng: random.Random) -> None:
        """SIGKILL the daemon's worker server (what the OOM killer takes once no worker is left, the server
        volunteering next): every worker's report ends at once, the daemon requeues their tasks and starts
        others from a new server, and the batches stay the same."""
        assert self.daemon is not None
        daemon = self.daemon
        self.wait_until(lambda: bool(daemon_workers(daemon.pid)), 60)  # a restarted daemon: once its workers are up
        base = self.fresh_status()
        if rng.random() < 0.5:
            self.wait_until(self.building, 1.0)
        fault.detail = "mid-build" if self.building() else "idle"
        fault.t_inject = time.time()
        try:
            server = worker_server(daemon.pid)
            server.send_signal(signal.SIGKILL)
            fault.data["pid"] = server.pid
        except (psutil.Error, ValueError):  # gone, or not started again yet
            fault.detail = "no worker server to kill"
        fault.check = counter_rose("worker_restarts", base)
        self.wait_until(lambda: fault.check is not None and fault.check(fault, self), 5.0)

    def inject_worker_stop(self, fault: Fault, rng: random.Random) -> None:
        """SIGSTOP one of the daemon's workers, half the time while a batch is being built, and leave it
        stopped, as a worker hangs: the daemon kills it once it has made no progress for --task-timeout
        (one stopped while idle gets the next tasks: the least busy worker does) and builds its tasks on
        a new one, and the batches stay the same."""
        victim, base = self._signal_worker(fault, rng, signal.SIGSTOP)
        fault.detail = "no worker to stop" if victim is None else fault.detail
        fault.check = counter_rose("worker_hangs", base)
        # Until a status counts it: the timeout, a look (about a second) and a status write, on a loaded box.
        if not self.wait_until(lambda: fault.check is not None and fault.check(fault, self), self.s.task_timeout + 30):
            with contextlib.suppress(psutil.Error):  # not noticed: the run goes on, and the fault counts as missed
                if victim is not None:
                    victim.send_signal(signal.SIGCONT)
            return
        # How long the stopped worker held its tasks: to the first status that counts it killed (the same look).
        assert base is not None
        counted_at = min(x.heartbeat for x in self.statuses if x.pid == base.pid and x.heartbeat > base.heartbeat
                         and x.counters["worker_hangs"] > base.counters["worker_hangs"])
        fault.detail += f", killed within {counted_at - fault.t_inject:.1f} s"

    def _signal_worker(self, fault: Fault, rng: random.Random,
                       sig: signal.Signals) -> tuple[psutil.Process | None, StatusSample | None]:
        """Send ``sig`` to one of the daemon's workers, half the time while a batch is being built (said in
        ``fault.detail``); the worker (None: none was there) and a status from just before."""
        assert self.daemon is not None
        daemon = self.daemon
        workers: list[psutil.Process] = []

        def found() -> bool:
            nonlocal workers
            with contextlib.suppress(psutil.Error):
                workers = daemon_workers(daemon.pid)
            return bool(workers)

        self.wait_until(found, 60)  # a restarted daemon: once its workers are up
        base = self.fresh_status()
        if rng.random() < 0.5:
            self.wait_until(self.building, 1.0)
        mid = self.building()
        fault.t_inject = time.time()
        victim = rng.choice(workers) if workers else None
        try:
            if victim is not None:
                victim.send_signal(sig)
        except psutil.NoSuchProcess:
            victim = None
        fault.detail = "mid-build" if mid else "idle"
        if victim is not None:
            fault.data["pid"] = victim.pid
        return victim, base

    def inject_trainer_kill(self, fault: Fault, rng: random.Random) -> None:
        assert self.driver is not None
        time.sleep(rng.uniform(0, self.s.step_seconds))  # anywhere in the step: before or after its checkpoint
        fault.t_inject = t = time.time()
        pid = self.driver.pid
        self.expected_exits.add(pid)
        self.driver.send_signal(signal.SIGKILL)
        self.driver.wait()
        # Restarted only once the daemon's status says this trainer is gone (or 5 s): the restart itself
        # is the harness's doing, the daemon's noticing is what is checked.
        fault.data["gone"] = self.wait_until(
            lambda: any(x.heartbeat > t and x.trainer_pid == pid and x.trainer_alive is False for x in self.statuses), 5.0)
        fault.t_ref = time.time()
        self.new_driver()
        fault.check = lambda f, h: bool(f.data["gone"])

    def _stopped(self) -> int:
        """SIGSTOP the trainer; the next position it may not have opened yet is returned."""
        assert self.driver is not None
        self.driver.send_signal(signal.SIGSTOP)
        time.sleep(0.01)
        self.log.poll()
        # It may be mapping position() right now; later ones it has not opened.
        return self.position() + 1

    def _cont(self) -> None:
        assert self.driver is not None
        self.driver.send_signal(signal.SIGCONT)

    def inject_trainer_stop(self, fault: Fault, rng: random.Random) -> None:
        self._stopped()
        t = time.time()
        full = self.wait_until(lambda: any(x.heartbeat > t and x.state == State.FULL for x in self.statuses), 10)
        self.sleep(rng.uniform(0.1, 0.5))  # longer than the buffer lasts: it has been full a while
        self._cont()
        fault.t_ref = time.time()
        # "full" is nothing to build: at the high-water mark, or anywhere above the low-water mark on the way down
        # (the hysteresis waits for the low-water mark, which a stopped trainer never brings).  Past it, never
        # more than the high-water mark's batches wait.
        over = [x.waiting for x in self.statuses if t < x.heartbeat <= fault.t_ref and x.waiting > x.high_water]
        fault.detail = ("full" if full else "not full") + (f", {max(over)} waiting past the mark" if over else "")
        fault.data["full"] = full and not over
        fault.check = lambda f, h: bool(f.data["full"])

    def inject_enospc(self, fault: Fault, rng: random.Random) -> None:
        assert self.mount is not None
        mount = self.mount
        base = self.fresh_status()
        filler = self.mount / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

        def top_up() -> None:
            # Less than any batch left free, enough for the small JSON documents. Topped up while waiting:
            # each batch the trainer consumes frees room for exactly one more, so a buffer filled while full
            # would otherwise go on replacing batch for batch and never run short.
            leave = 3 * PAGE
            for _ in range(20):
                st = os.statvfs(mount)
                free = st.f_bavail * st.f_frsize
                if free <= leave:
                    return
                try:
                    os.posix_fallocate(fd, 0, os.fstat(fd).st_size + free - leave)
                    return
                except OSError:  # a batch was written meanwhile: measure again
                    continue

        full: StatusSample | None = None  # a status written once the tmpfs was full
        freed = [float("inf")]  # when the filler went

        def in_spares(h: Harness) -> bool:
            # Batches committed while less than one batch was free were built in pages the daemon
            # had already: consumed batch files kept as spares (SPEC.md rule 1), not new space.
            return h.counter_rose("batches", full, freed[0])

        def noticed(f: Fault, h: Harness) -> bool:
            return (h.counter_rose("write_failures", base, f.end) or h.counter_rose("low_space_pauses", base, f.end)
                    or in_spares(h))

        try:
            top_up()
            fault.t_inject = time.time()
            full = self.fresh_status()

            def topped_up_and_noticed() -> bool:
                top_up()
                return noticed(fault, self)

            self.wait_until(topped_up_and_noticed, 5.0)
        finally:
            os.close(fd)
        self.sleep(rng.uniform(0.0, 0.3))
        filler.unlink()
        fault.t_ref = freed[0] = time.time()
        fault.detail = ("ENOSPC" if self.counter_rose("write_failures", base) else
                        "paused" if self.counter_rose("low_space_pauses", base) else
                        "went on in spares" if in_spares(self) else "not noticed")
        fault.check = noticed

    def _waiting_batch(self, rng: random.Random, first_offset: int) -> tuple[Path, int] | None:
        """A batch the stopped trainer has not opened: position >= its position + first_offset."""
        for _ in range(50):
            p = self._stopped()
            cands = [(k[0] * self.steps + k[1], path) for k, path in list_batches(self.buffer).items()]
            cands = [(g, path) for g, path in cands if g >= p - 1 + first_offset]
            if cands:
                g, path = rng.choice(sorted(cands))
                return path, g
            self._cont()
            self.sleep(0.05)
        return None

    def _damage_waiting_batch(self, fault: Fault, rng: random.Random, first_offset: int,
                              damage: Callable[[Path, int], str], settled: Callable[[], bool] | None = None) -> None:
        """With the trainer stopped, apply ``damage(path, g)`` (it returns the fault's detail) to a
        batch at least ``first_offset`` past the trainer's position, then let the trainer go on:
        once ``settled()`` holds (or 3 s passed), where the daemon must see the damage before the
        trainer's next step could hide it."""
        found = self._waiting_batch(rng, first_offset)
        try:
            if found is None:
                fault.detail = "no waiting batch"
                return
            path, g = found
            fault.detail = damage(path, g)
            fault.t_inject = time.time()
            fault.data["g"] = g
            if settled is not None:
                self.wait_until(settled, 3.0)
                fault.t_ref = time.time()  # the hold is the harness's: recovery counts from its end
        finally:
            self._cont()

    def inject_batch_corrupt(self, fault: Fault, rng: random.Random) -> None:
        def flip(path: Path, g: int) -> str:
            with open(path, "r+b") as f:
                data = f.read()
                # What the reader checks: the fixed header and the metadata.
                offset = rng.randrange(HEADER.size + HEADER.unpack_from(data)[3])
                f.seek(offset)
                byte = f.read(1)[0]
                f.seek(offset)
                f.write(bytes([byte ^ (1 << rng.randrange(8))]))
                f.seek(0)
                same = reads_the_same(data, f.read())
            return f"byte {offset}" + (f", {UNCHECKED_BYTE}" if same else "")

        fault.check = lambda f, h: h.protocol_error_at(f)
        self._damage_waiting_batch(fault, rng, 1, flip)

    def inject_batch_truncate(self, fault: Fault, rng: random.Random) -> None:
        def truncate(path: Path, g: int) -> str:
            size = path.stat().st_size
            new = rng.choice([0, rng.randrange(1, size)])
            os.truncate(path, new)
            return f"{size} -> {new} bytes"

        fault.check = lambda f, h: h.protocol_error_at(f)
        self._damage_waiting_batch(fault, rng, 1, truncate)

    def inject_batch_delete(self, fault: Fault, rng: random.Random) -> None:
        def delete(path: Path, g: int) -> str:
            path.unlink()
            return "next" if g == self.position() else "later"

        base = self.fresh_status()
        check = fault.check = counter_rose("vanished_batches", base)
        # Also the batch it waits for: unlinking a mapped file is safe.  The trainer stays stopped
        # until the daemon counted it: one that had mapped the batch before the stop would consume it
        # on SIGCONT, and a daemon looking after that finds it consumed, not vanished (1 in ~15 did).
        self._damage_waiting_batch(fault, rng, 0, delete, settled=lambda: check(fault, self))

    def inject_progress_garbage(self, fault: Fault, rng: random.Random) -> None:
        path = self.buffer / "progress.json"
        mode = rng.choice(["bytes", "format", "truncated"])
        if mode == "bytes":
            data = rng.randbytes(rng.randrange(1, 200))
        elif mode == "format":
            data = json.dumps({"format": "prefetchd.status", "version": 1, "epoch": 0, "step": 0}).encode()
        else:
            try:
                whole = path.read_bytes()
            except FileNotFoundError:
                whole = b'{"format": "prefetchd.progress", "version": 1, "epoch": 0, "step": 0}'
            data = whole[: rng.randrange(1, max(2, len(whole) - 1))]

        def overwrite() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # in place, as a broken writer would
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

        fault.detail = mode
        self._damage_progress(fault, "progress_rejected", overwrite)

    def _damage_progress(self, fault: Fault, counter: str, damage: Callable[[], None]) -> None:
        """Stop the trainer, ``damage()`` its progress file, and let it go on once the daemon counted
        ``counter`` (or 3 s): a running trainer's next step would replace the file before the daemon
        looked at it."""
        base = self.fresh_status()
        self._stopped()
        try:
            damage()
            fault.t_inject = time.time()
            self.wait_until(lambda: self.counter_rose(counter, base), 3.0)
        finally:
            self._cont()
        fault.t_ref = time.time()
        fault.check = counter_rose(counter, base)

    def inject_progress_rewind(self, fault: Fault, rng: random.Random) -> None:
        if rng.random() < 0.5:
            return self._rewind_while_waiting(fault, rng)
        back = rng.randint(2, 3 * self.s.high_water)  # within the window, and past it
        fault.detail = f"back {back}"
        self._damage_progress(fault, "progress_rewinds", lambda: self._rewrite_progress(self.position() - back))

    def _rewrite_progress(self, g: int) -> None:
        """Replace progress.json with position ``g`` (or 0), atomically as a trainer does, but naming no
        writer, as a hand edit or a script would: a live process named there is a second trainer on the
        same consumer, which the loader refuses rather than fights."""
        g = max(0, g)
        doc = {"format": "prefetchd.progress", "version": 1, "epoch": g // self.steps, "step": g % self.steps}
        tmp = self.buffer / f"progress.json.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.buffer / "progress.json")

    def _rewind_while_waiting(self, fault: Fault, rng: random.Random) -> None:
        """The trainer waits for a batch (the daemon is stopped meanwhile) when progress.json is
        rewound past the window: the daemon now builds other batches, and only the waiting loader
        can put its position back.

        The trainer is stopped too until the daemon has read the rewound file: a waiting loader
        refreshes its progress file now and then, and one refresh before the daemon looked would
        undo the fault unseen."""
        assert self.daemon is not None
        base = self.fresh_status()
        self.daemon.send_signal(signal.SIGSTOP)
        try:
            # Drained: no new batch for a while, so the trainer sits in its wait.
            self.wait_until(lambda: time.time() - self.last_batch_time() > 0.3, 10)
            self._stopped()
            back = min(self.position(), self.s.high_water + rng.randint(1, self.s.high_water))
            self._rewrite_progress(self.position() - back)
        finally:
            self.daemon.send_signal(signal.SIGCONT)
        try:
            fault.t_inject = fault.t_ref = time.time()
            fault.detail = f"back {back}, trainer waiting"
            fault.check = counter_rose("progress_rewinds", base)
            self.wait_until(lambda: fault.check is not None and fault.check(fault, self), 3.0)
        finally:
            self._cont()

    def inject_second_daemon(self, fault: Fault, rng: random.Random) -> None:
        log = self.work / f"second-{fault.index}.log"
        # Not while a restarted daemon is still starting: the two would race for the lock, and the
        # loser -- ours -- would be refused, rightly.
        assert self.daemon is not None
        pid = self.daemon.pid
        self.wait_until(lambda: daemon_pid(self.buffer) == pid, 60)
        fault.t_inject = time.time()
        argv = [self.s.python, "-m", "prefetchd", "start", "--buffer", str(self.buffer), *self.daemon_args()]
        proc = self.spawn(argv, log)
        self.expected_exits.add(proc.pid)
        fault.data["first"] = self.daemon
        self.pending_second.append((fault, proc, log))
        fault.check = lambda f, h: f.data.get("rc") == EXIT_BUFFER_BUSY and f.data.get("first_alive_after", False)

    def inject_dataset_delete(self, fault: Fault, rng: random.Random) -> None:
        i = rng.randrange(len(self.samples))
        rel = self.samples[i]
        src = self.data / rel
        dest = self.removed / rel.replace("/", "__")
        base = self.fresh_status()
        os.rename(src, dest)
        fault.t_inject = t = time.time()
        try:
            hit = self.wait_until(lambda: any(r.get("replaced") and r["t"] > t for r in self.log.records[-50:])
                                  or self.counter_rose("undecodable_files", base), 3.0)
        finally:
            os.rename(dest, src)
        fault.t_ref = time.time()
        fault.data["index"] = i
        fault.detail = "replaced" if hit else NOT_READ_WHILE_GONE
        # A delivered batch's header counts the replacement, or the daemon's status the undecodable file.
        fault.check = lambda f, h: any(r.get("replaced") and f.t_inject < r["t"] < f.end for r in h.log.records
                                       ) or h.counter_rose("undecodable_files", base, f.end)

    def inject_daemon_stuck(self, fault: Fault, rng: random.Random) -> None:
        """SIGSTOP the daemon until the trainer raises DaemonStuck (its heartbeat older than the stall
        timeout), then SIGCONT it: a daemon that was only swapped out serves on.  What ``--spawn-daemon``
        does instead (kill and restart it) has its own test, and daemon_kill restarts daemons here."""
        assert self.daemon is not None
        stuck = self.daemon
        pid = stuck.pid
        self.wait_until(lambda: daemon_pid(self.buffer) == pid, 60)  # a restarted one: once it serves
        fault.t_inject = t = time.time()
        stuck.send_signal(signal.SIGSTOP)
        said = self.wait_until(lambda: any(r.get("event") == "daemon_stuck" and r.get("pid") == pid and r["t"] > t
                                           for r in self.log.records), self.s.stall_timeout + 60)
        stuck.send_signal(signal.SIGCONT)
        fault.t_ref = time.time()
        fault.detail = f"said stuck after {fault.t_ref - t:.1f} s" if said else "not said"
        fault.data.update(said=said, pid=pid)
        fault.check = lambda f, h: bool(f.data["said"])

    def inject_progress_planted(self, fault: Fault, rng: random.Random) -> None:
        """Put a FIFO, or a symlink to a valid progress document, in place of progress.json (the
        trainer stopped meanwhile): the daemon must ignore it without blocking and count it."""
        path = self.buffer / "progress.json"
        kind = rng.choice(["fifo", "symlink"])

        def plant() -> None:
            tmp = self.buffer / f"progress.json.planted-{uuid.uuid4().hex[:8]}"
            if kind == "fifo":
                os.mkfifo(tmp)
            else:
                target = self.work / f"planted-progress-{fault.index}.json"
                target.write_bytes(path.read_bytes())  # the same position: only the link is wrong
                os.symlink(target, tmp)
            os.replace(tmp, path)

        fault.detail = kind
        self._damage_progress(fault, "progress_rejected", plant)

    def inject_batch_planted(self, fault: Fault, rng: random.Random) -> None:
        """Put a FIFO, or a symlink to a copy of the same batch, in place of a waiting batch: the trainer
        must get a ProtocolError (not block), or the daemon must count it gone and build it again."""
        kind = rng.choice(["fifo", "symlink"])

        def plant(path: Path, g: int) -> str:
            tmp = path.with_name(f"{path.name}.planted-{uuid.uuid4().hex[:8]}")
            if kind == "fifo":
                os.mkfifo(tmp)
            else:
                copy = self.work / f"planted-{fault.index}.batch"
                shutil.copyfile(path, copy)
                os.symlink(copy, tmp)
            os.replace(tmp, path)
            return kind

        base = self.fresh_status()
        fault.check = lambda f, h: h.protocol_error_at(f) or h.counter_rose("vanished_batches", base, f.end)
        self._damage_waiting_batch(fault, rng, 1, plant)
        self.wait_until(lambda: fault.check is not None and fault.check(fault, self), 3.0)

    def inject_bad_start(self, fault: Fault, rng: random.Random) -> None:
        """Start daemons that must refuse at once, each with its exit code and a last line naming the
        path: a missing dataset, a buffer that is a symlink, one owned by another user, one that
        cannot be written.  The running job must not notice."""
        scratch = self.work / f"bad-start-{fault.index}"
        scratch.mkdir()
        cases: dict[str, tuple[Path, Path, int]] = {}  # variant: (buffer, the path the error must name, exit code)
        cases["missing dataset"] = (scratch / "bf-missing", self.work / "no-such-dataset", EXIT_FAILURE)
        real = scratch / "real"
        real.mkdir(mode=0o700)
        os.symlink(real, scratch / "bf-link")
        cases["symlinked buffer"] = (scratch / "bf-link", scratch / "bf-link", EXIT_USAGE)
        # Another job's buffer: a copy of the running job's manifest and batches, where a daemon of
        # another seed starts.  (On the live buffer it would need the job's daemon killed first, and
        # a restart costs a torch import; the refusal is the same.)
        foreign = scratch / "bf-job"
        foreign.mkdir(mode=0o700)
        shutil.copyfile(self.buffer / MANIFEST_NAME, foreign / MANIFEST_NAME)
        for path in list(list_batches(self.buffer).values())[:2]:
            try:
                shutil.copyfile(path, foreign / path.name)
            except FileNotFoundError:
                pass  # consumed meanwhile
        kept = sorted(list_batches(foreign))
        cases["another job's buffer"] = (foreign, foreign, EXIT_USAGE)
        if os.geteuid() == 0:
            other = scratch / "bf-other"
            other.mkdir(mode=0o700)
            os.chown(other, 65534, 65534)
            cases["another user's buffer"] = (other, other, EXIT_USAGE)
            if self.readonly is not None:  # root writes through any mode bits: a read-only mount it is
                cases["unwritable buffer"] = (self.readonly / "bf", self.readonly / "bf", EXIT_USAGE)
            else:
                self.unavailable["bad_start: unwritable buffer"] = "as root it needs mount(8) for a read-only tmpfs"
        else:
            self.unavailable["bad_start: another user's buffer"] = "needs root to chown a directory to another user"
            locked = scratch / "bf-readonly"
            locked.mkdir(mode=0o500)
            cases["unwritable buffer"] = (locked, locked, EXIT_USAGE)
        procs = {}
        for name, (buffer, _, _) in cases.items():
            log = scratch / f"{name.replace(' ', '-').replace(chr(39), '')}.log"
            args = self.daemon_args()
            if name == "missing dataset":
                args[args.index("--data") + 1] = str(cases[name][1])
            if name == "another job's buffer":
                args[args.index("--seed") + 1] = "8"
            proc = self.spawn([self.s.python, "-m", "prefetchd", "start", "--buffer", str(buffer), *args], log)
            self.expected_exits.add(proc.pid)
            procs[name] = (proc, log)
        fault.t_inject = time.time()
        self.wait_until(lambda: all(p.poll() is not None for p, _ in procs.values()), 60)
        verdicts = {}
        for name, (proc, log) in procs.items():
            rc = proc.poll()
            if rc is None:
                proc.kill()
                proc.wait()
            _, named, want = cases[name]
            text = log.read_text(errors="replace").strip().splitlines()
            good = rc == want and bool(text) and str(named) in text[-1] and not any("Traceback" in t for t in text)
            if name == "another job's buffer":  # refused without clearing it
                good = good and sorted(list_batches(foreign)) == kept and Manifest.read(foreign).seed == 7
            verdicts[name] = good
            if not good:
                also = " with the other job's batches and manifest left alone" if name == "another job's buffer" else ""
                self.daemon_exits.append(f"bad start '{name}' (pid {proc.pid}) "
                                         f"{'still running after 60 s' if rc is None else describe_exit(rc)}; expected "
                                         f"exit code {want} and a last line naming {named}{also}; its log:{log_tail(log)}")
        fault.t_ref = time.time()
        fault.detail = ", ".join(f"{n} {'refused' if ok else 'NOT refused'}" for n, ok in verdicts.items())
        fault.data["verdicts"] = verdicts
        fault.check = lambda f, h: all(f.data["verdicts"].values())

    def inject_consumer_kill(self, fault: Fault, rng: random.Random) -> None:
        """Run a second, named consumer beside the trainer, SIGKILL it at a seeded point, and once the
        daemon's status says it is gone (or 10 s) and a seeded delay has passed, resume it from its
        checkpoint.  It must get exactly the batches it missed, and the trainer must not wait for it.

        Its whole life is within this fault (it ends ``extra_batches`` positions after it joined), so no
        other fault meets two readers of a batch.
        """
        session = self.extra_runs // 2
        log_path, _ = self.extra_paths(session)
        log = LogReader(log_path)
        kill_after = rng.randint(1, self.extra_batches - 2)  # batches it logs before the kill: mid-run
        delay = rng.uniform(0.2, 1.5)
        first = self.extra_driver()

        def logged() -> int:
            log.poll()
            return sum(1 for r in log.records if "sha" in r)

        self.wait_until(lambda: logged() >= kill_after or first.poll() is not None, RECOVERY_TIMEOUT)
        time.sleep(rng.uniform(0, self.s.step_seconds))  # anywhere in a step: before or after its checkpoint
        fault.t_inject = t = time.time()
        pid = first.pid
        if first.poll() is not None:
            self.trainer_crashes.append(f"extra consumer (pid {pid}) {describe_exit(first.returncode)} before it was "
                                        f"killed; its log:{log_tail(self.work / f'extra-{2 * session}.err')}")
        self.expected_exits.add(pid)
        first.kill()
        first.wait()
        # The restart is the harness's doing; the daemon's noticing is what is checked.
        gone = self.wait_until(lambda: any(x.heartbeat > t and (EXTRA_CONSUMER, pid, False) in x.consumers
                                           for x in self.statuses), 10.0)
        self.sleep(max(0.0, t + delay - time.time()))
        fault.t_ref = time.time()
        second = self.extra_driver()
        batches = self.extra_batches
        if not self.wait_until(lambda: second.poll() is not None, RECOVERY_TIMEOUT + batches * (self.s.step_seconds + 1)):
            self.hangs += 1
            self.problems.append(f"consumer_kill: the resumed extra consumer (pid {second.pid}) had not read its "
                                 f"{batches} positions after {RECOVERY_TIMEOUT:.0f} s; its log:"
                                 f"{log_tail(self.work / f'extra-{2 * session + 1}.err')}")
        elif second.returncode != 0:
            self.trainer_crashes.append(f"resumed extra consumer (pid {second.pid}) {describe_exit(second.returncode)}; "
                                        f"its log:{log_tail(self.work / f'extra-{2 * session + 1}.err')}")
        log.poll()
        fault.data.update(gone=gone, records=log.records, session=session)
        # The trainer went on meanwhile: its longest wait for a batch while the extra consumer was dead or catching up.
        times = [t, *(r["t"] for r in self.log.records if "sha" in r and r["t"] > t), time.time()]
        stall = max(b - a for a, b in zip(times, times[1:]))
        if stall > RECOVERY_TIMEOUT:
            self.problems.append(f"consumer_kill: the trainer waited {stall:.1f} s for a batch after the extra "
                                 f"consumer was killed (more than the {RECOVERY_TIMEOUT:.0f} s recovery bound)")
        fault.detail = (f"after {kill_after} batches, resumed after {fault.t_ref - t:.1f} s; "
                        f"the trainer's longest wait {stall:.1f} s")
        fault.check = lambda f, h: bool(f.data["gone"])

    def check_extra_consumer(self, fault: Fault, ref: dict[int, dict[str, Any]]) -> None:
        """The extra consumer's batches, as the trainer's: each position from where it joined exactly once,
        identical to the reference (``account``)."""
        records: list[dict[str, Any]] = fault.data.get("records", [])
        starts = [r for r in records if r.get("event") == "start" and r["run"] == 0]
        if not starts:
            self.problems.append(f"consumer_kill {fault.index}: the extra consumer never started")
            return
        first = starts[0]["epoch"] * self.steps + starts[0]["step"]
        end = min(first + self.extra_batches, self.positions)
        acc = account(records, ref, self.steps, end, len(self.samples), first=first)
        wrong = {k: acc[k] for k in ("lost", "duplicated", "different", "out_of_order") if acc[k]}
        if wrong or acc["committed"] != end - first:
            self.problems.append(f"consumer_kill {fault.index}: the extra consumer's positions {first}..{end - 1}: "
                                 f"{acc['committed']} committed, {wrong}")
        self.problems += [f"consumer_kill {fault.index}, the extra consumer: {p}" for p in acc["problems"]]
        fault.data["replayed"] = acc["replayed"]

    RAY_NODE = {"num_cpus": 1, "object_store_memory": 100 * 2**20}  # Ray's floor is 75 MiB

    def start_cluster(self) -> None:
        """A local Ray cluster: a head without CPUs, so that every remote slice runs on ``ray_node``."""
        try:
            from ray.cluster_utils import Cluster
        except ImportError:
            for kind in RAY_KINDS:
                self.unavailable[kind] = "needs Ray: pip install -e '.[ray]'"
            self.s.kinds = tuple(k for k in self.s.kinds if k not in RAY_KINDS)
            return
        self.cluster = Cluster(initialize_head=True, head_node_args={**self.RAY_NODE, "num_cpus": 0})
        self.ray_node = self.cluster.add_node(**self.RAY_NODE)
        self.cluster.wait_for_nodes()

    def inject_remote_node_lost(self, fault: Fault, rng: random.Random) -> None:
        old = self.ray_node
        self.cluster.remove_node(old, allow_graceful=False)  # SIGKILL, as a machine that goes away
        self.ray_node = self.cluster.add_node(**self.RAY_NODE)
        new = str(self.ray_node.node_id)[:8]
        fault.detail = f"node {str(old.node_id)[:8]} killed, {new} joined"
        fault.check = lambda f, h: any(x.heartbeat > f.t_inject and any(n.endswith("/" + new) for n in x.remote_nodes)
                                       for x in h.statuses)
        # The remote-only stretch of the run: until the new node has built slices (its Ray worker imports torch).
        self.wait_until(lambda: fault.check is not None and fault.check(fault, self), 60.0)

    def inject_trainer_crash(self, fault: Fault, rng: random.Random) -> None:
        """Self-test, not a fault of the system: SIGTERM the trainer behind the harness's back, as a bug
        would end it.  ``supervise`` restarts it and the run must be reported failed."""
        assert self.driver is not None
        fault.t_inject = time.time()
        self.driver.send_signal(signal.SIGTERM)
        fault.detail = f"pid {self.driver.pid}"

    # -- evaluation --------------------------------------------------------------

    def protocol_error_at(self, fault: Fault) -> bool:
        g = fault.data.get("g")
        return any(r.get("event") == "protocol_error" and r["epoch"] * self.steps + r["step"] == g
                   and r["t"] >= fault.t_inject for r in self.log.records)

    def false_alarms(self, faults: list[Fault]) -> list[str]:
        """DaemonStuck the trainer raised about a daemon no daemon_stuck fault had stopped (or after it
        had been continued or replaced, and the trainer had a batch again)."""
        stopped = [(f.data["pid"], f.t_inject, f.t_ref + (f.recovery or 0.0) + 1.0)
                   for f in faults if f.kind == "daemon_stuck" and "pid" in f.data]
        return [f"the trainer said daemon pid {r.get('pid')} was stuck at epoch {r['epoch']} step {r['step']}, "
                f"no fault had stopped it: {r.get('error', '')[:200]}"
                for r in self.log.records if r.get("event") == "daemon_stuck"
                and not any(pid == r.get("pid") and lo <= r["t"] <= hi for pid, lo, hi in stopped)]

    def evaluate(self, ref: dict[int, dict[str, Any]], faults: list[Fault], seconds: float, ref_seconds: float) -> Report:
        records = self.log.records
        for f, nxt in zip(faults, [*faults[1:], None]):
            f.data["t_end"] = nxt.t_inject if nxt else float("inf")
            after = [r["t"] for r in records if "sha" in r and r["t"] > f.t_ref]
            f.recovery = (min(after) - f.t_ref) if after else None
            f.detected = bool(f.check and f.check(f, self))
        deleted = frozenset(f.data["index"] for f in faults if f.kind == "dataset_delete" and "index" in f.data)
        acc = account(records, ref, self.steps, self.positions, len(self.samples), deleted)
        acc["problems"] += self.false_alarms(faults)
        for f in faults:
            if f.kind == "consumer_kill":
                self.check_extra_consumer(f, ref)
        acc["problems"] += self.problems
        unrecovered = sum(1 for f in faults if f.recovery is None)  # the margin leaves batches after each
        return Report(
            settings={k: str(v) for k, v in dataclasses.asdict(self.s).items()}, faults=faults,
            positions=self.positions, **acc,
            protocol_errors=sum(1 for r in records if r.get("event") == "protocol_error"),
            trainer_crashes=self.trainer_crashes, daemon_exits=self.daemon_exits, hangs=self.hangs,
            unrecovered=unrecovered, seconds=seconds, reference_seconds=ref_seconds, skipped=self.skipped,
            unavailable=self.unavailable,
        )


def sorted_samples(root: Path) -> list[str]:
    """Relative paths in ImageFolder's order (sample i is the i-th)."""
    from torchvision.datasets import ImageFolder

    return [os.path.relpath(p, root) for p, _ in ImageFolder(str(root)).samples]


def run_suite(settings: Settings) -> Report:
    harness = Harness(settings)
    try:
        return harness.run()
    finally:
        harness.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run the fault-injection suite and print its table.")
    p.add_argument("--faults", type=int, default=260,
                   help=f"faults to inject (default: the long run's 260; the test's short run: {len(KINDS)})")
    p.add_argument("--seed", type=int, default=1, help="schedule seed (the long run: 1; the short run: 3)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"comma-separated subset of: {', '.join(KINDS)}; {', '.join(RAY_KINDS)} (starts a Ray cluster: "
                        f"run in a loopback-only network namespace); or {', '.join(SELF_TEST_KINDS)}, which must fail the run")
    p.add_argument("--workdir", type=Path, help="default: a fresh directory under /dev/shm, removed afterwards")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = set(kinds) - set(KINDS) - set(RAY_KINDS) - set(SELF_TEST_KINDS)
    if unknown:
        p.error(f"unknown kinds: {', '.join(sorted(unknown))}")
    work = args.workdir or Path("/dev/shm") / f"prefetchd-faults-{uuid.uuid4().hex[:8]}"
    try:
        report = run_suite(Settings(workdir=work, faults=args.faults, seed=args.seed, kinds=kinds))
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(report.table())
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=1))
    return 0 if report.ok and not report.missed else 1


if __name__ == "__main__":
    sys.exit(main())
