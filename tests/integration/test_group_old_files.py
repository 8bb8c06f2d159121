"""Files older prefetchd versions left 0600 in a service's buffer (a daemon of its own user, --group-access, and a
trainer of another member of its group), with real users.

A trainer of an older prefetchd under umask 077 left its progress.json and progress.json.lock 0600: the daemon said
only "cannot open a progress document (Permission denied); check the buffer's owner and permissions".  Now it says
whose the file is, its mode and what to do, once, and goes on serving the other trainers.

A daemon started under umask 077 without --group-access (or by an older prefetchd) left its batches, manifest and
lock 0600, and a later daemon started with --group-access on the same job kept them so: the member's trainer
failed on the first of them.  Now a --group-access daemon gives the group read on its own files at start, never
through a link nor on a file with another name elsewhere."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sysconfig
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import prefetchd
from prefetchd.buffer_protocol import Progress, ProtocolError, list_batches, read_status
from prefetchd.synthetic import make_shapes_dataset
from tests.group_users import NEEDS_ROOT_AND_USERADD, Users, chown_tree, python_for, service_users, stop_and_clean
from tests.waiting import wait_for

pytestmark = NEEDS_ROOT_AND_USERADD

SOURCE_ROOT = Path(prefetchd.__file__).resolve().parents[1]
# Two epochs of 4 batches with a high-water mark of 2: the daemon builds the third batch only once it has read
# that the trainer is past the first.
READ = """
import sys
from prefetchd.trainer import BufferLoader
with BufferLoader(sys.argv[1], normalize=False, timeout=20, consumer=sys.argv[2]) as loader:
    print(sum(1 for _ in loader) + sum(1 for _ in loader))
"""
JOB = ["--batch-size", "4", "--image-size", "32", "--workers", "1", "--high-water", "2"]


class Service:
    """A buffer of the daemon's user under /dev/shm, its daemons and the group's other member."""

    def __init__(self, users: Users, base: Path) -> None:
        self.users, self.base = users, base
        self.data, self.buffer, self.log = base / "data", base / "bf", base / "daemon.log"
        make_shapes_dataset(self.data, classes=2, train_per_class=8, val_per_class=2, seed=1)
        (base / "cache").mkdir()
        chown_tree(base, users.daemon_uid, users.gid, 0o750)  # the group may enter, to reach the buffer
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(base), "LANG": "C.UTF-8",
                    "PYTHONPATH": os.pathsep.join([str(SOURCE_ROOT), sysconfig.get_paths()["purelib"]])}
        self.python = python_for(users.daemon, self.env)
        self.trainer_python = python_for(users.trainer, self.env, "prefetchd.trainer")
        self.daemon: subprocess.Popen[bytes] | None = None

    def start(self, *flags: str, umask: int = 0o007) -> subprocess.Popen[bytes]:
        """The daemon of the job, with ``flags``, as the daemon's user under ``umask``."""
        with open(self.log, "ab") as out:
            self.daemon = subprocess.Popen(
                [self.python, "-m", "prefetchd", "start", "--buffer", str(self.buffer), "--data",
                 str(self.data / "train"), "--index-cache", str(self.base / "cache"), *JOB, *flags],
                user=self.users.daemon_uid, group=self.users.gid, extra_groups=[], umask=umask,
                env=self.env, cwd=self.base, stdout=out, stderr=subprocess.STDOUT)
        return self.daemon

    def stop(self) -> None:
        assert self.daemon is not None
        self.daemon.send_signal(signal.SIGTERM)
        assert self.daemon.wait(30) == 0, self.said()

    def said(self) -> str:
        listing = subprocess.run(["ls", "-la", str(self.buffer)], capture_output=True, text=True).stdout
        return f"ls -la {self.buffer}:\n{listing}\ndaemon log:\n{self.log.read_text(errors='replace')}"

    def wait(self, predicate: Callable[[], object], timeout: float, what: str) -> None:
        try:
            wait_for(predicate, timeout, what, self.daemon)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.said()}") from None

    def read_job(self, consumer: str = "") -> subprocess.CompletedProcess[str]:
        """A trainer of the group's other member reads the whole job as ``consumer``."""
        return subprocess.run(["runuser", "-u", self.users.trainer, "--", self.trainer_python, "-c", READ,
                               str(self.buffer), consumer], env=self.env, cwd=self.base, capture_output=True,
                              text=True, timeout=120)


@pytest.fixture
def service() -> Iterator[Service]:
    with service_users() as users:
        base = Path("/dev/shm") / f"prefetchd-test-old-{uuid.uuid4().hex[:10]}"
        base.mkdir()
        made = None
        try:
            made = Service(users, base)
            yield made
        finally:
            stop_and_clean(made.daemon if made is not None else None, base)


