"""--ray and --ray-builds: flags and config keys from DaemonConfig, their checks, and the status they add
(no Ray cluster needed; tests/integration/test_ray.py runs one).  The tests that run a ``RemotePool``'s bridge
need Ray installed (``needs_ray``): the README's test command installs no extras."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from prefetchd.buffer_protocol import read_status, write_status
from prefetchd.daemon.cli import start
from prefetchd.daemon.config import DaemonConfig, load_toml
from prefetchd.daemon.errors import ConfigError
from prefetchd.daemon.job_inbox import JOB_FIELDS
from prefetchd.daemon.main import run_daemon
from prefetchd.daemon.remote import RemotePool
from prefetchd.daemon.remote import pool as pool_module
from prefetchd.daemon.remote.connect import connect_failure, unreachable
from prefetchd.daemon.status_view import format_status
from prefetchd.daemon.tasks import WorkerJob
from tests.daemon.test_workers import SIZE, _dataset
from tests.status_examples import REMOTE, production, report, status
from tests.waiting import wait_for

# A RemotePool refuses to exist without Ray (config.require_ray), as the daemon refuses --ray.
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="needs Ray: pip install 'prefetchd[ray]'")


@pytest.mark.parametrize("address", ["local", "auto", "ray://head:10001", "10.0.0.5:6379", "127.0.0.1:40123"])
def test_ray_addresses_accepted(tmp_path: Path, address: str) -> None:
    assert DaemonConfig(buffer=tmp_path, ray=address, workers=0).ray == address


@pytest.mark.parametrize("address", ["", "remote", "ray://head", "http://head:8265", "head:port", "local cluster"])
def test_bad_ray_address_names_the_forms(tmp_path: Path, address: str) -> None:
    with pytest.raises(ConfigError, match=r"ray = .*'local', 'auto', 'ray://HOST:PORT'"):
        DaemonConfig(buffer=tmp_path, ray=address)


def test_no_workers_without_a_cluster_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"workers = 0 .*--ray ADDRESS"):
        DaemonConfig(buffer=tmp_path, workers=0)


def test_ray_builds_without_a_cluster_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ray_builds = 4 needs --ray"):
        DaemonConfig(buffer=tmp_path, ray_builds=4)


def test_missing_ray_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if it were not installed: import ray fails
    cfg = DaemonConfig(buffer=tmp_path, ray="auto")  # a config may name a cluster anywhere
    with pytest.raises(ConfigError, match=r"pip install 'prefetchd\[ray\]'"):
        run_daemon(cfg)  # the daemon refuses it before it touches the buffer or the dataset
    assert not (tmp_path / "daemon.lock").exists()


def test_ray_keys_in_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "d.toml"
    path.write_text('ray = "ray://head:10001"\nray-builds = 8\nworkers = 0\n')
    cfg = DaemonConfig(buffer=tmp_path, **load_toml(path))
    assert (cfg.ray, cfg.ray_builds, cfg.workers) == ("ray://head:10001", 8, 0)


def test_ray_builds_range_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ray_builds = 0: must be at least 1"):
        DaemonConfig(buffer=tmp_path, ray="auto", ray_builds=0)


def test_start_has_the_flags_and_jobs_cannot_set_them() -> None:
    shown = CliRunner().invoke(start, ["--help"]).output
    assert "--ray local|auto|HOST:PORT|ray://HOST:PORT" in shown and "--ray-builds" in shown
    assert not {"ray", "ray_builds"} & JOB_FIELDS, "which machines build is the daemon's, not a job's"


def test_remote_status_round_trips_and_old_documents_have_none(tmp_path: Path) -> None:
    write_status(tmp_path, status(production=production(remote=REMOTE)))
    got = read_status(tmp_path)
    assert got is not None and got.production is not None and got.production.remote == REMOTE == got.remote
    write_status(tmp_path, status())
    doc = json.loads((tmp_path / "status.json").read_text())
    assert doc.pop("remote") is None  # without --ray
    (tmp_path / "status.json").write_text(json.dumps(doc))  # as a daemon before --ray wrote it
    old = read_status(tmp_path)
    assert old is not None and old.production is not None and old.production.remote is None and old.remote is None
    assert status(production=None).remote is None  # no job: no production


def test_a_remote_status_without_unfit_nodes_reads_as_none_unfit(tmp_path: Path) -> None:
    write_status(tmp_path, status(production=production(remote=REMOTE)))
    doc = json.loads((tmp_path / "status.json").read_text())
    del doc["remote"]["unfit_nodes"]  # as a daemon before the probe wrote it
    (tmp_path / "status.json").write_text(json.dumps(doc))
    got = read_status(tmp_path)
    assert got is not None and got.production is not None and got.production.remote is not None
    assert got.production.remote.unfit_nodes == ()


def test_status_shows_where_batches_are_built() -> None:
    info = report(status(production=production(remote=REMOTE)), pid=4242, heartbeat_age_s=0.2)
    text = format_status(info)
    assert ("remote    ray ray://head:10001 connected: 3 nodes, 96 CPUs; 40 slices in flight; 1664 img built "
            "there (50% of all), copied in at 1991 MiB/s, 2 retries, 1 straggler, 0 disconnects") in text, text
    assert "node      cpu-1/3f2a9c1d: 1664 img, 1900 img/s, slice p50 0.41 s" in text, text
    one = dataclasses.replace(REMOTE, cluster_nodes=1, cluster_cpus=1)
    assert " connected: 1 node, 1 CPU; " in format_status(
        dataclasses.replace(info, status=status(production=production(remote=one))))
    assert "UNFIT     cpu-2/77ab01c3: cannot read 8 of the 8 samples probed: n01/a.jpg" in text, text
    # The cluster's slices are counted as they arrive, all images as batches commit: it may be ahead.
    ahead = production(remote=REMOTE, totals=dataclasses.replace(production().totals, samples=REMOTE.images - 20))
    assert "img built there (100% of all)" in format_status(dataclasses.replace(info, status=status(production=ahead)))
    lost = REMOTE.__class__(**{**REMOTE.__dict__, "connected": False, "message": "lost: no answer; the 3 local workers build alone"})
    assert "NOT CONNECTED (lost: no answer; the 3 local workers build alone)" in format_status(
        dataclasses.replace(info, status=status(production=production(remote=lost))))
    never = REMOTE.__class__(**{**REMOTE.__dict__, "connected": False,
                                "message": "not connected: no cluster; 1 local worker builds alone"})
    assert "NOT CONNECTED (no cluster; 1 local worker builds alone)" in format_status(  # said once
        dataclasses.replace(info, status=status(production=production(remote=never))))
    given_up = dataclasses.replace(REMOTE, connected=False, message="given up for this job, 1 local worker builds "
                                   "alone: the Ray cluster's workers die before their first image")
    assert ("remote    ray ray://head:10001 GIVEN UP for this job (1 local worker builds alone: the Ray cluster's "
            "workers die before their first image); 40 slices in flight") in format_status(
        dataclasses.replace(info, status=status(production=production(remote=given_up)))), "not a word of its own"


def test_metrics_say_where_batches_are_built(tmp_path: Path) -> None:
    from prometheus_client import generate_latest

    from prefetchd.daemon.metrics import Metrics

    metrics = Metrics(tmp_path, None, "127.0.0.1", None)
    metrics.update(status(production=production(remote=REMOTE)))
    text = generate_latest(metrics.registry).decode()
    assert f'prefetchd_remote_images_total{{buffer="{tmp_path}"}} 1664.0' in text, text
    assert f'prefetchd_remote_connected{{buffer="{tmp_path}"}} 1.0' in text
    assert f'prefetchd_remote_unfit_nodes{{buffer="{tmp_path}"}} 1.0' in text
    assert f'prefetchd_remote_node_images_per_second{{buffer="{tmp_path}",node="cpu-1/3f2a9c1d"}} 1900.5' in text
    metrics.update(status())
    assert "prefetchd_remote_" not in generate_latest(metrics.registry).decode(), "no cluster, no remote series"


def test_bench_measures_the_ray_contender_only_when_asked() -> None:
    from prefetchd.bench import CONTENDERS, bench_command

    assert "prefetchd-ray" not in CONTENDERS, "Ray is an optional extra: not in the default run"
    assert "--ray" in CliRunner().invoke(bench_command, ["--help"]).output


def test_config_show_prints_the_ray_keys(tmp_path: Path) -> None:
    from prefetchd.daemon.cli import config_command

    result = CliRunner().invoke(config_command, ["--buffer", str(tmp_path / "bf"), "--ray", "ray://head:10001",
                                                 "--ray-builds", "6", "--workers", "0", "--show"])
    assert result.exit_code == 0, result.output
    assert 'ray = "ray://head:10001"' in result.output and "ray_builds = 6" in result.output
    assert "workers = 0" in result.output


def test_no_cluster_for_auto_is_told_in_prefetchd_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's error for `auto` with no cluster tells to set `--address`, a flag of Ray's CLI; the
    daemon's status names its own --ray forms instead.  Other failures keep Ray's words."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray_says = ConnectionError("Could not find any running Ray instance. Please specify the one to connect to by "
                               "setting `--address` flag or `RAY_ADDRESS` environment variable.")
    told = connect_failure("auto", ray_says)
    assert told.startswith("no Ray cluster runs on this machine"), told  # the warning names the address before it
    assert "--ray HOST:6379" in told and "--ray local" in told and "--address" not in told
    assert connect_failure("10.0.0.5:6379", ConnectionError("Failed to connect")).startswith(
        "ConnectionError: Failed to connect")
    assert connect_failure("local", RuntimeError("raylet died")) == "RuntimeError: raylet died"
    # A head with token authentication refuses a driver without it with only this (Ray 2.60): the hint says how.
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    refused = connect_failure("10.0.0.5:6379", ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6379"))
    assert "if the head uses token authentication" in refused and "RAY_AUTH_MODE=token" in refused, refused
    assert "Token authentication" in refused and "~/.ray/auth_token" in refused, refused
    # With RAY_AUTH_MODE=token and a token the head refuses, Ray says the same: the hint then asks about the token.
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    wrong = connect_failure("10.0.0.5:6379", ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6379"))
    assert "runs with RAY_AUTH_MODE=token: is its token the cluster's?" in wrong and "ray get-auth-token" in wrong
    monkeypatch.delenv("RAY_AUTH_MODE")
    no_token = connect_failure("auto", RuntimeError("Token authentication is enabled but no authentication token was "
                                                    "found."))
    assert no_token.endswith("start the daemon with RAY_AUTH_MODE=token and the cluster's token in ~/.ray/auth_token "
                             "(or RAY_AUTH_TOKEN_PATH); see docs/SCALE.md, 'Token authentication'"), no_token
    client = connect_failure("ray://head:10001", ValueError("Ray Client requires pip package `ray[client]`. If you "
                                                            "installed the minimal Ray (e.g. `pip install ray`), ..."))
    assert "prefetchd[ray] does not install Ray's client: pip install 'ray[client]'" in client, client
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")  # auto followed it: Ray's message names that address
    assert "Failed to connect" in connect_failure("auto", ConnectionError("Failed to connect to Ray cluster at 10.0.0.5"))


def test_a_head_whose_name_does_not_resolve_is_told_so_not_that_nothing_answers() -> None:
    """`--ray gpu-box-1:6379` on a machine that cannot resolve the name said "nothing answers there (gaierror: ...);
    start the head": there is nothing to start, the name is what to check (a review of docs/SCALE.md)."""
    told = unreachable("gpu-box-1.invalid:6379")  # .invalid never resolves (RFC 2606)
    assert told.startswith("its host name does not resolve here (gaierror: "), told
    assert "start the head" not in told and "check the address" in told
    assert unreachable("auto") == unreachable("local") == ""


