"""Many ranks: one daemon produces every local rank's stream; boxes split the world."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import re
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
from torchvision.datasets import ImageFolder

import tests.torchrun

from prefetchd.buffer_protocol import Manifest, ProtocolError, batch_name, stream_dir
from prefetchd.trainer import BufferLoader
from prefetchd.trainer.errors import LoaderError, SetupError
from prefetchd.trainer.ranks import Ranks, wait_for_stream
from tests.status_examples import production_of

SMALL = ["--batch-size", "8", "--image-size", "32", "--workers", "2", "--high-water", "3"]

RANK_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    from prefetchd.buffer_protocol import read_status, stream_dir
    from prefetchd.trainer import BufferLoader

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = BufferLoader(stream_dir(sys.argv[1], rank, world), normalize=False, timeout=120)
    epochs = [[int(i) for batch in loader for i in batch.indices] for _ in range(2)]
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "steps": len(loader), "epochs": epochs})
    if rank == 0:
        json.dump(gathered, open(sys.argv[2], "w"))
    loader.close()
    dist.destroy_process_group()
""")


def test_two_ranks_under_torchrun_cover_each_sample_once_per_epoch(shapes_data: Path, shm_dir: Path, tmp_path: Path, start_daemon) -> None:
    data = shapes_data / "train"
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", data, *SMALL, "--world-size", "2", "--epochs", "2")
    script, out = tmp_path / "ranks.py", tmp_path / "ranks.json"
    script.write_text(RANK_SCRIPT)
    run = tests.torchrun.run(["--standalone", "--nproc-per-node", "2", script, buffer, out], 300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:] + daemon.log
    ranks = json.loads(out.read_text())
    n = len(ImageFolder(str(data)).samples)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["steps"] == ranks[1]["steps"], "every rank must run the same number of steps"
    for epoch in range(2):
        per_rank = [r["epochs"][epoch] for r in ranks]
        assert len(per_rank[0]) == len(per_rank[1]) == n // 2
        assert sorted(per_rank[0] + per_rank[1]) == list(range(n)), f"epoch {epoch}: not every sample exactly once"
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1], "each epoch is shuffled anew"
    assert daemon.wait_exit(30) == 0, daemon.log


