"""The Ray scenarios of test_ray.py, run as a program inside a loopback-only network namespace.

Ray 2.60 ignores 127.0.0.1 and binds the machine's own address unless it finds no
route out, so test_ray.py runs this under ``unshare -n`` with only ``lo`` up.  It
starts a 2-node ``ray.cluster_utils.Cluster`` (one CPU each), runs daemons that
build on it while a trainer reads every batch, and prints one JSON document: per
scenario the digest of every (epoch, step) the trainer read and the daemon's last
``remote`` status, into OUT.json (Ray writes to stdout itself).  test_ray.py asserts on it.

    python -m tests.integration.ray_scenarios DATA WORKDIR OUT.json
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefetchd.buffer_protocol import read_status
from prefetchd.launch import launch, start_argv, stop_daemon_process
from prefetchd.trainer import BufferLoader
from tests.waiting import wait_for

JOB = ["--batch-size", "8", "--image-size", "32", "--high-water", "3", "--low-water", "1", "--epochs", "1",
       "--seed", "5", "--transform", "tests.integration.ray_scenarios:slow"]
NODE = {"num_cpus": 1, "object_store_memory": 100 * 2**20}  # Ray's floor is 75 MiB
SLOW_NODE = "PREFETCHD_TEST_SLOW_NODE"


def slow(image: Any, rng: Any) -> Any:
    """The jobs' transform hook: the identity, taking time.  On the node whose environment names a
    marker file it touches the file and takes 1 s per image, so that the test can remove that
    node while it certainly holds a slice."""
    marker = os.environ.get(SLOW_NODE)
    if marker:
        Path(marker).touch()
    time.sleep(1.0 if marker else 0.02)
    return image



def remote_status(buffer: Path) -> Any:
    try:
        status = read_status(buffer)
    except (OSError, ValueError):
        return None
    return status.remote if status is not None else None


def building_there(buffer: Path) -> bool:
    """The daemon is connected to its cluster, and a node there gets slices."""
    r = remote_status(buffer)
    return r is not None and r.connected and r.cluster_cpus > 0


def read_job(data: Path, buffer: Path, log: Path, args: list[str], connected: bool = False,
             before: Callable[[Any], None] = lambda _p: None,
             after_first: Callable[[Any], None] = lambda _p: None) -> dict[str, Any]:
    """Run a one-epoch daemon with ``args``, read every batch; ``connected``: start reading once its
    cluster is connected and a node there gets slices; ``before`` runs then (with the daemon's
    process), ``after_first`` once the first batch was read."""
    started = time.monotonic()
    proc = launch(start_argv(buffer, extra=["--data", str(data), *JOB, *args]), log=log)
    digests: dict[str, str] = {}
    indices: list[int] = []
    shown = ""
    running = None  # the remote status last seen while the daemon ran
    try:
        if connected:
            wait_for(lambda: building_there(buffer), 180, "the daemon to connect to the cluster and probe a node", proc)
        before(proc)
        loader = BufferLoader(buffer, normalize=False, timeout=120)
        for batch in loader:
            images, labels = batch
            digest = hashlib.sha256(images.contiguous().numpy().tobytes())
            digest.update(labels.numpy().tobytes())
            digest.update(batch.indices.numpy().tobytes())
            key = f"{batch.epoch}/{batch.step}"
            assert key not in digests, f"batch {key} delivered twice"
            digests[key] = digest.hexdigest()
            indices += [int(i) for i in batch.indices]
            running = remote_status(buffer) or running
            if len(digests) == 1:
                shown = subprocess.run([sys.executable, "-m", "prefetchd", "status", "--buffer", str(buffer)],
                                       capture_output=True, text=True, timeout=60).stdout
                after_first(proc)
        loader.close()
        code = proc.wait(60)
    finally:
        stop_daemon_process(proc, 20)
    status = read_status(buffer)
    remote = status.remote if status is not None else None
    text = log.read_text()
    about_nodes = [line for line in text.splitlines()
                   if any(said in line for said in ("reads --data", "cannot read", "cannot build", "otherwise than"))]
    return {"seconds": round(time.monotonic() - started, 1), "digests": digests, "indices": indices, "exit_code": code,
            "status_text": shown, "remote": dataclasses.asdict(remote) if remote is not None else None,
            "running": dataclasses.asdict(running) if running is not None else None, "log": text[-6000:],
            "about_nodes": about_nodes}


def join_with_own_mounts(address: str, data: Path, log: Path, without_data: bool,
                         without_hook: bool = False, emptied: Path | None = None) -> subprocess.Popen[bytes]:
    """A node that joins the cluster at ``address`` as a user adds one (``ray start``), in a private
    mount namespace; ``without_data``: an empty tmpfs hides ``data`` there, as on a machine without
    the dataset's mount (``hide_data`` does it later); ``without_hook``: one hides the package of
    the jobs' transform hook (this repository's ``tests``), as on a machine where it is not installed;
    ``emptied``: an empty file is mounted over that one, as on a machine whose copy of it is damaged."""
    ray = Path(sys.executable).parent / "ray"
    hide = f"mount -t tmpfs -o size=1m none {data} && " if without_data else ""
    if without_hook:
        hide += f"mount -t tmpfs -o size=1m none {Path(__file__).resolve().parents[1]} && "
    if emptied is not None:
        empty = log.with_suffix(".empty")
        empty.write_bytes(b"")
        hide += f"mount --bind {empty} {emptied} && "
    script = (f"{hide}exec {ray} start --address={address} --num-cpus=1 "
              f"--object-store-memory={NODE['object_store_memory']} --disable-usage-stats --block")
    return subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)


def hide_data(node: subprocess.Popen[bytes], data: Path) -> None:
    """The dataset's mount goes away on a node of ``join_with_own_mounts``: an empty tmpfs over it."""
    subprocess.run(["nsenter", "--target", str(node.pid), "--mount", "mount", "-t", "tmpfs", "-o", "size=1m", "none",
                    str(data)], check=True)


