"""A service's daemon (a user of its own, --group-access) and a member of its group whose shell has umask 077,
with real users.  What the member wrote in the buffer was 0600, which the daemon may not read: it refused the
job.json of `prefetchd submit` unread, under no job id, and the submit waited out its --timeout; and it ignored
the trainer's progress.json ("cannot open a progress document (Permission denied)"), so it deleted nothing and
built no further than its high-water mark while the trainer waited for the next batch until its timeout.  Now
those files are 0644 whatever the writer's umask.

The daemon started by hand under umask 077 (not the unit's UMask=0007) made its batches, manifest.json, status.json
and daemon.lock 0600, and the member's submit and trainer could read none of them ("manifest.json: cannot open a
manifest document (Permission denied)").  Now a --group-access daemon gives its group read whatever its umask."""

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
from prefetchd.buffer_protocol import Progress, State, list_batches
from prefetchd.synthetic import make_shapes_dataset
from tests.group_users import NEEDS_ROOT_AND_USERADD, Users, chown_tree, python_for, service_users, stop_and_clean
from tests.status_examples import state_of
from tests.waiting import wait_for

pytestmark = NEEDS_ROOT_AND_USERADD

SOURCE_ROOT = Path(prefetchd.__file__).resolve().parents[1]
# Two epochs of 4 batches with a high-water mark of 2: the daemon builds the third batch only once it has read
# that the trainer is past the first.
READ = """
import sys
from prefetchd.trainer import BufferLoader
with BufferLoader(sys.argv[1], normalize=False, timeout=20) as loader:
    print(sum(1 for _ in loader) + sum(1 for _ in loader))
"""


@pytest.fixture
def users() -> Iterator[Users]:
    with service_users() as made:
        yield made


@pytest.mark.parametrize("daemon_umask", [0o007, 0o077], ids=["unit-umask", "daemon-umask-077"])
def test_a_trainer_under_umask_077_is_read_by_the_service(users: Users, daemon_umask: int) -> None:
    base = Path("/dev/shm") / f"prefetchd-test-umask-{uuid.uuid4().hex[:10]}"
    base.mkdir()
    daemon: subprocess.Popen[bytes] | None = None
    try:
        data = base / "data"
        make_shapes_dataset(data, classes=2, train_per_class=8, val_per_class=2, seed=1)
        (base / "cache").mkdir()
        chown_tree(base, users.daemon_uid, users.gid, 0o750)  # the group may enter, to reach the buffer
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(base), "LANG": "C.UTF-8",
               "PYTHONPATH": os.pathsep.join([str(SOURCE_ROOT), sysconfig.get_paths()["purelib"]])}
        python = python_for(users.daemon, env)
        trainer_python = python_for(users.trainer, env, "prefetchd.trainer")
        buffer, log = base / "bf", base / "daemon.log"
        with open(log, "wb") as out:
            daemon = subprocess.Popen(
                [python, "-m", "prefetchd", "start", "--buffer", str(buffer), "--group-access", "--workers", "1",
                 "--high-water", "2", "--index-cache", str(base / "cache"), "--allowed-data", str(data)],
                user=users.daemon_uid, group=users.gid, extra_groups=[], umask=daemon_umask,
                env=env, cwd=base, stdout=out, stderr=subprocess.STDOUT)

        def said() -> str:
            listing = subprocess.run(["ls", "-la", str(buffer)], capture_output=True, text=True).stdout
            return f"ls -la {buffer}:\n{listing}\ndaemon log:\n{log.read_text(errors='replace')}"

        def wait(predicate: Callable[[], object], timeout: float, what: str) -> None:
            try:
                wait_for(predicate, timeout, what, daemon)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{said()}") from None

        def as_trainer(*argv: str) -> subprocess.CompletedProcess[str]:
            """``argv`` run as the group's other member, from a shell whose umask leaves the group nothing."""
            return subprocess.run(["runuser", "-u", users.trainer, "--", "sh", "-c", 'umask 077; exec "$@"', "sh",
                                   *argv], env=env, cwd=base, capture_output=True, text=True, timeout=120)

        def written_by_the_trainer(*names: str) -> None:
            for name in names:
                st = os.stat(buffer / name)
                assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (users.trainer_uid, users.gid, 0o644), \
                    f"{name}: mode {stat.S_IMODE(st.st_mode):04o}\n{said()}"

        def written_by_the_daemon(*paths: Path) -> None:
            for path in paths:
                st = os.stat(path)
                assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (users.daemon_uid, users.gid, 0o640), \
                    f"{path.name}: mode {stat.S_IMODE(st.st_mode):04o}\n{said()}"

        wait(lambda: state_of(buffer) == State.WAITING_FOR_JOB, 60, "the daemon to wait for a job")
        written_by_the_daemon(buffer / "daemon.lock", buffer / "status.json")
        submitted = as_trainer(trainer_python, "-m", "prefetchd", "submit", "--buffer", str(buffer), "--data",
                               str(data / "train"), "--batch-size", "4", "--image-size", "32", "--epochs", "2",
                               "--timeout", "20")
        assert submitted.returncode == 0 and " accepted: " in submitted.stdout, \
            f"{submitted.stdout}{submitted.stderr}\n{said()}"
        written_by_the_trainer("job.json")
        wait(lambda: len(list_batches(buffer)) == 2, 60, "the high-water mark")
        written_by_the_daemon(buffer / "manifest.json", *list_batches(buffer).values())

        read = as_trainer(trainer_python, "-c", READ, str(buffer))
        assert read.returncode == 0 and read.stdout.split() == ["8"], f"{read.stdout}{read.stderr}\n{said()}"
        written_by_the_trainer("progress.json", "progress.json.lock")
        assert Progress.read(buffer) == Progress(2, 0)
        wait(lambda: not list_batches(buffer), 30, "the daemon to delete the consumed batches")
        assert "Permission denied" not in log.read_text(), said()
        assert ("umask 0077 -> 0037" in log.read_text()) == (daemon_umask == 0o077), said()

        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(30) == 0, said()
    finally:
        stop_and_clean(daemon, base)

