"""Fixtures shared by all test packages: buffers on the real tmpfs, small datasets,
real daemon processes that are always cleaned up, and a real S3-compatible server
(moto's server mode) on loopback."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

# One OpenMP thread for torch in the test processes and what they start (trainers, torchrun ranks), set
# before torch is imported: its default of one thread per core, in the four test processes beside the
# daemons' workers, oversubscribes 2 cores, and OpenMP's spinning threads then stall each other.  The
# drop-in test alone took 12 s; three copies at once took 126 s each with the default, 12 s each with one
# thread (2026-11-30).  An explicit setting (``--threads``, the benchmarks' own) still wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The README's test command installs no extras, and `.ci/run` installs them all: it runs the tests that use Ray
# again with Ray hidden from the test processes (PREFETCHD_TEST_WITHOUT_RAY=1), as where it is not installed, so
# that each of them must skip rather than fail (four did from 2026-11-27 to 11-30, unseen by CI).
if os.environ.get("PREFETCHD_TEST_WITHOUT_RAY"):
    sys.modules["ray"] = None  # type: ignore[assignment]  # import ray fails, find_spec("ray") is None

import pytest
from hypothesis import settings

from prefetchd import locations
from prefetchd.launch import launch, start_argv, stop_daemon_process
from prefetchd.synthetic import make_shapes_dataset
from tests.waiting import wait_for

# No property test is a timed test: hypothesis's 200-500 ms deadline per example failed
# test_json_progress_is_valid_or_refused on a loaded 2-core machine (815 ms, then 61 ms).
settings.register_profile("untimed", deadline=None)
settings.load_profile("untimed")

SHM = Path("/dev/shm")
REPO = Path(__file__).resolve().parents[1]
SMALL_TMPFS = 1 << 20


# The modules of the tests marked "ray", which run one after another in one test process (``RayTogether``).
RAY_MODULES = ("tests/integration/test_ray.py", "tests/integration/test_ray_faults.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The Ray scenarios first (their module's cluster fixture took 228 s of a 503 s run on the 2
    cores): the first test process starts them at once and the others share out the rest beside it.
    Collected in place, they began at 241 s and ended the run alone."""
    items.sort(key=lambda item: item.get_closest_marker("ray") is None)
    elsewhere = sorted({item.nodeid.split("::")[0] for item in items
                        if item.get_closest_marker("ray") and not item.nodeid.startswith(RAY_MODULES)})
    if elsewhere:
        raise pytest.UsageError(f"tests marked ray in {', '.join(elsewhere)}: add the module to RAY_MODULES "
                                "in tests/conftest.py, so that its cluster never runs beside another")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a run without xdist (-p no:xdist) must not fail on it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's own scheduling ("load"), but the Ray tests in one process, one after another: two Ray
    clusters beside each other on the 2 cores of a slow CI host ran the scenarios past 560 s and a fault test past
    240 s (stop 71).  ``--dist loadgroup`` with ``xdist_group`` marks would do it, but xdist 3.8 under pytest 9.2
    silently does not group (it renames the tests' node ids, which pytest 9.2 no longer reads:
    pytest-dev/pytest-xdist#1386).  The work units are xdist's "loadscope" ones, each test alone but the Ray
    modules, a unit together; the largest goes first, so the Ray tests start at once.  Another --dist is kept."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RayTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:  # LoadFileScheduling and LoadGroupScheduling override it so
            return "ray" if nodeid.startswith(RAY_MODULES) else nodeid

    return RayTogether(config, log)


def _oom_score_adj() -> str | None:
    try:
        return Path("/proc/self/oom_score_adj").read_text()
    except OSError:
        return None


@pytest.fixture(autouse=True)
def oom_score_kept() -> Iterator[None]:
    """Fail a test that leaves this process's oom_score_adj raised: every daemon the test process starts later
    inherits it.  worker_main run in the test process (its workers volunteer for the OOM killer) left it at 1000,
    the most, so that the controller of a later daemon was the workers' equal, and the largest: the OOM test's
    400 MiB cgroup killed it (twice in full runs, the test passing alone)."""
    before = _oom_score_adj()
    yield
    after = _oom_score_adj()
    assert after == before, f"this test left the test process's oom_score_adj {after!r}, was {before!r}"


@pytest.fixture(autouse=True)
def prefetchd_log_level_kept() -> Iterator[None]:
    """The "prefetchd" logger's level as it was before each test.  A command run in this process (``pack`` through
    CliRunner) sets it (``setup_logging``: its debug is prefetchd's own), and it stayed INFO for the tests after it
    in the same process: their caplog then held the INFO lines of the code they drive ("indexed ..."), and three
    tests that count the records failed, in one full run, not alone."""
    logger = logging.getLogger("prefetchd")
    before = logger.level
    yield
    logger.setLevel(before)


@pytest.fixture(autouse=True)
def child_tmpdir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A TMPDIR of its own for the processes each test starts, removed after it.

    A daemon SIGKILLed by a test (test_killed_*, the faults suite) cannot remove its worker server's
    socket folder (a later daemon in the same TMPDIR does), and torchrun never removes its torchelastic_*
    log folder: a full run left a few dozen of them in TMPDIR.  The exits the daemon controls (a finished
    job, SIGTERM, a refused start) are checked to leave none in test_daemon_exit.py.  Not under tmp_path:
    a TMPDIR past 53 bytes (as pytest-xdist's can be) has the daemon put its socket folder in /tmp
    instead (pool.py)."""
    tempfile.gettempdir()  # this process's own temp folder stays what it was (cached by tempfile)
    tmp_path_factory.getbasetemp()  # ... and pytest's, which it finds there on first use
    path = Path(tempfile.mkdtemp(prefix="pfd-t-"))
    monkeypatch.setenv("TMPDIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory on the real tmpfs (falls back to /tmp where /dev/shm is missing)."""
    root = SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path("/tmp")
    path = root / f"prefetchd-test-{uuid.uuid4().hex[:10]}"
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, options: str) -> Iterator[Path]:
    """A tmpfs of its own at ``mount`` with mount(8) ``options`` (root only), unmounted after."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8) for a tmpfs of its own")
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        # A daemon's worker server may outlive it by a moment, a test's last batch stays mapped
        # until it is collected: busy for a while, then detached lazily.
        for _ in range(50):
            if subprocess.run(["umount", str(mount)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        else:
            subprocess.run(["umount", "--lazy", str(mount)], check=True)


@pytest.fixture
def small_tmpfs(shm_dir: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs of its own (root only): its free space is known and nothing else fills it."""
    with mounted_tmpfs(shm_dir / "small", f"size={SMALL_TMPFS},mode=0700") as mount:
        yield mount


@pytest.fixture(scope="session")
def shapes_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small generated dataset: <root>/train and <root>/val, 3 classes."""
    root = tmp_path_factory.mktemp("shapes")
    make_shapes_dataset(root, classes=3, train_per_class=24, val_per_class=6, seed=1)
    return root


@contextlib.contextmanager
def sighup_not_ignored() -> Iterator[None]:
    """SIGHUP's default action for the processes started within, where this one has it ignored (a test run under
    `nohup`): a daemon started with it ignored keeps ignoring it, as nohup asks, and the tests that send it one
    expect it to stop."""
    ignored = (threading.current_thread() is threading.main_thread()
               and signal.getsignal(signal.SIGHUP) == signal.SIG_IGN)
    if ignored:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)


class Daemon:
    """A `prefetchd start` process with its log captured."""

    def __init__(self, buffer: Path, args: list[str], log: Path) -> None:
        self.buffer = buffer
        self.log_path = log
        with sighup_not_ignored():
            self.proc = launch(start_argv(buffer, extra=args), log=log)

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        try:
            wait_for(predicate, timeout, what, self.proc)
        except AssertionError as exc:
            raise AssertionError(f"the daemon {exc}:\n{self.log}") from None

    def wait_exit(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"daemon did not exit within {timeout} s:\n{self.log}") from None

    def terminate(self) -> None:
        stop_daemon_process(self.proc, 15)


def started_daemons(kind: Callable[[Path, list[str], Path], Daemon], logs: Path,
                    prefix: str = "daemon") -> Iterator[Callable[..., Daemon]]:
    """A fixture's body: a function that starts ``kind`` daemons, their logs in ``logs``; each is stopped (and
    killed if need be) after the test."""
    started: list[Daemon] = []

    def start(buffer: Path, *args: str | os.PathLike[str]) -> Daemon:
        daemon = kind(buffer, [str(a) for a in args], logs / f"{prefix}-{len(started)}.log")
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.terminate()


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Start real daemons; each is stopped (and killed if need be) after the test."""
    yield from started_daemons(Daemon, tmp_path)


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