def _status_pid(buffer: Path) -> int | None:
    try:
        status = read_status(buffer)
    except ProtocolError:  # being replaced
        return None
    return status.pid if status is not None else None


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_an_older_trainers_0600_files_are_said_with_whose_they_are_and_the_others_are_served(service: Service) -> None:
    """Consumer 'old''s progress file and its lock, the trainer's, 0600: the daemon says whose they are, their mode
    and what to do, once, and a trainer reading as another consumer reads the whole job, which the daemon deletes
    behind it.  Made readable as the log says (a chmod: no new file), they are read within seconds."""
    users, buffer = service.users, service.buffer
    daemon = service.start("--group-access")  # no --epochs: it goes on after the trainer leaves
    service.wait(lambda: len(list_batches(buffer)) == 2, 60, "the high-water mark")
    progress, lock = buffer / "progress.old.json", buffer / "progress.old.json.lock"
    # What an older trainer wrote, under umask 077: made aside and renamed in with its owner and mode, or the daemon
    # may read it in between (it did, under load) and keep the batches for consumer 'old' at (0, 0) for good.
    staging = service.base / "staging"
    staging.mkdir()
    Progress(0, 0).write(staging, "old")
    (staging / lock.name).touch()
    for path in (lock, progress):
        os.chown(staging / path.name, users.trainer_uid, users.gid)
        os.chmod(staging / path.name, 0o600)
        os.rename(staging / path.name, path)

    read = service.read_job("other")
    assert read.returncode == 0 and read.stdout.split() == ["8"], f"{read.stdout}{read.stderr}\n{service.said()}"
    service.wait(lambda: min(list_batches(buffer), default=(0, 0)) >= (2, 0), 30,
                 "the daemon to delete the consumed batches")
    assert daemon.poll() is None, service.said()
    log = service.log.read_text()
    said = [line.partition("prefetchd.daemon.stream: ")[2] for line in log.splitlines()
            if f"ignoring {progress}: " in line]
    trainer = f"{users.trainer} (uid {users.trainer_uid})"
    assert said == [
        f"ignoring {progress}: the daemon's user, {users.daemon} (uid {users.daemon_uid}), may not read it: it belongs "
        f"to {trainer} and has mode 0600; nor its lock {lock.name}, which belongs to {trainer} and has mode 0600. A "
        "trainer of an older prefetchd leaves them so under a umask such as 077 (trainers of this version write them "
        "0644 whatever the umask); meanwhile the daemon cannot tell where that trainer is, and keeps no batches for "
        f"it. Their owner can make them readable (`chmod 644 {progress} {lock}`) or remove them while no trainer reads "
        f"as consumer 'old' (`rm {progress} {lock}`), and should update their prefetchd"], service.said()

    for path in (progress, lock):
        os.chmod(path, 0o644)
    service.wait(lambda: "consumer 'old' joined rank 0" in service.log.read_text(), 30, "the daemon to read it")
    service.stop()


def test_a_group_access_daemon_lets_its_group_read_the_files_an_earlier_one_left_0600(service: Service) -> None:
    """A daemon under umask 077 without --group-access builds the job's first batches, 0600; the service's daemon
    (--group-access) on the same job keeps them and gives its group read on them and its other files, so the
    member's trainer reads the whole job.  A link and a second name of another file of the daemon's user, and
    a file of the trainer's, are left as they are."""
    users, buffer, base = service.users, service.buffer, service.base
    service.start("--epochs", "2", umask=0o077)
    service.wait(lambda: len(list_batches(buffer)) == 2, 60, "the high-water mark")
    service.stop()
    kept = sorted(list_batches(buffer).values())
    assert [_mode(path) for path in kept] == [0o600, 0o600], service.said()
    os.chmod(buffer, 0o2770)  # as an admin would have; the daemon does that itself too
    secret = base / "secret"
    secret.write_text("the daemon user's")
    os.chown(secret, users.daemon_uid, users.gid)
    os.chmod(secret, 0o600)
    (buffer / "linked").symlink_to(secret)
    os.link(secret, buffer / "hard")
    theirs = buffer / "theirs"
    theirs.touch(0o600)
    os.chown(theirs, users.trainer_uid, users.gid)

    daemon = service.start("--epochs", "2", "--group-access")
    service.wait(lambda: _status_pid(buffer) == daemon.pid, 60, "the daemon to start")
    assert [_mode(path) for path in kept] == [0o640, 0o640], service.said()
    assert _mode(buffer / "daemon.lock") == 0o640, service.said()
    read = service.read_job()
    assert read.returncode == 0 and read.stdout.split() == ["8"], f"{read.stdout}{read.stderr}\n{service.said()}"
    assert _mode(secret) == 0o600 and _mode(theirs) == 0o600, service.said()
    log = service.log.read_text()
    assert (f"gave the buffer's group read access to 5 files of the daemon's in {buffer}, which an earlier daemon "
            "left without it (started under umask 077, or without --group-access): the group's trainers read them"
            in log), service.said()  # daemon.lock, manifest.json, status.json and the two batches
    assert f"leaving {buffer}/hard as it is (mode 0600): it has 2 names" in log, service.said()
    service.stop()