def hide_data_when_idle(node: subprocess.Popen[bytes], data: Path, buffer: Path, proc: Any) -> None:
    """``hide_data`` once the daemon has no slice in flight (the trainer holds its first batch, so
    the buffer fills and the daemon rests). Every slice after that is begun without the data, and
    a refill submits several at once while both nodes are idle: node D gets one. Hidden at once
    instead, D could still be busy with a slice begun before (4.6 s for its first under a loaded
    CI) while node B built the rest of the epoch, and D never failed."""
    wait_for(lambda: (r := remote_status(buffer)) is not None and r.in_flight == 0, 60, "no slice in flight", proc)
    hide_data(node, data)


def mend_file(node: subprocess.Popen[bytes], path: Path) -> None:
    """Undo ``join_with_own_mounts``' ``emptied``: the node reads the box's copy of ``path`` again."""
    subprocess.run(["nsenter", "--target", str(node.pid), "--mount", "umount", str(path)], check=True)


def stop_node(node: subprocess.Popen[bytes]) -> None:
    node.terminate()  # ray start drains and stops its node on SIGTERM
    node.wait(60)


HIDDEN_SAMPLE = 5  # not one of the 8 probe samples of the 72 (0, 10, 20, ..., 71): the probe passes without it


def file_differs(cluster: Any, node_b: Any, data: Path, work: Path, ray: list[str]) -> dict[str, Any]:
    """Node B leaves; node F joins with one sample's file empty there, and is the only node with a CPU
    of a remote-only job.  The slice it builds with that sample replaced is built again on the daemon's
    box, F gets no more slices (production waits, and the status says why), and once the file is
    mended there F's next probe passes and it builds the rest."""
    from prefetchd.daemon.dataset import scan_class_folders

    hidden = scan_class_folders(data).path(HIDDEN_SAMPLE)
    cluster.remove_node(node_b)
    node_f = join_with_own_mounts(cluster.address, data, work / "node-f.log", without_data=False, emptied=hidden)
    buffer = work / "file-differs"
    seen: dict[str, Any] = {}

    def mend_once_unfit(proc: Any) -> None:
        wait_for(lambda: (r := remote_status(buffer)) is not None and r.unfit_nodes and r.cluster_cpus == 0, 180,
                 "node F to be found unfit", proc)
        seen["status"] = dataclasses.asdict(remote_status(buffer))
        mend_file(node_f, hidden)

    def in_background(proc: Any) -> None:
        def run() -> None:
            try:
                mend_once_unfit(proc)
            except BaseException as exc:  # noqa: BLE001 - told in the result; the job then times out
                seen["error"] = repr(exc)

        seen["thread"] = threading.Thread(target=run, daemon=True)
        seen["thread"].start()

    try:
        result = read_job(data, buffer, work / "file-differs.log", [*ray, "--workers", "0"], connected=True,
                          before=in_background)
        seen["thread"].join(10)
    finally:
        stop_node(node_f)
        cluster.add_node(**NODE)  # a node with a CPU for the next scenario
    return {**result, "unfit_status": seen.get("status"), "error": seen.get("error"), "hidden": str(hidden)}


