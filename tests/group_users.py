"""Real users for the tests of a service's buffer: a fresh group with two members, one that runs the daemon and
one that trains, removed after the test, and an interpreter each of them can run prefetchd with.  Root only
(useradd, runuser)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

NEEDS_ROOT_AND_USERADD = [
    pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                       reason="creates users and runs the daemon as one of them: needs root"),
    pytest.mark.skipif(shutil.which("useradd") is None or shutil.which("groupadd") is None,
                       reason="needs useradd and groupadd"),
]


@dataclass(frozen=True)
class Users:
    group: str
    gid: int
    daemon: str  # runs the daemon
    daemon_uid: int
    trainer: str  # another member of the buffer's group
    trainer_uid: int


@contextmanager
def service_users() -> Iterator[Users]:
    """Two fresh users sharing a fresh primary group, removed after the block."""
    tag = uuid.uuid4().hex[:8]
    group, daemon, trainer = f"pfg{tag}", f"pfd{tag}", f"pft{tag}"
    subprocess.run(["groupadd", group], check=True)
    made: list[str] = []
    try:
        for name in (daemon, trainer):
            subprocess.run(["useradd", "--no-create-home", "--no-user-group", "--gid", group,
                            "--shell", "/usr/sbin/nologin", name], check=True)
            made.append(name)
        ids = {name: int(subprocess.run(["id", "-u", name], capture_output=True, text=True, check=True).stdout)
               for name in made}
        gid = int(subprocess.run(["getent", "group", group], capture_output=True, text=True, check=True)
                  .stdout.split(":")[2])
        yield Users(group, gid, daemon, ids[daemon], trainer, ids[trainer])
    finally:
        for name in made:
            remove_user(name)
        subprocess.run(["groupdel", group], check=False)


def remove_user(name: str) -> None:
    """userdel refuses a user with live processes: the daemon's worker server outlives it by a
    moment, so wait for them to go, and end the ones this test started that do not."""
    uid = int(subprocess.run(["id", "-u", name], capture_output=True, text=True, check=True).stdout)
    deadline = time.monotonic() + 15
    while subprocess.run(["userdel", name], capture_output=True).returncode != 0:
        left = [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid]
        if time.monotonic() > deadline:
            for proc in left:
                proc.kill()
            psutil.wait_procs(left, timeout=5)
            subprocess.run(["userdel", name], check=False)
            return
        time.sleep(0.1)


def python_for(user: str, env: dict[str, str], module: str = "prefetchd.daemon.main") -> str:
    """An interpreter that ``user`` can run with ``module`` importable: this one, or the system's
    of the same version when this one lives where other users cannot reach (a root-only pyenv)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for exe in [sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}"]:
        if not os.path.exists(exe):
            continue
        probe = subprocess.run(["runuser", "-u", user, "--", exe, "-c", f"import {module}"],
                               env=env, capture_output=True, text=True)
        if probe.returncode == 0:
            return exe
    pytest.skip(f"no {version} with {module}'s dependencies that user {user} can run")


def chown_tree(path: Path, uid: int, gid: int, mode: int) -> None:
    for root, dirs, files in os.walk(path):
        os.chown(root, uid, gid)
        os.chmod(root, mode)
        for name in files:
            os.chown(os.path.join(root, name), uid, gid)


__all__ = ["NEEDS_ROOT_AND_USERADD", "Users", "chown_tree", "python_for", "remove_user", "service_users"]


def stop_and_clean(daemon: subprocess.Popen[bytes] | None, base: Path) -> None:
    """A test's last step: kill its daemon where it is still running (a failed assertion left it), remove its folder."""
    if daemon is not None and daemon.poll() is None:
        daemon.kill()
        daemon.wait()
    shutil.rmtree(base, ignore_errors=True)