def load_tool(name: str) -> ModuleType:
    """A script of tools/ as a module."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def proxy(s3: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A proxy in front of the loopback server; the environment (and daemons started now) go through it."""
    proxy = load_tool("http_proxy").Proxy(s3.endpoint).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    yield proxy
    proxy.stop()


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Object-storage retries a hundredth as long apart: an outage of N tries in milliseconds."""
    monkeypatch.setattr(locations, "RETRY_BASE_SECONDS", 0.01)
    monkeypatch.setattr(locations, "RETRY_MAX_SECONDS", 0.05)


@dataclass
class S3:
    """The loopback S3 server as a test sees it: its endpoint and a fresh bucket of its own."""

    endpoint: str
    bucket: str
    fs: Any  # an s3fs filesystem on the endpoint

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")

    def upload(self, local: Path, prefix: str) -> str:
        """Copy the tree under ``local`` to ``s3://bucket/prefix``; return that URL."""
        for path in sorted(local.rglob("*")):
            if path.is_file():
                self.fs.pipe_file(f"{self.bucket}/{prefix}/{path.relative_to(local).as_posix()}", path.read_bytes())
        return self.url(prefix)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server in a thread of the test process, on a free loopback port."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


S3_ENV = {
    # Credentials come from the standard AWS environment only, as in production; the
    # daemon subprocesses inherit them.  AWS_ENDPOINT_URL is honoured by botocore >= 1.31.
    "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": "/nonexistent/aws-config", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@pytest.fixture
def s3(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3:
    """Environment pointing at the loopback server (inherited by daemons) and an empty bucket."""
    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in S3_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the daemon's index cache
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    fs.mkdir(bucket)
    return S3(s3_endpoint, bucket, fs)
