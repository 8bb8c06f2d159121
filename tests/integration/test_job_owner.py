"""Jobs from the buffer's group, with real users: a daemon running as one user with
--group-access refuses a job another user of its group submits when it names a transform
hook or data outside the config's allow-lists (and never imports such a hook), and runs
one that stays inside them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sysconfig
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import prefetchd
from prefetchd.buffer_protocol import JobResult, Manifest, State, list_batches, read_status
from tests.group_users import NEEDS_ROOT_AND_USERADD, Users, chown_tree, python_for, service_users, stop_and_clean
from tests.status_examples import job_result_of, state_of
from prefetchd.synthetic import make_shapes_dataset

pytestmark = NEEDS_ROOT_AND_USERADD

SOURCE_ROOT = Path(prefetchd.__file__).resolve().parents[1]
HOOK = '''"""A transform hook that leaves a mark when it is imported."""
from pathlib import Path

(Path(__file__).parents[1] / "markers" / __name__).write_text("imported")


def identity(image, rng):
    return image
'''


@pytest.fixture
def two_users() -> Iterator[Users]:
    with service_users() as users:
        yield users


def test_group_jobs_are_held_to_the_allow_lists(two_users: Users) -> None:
    users = two_users
    base = Path("/dev/shm") / f"prefetchd-owner-{uuid.uuid4().hex[:10]}"
    base.mkdir()
    daemon_proc: subprocess.Popen[bytes] | None = None
    try:
        # The daemon's tree; its group may enter it, to reach the buffer.
        allowed, secret, hooks, markers = base / "allowed", base / "secret", base / "hooks", base / "markers"
        make_shapes_dataset(allowed, classes=2, train_per_class=8, val_per_class=2, seed=1)
        make_shapes_dataset(secret, classes=2, train_per_class=8, val_per_class=2, seed=2)
        (allowed / "escape").symlink_to(secret / "train")  # inside the allowed root by name only
        some_secret = sorted((secret / "train").rglob("*.*"))[:4]
        (allowed / "list.csv").write_text("".join(f"{p},{p.parent.name}\n" for p in some_secret))
        hooks.mkdir()
        markers.mkdir()
        for name in ("pfd_denied_hook", "pfd_allowed_hook"):
            (hooks / f"{name}.py").write_text(HOOK)
        (base / "cache").mkdir()
        chown_tree(base, users.daemon_uid, users.gid, 0o750)
        chown_tree(secret, users.daemon_uid, users.gid, 0o700)  # what only the service may read

        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(base), "LANG": "C.UTF-8",
               "PYTHONPATH": os.pathsep.join([str(SOURCE_ROOT), str(hooks), sysconfig.get_paths()["purelib"]])}
        python = python_for(users.daemon, env)
        buffer = base / "bf"
        log = base / "daemon.log"
        with open(log, "wb") as out:
            daemon_proc = subprocess.Popen(
                [python, "-m", "prefetchd", "start", "--buffer", str(buffer), "--group-access", "--workers", "1",
                 "--high-water", "2", "--index-cache", str(base / "cache"), "--allowed-data", str(allowed),
                 "--allowed-transforms", "pfd_allowed_hook:identity"],
                user=users.daemon_uid, group=users.gid, extra_groups=[], env=env, cwd=base, stdout=out,
                stderr=subprocess.STDOUT)

        def daemon_log() -> str:
            return log.read_text(errors="replace")

        deadline = time.monotonic() + 60
        while state_of(buffer) != State.WAITING_FOR_JOB:
            assert daemon_proc.poll() is None and time.monotonic() < deadline, daemon_log()
            time.sleep(0.05)

        def submit(*args: str | Path) -> tuple[int, str]:
            """`prefetchd submit` as the other member of the group; its exit status and what it says."""
            out = subprocess.run(
                ["runuser", "-u", users.trainer, "--", python, "-m", "prefetchd", "submit", "--buffer", str(buffer),
                 "--batch-size", "4", "--image-size", "32", *map(str, args)],
                env=env, capture_output=True, text=True, timeout=120)
            result = job_result_of(buffer)
            assert os.stat(buffer / "job.json").st_uid == users.trainer_uid
            return out.returncode, f"{out.stdout}{out.stderr}\njob_result: {result}"

        code, said = submit("--data", allowed / "train", "--transform", "pfd_denied_hook:identity")
        assert code == 1 and "refused" in said and "allowed_transforms" in said, said
        assert "pfd_denied_hook:identity" in said and users.trainer in said, said

        code, said = submit("--data", secret / "train")
        assert code == 1 and "refused" in said and "allowed_data" in said, said

        # Symlinks are resolved: a link inside the allowed root to the secret data is the secret data.
        # Where it points is not said (the daemon may resolve links in folders the trainer cannot read).
        code, said = submit("--data", allowed / "escape")
        assert code == 1 and "allowed_data" in said and "after resolving symbolic links" in said, said
        assert str(secret) not in said, said

        # A file list inside the allowed root that names files outside it.
        code, said = submit("--data", allowed / "list.csv")
        assert code == 1 and "allowed_data" in said and str(some_secret[0]) in said, said

        assert daemon_proc.poll() is None, "a refused job must not stop the daemon:\n" + daemon_log()
        assert state_of(buffer) == State.WAITING_FOR_JOB
        assert list_batches(buffer) == {}

        code, said = submit("--data", allowed / "train", "--transform", "pfd_allowed_hook:identity")
        assert code == 0 and "accepted" in said, said + daemon_log()
        deadline = time.monotonic() + 60
        while not list_batches(buffer):
            assert daemon_proc.poll() is None and time.monotonic() < deadline, daemon_log()
            time.sleep(0.05)
        assert (markers / "pfd_allowed_hook").exists()
        # The refused hook's module was never imported, by the daemon nor by any worker.
        assert not (markers / "pfd_denied_hook").exists(), daemon_log()

        daemon_proc.send_signal(signal.SIGTERM)
        assert daemon_proc.wait(30) == 0, daemon_log()
    finally:
        stop_and_clean(daemon_proc, base)


class Scene:
    """The daemon's user's tree for the tests of requests and records renamed by a member: data the group may name
    (``allowed``, the daemon's allow-list), data only the daemon's user may read (``secret``), the buffer and its
    daemon's log; the daemon started as the daemon's user, commands run as either user."""

    def __init__(self, users: Users, base: Path) -> None:
        self.users, self.base = users, base
        self.allowed, self.secret = base / "allowed", base / "secret"
        self.buffer, self.log = base / "bf", base / "daemon.log"
        self.daemon: subprocess.Popen[bytes] | None = None
        make_shapes_dataset(self.allowed, classes=2, train_per_class=8, val_per_class=2, seed=1)
        make_shapes_dataset(self.secret, classes=2, train_per_class=8, val_per_class=2, seed=2)
        (base / "cache").mkdir()
        chown_tree(base, users.daemon_uid, users.gid, 0o750)
        chown_tree(self.secret, users.daemon_uid, users.gid, 0o700)
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(base), "LANG": "C.UTF-8",
                    "PYTHONPATH": os.pathsep.join([str(SOURCE_ROOT), sysconfig.get_paths()["purelib"]])}
        self.python = python_for(users.daemon, self.env)

    @classmethod
    @contextlib.contextmanager
    def made(cls, users: Users, name: str) -> Iterator[Scene]:
        base = Path("/dev/shm") / f"prefetchd-{name}-{uuid.uuid4().hex[:10]}"
        base.mkdir()
        scene: Scene | None = None
        try:
            scene = cls(users, base)
            yield scene
        finally:
            stop_and_clean(scene.daemon if scene is not None else None, base)

    def daemon_log(self) -> str:
        return self.log.read_text(errors="replace")

    def start_daemon(self) -> subprocess.Popen[bytes]:
        with open(self.log, "ab") as out:
            self.daemon = subprocess.Popen(
                [self.python, "-m", "prefetchd", "start", "--buffer", str(self.buffer), "--group-access", "--workers",
                 "1", "--high-water", "2", "--index-cache", str(self.base / "cache"), "--allowed-data",
                 str(self.allowed)],
                user=self.users.daemon_uid, group=self.users.gid, extra_groups=[], env=self.env, cwd=self.base,
                stdout=out, stderr=subprocess.STDOUT)
        return self.daemon

    def stop_daemon(self) -> None:
        assert self.daemon is not None
        self.daemon.send_signal(signal.SIGTERM)
        assert self.daemon.wait(30) == 0, self.daemon_log()

    def wait(self, done: Callable[[], bool], timeout: float = 60.0) -> None:
        """Until ``done()``, while the daemon runs."""
        deadline = time.monotonic() + timeout
        while not done():
            assert self.daemon is not None and self.daemon.poll() is None and time.monotonic() < deadline, \
                self.daemon_log()
            time.sleep(0.05)

    def as_user(self, user: str, *command: str | Path) -> str:
        done = subprocess.run(["runuser", "-u", user, "--", *map(str, command)], env=self.env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, f"{done.stdout}{done.stderr}{self.daemon_log()}"
        return done.stdout

    def submit(self, user: str, data: Path) -> str:
        """`prefetchd submit` as ``user``, accepted: the id of its job."""
        said = self.as_user(user, self.python, "-m", "prefetchd", "submit", "--buffer", self.buffer, "--batch-size",
                            "4", "--image-size", "32", "--data", data)
        assert " accepted: " in said, said + self.daemon_log()
        return said.split()[1]


def test_another_users_old_job_json_renamed_back_by_a_member_is_not_run_again(two_users: Users) -> None:
    """The buffer's folder is writable by its group and not sticky, so a member may rename any file there: the
    trainer kept the daemon's user's job.json aside (a job on data no member may name) before its own replaced it,
    and renamed it back.  The daemon ran that old job again, as the daemon's user's, and so beyond the allow-list.
    Renamed back at once it is older than the request answered since; renamed back to a restarted daemon, which
    knows of no such request, it was put in place an hour after it was written."""
    users = two_users
    with Scene.made(users, "replay") as scene:
        buffer, allowed, secret = scene.buffer, scene.allowed, scene.secret

        def answer_to(job_id: str) -> JobResult:
            result: JobResult | None = None

            def answered() -> bool:
                nonlocal result
                result = job_result_of(buffer)
                return result is not None and result.job_id == job_id
            scene.wait(answered, 30)
            assert result is not None
            return result

        def running_job() -> str | None:
            status = read_status(buffer)
            return status.running_job.job_id if status is not None and status.running_job is not None else None

        def refused_as_put_back(result: JobResult, *said: str) -> None:
            assert not result.accepted, f"the old job ran again: {result}\n{scene.daemon_log()}"
            assert result.submitter == users.daemon_uid, result
            for words in (str(buffer / "job.json"), users.daemon, "renamed back", f"prefetchd submit --buffer {buffer}",
                          *said):
                assert words in result.reason, result.reason
            assert running_job() == theirs and Manifest.read(buffer).dataset_root == str(allowed / "train")

        scene.start_daemon()
        scene.wait(lambda: state_of(buffer) == State.WAITING_FOR_JOB)

        mine = scene.submit(users.daemon, secret / "train")  # the daemon's user may name any data
        scene.as_user(users.trainer, "mv", buffer / "job.json", buffer / "kept.json")
        theirs = scene.submit(users.trainer, allowed / "train")
        assert Manifest.read(buffer).dataset_root == str(allowed / "train")
        scene.as_user(users.trainer, "mv", buffer / "kept.json", buffer / "job.json")
        assert os.stat(buffer / "job.json").st_uid == users.daemon_uid  # the daemon's user's file, as it was
        refused_as_put_back(answer_to(mine))

        # Kept again, and renamed back to the next daemon (a restart: the unit's, an upgrade), an hour later.
        scene.as_user(users.trainer, "mv", buffer / "job.json", buffer / "kept.json")
        scene.stop_daemon()
        hour_ago = os.stat(buffer / "kept.json").st_mtime_ns - 3600 * 10**9
        os.utime(buffer / "kept.json", ns=(hour_ago, hour_ago))  # as its owner wrote it, an hour before
        scene.start_daemon()
        scene.wait(lambda: running_job() == theirs and state_of(buffer) not in (State.STOPPED, State.STARTING))
        scene.as_user(users.trainer, "mv", buffer / "kept.json", buffer / "job.json")
        refused_as_put_back(answer_to(mine), "s after it was written")

        # A new request is taken however soon it follows another: the trainer's own job again, twice at once,
        # and the daemon's user's old job, submitted again by that user.
        scene.submit(users.trainer, allowed / "train")
        scene.submit(users.trainer, allowed / "train")
        again = scene.submit(users.daemon, secret / "train")
        assert running_job() == again and Manifest.read(buffer).dataset_root == str(secret / "train")
        scene.stop_daemon()


def test_the_daemons_record_of_a_members_job_renamed_to_job_json_is_not_the_daemons_users_job(two_users: Users) -> None:
    """The daemon keeps the job it accepted as job.accepted.json, its own file, in the job document's format: a member
    renamed it to job.json at once, and the daemon read it as a request of its own user's, held to no allow-list.
    The member's job named a link of theirs to allowed data, which the member then pointed at data only the daemon
    may read: run as the daemon's user's, that job produced those pixels for the member's group."""
    users = two_users
    with Scene.made(users, "record") as scene:
        buffer, allowed, secret, mine = scene.buffer, scene.allowed, scene.secret, scene.base / "mine"
        mine.mkdir()
        os.chown(mine, users.trainer_uid, users.gid)
        scene.start_daemon()
        scene.wait(lambda: state_of(buffer) == State.WAITING_FOR_JOB)

        scene.as_user(users.trainer, "ln", "-s", allowed / "train", mine / "data")
        scene.submit(users.trainer, mine / "data")
        assert (buffer / "job.accepted.json").stat().st_uid == users.daemon_uid
        scene.as_user(users.trainer, "ln", "-sfn", secret / "train", mine / "data")
        scene.as_user(users.trainer, "mv", buffer / "job.accepted.json", buffer / "job.json")
        scene.wait(lambda: (r := job_result_of(buffer)) is not None and r.submitter == users.daemon_uid, 10)
        result = job_result_of(buffer)
        assert result is not None and not result.accepted, \
            f"the member's job ran as the daemon's user's: {result}\n{scene.daemon_log()}"
        for words in ("job.accepted.json", "record", "prefetchd submit"):
            assert words in result.reason, result.reason
        time.sleep(2)
        manifest = Manifest.read(buffer)
        assert manifest is not None and manifest.dataset_root == str(allowed / "train"), scene.daemon_log()
        scene.stop_daemon()


def test_an_old_record_of_an_accepted_job_renamed_back_is_not_resumed(two_users: Users) -> None:
    """A restarted daemon resumes the job its record (job.accepted.json) names.  A member kept the record of the
    daemon's user's job (on data no member may name) aside while that job ran, let their own job replace it and
    renamed the old record back over the new one: the next daemon (a restart: the unit's, an upgrade) ran the
    daemon's user's old job again, and published that data to the group."""
    users = two_users
    with Scene.made(users, "resume") as scene:
        buffer = scene.buffer

        def start_serving() -> None:
            proc = scene.start_daemon()
            scene.wait(lambda: (status := read_status(buffer)) is not None and status.pid == proc.pid
                       and status.state not in (State.STOPPED, State.STARTING))

        start_serving()
        scene.submit(users.daemon, scene.secret / "train")
        scene.as_user(users.trainer, "mv", buffer / "job.accepted.json", buffer / "kept.json")
        scene.submit(users.trainer, scene.allowed / "train")
        scene.stop_daemon()
        scene.as_user(users.trainer, "mv", buffer / "kept.json", buffer / "job.accepted.json")
        scene.as_user(users.trainer, "rm", buffer / "job.json")  # which a daemon reads at start: it would run it instead

        start_serving()
        time.sleep(1)
        status = read_status(buffer)
        assert status is not None and status.state == State.WAITING_FOR_JOB, scene.daemon_log()
        manifest = Manifest.read(buffer)
        assert manifest is None or manifest.dataset_root != str(scene.secret / "train"), scene.daemon_log()
        said = scene.daemon_log().split("not resuming the job an earlier daemon accepted: ")[-1]
        assert said.startswith(str(buffer / "job.accepted.json")) and "renamed away and back" in said, \
            scene.daemon_log()
        scene.stop_daemon()
