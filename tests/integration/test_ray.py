"""Remote producers (--ray) on a real 2-node Ray cluster, in a network namespace with only loopback.

Ray 2.60 binds the machine's own address even when told 127.0.0.1, so the cluster,
the daemons and their trainers run together in ``ray_scenarios.py`` under
``unshare -n`` (root), where Ray finds no route out and uses 127.0.0.1.  This test
runs that program once (2-4 min on 2 quiet cores: the cluster starts once and each
job's Ray workers import torch) and asserts on what it read:

- a remote-only job (``--workers 0``) whose only CPU node is removed while it
  builds a slice (a node with a CPU joins after) and a mixed job (one local
  worker beside the cluster) deliver every batch of the epoch exactly once, equal
  byte for byte to those of a local-only daemon;
- in the mixed job a third node joins (``ray start``) from a mount namespace that
  hides the dataset: the probe names it and the files it cannot read, and it
  builds nothing;
- in a remote-only job a fourth node joins with the dataset and loses its mount
  (``nsenter`` mounts an empty tmpfs over it) once the trainer has a batch: it is
  named, and every batch is still the local-only daemon's;
- in a remote-only job whose only node has one sample's file empty (not one the probe reads), the
  slice it builds with that sample replaced is built again on the daemon's box; the node gets no
  more slices until the file is mended there and its next probe, which reads that sample, passes;
- a job whose whole cluster is shut down mid-epoch goes on with its local worker,
  says so in its status, connects again to a cluster started at the same address,
  builds there again, and delivers the same batches.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.ray_namespace import namespace_problem

# The scenarios take 2 min on the 2 quiet cores, 3.5 on those of a slow host, 5-9 when both are saturated (each Ray
# worker's start, a probe's answer, then takes a minute): more than 9 on the slow CI host beside the rest of the
# suite and the Ray fault tests (stop 71), 9.3 on the slow EPYC host beside the rest of the suite alone (stop 72's
# fresh CI).  A bound for a hang, not for speed.  The Ray tests run one after another (tests/conftest.py).
SCENARIOS_SECONDS = 1500
pytestmark = [pytest.mark.ray, pytest.mark.timeout(SCENARIOS_SECONDS + 40)]

ROOT = Path(__file__).resolve().parents[2]


def _shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of this run's: shared by its pytest-xdist processes, each of which gets a
    ``popen-gwN`` folder in it, and this process's own without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _run_scenarios(data: Path, out: Path) -> dict[str, Any]:
    """Run ray_scenarios.py into ``out``; what it printed and how it ended."""
    work = Path("/dev/shm") / f"prefetchd-ray-{os.getpid()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    script = f"ip link set lo up && exec {sys.executable} -m tests.integration.ray_scenarios {data} {work} {out}"
    try:
        run = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True,
                             timeout=SCENARIOS_SECONDS,
                             cwd=ROOT, env=env)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"returncode": run.returncode, "stdout": run.stdout[-4000:], "stderr": run.stderr[-8000:]}


@pytest.fixture(scope="module")
def scenarios(shapes_data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The scenarios' results, run once per test run: pytest-xdist may hand this module's tests
    to several processes (all of them when it has fewer tests than 2 per process), and each
    would start its own cluster and jobs (three at once took 150 s instead of 70 on 2 cores).
    The first to take the lock runs them; the others read what it wrote."""
    problem = namespace_problem()
    if problem:
        pytest.skip(problem)
    shared = _shared_dir(tmp_path_factory)
    out, ended = shared / "ray-scenarios.json", shared / "ray-scenarios-run.json"
    with open(shared / "ray-scenarios.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ended.exists():
            ended.write_text(json.dumps(_run_scenarios(shapes_data / "train", out)))
    run = json.loads(ended.read_text())
    assert run["returncode"] == 0 and out.exists(), f"the Ray scenarios failed:\n{run['stdout']}\n{run['stderr']}"
    result: dict[str, Any] = json.loads(out.read_text())
    timings = {k: v["seconds"] for k, v in result.items() if isinstance(v, dict) and "seconds" in v}
    print(f"Ray scenarios: cluster started in {result.pop('cluster_start_seconds')} s; seconds per job {timings}")
    return result


def _check_delivery(scenarios: dict[str, Any], name: str) -> dict[str, Any]:
    """Every batch of the epoch once, and each equal to the local-only daemon's; the daemon exited cleanly."""
    run: dict[str, Any] = scenarios[name]
    local = scenarios["local"]
    assert run["exit_code"] == 0, run["log"]
    assert len(local["digests"]) == 9 and sorted(local["indices"]) == list(range(72))
    assert sorted(run["indices"]) == list(range(72)), f"{name}: not every sample exactly once\n{run['log']}"
    differ = sorted(k for k in local["digests"] if run["digests"].get(k) != local["digests"][k])
    assert run["digests"].keys() == local["digests"].keys() and not differ, f"{name}: batches {differ} differ\n{run['log']}"
    return run


def test_remote_only_job_survives_losing_its_node_and_matches_local_workers(scenarios: dict[str, Any]) -> None:
    run = _check_delivery(scenarios, "remote_only")
    remote = run["remote"]
    assert remote["images"] == 72 and remote["slices"] == 18, remote  # --workers 0: every slice on the cluster
    # Node A was removed while it slept in a slice: that slice came back as lost and was built again.
    assert remote["retries"] >= 1, (remote, run["log"])
    assert {n["node"] for n in remote["nodes"]}, remote
    assert "remote    ray 127.0.0.1:" in run["status_text"] and " connected: " in run["status_text"], run["status_text"]


def test_mixed_job_matches_local_workers_and_a_node_without_the_data_builds_nothing(scenarios: dict[str, Any]) -> None:
    run = _check_delivery(scenarios, "mixed")
    remote = run["remote"]
    assert 0 < remote["images"], remote
    # No node was lost: slices that reached node C or E before their probes answered went elsewhere, uncounted.
    assert remote["retries"] == 0, (remote, run["log"])
    # Node C joined from a mount namespace where --data is hidden: the probe named it and the files it could
    # not read, and every slice went to the node that reads the data.
    unfit = [u for u in run["running"]["unfit_nodes"] if "cannot read" in u]
    assert len(unfit) == 1 and "cannot read 8 of the 8 samples probed: " in unfit[0], run["running"]
    assert "FileNotFoundError" in unfit[0] and "mount the same --data at the same path on every node" in unfit[0], unfit
    node_c = unfit[0].split(":")[0]
    assert node_c not in {n["node"] for n in remote["nodes"]}, (node_c, remote["nodes"])
    assert any(f"node {node_c} cannot read" in line and "it gets no slices" in line for line in run["about_nodes"]), run
    assert any(" reads --data (8 samples checked)" in line for line in run["about_nodes"]), run
    # Node E cannot import the jobs' transform hook (its package is hidden there): the probe named it with the
    # import error, instead of its first slice failing the job.
    hook = [u for u in run["running"]["unfit_nodes"] if "cannot build the job's slices: " in u]
    assert len(hook) == 1 and "cannot import tests.integration.ray_scenarios (ModuleNotFoundError" in hook[0], hook
    assert hook[0].split(":")[0] not in {n["node"] for n in remote["nodes"]}, (hook, remote["nodes"])


def test_a_node_that_loses_the_dataset_mid_job_stops_building_and_no_batch_changes(scenarios: dict[str, Any]) -> None:
    run = _check_delivery(scenarios, "mount_lost")
    remote = run["remote"]
    assert remote["images"] == 72, remote  # --workers 0: every slice on the cluster, none lost to the failing node
    # Node D passed the probe when it joined; once its mount was gone, a slice there failed its samples, it
    # read the probe samples again and answered that it cannot: the warning names it, and its slices went to
    # node B.  (The log, not the status: the job may end within the second the status takes to say it.)
    about = "\n".join(run["about_nodes"])
    passed = re.findall(r"node (\S+) reads --data \(8 samples checked\)", about)
    failed = re.findall(r"node (\S+) cannot read 8 of the 8 samples probed: \S+ \(FileNotFoundError", about)
    assert len(passed) == 2 and len(failed) == 1 and failed[0] in passed, about


def test_a_node_with_a_damaged_file_changes_no_batch_and_builds_again_once_it_is_mended(
        scenarios: dict[str, Any]) -> None:
    run = _check_delivery(scenarios, "file_differs")  # every batch the local-only daemon's, the damaged sample's too
    assert run["error"] is None, run["error"]
    remote, about = run["remote"], "\n".join(run["about_nodes"])
    # Node F passed the probe, replaced the sample whose file is empty there, and the bridge built that slice
    # again on the daemon's box instead of writing F's.
    box = [n for n in remote["nodes"] if n["node"] == "the daemon's box"]
    assert len(box) == 1 and box[0]["slices"] == 1, remote["nodes"]
    hidden = run["hidden"].rsplit("/", 2)
    told = re.findall(r"node (\S+) reads 1 sample otherwise than the daemon's box: (\S+) \(", about)
    assert len(told) == 1 and told[0][1].endswith("/".join(hidden[-2:])), about
    # F was the only node with a CPU and --workers 0: production waited, and the status said why.
    waited = run["unfit_status"]
    assert waited["cluster_cpus"] == 0 and told[0][0] in waited["unfit_nodes"][0], waited
    assert waited["message"] == ("1 node with CPUs, each unfit (one that cannot read --data is probed again every "
                                 "30 s); no local workers (--workers 0): production waits for the cluster"), waited
    # The file mended there, F's next probe (which reads that sample too) passed and it built the rest.
    assert f"node {told[0][0]} reads --data again (9 samples checked): it builds slices again" in about, about
    assert any(n["node"] == told[0][0] and n["slices"] > 1 for n in remote["nodes"]), remote["nodes"]


def test_job_goes_on_with_local_workers_when_the_cluster_disappears_and_returns(scenarios: dict[str, Any]) -> None:
    run = _check_delivery(scenarios, "cluster_lost")
    remote, lost = run["remote"], scenarios["lost_status"]
    assert not lost["connected"] and lost["message"].startswith("lost: "), lost
    assert "1 local worker builds alone" in lost["message"], lost  # the scenario's --workers 1
    # A failed attempt to connect again keeps why the cluster was lost in the status, beside why it failed.
    again = scenarios["reconnecting_status"]["message"]
    assert again.startswith(lost["message"].removesuffix("; 1 local worker builds alone") + "; reconnecting: "), again
    assert "nothing answers there (ConnectionRefusedError" in again and again.endswith("1 local worker builds alone"), again
    assert "Ray cluster at 127.0.0.1:" in run["log"] and " lost: " in run["log"], run["log"]
    # A cluster at the same address again: the daemon connected to it and built there once more.
    assert run["running"] is not None and run["running"]["connected"], run["running"]
    assert remote["disconnects"] >= 1 and remote["images"] > lost["images"], (lost, remote, run["log"])