def test_two_boxes_split_the_world_without_talking(shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    data = shapes_data / "train"
    seen: Counter[int] = Counter()
    counts = []
    for box, ranks in enumerate(("0-1", "2-3")):
        buffer = shm_dir / f"box{box}"
        daemon = start_daemon(buffer, "--data", data, *SMALL, "--world-size", "4", "--ranks", ranks, "--epochs", "1")
        lo = int(ranks[0])
        daemon.wait_until(lambda: (p := production_of(buffer)) is not None and len(p.streams) == 2, 60, "both streams in the status")
        shown = subprocess.run([sys.executable, "-m", "prefetchd", "status", "--buffer", str(buffer)], capture_output=True, text=True).stdout
        assert f"rank {lo} " in shown and f"rank {lo + 1} " in shown and "72 samples" in shown, shown
        for rank in (lo, lo + 1):
            loader = BufferLoader(stream_dir(buffer, rank, 4), normalize=False, timeout=120)
            assert loader.manifest.rank == rank and loader.manifest.world_size == 4
            got = [int(i) for batch in loader for i in batch.indices]
            counts.append(len(got))
            seen.update(got)
            loader.close()
        assert not (buffer / f"rank-{(lo + 2) % 4:05d}").exists(), "a box produces only its own ranks"
    n = len(ImageFolder(str(data)).samples)
    assert counts == [n // 4] * 4
    assert sorted(seen) == list(range(n)) and set(seen.values()) == {1}


def test_a_batch_renamed_in_from_another_rank_or_kept_from_an_earlier_job_is_refused(
        shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """A member of a --group-access buffer's group may rename the daemon's files (here the test's user renames
    its own daemon's): rank 1's batch over rank 0's of the same position, or one of rank 0 kept aside and put back
    once a job of the same seed and sizes (one rank, this time) runs.  The batch passed every check (position,
    sizes, seed, label and index ranges, the daemon's user's file) and rank 0's trainer trained on it."""
    data, buffer = shapes_data / "train", shm_dir / "bf"
    first = start_daemon(buffer, "--data", data, *SMALL, "--world-size", "2", "--seed", "3")
    rank_0, rank_1 = stream_dir(buffer, 0, 2), stream_dir(buffer, 1, 2)
    first.wait_until(lambda: all((d / batch_name(0, s)).exists() for d in (rank_0, rank_1) for s in (0, 1)), 60,
                     "two batches of each rank")
    ours, theirs = Manifest.read(rank_0).job_key, Manifest.read(rank_1).job_key
    kept = shm_dir / "kept.batch"
    os.rename(rank_0 / batch_name(0, 1), kept)
    os.rename(rank_1 / batch_name(0, 0), rank_0 / batch_name(0, 0))
    loader = BufferLoader(rank_0, normalize=False, timeout=60)
    with pytest.raises(ProtocolError) as refused:
        next(iter(loader))
    loader.close()
    assert str(refused.value).startswith(
        f"{rank_0 / batch_name(0, 0)}: is a batch of rank 1 of job {theirs}, at epoch 0 step 0, but this stream is "
        f"rank 0 of job {ours} (its manifest.json)"), refused.value
    first.terminate()
    second = start_daemon(buffer, "--data", data, *SMALL, "--seed", "3", "--reset")
    second.wait_until(lambda: (buffer / batch_name(0, 1)).exists(), 60, "the one-rank job's second batch")
    os.rename(kept, buffer / batch_name(0, 1))
    loader = BufferLoader(buffer, normalize=False, timeout=60)
    it = iter(loader)
    assert next(it).step == 0
    with pytest.raises(ProtocolError) as refused:
        next(it)
    loader.close()
    assert str(refused.value).startswith(
        f"{buffer / batch_name(0, 1)}: is a batch of rank 0 of job {ours}, at epoch 0 step 1, but this stream is "
        f"rank 0 of job {Manifest.read(buffer).job_key} (its manifest.json)"), refused.value
    assert "(a member of its group?) renamed it there" in str(refused.value)


def test_status_and_stop_on_rank_directories(shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """A daemon serving ranks 0-1 of 3: status names the world and its ranks, and on a rank's directory
    shows that rank alone; a rank directory it does not write is no daemon's; stop on a rank directory,
    which would stop every rank, points to the buffer."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *SMALL, "--world-size", "3", "--ranks", "0-1")
    daemon.wait_until(lambda: (p := production_of(buffer)) is not None and len(p.streams) == 2, 60, "its streams")

    def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "prefetchd", *map(str, args)], capture_output=True, text=True, timeout=60)

    shown = cli("status", "--buffer", buffer)
    assert shown.returncode == 0 and f"ranks     0-1 of world size 3, each in {buffer}/rank-NNNNN" in shown.stdout, shown.stdout
    assert "rank 0 " in shown.stdout and "rank 1 " in shown.stdout, shown.stdout
    one = cli("status", "--buffer", buffer / "rank-00001")
    assert one.returncode == 0 and f"rank 1 of the daemon on {buffer}" in one.stdout, one.stdout
    assert "ranks     1 of world size 3" in one.stdout and "rank 0 " not in one.stdout, one.stdout
    doc = json.loads(cli("status", "--json", "--buffer", buffer / "rank-00001").stdout)
    whole = production_of(buffer)
    assert doc["rank"] == 1 and doc["served"] is True and [s["rank"] for s in doc["status"]["streams"]] == [1], doc
    assert whole is not None and doc["status"]["high_water"] == whole.high_water // 2
    (buffer / "rank-00002").mkdir()  # a rank of the world this daemon leaves to another box
    other = cli("status", "--buffer", buffer / "rank-00002")
    assert other.returncode == 3, other  # as where no daemon runs: nothing builds its batches (a review: 0)
    assert json.loads(cli("status", "--json", "--buffer", buffer / "rank-00002").stdout)["served"] is False
    assert f"does not serve rank 2 now (it serves 0-1); `prefetchd status --buffer {buffer}`" in other.stdout, other.stdout
    assert "batches waiting" not in other.stdout, "the served ranks' fill shown under rank 2's heading"
    # Nor "its trainer and fill", nor "some of world size 3": a rank it does not serve (a review).
    assert f"rank 2 of the daemon on {buffer}, which builds no batches for it now" in other.stdout, other.stdout
    assert "its trainer and fill" not in other.stdout and "ranks     " not in other.stdout, other.stdout
    missing = cli("status", "--buffer", buffer / "rank-00007")
    assert missing.returncode == 3 and "running (pid" not in missing.stdout, missing.stdout
    assert missing.stdout.startswith(f"prefetchd on {buffer / 'rank-00007'}: no such rank\n"), missing.stdout
    assert "not running" not in missing.stdout and f"no such rank: the daemon on {buffer}" in missing.stdout
    refused = cli("stop", "--buffer", buffer / "rank-00000")
    assert refused.returncode == 2 and f"`prefetchd stop --buffer {buffer}`" in refused.stderr, refused
    assert daemon.proc.poll() is None, "stop on one rank's directory stopped the daemon of every rank"
    stopped = cli("stop", "--buffer", buffer)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout


def test_a_buffer_named_as_another_buffers_rank_stream_is_refused_and_one_inside_stops_the_outer_daemon(
        shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """A walk: `start --buffer P/rank-00003` beside P's daemon was taken, and every command read it as P's rank 3
    (status showed P's pid, stop refused, its trainer was told P serves no rank 3); a daemon started on such a
    folder first, then one on P with --world-size 2 took it for its rank 1, overwrote its manifest and fed its
    trainer the other job's batches."""
    from prefetchd.buffer_protocol import DaemonLock

    def start(buffer: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "prefetchd", "start", "--buffer", str(buffer), "--data",
                               str(shapes_data / "train"), *SMALL, *args], capture_output=True, text=True, timeout=60)

    outer = shm_dir / "p"
    daemon = start_daemon(outer, "--data", shapes_data / "train", *SMALL)
    daemon.wait_until(lambda: (outer / "manifest.json").exists(), 60, "its manifest")
    nested = start(outer / "rank-00003")
    assert nested.returncode == 2, nested.stderr
    assert f"buffer {outer / 'rank-00003'} is named as a rank's stream folder of the buffer {outer}, and every " \
           "prefetchd command would take it for one" in " ".join(nested.stderr.split()), nested.stderr
    daemon.terminate()

    other = shm_dir / "x"
    (other / "rank-00001").mkdir(parents=True, mode=0o700)
    lock = DaemonLock(other / "rank-00001")
    lock.acquire()  # this test process plays a daemon started there first, before any on x
    try:
        refused = start(other, "--world-size", "2", "--reset")
    finally:
        lock.release()
    assert refused.returncode == 2, refused.stderr
    assert f"{other / 'rank-00001'} is the buffer of another daemon (its daemon.lock is held), named as a rank's " \
           f"stream folder of {other}" in " ".join(refused.stderr.split()), refused.stderr
    assert sorted(p.name for p in (other / "rank-00001").iterdir()) == ["daemon.lock"], "cleared or taken over"


def test_a_buffer_of_another_world_size_is_refused_naming_both(shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """Either way between one rank and two: the refusal names both world sizes, as between two and four."""
    for before, after in ((1, 2), (2, 1)):
        buffer = shm_dir / f"bf-{before}-{after}"
        first = start_daemon(buffer, "--data", shapes_data / "train", *SMALL, "--world-size", before)
        first.wait_until(lambda: production_of(buffer) is not None, 30, "the first job to run")
        first.terminate()
        second = start_daemon(buffer, "--data", shapes_data / "train", *SMALL, "--world-size", after)
        assert second.wait_exit(30) == 2, second.log
        assert f"world_size: {before} -> {after} (" in second.log and "pass --reset" in second.log, second.log


def test_another_jobs_stream_of_a_rank_this_job_leaves_out_is_kept_without_reset(
        shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """--ranks 0 of one job, then --ranks 1 of another: rank 0's stream (its batches and its trainer's progress)
    was deleted with an INFO line, where every other sign of another job is refused without --reset (review)."""
    buffer = shm_dir / "bf"
    first = start_daemon(buffer, "--data", shapes_data / "train", *SMALL, "--world-size", "2", "--ranks", "0",
                         "--seed", "3")
    first.wait_until(lambda: production_of(buffer) is not None, 60, "the first job to run")
    first.terminate()
    kept = sorted(p.name for p in stream_dir(buffer, 0, 2).iterdir())
    other = [*SMALL, "--world-size", "2", "--ranks", "1", "--seed", "4"]
    second = start_daemon(buffer, "--data", shapes_data / "train", *other)
    assert second.wait_exit(30) == 2, second.log
    assert "holds batches of a different job in rank-00000, a rank this job does not produce (seed: 3 -> 4" in \
        " ".join(second.log.split()) and "pass --reset" in second.log, second.log
    assert sorted(p.name for p in stream_dir(buffer, 0, 2).iterdir()) == kept
    assert not stream_dir(buffer, 1, 2).exists(), "refused before it changed anything"
    third = start_daemon(buffer, "--data", shapes_data / "train", *other, "--reset")
    third.wait_until(lambda: production_of(buffer) is not None, 60, "the job to run with --reset")
    assert not stream_dir(buffer, 0, 2).exists()


def test_a_rank_whose_stream_an_earlier_run_left_is_refused_without_waiting_out_its_timeout(
        shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """A daemon restarted with fewer --ranks keeps the job's other streams, manifests included: a trainer of
    such a rank found its manifest, looked no further, and waited out its timeout (review)."""
    buffer = shm_dir / "bf"
    both = start_daemon(buffer, "--data", shapes_data / "train", *SMALL, "--world-size", "2")
    both.wait_until(lambda: production_of(buffer) is not None, 60, "the job to run")
    both.terminate()
    one = start_daemon(buffer, "--data", shapes_data / "train", *SMALL, "--world-size", "2", "--ranks", "0")
    one.wait_until(lambda: (p := production_of(buffer)) is not None and [s.rank for s in p.streams] == [0], 60,
                   "the job to run again, for rank 0 alone")
    assert (stream_dir(buffer, 1, 2) / "manifest.json").is_file()
    unserved = f"the daemon of {buffer} (pid {one.proc.pid}) produces rank 0, not rank 1"
    started = time.monotonic()
    with pytest.raises(SetupError, match=re.escape(unserved)):
        wait_for_stream(buffer, Ranks(1, 2, 1, 2), timeout=120)
    with pytest.raises(LoaderError, match=re.escape(unserved)):
        BufferLoader(stream_dir(buffer, 1, 2), timeout=120)
    assert time.monotonic() - started < 60, "refused only at the timeout"


def test_a_rank_the_daemon_does_not_produce_is_refused_without_waiting_out_its_timeout(
        shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """Box 0's daemon started with too few --ranks: its other local rank is told at once, not after the
    timeout, by prefetchd-train's wait for its stream and by a BufferLoader on the stream directory."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *SMALL, "--world-size", "4", "--ranks", "0")
    daemon.wait_until(lambda: production_of(buffer) is not None, 60, "the job to run")
    assert wait_for_stream(buffer, Ranks(0, 4, 0, 2), timeout=5) == stream_dir(buffer, 0, 4)
    unserved = f"the daemon of {buffer} (pid {daemon.proc.pid}) produces rank 0, not rank 1"
    started = time.monotonic()
    with pytest.raises(SetupError) as refused:
        wait_for_stream(buffer, Ranks(1, 4, 1, 2), timeout=120)
    assert unserved in str(refused.value) and "--world-size 4 --ranks 0-1`" in str(refused.value), refused.value
    with pytest.raises(LoaderError) as refused_too:
        BufferLoader(stream_dir(buffer, 1, 4), timeout=120)
    assert unserved in str(refused_too.value), refused_too.value
    assert time.monotonic() - started < 60, "refused only at the timeout"
