"""Fault injection on real processes: a daemon and a trainer (``driver.py``) run a
multi-epoch job while a seeded schedule breaks things; the batches the trainer
received are then compared with a fault-free run of the same job.

The promise checked: whatever fails, the trainer gets every batch exactly
once, bit-identical to the fault-free run, or a clear error -- never a silent
gap, a duplicate, a hang or a crash loop.

Run the long version and print its table::

    PYTHONPATH=$PWD python -m tests.faults.harness --faults 260 --seed 1

How the comparison works (see ``driver.py`` for the commit semantics): each
line the trainer logged is either *committed* (it is part of the training
run) or a *replay* (received again after a crash because the checkpoint had
not moved past it).  Committed positions must be exactly 0 .. N-1 in order;
every line, replays included, must equal the fault-free run's batch (indices,
labels, sha256 of the image and label bytes).  The one accepted difference is
a sample the bad-sample policy replaced while the harness had its file moved
away (``dataset_delete``): that slot must hold the next sample of the split,
every other slot must be identical, and the batch must say ``replaced``.

Fault kinds (``KINDS``); a fault is *detected* when the system noticed it:

=================== ===================================================== =================================
kind                what is done                                          detected when
=================== ===================================================== =================================
daemon_kill         SIGKILL the daemon (half the time while a ``.tmp``     the restarted daemon owns the
                    batch is being written), start another                buffer again
trainer_kill        SIGKILL the trainer, restart it from its checkpoint   the new run resumed (start line)
trainer_stop        SIGSTOP the trainer until the daemon reports the      status.json said ``full`` while
                    buffer ``full``, a while longer, then SIGCONT         the trainer was stopped
enospc              fill the buffer's small tmpfs (root only) to less     the daemon logged a failed write
                    than a batch free, until a write fails, then free it  (ENOSPC) or a low-space pause
batch_corrupt       flip a byte of the header or metadata of a waiting    the trainer got a ProtocolError
                    batch (not yet opened by the trainer)                 for it
batch_truncate      truncate a waiting batch (not yet opened)             as for batch_corrupt
batch_delete        delete a waiting batch                                the daemon logged it missing
progress_garbage    overwrite progress.json with garbage bytes, JSON of   the daemon logged it ignored it
                    another format, or a truncated document
progress_rewind     rewrite progress.json with an older position         the daemon logged the move back
second_daemon       start a second daemon on the buffer                   it was refused (non-zero exit,
                                                                          "owned by a running daemon")
dataset_delete      move a dataset file away until a batch that needed    a delivered batch says
                    it was built, then put it back                        ``replaced`` or the daemon logged
                                                                          the undecodable file
=================== ===================================================== =================================

Limits (see docs/RELIABILITY.md): payload bytes carry no checksum, so
``batch_corrupt`` only touches what the protocol checks (header and metadata);
a batch the trainer already mapped is never truncated (that is a SIGBUS by
design of mmap); ``enospc`` needs root for its small tmpfs; a deleted dataset
file is put back before the next fault (a daemon restarted while it is gone
sees another dataset fingerprint and refuses the buffer, by design).
"""

from __future__ import annotations

import argparse
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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from prefetchd.buffer_protocol import State, batch_name, daemon_pid, list_batches, read_status
from prefetchd.buffer_protocol.batch import HEADER

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).resolve().with_name("driver.py")

KINDS = (
    "daemon_kill", "trainer_kill", "trainer_stop", "enospc", "batch_corrupt", "batch_truncate",
    "batch_delete", "progress_garbage", "progress_rewind", "second_daemon", "dataset_delete",
)
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
}
RECOVERY_TIMEOUT = 90.0  # no batch for this long after a fault is a hang
PAGE = 4096


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
    python: str = sys.executable


