"""Jobs from the buffer's group, with real users: a daemon running as one user with
--group-access refuses a job another user of its group submits when it names a transform
hook or data outside the config's allow-lists (and never imports such a hook), and runs
one that stays inside them."""

from __future__ import annotations

import os
import signal
import subprocess
import sysconfig
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import prefetchd
from prefetchd.buffer_protocol import State, list_batches
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