def main() -> None:
    data, work = Path(sys.argv[1]), Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    from ray.cluster_utils import Cluster

    out: dict[str, Any] = {"local": read_job(data, work / "local", work / "local.log", ["--workers", "1"])}
    # The head runs no tasks: while node A is the only one with a CPU, every slice goes there.
    started = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "num_cpus": 0})
    marker = work / "slow-node-busy"
    node_a = cluster.add_node(**NODE, env_vars={SLOW_NODE: str(marker)})
    cluster.wait_for_nodes()
    out["cluster_start_seconds"] = round(time.monotonic() - started, 1)
    ray = ["--ray", cluster.address]

    node_b: Any = None

    def lose_node_a(proc: Any) -> None:
        """Remove node A while it builds a slice (it has touched the marker and sleeps), then add node B."""
        nonlocal node_b
        wait_for(marker.exists, 180, "node A to build a slice", proc)
        cluster.remove_node(node_a, allow_graceful=False)  # SIGKILL, as a machine that goes away
        node_b = cluster.add_node(**NODE)

    try:
        out["remote_only"] = read_job(data, work / "remote", work / "remote.log", [*ray, "--workers", "0"],
                                      connected=True, before=lose_node_a)
        # Node C joins without the dataset, node E without the hook's module: the probe names each, and they build
        # nothing.
        node_c = join_with_own_mounts(cluster.address, data, work / "node-c.log", without_data=True)
        # One at a time: two `ray start` at once may pick the same socket name in the session's folder.
        wait_for(lambda: "Ray runtime started" in (work / "node-c.log").read_text(), 120, "node C to join", node_c)
        node_e = join_with_own_mounts(cluster.address, data, work / "node-e.log", without_data=False,
                                      without_hook=True)
        mixed = work / "mixed"

        def node_c_named(proc: Any) -> None:
            wait_for(lambda: (r := remote_status(mixed)) is not None and len(r.unfit_nodes) == 2, 180,
                     "the daemon to name the nodes that cannot read --data or import the hook", proc)
            # The fit node gets slices before its probe answers; under a full test run's load (four clusters at
            # once) its answer came after the job's last batch, and the log never said it.
            wait_for(lambda: " reads --data (8 samples checked)" in (work / "mixed.log").read_text(), 180,
                     "the daemon to say which node reads --data", proc)

        try:
            out["mixed"] = read_job(data, mixed, work / "mixed.log", [*ray, "--workers", "1"], connected=True,
                                    before=node_c_named)
        finally:
            stop_node(node_c)
            stop_node(node_e)
        # Node D joins with the dataset, and its mount goes away once the trainer has a batch and no slice
        # is in flight: the slices it gets after that fail their samples, it reads the probe samples again,
        # and answers it cannot.
        node_d = join_with_own_mounts(cluster.address, data, work / "node-d.log", without_data=False)
        mount_lost = work / "mount-lost"
        try:
            out["mount_lost"] = read_job(
                data, mount_lost, work / "mount-lost.log", [*ray, "--workers", "0"], connected=True,
                before=lambda proc: wait_for(lambda: (work / "mount-lost.log").read_text().count(" reads --data ") >= 2,
                                             180, "nodes B and D to pass the probe", proc),
                after_first=lambda proc: hide_data_when_idle(node_d, data, mount_lost, proc))
        finally:
            stop_node(node_d)
        out["file_differs"] = file_differs(cluster, node_b, data, work, ray)
        lost = work / "cluster-lost"

        def lose_cluster(proc: Any) -> None:
            """Shut the whole cluster down and wait until the daemon has noticed (within SILENT_SECONDS); then
            start another at the same address and wait until the daemon is back on it (it retries every 10 s)."""
            nonlocal cluster
            port = int(cluster.address.rsplit(":", 1)[1])
            cluster.shutdown()
            wait_for(lambda: (r := remote_status(lost)) is not None and not r.connected, 180, "the daemon to notice", proc)
            out["lost_status"] = dataclasses.asdict(remote_status(lost))
            wait_for(lambda: (r := remote_status(lost)) is not None and "; reconnecting: " in r.message, 60,
                     "the daemon to try again (every 10 s) and fail, the cluster being gone", proc)
            out["reconnecting_status"] = dataclasses.asdict(remote_status(lost))
            cluster = Cluster(initialize_head=True, head_node_args={**NODE, "gcs_server_port": port})
            wait_for(lambda: building_there(lost), 180, "the daemon to reconnect and probe the node again", proc)

        out["cluster_lost"] = read_job(data, lost, work / "cluster-lost.log", [*ray, "--workers", "1"],
                                       connected=True, after_first=lose_cluster)
    finally:
        cluster.shutdown()
    Path(sys.argv[3]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