@dataclass
class Fault:
    kind: str
    index: int
    t_inject: float
    t_ref: float = 0.0  # recovery is measured from here: the injection, or the end of a hold
    detail: str = ""
    mark: tuple[int, int] = (0, 0)  # (daemon log number, offset) at injection
    check: Callable[[Fault, Harness], bool] | None = None
    detected: bool = False
    recovery: float | None = None
    data: dict[str, Any] = field(default_factory=dict)


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

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.different or self.out_of_order or self.hangs
                    or self.unrecovered or self.problems)

    def table(self) -> str:
        by_kind: dict[str, list[Fault]] = {}
        for f in self.faults:
            by_kind.setdefault(f.kind, []).append(f)
        lines = [f"{'fault':<28} {'injected':>8} {'detected':>8} {'recovery p50 / max (s)':>24}"]
        for kind in KINDS:
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
        for p in self.problems[:20]:
            lines.append(f"PROBLEM: {p}")
        for c in self.trainer_crashes[:5]:
            lines.append(f"trainer exit: {c}")
        for c in self.daemon_exits[:5]:
            lines.append(f"daemon exit: {c}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "faults"}
        doc["faults"] = [{"kind": f.kind, "detail": f.detail, "detected": f.detected, "recovery": f.recovery}
                         for f in self.faults]
        return doc


class LogReader:
    """The driver's JSON lines, read incrementally; a line cut by a kill is skipped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.records: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        new = []
        for line in data[: end + 1].splitlines():
            try:
                new.append(json.loads(line))
            except ValueError:
                continue
        self.records.extend(new)
        return new


def read_log(path: Path) -> list[dict[str, Any]]:
    reader = LogReader(path)
    reader.poll()
    return reader.records


class Harness:
    def __init__(self, s: Settings) -> None:
        self.s = s
        self.work = s.workdir
        self.work.mkdir(parents=True, exist_ok=True)
        path = os.environ.get("PYTHONPATH")
        self.env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}
        self.mount: Path | None = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.daemon_logs: list[Path] = []
        self.daemon: subprocess.Popen[bytes] | None = None
        self.driver: subprocess.Popen[bytes] | None = None
        self.spare: subprocess.Popen[bytes] | None = None
        self.run_id = -1
        self.trainer_crashes: list[str] = []
        self.daemon_exits: list[str] = []
        self.pending_second: list[tuple[Fault, subprocess.Popen[bytes], Path]] = []
        self.hangs = 0
        self.skipped = 0
        self.finished = False

    # -- setup -------------------------------------------------------------------

    def prepare(self) -> None:
        from prefetchd.synthetic import make_shapes_dataset

        root = self.work / "data"
        if not (root / "train").is_dir():
            make_shapes_dataset(root, classes=3, train_per_class=24, val_per_class=1, seed=1)
        self.data = root / "train"
        self.samples = sorted_samples(self.data)
        self.steps = -(-len(self.samples) // self.s.batch_size)
        # Room for the gaps and for what the trainer consumes while a fault is being handled.
        total = self.s.faults * (sum(self.s.gap) // 2 + 20) + 40
        self.epochs = -(-total // self.steps)
        self.positions = self.epochs * self.steps
        self.ref_buffer = self.work / "ref"
        self.buffer = self.work / "bf"
        self.removed = self.work / "removed"
        self.removed.mkdir(exist_ok=True)
        if "enospc" in self.s.kinds:
            if os.geteuid() != 0 or shutil.which("mount") is None:
                self.s.kinds = tuple(k for k in self.s.kinds if k != "enospc")
            else:
                self.mount = self.work / "mnt"
                self.mount.mkdir(exist_ok=True)
                # Room for the high-water mark and the documents, little more: easy to fill.
                size = max(1 << 20, 4 * self.s.high_water * self.batch_bytes())
                subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(self.mount)],
                               check=True)
                self.buffer = self.mount / "bf"

    def batch_bytes(self) -> int:
        n, size = self.s.batch_size, self.s.image_size
        return PAGE + -(-n * size * size * 3 // PAGE) * PAGE + 2 * -(-n * 8 // PAGE) * PAGE

    def daemon_args(self) -> list[str]:
        s = self.s
        return ["--data", str(self.data), "--batch-size", str(s.batch_size), "--image-size", str(s.image_size),
                "--workers", str(s.workers), "--seed", "7", "--epochs", str(self.epochs),
                "--high-water", str(s.high_water), "--low-water", str(s.low_water), "--min-free-mb", "0"]

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
                     go: Path | None = None) -> subprocess.Popen[bytes]:
        argv = [self.s.python, str(DRIVER), "--buffer", str(buffer), "--log", str(log), "--checkpoint",
                str(checkpoint), "--run", str(run), "--step-seconds", str(step_seconds), "--timeout", "120"]
        if go is not None:
            argv += ["--go", str(go)]
        return self.spawn(argv, self.work / f"driver-{run}.err")

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
        if self.mount is not None:
            if subprocess.run(["umount", str(self.mount)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(self.mount)], capture_output=True)

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
        self.ref_daemon.wait(60)
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
        if spare is None or spare.poll() is not None:
            spare = self._spare(self.run_id)
        (self.work / f"go-{self.run_id}").touch()
        self.driver = spare
        self.spare = self._spare(self.run_id + 1)

    def _spare(self, run: int) -> subprocess.Popen[bytes]:
        return self.start_driver(self.buffer, self.log_path, self.ckpt, run, self.s.step_seconds,
                                 go=self.work / f"go-{run}")

    def new_daemon(self) -> None:
        self.daemon = self.start_daemon(self.buffer)

    def daemon_mark(self) -> tuple[int, int]:
        log = self.daemon_logs[-1]
        return (len(self.daemon_logs) - 1, log.stat().st_size if log.exists() else 0)

    def daemon_text(self, start: tuple[int, int], end: tuple[int, int] | None) -> str:
        """Daemon log text written between two marks."""
        parts = []
        last = end[0] if end else len(self.daemon_logs) - 1
        for i in range(start[0], last + 1):
            path = self.daemon_logs[i]
            data = path.read_bytes() if path.exists() else b""
            lo = start[1] if i == start[0] else 0
            hi = end[1] if end and i == end[0] else len(data)
            parts.append(data[lo:hi].decode(errors="replace"))
        return "".join(parts)

    def supervise(self) -> None:
        """Notice processes that exited on their own, restart them, and read the trainer's log."""
        self.log.poll()
        assert self.driver is not None and self.daemon is not None
        rc = self.driver.poll()
        if rc is not None and not self.finished:
            self.log.poll()
            if rc == 0 and any(r.get("event") == "done" for r in self.log.records):
                self.finished = True
            else:
                err = (self.work / f"driver-{self.run_id}.err").read_text(errors="replace").strip().splitlines()
                self.trainer_crashes.append(f"run {self.run_id} exit {rc}: {err[-1] if err else ''}")
                if len(self.trainer_crashes) > 20:
                    raise RuntimeError("crash loop: the trainer died more than 20 times: " + "; ".join(self.trainer_crashes[-3:]))
                self.new_driver()
        rc = self.daemon.poll()
        if rc is not None and not self.finished:
            if not (rc == 0 and self.position() >= self.positions):
                text = self.daemon_logs[-1].read_text(errors="replace").strip().splitlines()
                self.daemon_exits.append(f"exit {rc}: {text[-1] if text else ''}")
                if len(self.daemon_exits) > 20:
                    raise RuntimeError("crash loop: the daemon died more than 20 times")
                self.new_daemon()
        for item in list(self.pending_second):
            fault, proc, log = item
            if proc.poll() is not None:
                fault.data["rc"] = proc.returncode
                fault.data["log"] = log.read_text(errors="replace")
                self.pending_second.remove(item)

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
        self.prepare()
        self.start_reference()
        self.log_path, self.ckpt = self.work / "trainer.jsonl", self.work / "trainer.ckpt"
        for p in (self.log_path, self.ckpt):
            p.unlink(missing_ok=True)
        self.log = LogReader(self.log_path)
        rng = random.Random(self.s.seed)
        plan: list[str] = []
        while len(plan) < self.s.faults:
            round_ = list(self.s.kinds)
            rng.shuffle(round_)
            plan += round_
        plan = plan[: self.s.faults]
        faults: list[Fault] = []
        started = time.monotonic()
        self.new_daemon()
        self.new_driver()
        margin = 2 * self.s.high_water + 4
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
            fault = Fault(kind, i, time.time(), mark=self.daemon_mark())
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
            remaining = self.positions - self.position()
            if not self.wait_until(lambda: self.finished, 120 + remaining * (self.s.step_seconds + 0.05)):
                self.hangs += 1
        self.wait_until(lambda: not self.pending_second, 60)
        if self.daemon is not None and self.finished:
            try:
                self.daemon.wait(30)
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
            self.wait_until(lambda: any(self.buffer.glob("*.tmp")), 1.0)
        mid = any(self.buffer.glob("*.tmp"))
        fault.t_inject = time.time()
        self.daemon.send_signal(signal.SIGKILL)
        self.daemon.wait()
        fault.detail = "mid-write" if mid else "idle"
        self.new_daemon()
        pid = self.daemon.pid
        fault.check = lambda f, h: f.data.get("owned", False)
        fault.data["owned"] = self.wait_until(lambda: daemon_pid(self.buffer) == pid, 60)

    def inject_trainer_kill(self, fault: Fault, rng: random.Random) -> None:
        assert self.driver is not None
        time.sleep(rng.uniform(0, self.s.step_seconds))  # anywhere in the step: before or after its checkpoint
        fault.t_inject = time.time()
        self.driver.send_signal(signal.SIGKILL)
        self.driver.wait()
        self.new_driver()
        run = self.run_id
        fault.check = lambda f, h: any(r.get("event") == "start" and r.get("run") == run for r in h.log.records)

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
        full = False
        end = time.monotonic() + 10
        while time.monotonic() < end and not full:
            try:
                full = (s := read_status(self.buffer)) is not None and s.state == State.FULL
            except Exception:
                pass
            time.sleep(0.02)
        time.sleep(rng.uniform(0.1, 0.5))  # longer than the buffer lasts: it has been full a while
        self._cont()
        fault.t_ref = time.time()
        fault.detail = "full" if full else "not full"
        fault.data["full"] = full
        fault.check = lambda f, h: bool(f.data["full"])

    def inject_enospc(self, fault: Fault, rng: random.Random) -> None:
        assert self.mount is not None
        filler = self.mount / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            leave = 3 * PAGE  # less than any batch, enough for the small JSON documents
            for _ in range(20):
                st = os.statvfs(self.mount)
                free = st.f_bavail * st.f_frsize
                try:
                    os.posix_fallocate(fd, 0, os.fstat(fd).st_size + max(0, free - leave))
                    break
                except OSError:
                    continue
        finally:
            os.close(fd)
        mark = self.daemon_mark()
        hit = self.wait_until(lambda: "No space left" in self.daemon_text(mark, None) or "paused" in self.daemon_text(mark, None), 5.0)
        time.sleep(rng.uniform(0.0, 0.3))
        filler.unlink()
        fault.t_ref = time.time()
        text = self.daemon_text(mark, None)
        fault.detail = "ENOSPC" if "No space left" in text else "paused" if "paused" in text else "not noticed"
        fault.check = lambda f, h: "No space left" in h.daemon_text(f.mark, f.data.get("end")) or "paused" in h.daemon_text(f.mark, f.data.get("end"))

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
                              damage: Callable[[Path, int], str]) -> None:
        """With the trainer stopped, apply ``damage(path, g)`` (it returns the fault's detail) to a
        batch at least ``first_offset`` past the trainer's position, then let the trainer go on."""
        found = self._waiting_batch(rng, first_offset)
        try:
            if found is None:
                fault.detail = "no waiting batch"
                return
            path, g = found
            fault.detail = damage(path, g)
            fault.t_inject = time.time()
            fault.data["g"] = g
        finally:
            self._cont()

    def inject_batch_corrupt(self, fault: Fault, rng: random.Random) -> None:
        def flip(path: Path, g: int) -> str:
            with open(path, "r+b") as f:
                head = f.read(HEADER.size)
                meta_len = HEADER.unpack(head)[3]
                # What the reader checks: the fixed header and the metadata.
                offset = rng.randrange(HEADER.size + meta_len)
                f.seek(offset)
                byte = f.read(1)[0]
                f.seek(offset)
                f.write(bytes([byte ^ (1 << rng.randrange(8))]))
            return f"byte {offset}"

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
            name = path.name
            fault.check = lambda f, h: name in h.daemon_text(f.mark, f.data.get("end"))
            return "next" if g == self.position() else "later"

        # Also the batch it waits for: unlinking a mapped file is safe.
        self._damage_waiting_batch(fault, rng, 0, delete)

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
        # The trainer is stopped meanwhile: otherwise its next step replaces the file before the daemon
        # has looked at it.  It stays stopped until the daemon noticed (or 2 s).
        self._stopped()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # in place, as a broken writer would
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            fault.t_inject = time.time()
            mark = self.daemon_mark()
            self.wait_until(lambda: "ignoring" in self.daemon_text(mark, None), 2.0)
        finally:
            self._cont()
        fault.t_ref = time.time()
        fault.detail = mode
        fault.check = lambda f, h: "ignoring" in h.daemon_text(f.mark, f.data.get("end"))

    def inject_progress_rewind(self, fault: Fault, rng: random.Random) -> None:
        if rng.random() < 0.5:
            return self._rewind_while_waiting(fault, rng)
        self._stopped()  # as for progress_garbage: the daemon sees the rewound file before the trainer moves on
        try:
            back = rng.randint(2, 3 * self.s.high_water)  # within the window, and past it
            g = max(0, self.position() - back)
            doc = {"format": "prefetchd.progress", "version": 1, "epoch": g // self.steps, "step": g % self.steps,
                   "pid": os.getpid(), "time": time.time()}
            tmp = self.buffer / f"progress.json.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.buffer / "progress.json")
            fault.t_inject = time.time()
            mark = self.daemon_mark()
            self.wait_until(lambda: "moved back" in self.daemon_text(mark, None), 2.0)
        finally:
            self._cont()
        fault.t_ref = time.time()
        fault.detail = f"back {back}"
        fault.check = lambda f, h: "moved back" in h.daemon_text(f.mark, f.data.get("end"))

    def _rewind_while_waiting(self, fault: Fault, rng: random.Random) -> None:
        """The trainer waits for a batch (the daemon is stopped meanwhile) when progress.json is
        rewound past the window: the daemon now builds other batches, and only the waiting loader
        can put its position back."""
        assert self.daemon is not None
        self.daemon.send_signal(signal.SIGSTOP)
        try:
            # Drained: no new batch for a while, so the trainer sits in its wait.
            self.wait_until(lambda: time.time() - self.last_batch_time() > 0.3, 10)
            g = max(0, self.position() - self.s.high_water - rng.randint(1, self.s.high_water))
            back = self.position() - g
            doc = {"format": "prefetchd.progress", "version": 1, "epoch": g // self.steps, "step": g % self.steps,
                   "pid": os.getpid(), "time": time.time()}
            tmp = self.buffer / f"progress.json.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.buffer / "progress.json")
        finally:
            self.daemon.send_signal(signal.SIGCONT)
        fault.t_inject = fault.t_ref = time.time()
        fault.detail = f"back {back}, trainer waiting"
        fault.check = lambda f, h: "moved back" in h.daemon_text(f.mark, f.data.get("end"))

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
        self.pending_second.append((fault, proc, log))
        first = self.daemon

        def check(f: Fault, h: Harness) -> bool:
            return (f.data.get("rc") not in (None, 0) and "owned by a running daemon" in f.data.get("log", "")
                    and f.data.get("first_alive", False))

        fault.check = check
        fault.data["first_alive"] = first is not None and first.poll() is None

    def inject_dataset_delete(self, fault: Fault, rng: random.Random) -> None:
        i = rng.randrange(len(self.samples))
        rel = self.samples[i]
        src = self.data / rel
        dest = self.removed / rel.replace("/", "__")
        os.rename(src, dest)
        mark = self.daemon_mark()
        t = time.time()
        try:
            hit = self.wait_until(lambda: any(r.get("replaced") and r["t"] > t for r in self.log.records[-50:])
                                  or rel in self.daemon_text(mark, None), 3.0)
        finally:
            os.rename(dest, src)
        fault.t_ref = time.time()
        fault.data["index"] = i
        fault.detail = "replaced" if hit else "not read while gone"
        fault.check = lambda f, h: any(r.get("replaced") and f.t_inject < r["t"] for r in h.log.records
                                       if r["t"] < f.data.get("t_end", float("inf"))) or rel in h.daemon_text(f.mark, f.data.get("end"))

    # -- evaluation --------------------------------------------------------------

    def protocol_error_at(self, fault: Fault) -> bool:
        g = fault.data.get("g")
        return any(r.get("event") == "protocol_error" and r["epoch"] * self.steps + r["step"] == g
                   and r["t"] >= fault.t_inject for r in self.log.records)

    def evaluate(self, ref: dict[int, dict[str, Any]], faults: list[Fault], seconds: float, ref_seconds: float) -> Report:
        records = self.log.records
        for f, nxt in zip(faults, [*faults[1:], None]):
            f.data["end"] = nxt.mark if nxt else None
            f.data["t_end"] = nxt.t_inject if nxt else float("inf")
            after = [r["t"] for r in records if "sha" in r and r["t"] > f.t_ref]
            f.recovery = (min(after) - f.t_ref) if after else None
            f.detected = bool(f.check and f.check(f, self))
        deleted = frozenset(f.data["index"] for f in faults if f.kind == "dataset_delete" and "index" in f.data)
        acc = account(records, ref, self.steps, self.positions, len(self.samples), deleted)
        unrecovered = sum(1 for f in faults if f.recovery is None)  # the margin leaves batches after each
        return Report(
            settings={k: str(v) for k, v in dataclasses.asdict(self.s).items()}, faults=faults,
            positions=self.positions, **acc,
            protocol_errors=sum(1 for r in records if r.get("event") == "protocol_error"),
            trainer_crashes=self.trainer_crashes, daemon_exits=self.daemon_exits, hangs=self.hangs,
            unrecovered=unrecovered, seconds=seconds, reference_seconds=ref_seconds, skipped=self.skipped,
        )


