"""Fixtures shared by all test packages: buffers on the real tmpfs, small datasets,
and real daemon processes that are always cleaned up."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from prefetchd.synthetic import make_shapes_dataset

SHM = Path("/dev/shm")


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory on the real tmpfs (falls back to /tmp where /dev/shm is missing)."""
    root = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path("/tmp")
    path = root / f"prefetchd-test-{uuid.uuid4().hex[:10]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def shapes_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small generated dataset: <root>/train and <root>/val, 3 classes."""
    root = tmp_path_factory.mktemp("shapes")
    make_shapes_dataset(root, classes=3, train_per_class=24, val_per_class=6, seed=1)
    return root


class Daemon:
    """A `prefetchd start` process with its log captured."""

    def __init__(self, buffer: Path, args: list[str], log: Path) -> None:
        self.buffer = buffer
        self.log_path = log
        self._log = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefetchd", "start", "--buffer", str(buffer), *args],
            stdout=self._log, stderr=subprocess.STDOUT,
        )

    @property
    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited ({self.proc.returncode}) while waiting for {what}:\n{self.log}")
            time.sleep(0.02)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}:\n{self.log}")

    def wait_exit(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"daemon did not exit within {timeout} s:\n{self.log}") from None

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Start real daemons; each is stopped (and killed if need be) after the test."""
    started: list[Daemon] = []

    def start(buffer: Path, *args: str | os.PathLike[str]) -> Daemon:
        daemon = Daemon(buffer, [str(a) for a in args], tmp_path / f"daemon-{len(started)}.log")
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.terminate()


@pytest.fixture(scope="session", autouse=True)
def index_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Daemons started by tests cache their class-folder indexes here, not in the user's ~/.cache."""
    path = tmp_path_factory.mktemp("index-cache")
    saved = {k: os.environ.get(k) for k in ("XDG_CACHE_HOME", "CACHE_DIRECTORY")}
    os.environ.pop("CACHE_DIRECTORY", None)
    os.environ["XDG_CACHE_HOME"] = str(path)
    yield path
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