@needs_ray
def test_a_head_nobody_runs_is_told_at_once_and_local_workers_build_meanwhile(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """ray.init waits for minutes on an address where nothing listens: the bridge checks it first."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # free once closed: nothing listens there
    index = _dataset(tmp_path / "data")
    pool = RemotePool(WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7), address, None, 1, 600.0, 600.0)
    started = time.monotonic()
    pool.start()
    try:
        wait_for(lambda: pool.handle(lambda _t, _r: None, lambda t: t, lambda _t, _f: None, lambda _f, _t: None)
                 or pool.process is None, 20,
                 "the bridge to give up on the address")
    finally:
        pool.stop()
    assert time.monotonic() - started < 15
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1, warned
    assert warned[0].startswith(f"cannot use the Ray cluster at {address}: "), warned
    assert "nothing answers there (ConnectionRefusedError: Connection refused)" in warned[0], warned
    assert "1 local worker builds alone; trying again every 10 s" in warned[0], warned
    shown = pool.status()
    assert not shown.connected and "nothing answers there" in shown.message and "1 local worker builds alone" in shown.message


@needs_ray
def test_a_head_that_accepts_but_does_not_answer_is_warned_about_while_local_workers_build(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A listener that never speaks Ray's protocol passes the bridge's check; ray.init then waits,
    and the daemon says so instead of "connecting" for two minutes."""
    monkeypatch.setattr(pool_module, "NO_ANSWER_SECONDS", 1.0)  # 15 s in the daemon
    index = _dataset(tmp_path / "data")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        pool = RemotePool(WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7), address, None, 2,
                          600.0, 600.0)
        pool.start()
        try:
            wait_for(lambda: pool.handle(lambda _t, _r: None, lambda t: t, lambda _t, _f: None, lambda _f, _t: None)
                     or pool.told_no_answer, 10,
                     "the warning that the cluster does not answer")
            assert pool.process is not None and pool.process.is_alive(), "still trying"
        finally:
            pool.stop()
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == [f"the Ray cluster at {address} does not answer yet (1 s); 2 local workers build alone "
                      "meanwhile; prefetchd waits up to 120 s for it (Ray gives up sooner on some heads: one that "
                      "refuses this daemon's token, after 20 s), then tries again every 10 s"], warned
    assert pool.status().message == "not connected: no answer after 1 s yet; 2 local workers build alone"