def account(records: list[dict[str, Any]], ref: dict[int, dict[str, Any]], steps: int, positions: int,
            samples: int, deleted: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Compare the trainer's log with the reference (see the module docstring for the rules)."""
    starts = {r["run"]: r["epoch"] * steps + r["step"] for r in records if r.get("event") == "start"}
    runs = sorted(starts)
    problems: list[str] = []
    committed: list[int] = []
    replayed = replaced = different = 0
    for run, nxt in zip(runs, [*runs[1:], None]):
        limit = starts[nxt] if nxt is not None else None
        again = 0
        for r in records:
            if r.get("run") != run or "sha" not in r:
                continue
            g = r["epoch"] * steps + r["step"]
            verdict = compare(r, ref.get(g), samples, deleted)
            if verdict == "replaced":
                replaced += 1
            elif verdict != "same":
                different += 1
                problems.append(f"run {run} epoch {r['epoch']} step {r['step']}: {verdict}")
            if limit is not None and g >= limit:
                again += 1
            else:
                committed.append(g)
        # The checkpoint follows every step, so a kill costs at most the one batch in training.
        if again > 1:
            problems.append(f"run {nxt} received {again} batches of run {run} again; at most 1 is expected")
        replayed += again
        if nxt is not None and starts[nxt] < starts[run]:
            problems.append(f"run {nxt} resumed at {starts[nxt]}, before run {run}'s start {starts[run]}")
    counts = Counter(committed)
    return {
        "committed": len(committed),
        "lost": sum(1 for g in range(positions) if g not in counts),
        "duplicated": sum(c - 1 for c in counts.values() if c > 1),
        "different": different,
        "out_of_order": sum(1 for a, b in zip(committed, committed[1:]) if b != a + 1),
        "replayed": replayed,
        "replaced_by_policy": replaced,
        "problems": problems,
    }


def sorted_samples(root: Path) -> list[str]:
    """Relative paths in ImageFolder's order (sample i is the i-th)."""
    from torchvision.datasets import ImageFolder

    return [os.path.relpath(p, root) for p, _ in ImageFolder(str(root)).samples]


def compare(got: dict[str, Any], want: dict[str, Any] | None, n: int, deleted: frozenset[int] = frozenset()) -> str:
    """"same", "replaced" (allowed: a sample replaced by the bad-sample policy) or what differs."""
    if want is None:
        return "position not in the reference run"
    if got["sha"] == want["sha"] and got["indices"] == want["indices"] and got["labels"] == want["labels"]:
        return "same"
    if not got.get("replaced") or len(got["indices"]) != len(want["indices"]):
        return "different content"
    swapped = 0
    for gi, wi, gs, ws in zip(got["indices"], want["indices"], got["slots"], want["slots"]):
        if gi == wi:
            if gs != ws:
                return f"sample {gi}'s image differs"
            continue
        # The next member of the split (every sample here) whose file was there: the ones in
        # between, and the sample itself, must be files the harness moved away.
        k = (gi - wi) % n
        if not 1 <= k < 16 or any((wi + j) % n not in deleted for j in range(k)):
            return f"sample {wi} became {gi}, which is not its replacement"
        swapped += 1
    return "replaced" if swapped == got["replaced"] else f"{swapped} samples swapped but {got['replaced']} reported"


def run_suite(settings: Settings) -> Report:
    harness = Harness(settings)
    try:
        return harness.run()
    finally:
        harness.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run the fault-injection suite and print its table.")
    p.add_argument("--faults", type=int, default=260)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of: " + ", ".join(KINDS))
    p.add_argument("--workdir", type=Path, help="default: a fresh directory under /dev/shm, removed afterwards")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    unknown = set(kinds) - set(KINDS)
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
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