@needs_ray
def test_a_warning_a_new_bridge_sends_again_is_not_logged_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each bridge (a new one after every reconnection) probes the nodes: an unfit node is warned about once."""
    import multiprocessing

    from prefetchd.daemon.remote.messages import Note

    index = _dataset(tmp_path / "data")
    pool = RemotePool(WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7), "local", None, 1, 600.0, 600.0)
    unfit = "node 10.0.0.7 cannot read 3 of the 3 samples probed: ...; it gets no slices"
    retried = "slice 4: node 10.0.0.7 died; submitting it to another node"
    for _bridge in range(2):
        parent, child = multiprocessing.Pipe()
        pool.conn = parent
        child.send(Note(logging.WARNING, unfit))
        child.send(Note(logging.INFO, retried))
        with caplog.at_level(logging.INFO, logger="prefetchd.daemon.remote.pool"):
            pool._receive(lambda _t, _r: None, lambda t: t, lambda _t, _f: None, lambda _f, _t: None)
        parent.close()
        child.close()
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said.count((logging.WARNING, f"ray: {unfit}")) == 1, said
    assert said.count((logging.INFO, f"ray: {retried}")) == 2, said  # news each time


@needs_ray
def test_a_cluster_whose_every_node_is_unfit_is_said_in_the_status_and_warned_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With --workers 0 and every node unfit, production stopped with a connected cluster and an empty
    message: the status said nothing of why no batch came (Ray review)."""
    from prefetchd.daemon.remote.messages import Report

    index = _dataset(tmp_path / "data")
    pool = RemotePool(WorkerJob(index, np.arange(len(index)), SIZE, train=True, seed=7), "10.0.0.5:6379", None, 0,
                      600.0, 600.0)
    unfit = Report(True, nodes=2, cpus=0, unfit=("cpu-2/77ab01c3: could not use 1 sample ...",))
    with caplog.at_level(logging.WARNING, logger="prefetchd.daemon.remote.pool"):
        for said in (unfit, unfit, Report(True, nodes=2, cpus=4), unfit):
            pool._on_report(said)
            shown = pool.status().message
            if said.cpus:
                assert shown == "", "a node gets slices again"
    assert shown == ("1 node with CPUs, each unfit (one that cannot read --data is probed again every 30 s); "
                     "no local workers (--workers 0): production waits for the cluster")
    warned = [r.getMessage() for r in caplog.records]
    assert warned == [f"no node of the Ray cluster at 10.0.0.5:6379 gets slices: {shown}"] * 2, warned  # each time
    info = report(status(production=production(remote=pool.status())), pid=4242, heartbeat_age_s=0.2)
    assert f"connected: 2 nodes, 0 CPUs ({shown}); 0 slices in flight" in format_status(info)
