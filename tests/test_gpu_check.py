"""tools/gpu_check.py --dry-run: every step of the GPU check, on the CPU at toy sizes, so that the
script still runs on the day a GPU machine is lent.  Structure only: the figures mean nothing."""

from __future__ import annotations

import dataclasses
import json
import re
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from prefetchd.daemon.mounts import pages_of

REPO = Path(__file__).resolve().parents[1]
FEEDS = ("synthetic", "prefetchd", "DataLoader", "DALI")


def tool_env(*first: Path) -> dict[str, str]:
    """This environment with ``first`` and the repository ahead on PYTHONPATH, for a tool run as a script."""
    paths = [*map(str, first), str(REPO), os.environ.get("PYTHONPATH")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}


def test_dry_run_writes_every_section(tmp_path: Path, shm_dir: Path) -> None:
    docs_before = {p.name: p.read_bytes() for p in (REPO / "docs").iterdir() if p.is_file()}
    out = tmp_path / "result" / "gpu.json"
    env = tool_env()
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--dry-run", "--out", str(out),
                           "--scaling-buffer-root", str(shm_dir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    doc = json.loads(out.read_text())
    assert doc["format"] == "prefetchd.gpu_check" and doc["dry_run"] is True
    assert doc["sizes"]["device"] == "cpu"
    # 1. pytest -m gpu ran and its counts were read (on a machine without CUDA, every GPU test skips).
    assert doc["tests"]["returncode"] == 0
    assert doc["tests"]["counts"].get("skipped", 0) + doc["tests"]["counts"].get("passed", 0) > 0
    # 2. one row per toy batch size, with a time per batch derived from real copies.
    assert sorted({row["batch_size"] for row in doc["h2d"]}) == sorted(doc["sizes"]["h2d_batch_sizes"])
    assert all(row["us_per_batch"] > 0 and row["gb_per_s"] > 0 for row in doc["h2d"])
    # 3./4. the three feeds trained the model to a finite loss; DALI says why it was left out or ran.
    rows = {row["feed"].split()[0]: row for row in doc["training"]}
    assert tuple(rows) == FEEDS
    for name in FEEDS[:3]:
        row = rows[name]
        assert "note" not in row, row
        assert row["images_per_s"] > 0 and 0 <= row["data_wait_share"] < 1
        assert math.isfinite(row["final_loss"])
        assert row["tree_pss_peak_mib"] > 0
    assert rows["synthetic"]["vs_synthetic"] == 1.0
    for name in FEEDS[:3]:  # every round of every feed, the row its median
        assert len(rows[name]["rounds_images_per_s"]) == doc["sizes"]["rounds"] == 2
        assert rows[name]["images_per_s"] == min(rows[name]["rounds_images_per_s"])
        # Each round's detail: where the CPU went (the trainer's own steps at least, in this tree) and
        # where the time went (a rate for every part of the dry run's 3 steps, the longest wait).
        assert len(rows[name]["rounds_detail"]) == 2
        for detail in rows[name]["rounds_detail"]:
            assert detail["cpu_tree_cores"] > 0 and detail["cpu_other_cores"] >= 0
            assert 0 <= detail["cpu_steal_share"] < 1
            assert len(detail["fifths_images_per_s"]) == doc["sizes"]["steps"] == 3
            assert all(rate > 0 for rate in detail["fifths_images_per_s"])
            assert 0 <= detail["longest_wait_s"] and 0 <= detail["longest_wait_step"] < 3
            assert detail["between_epochs_images_per_s"] > 0 and detail["epoch_starts"] >= 0
    assert rows["DALI"].get("note", "").startswith("skipped:") or "images_per_s" in rows["DALI"]

    # 5. the producer alone, with the floor it is compared with (one worker count on a dry run), in rounds:
    # every round's rate kept, the row the median (the lower of two), and as many rounds of the loops and floor.
    scaling = doc["scaling"]
    [row] = scaling["rows"]
    assert row["workers"] == 1 and row["images_per_s"] > 0 and row["scaling"] == 1.0
    assert scaling["rounds"] == doc["sizes"]["scaling_rounds"] == 2
    assert scaling["buffer"] == str(shm_dir), "--scaling-buffer-root: where step 5's daemons put their buffers"
    assert len(row["rounds_images_per_s"]) == len(row["loops_rounds"]) == len(scaling["floor"]["rounds"]) == 2
    assert round(row["images_per_s"], 1) == min(row["rounds_images_per_s"])
    assert round(row["independent_loops_per_s"], 1) == min(row["loops_rounds"])
    assert scaling["floor"]["images_per_s"] > 0
    assert abs(row["vs_floor"] - row["images_per_s"] / scaling["floor"]["images_per_s"]) < 2e-3
    assert row["independent_loops_per_s"] > 0
    assert abs(row["vs_loops"] - row["images_per_s"] / row["independent_loops_per_s"]) < 2e-3
    assert scaling["cpu_tree_cores"] > 0
    assert row["cpu"]["workers_cores"] > 0 and row["cpu"]["worker_ms_per_image"] > 0

    markdown = (out.parent / "GPU.md").read_text()
    assert "**Dry run**" in markdown
    for heading in ("## Machine", "## GPU tests", "## Host to device", "## Training", "## The producer on more cores"):
        assert heading in markdown
    for name in FEEDS:
        assert f"| {name}" in markdown
    assert "By round" in markdown and "Over the whole step, in cores on average" in markdown
    machine = doc["machine"]  # where the batches lived, and in which pages
    assert f"| buffer | {machine['buffer_fs']} ({pages_of(machine['buffer_huge_pages'])}) |" in markdown
    ms, vs_floor = row["cpu"]["worker_ms_per_image"], row["cpu"]["worker_ms_per_image"] / scaling["floor"]["ms_per_image"] - 1
    assert f"| {ms:.2f} ({vs_floor:+.0%}) |" in markdown  # the workers' CPU per image, against the floor's
    low, high = row["rounds_images_per_s"]  # the producer's rate with its rounds' range
    assert f"| 1 | {round(row['images_per_s'], 1):.0f} ({min(low, high):.0f}–{max(low, high):.0f}) |" in markdown
    assert "Each count measured 2 times in a row" in markdown
    assert f"the daemons' buffers in {shm_dir} ({pages_of(scaling['buffer_huge_pages'])})" in markdown
    # A dry run never touches the measured docs.
    assert {p.name: p.read_bytes() for p in (REPO / "docs").iterdir() if p.is_file()} == docs_before


def test_the_producer_is_measured_at_powers_of_two_and_every_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import gpu_check_steps

    assert gpu_check_steps.scaling_counts(16) == [1, 2, 4, 8, 16]
    assert gpu_check_steps.scaling_counts(6) == [1, 2, 4, 6]
    assert gpu_check_steps.scaling_counts(1) == [1]


def test_a_missing_dependency_stops_the_check_before_it_measures(tmp_path: Path) -> None:
    # The first H200 run lacked tomli-w: every daemon-fed row failed minutes later.  Now the
    # check names the module and measures nothing.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "tomli_w.py").write_text("raise ModuleNotFoundError(\"No module named 'tomli_w'\", name='tomli_w')\n")
    out = tmp_path / "result" / "gpu.json"
    env = tool_env(shadow)
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--dry-run", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "No module named 'tomli_w'" in proc.stderr and "fetch_gpu_wheels.sh" in proc.stderr
    assert not out.exists()


def test_feeds_rotate_over_rounds_and_report_their_median(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import gpu_check_training
    import torch
    from gpu_check_plan import DRY

    order: list[str] = []
    figures = {"synthetic": [100.0, 110.0, 90.0], "prefetchd (2 workers)": [50.0, 70.0, 60.0],
               "prefetchd (1 worker)": [20.0, 30.0, 25.0], "DataLoader (2 workers)": [40.0, None, 30.0]}

    def train(name: str, feed: object, sizes: object, classes: int, device: object) -> dict[str, object]:
        order.append(name)
        value = figures[name][order.count(name) - 1]
        if value is None:
            raise RuntimeError("the daemon went away")
        return {"feed": name, "images_per_s": value, "data_wait_share": 0.0}

    monkeypatch.setattr(gpu_check_training, "train_with", train)
    sizes = dataclasses.replace(DRY, rounds=3)
    snapshots: list[int] = []
    rows, stopped = gpu_check_training.training_rows(tmp_path, sizes, 2, torch.device("cpu"), [2, 1], tmp_path,
                                                     done=lambda rows: snapshots.append(len(rows)))
    assert stopped is None
    # The ceiling opens every round; the others take turns at going first.
    p2, p1, dl = "prefetchd (2 workers)", "prefetchd (1 worker)", "DataLoader (2 workers)"
    assert order == ["synthetic", p2, p1, dl, "synthetic", p1, dl, p2, "synthetic", dl, p2, p1]
    assert len(snapshots) == 12  # saved after every training run
    by_feed = {row["feed"]: row for row in rows}
    assert list(by_feed) == ["synthetic", p2, p1, dl, "DALI mixed (2 threads)"]
    assert by_feed["synthetic"]["images_per_s"] == 100.0 and by_feed["synthetic"]["vs_synthetic"] == 1.0
    assert by_feed[p2]["images_per_s"] == 60.0 and by_feed[p2]["rounds_images_per_s"] == [50.0, 70.0, 60.0]
    assert by_feed[p2]["vs_synthetic"] == 0.6
    assert by_feed[p1]["images_per_s"] == 25.0
    # A failed round is kept as such: the median of what was measured, and the failure beside it.
    assert by_feed[dl]["rounds_images_per_s"] == [40.0, None, 30.0]
    assert by_feed[dl]["images_per_s"] == 30.0
    assert by_feed[dl]["failed_rounds"] == ["failed: RuntimeError: the daemon went away"]
    assert by_feed["DALI mixed (2 threads)"]["note"].startswith("skipped:")


def test_a_time_limit_stops_before_a_round_that_would_not_fit_so_every_feed_has_as_many_rounds(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import gpu_check_training
    import torch
    from gpu_check_plan import DRY, TimeLimit

    now = [0.0]
    seconds = {"synthetic": 10.0, "prefetchd (2 workers)": 30.0, "DataLoader (2 workers)": 40.0}
    order: list[str] = []

    def train(name: str, feed: object, sizes: object, classes: int, device: object) -> dict[str, object]:
        order.append(name)
        now[0] += seconds[name]
        return {"feed": name, "images_per_s": 100.0, "data_wait_share": 0.0}

    monkeypatch.setattr(gpu_check_training, "train_with", train)
    sizes = dataclasses.replace(DRY, rounds=3)
    # Each round takes 80 s. With 210 s, round 2 fits (ending at 160); round 3 would end at 240. In the
    # 50 s left, its ceiling and DataLoader (10 + 40 s) would fit, the daemon's 30 s then not: the round
    # is left out whole, not cut after two of its feeds.
    limit = TimeLimit(210.0, 0.0, clock=lambda: now[0])
    rows, stopped = gpu_check_training.training_rows(tmp_path, sizes, 2, torch.device("cpu"), [2], tmp_path,
                                                     done=lambda rows: None, deadline=limit)
    assert order == ["synthetic", "prefetchd (2 workers)", "DataLoader (2 workers)",
                     "synthetic", "DataLoader (2 workers)", "prefetchd (2 workers)"]
    assert stopped == ("stopped before round 3, whose 3 feeds took 80 s in the last, with 50 s of "
                       "--time-limit 210 left: 2 of 3 rounds ran")
    by_feed = {row["feed"]: row for row in rows if "note" not in row}
    assert all(row["rounds_images_per_s"] == [100.0, 100.0] for row in by_feed.values()), by_feed
    # The first round always runs whole, however little time is left.
    now[0], order[:] = 0.0, []
    little = TimeLimit(1.0, 0.0, clock=lambda: now[0])
    rows, stopped = gpu_check_training.training_rows(tmp_path, sizes, 2, torch.device("cpu"), [2], tmp_path,
                                                     done=lambda rows: None, deadline=little)
    assert len(order) == 3 and stopped is not None and stopped.startswith("stopped before round 2, ")


def test_worker_counts_are_read_from_a_comma_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import gpu_check

    assert gpu_check.worker_counts("15,12") == [15, 12]
    for bad in ("", "0", "15,x", "-1"):
        with pytest.raises(gpu_check.argparse.ArgumentTypeError, match="worker counts of 1 or more"):
            gpu_check.worker_counts(bad)


BURN = "import time\nwhile time.process_time() < {seconds}: pass\n"  # exits having used that much CPU


def test_cpu_use_counts_children_in_the_tree_and_a_detached_process_as_another(monkeypatch: pytest.MonkeyPatch,
                                                                               tmp_path: Path) -> None:
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import host_use

    # A child that has exited and been reaped still counts: its CPU is in our children_* times
    # (in clock ticks of 10 ms, user and system each rounded down: 0.5 s can read 0.49).
    before = host_use._cpu(psutil.Process())
    subprocess.run([sys.executable, "-c", BURN.format(seconds=0.5)], check=True, timeout=60)
    assert host_use._cpu(psutil.Process()) - before >= 0.45

    # A process outside the tree (its parent exits at once: it is re-parented away from us, and
    # waits for its go until then) is another's CPU, and only the machine's figure sees it.
    done, go = tmp_path / "done", tmp_path / "go"
    script = (f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
              + BURN.format(seconds=0.5) + f"open({str(done)!r}, 'w').close()\n")
    subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                    f"{script!r}], start_new_session=True)"], check=True, timeout=60)
    use, started = host_use.CpuUse(), time.perf_counter()
    go.touch()
    deadline = time.monotonic() + 60
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done.exists()
    got = use.stop()
    span = time.perf_counter() - started
    assert got["cpu_tree_cores"] * span < 0.4, "the detached process was counted as ours"
    assert got["cpu_other_cores"] * span >= 0.45
    assert 0 <= got["cpu_steal_share"] < 1


def test_cpu_use_keeps_counting_a_process_of_the_tree_that_outlives_its_parent(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    # A daemon that stops leaves its worker server and workers to another reaper: their CPU time
    # never reaches our children_* times, and they were booked as other processes' CPU.
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import host_use

    ready, go, done = tmp_path / "ready", tmp_path / "go", tmp_path / "done"
    wait_for = "import os, time\nwhile not os.path.exists({path!r}): time.sleep(0.01)\n"
    grandchild = (f"open({str(ready)!r}, 'w').close()\n" + wait_for.format(path=str(go))
                  + BURN.format(seconds=0.5) + f"open({str(done)!r}, 'w').close()\n"
                  # Alive for a few samples after its work: CPU after a process's last sample is lost by design
                  # (a host whose init reaps orphans at once frees it before anyone reads it again; review).
                  + f"time.sleep({3 * host_use.SAMPLE_SECONDS})\n")
    child = ("import subprocess, sys\n"
             f"subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n" + wait_for.format(path=str(go)))
    use = host_use.CpuUse()
    proc = subprocess.Popen([sys.executable, "-c", child])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists()
        use._sample()  # what the thread does every SAMPLE_SECONDS: both are in the tree now
        go.touch()
        proc.wait(60)  # the child leaves first, reaped by us; the grandchild burns and exits unreaped by us
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert done.exists()
        time.sleep(5 * host_use.SAMPLE_SECONDS)  # it exits three samples after its file; let it go
    finally:
        proc.kill()
        proc.wait()
    got = use.stop()
    span = time.perf_counter() - use._begin[0]
    assert got["cpu_tree_cores"] * span >= 0.45, "the grandchild's CPU left the tree with its parent"


def test_a_round_s_timeline_shows_where_its_time_went(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import gpu_check_training

    # 10 steps of 0.1 s at batch 4 (40 img/s), but step 7 opened an epoch and waited 2 s for its
    # batch: the fourth fifth (steps 7 and 8) is the slow one, and the longest wait names step 7
    # (index 6).  Steps 2 and 4 waited 0.1 s more, inside the epoch: the rate between epoch
    # starts counts those waits and leaves out step 7's.
    waits = [0.01] * 10
    waits[6], waits[1], waits[3] = 2.0, 0.11, 0.11
    marks = [0.0]
    for waited in waits:
        marks.append(marks[-1] + 0.09 + waited)
    opens = [i == 6 for i in range(10)]
    got = gpu_check_training.timeline(marks, waits, [4] * 10, opens)
    assert got["fifths_images_per_s"] == [round(8 / 0.3, 1), round(8 / 0.3, 1), 40.0, round(8 / 2.19, 1), 40.0]
    assert got["longest_wait_s"] == 2.0 and got["longest_wait_step"] == 6
    assert got["between_epochs_images_per_s"] == round(36 / 1.1, 1) and got["epoch_starts"] == 1
    # A short batch counts the images it had.  Fewer steps than fifths: one part per step.
    # No epoch start (the synthetic feed): every step counts.  No steps: nothing to say.
    short = gpu_check_training.timeline([0.0, 0.5, 1.5], [0.0, 0.0], [2, 1], [False, False])
    assert short["fifths_images_per_s"] == [4.0, 1.0] and short["between_epochs_images_per_s"] == 2.0
    assert short["epoch_starts"] == 0
    assert gpu_check_training.timeline([0.0], [], [], []) == {}


def test_the_daemon_feed_gives_full_batches_as_the_dataloader_feed_does(monkeypatch: pytest.MonkeyPatch,
                                                                       shapes_data: Path, shm_dir: Path) -> None:
    # A short last batch made cuDNN tune itself inside the first daemon-fed round on the H100;
    # the DataLoader feed drops it (drop_last=True), and so must the daemon's.  72 images in
    # batches of 10: 7 full ones an epoch, read across an epoch's end.
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import gpu_check_feeds
    import torch
    from gpu_check_plan import DRY

    sizes = dataclasses.replace(DRY, batch_size=10)
    with gpu_check_feeds.prefetchd_feed(shapes_data / "train", sizes, 1, torch.device("cpu"), shm_dir) as batches:
        assert [len(next(batches)[1]) for _ in range(9)] == [10] * 9


def test_a_short_run_leaves_out_the_tests_and_step_5_and_stops_its_rounds_at_the_time_limit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], shapes_data: Path) -> None:
    out = tmp_path / "gpu.json"
    env = tool_env()
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--dry-run", "--skip-tests", "--skip-scaling",
                           "--rounds", "2", "--time-limit", "1", "--data", str(shapes_data / "train"),
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    # The --data it was given, described as a generated one is (a review: its folder alone).
    assert re.fullmatch(rf"{shapes_data / 'train'}: 3 classes, 72 images, mean \d+ KB, [\d.]+ KiB in all",
                        doc["dataset"]), doc["dataset"]
    assert doc["tests"] is None and doc["scaling"] is None and doc["sizes"]["rounds"] == 2
    # A second of --time-limit leaves only the first round, which always runs whole.
    assert all(len(row["rounds_images_per_s"]) == 1 for row in doc["training"] if "note" not in row)
    assert doc["training_stopped"].startswith("stopped before round 2, ")
    # The first round ran past the limit: by how much, not "with 0 s of --time-limit 1 left" (a review).
    assert re.search(r"took \d+ s in the last, \d+ s past --time-limit 1 already: 1 of 2 rounds ran$",
                     doc["training_stopped"]), doc["training_stopped"]
    markdown = (tmp_path / "GPU.md").read_text()
    assert "**Cut short by `--time-limit`**: stopped before round 2, " in markdown
    # Left out, and said so (a review: the sections vanished without a word); the options of the run recorded.
    assert "## The producer on more cores\n\nNot measured this time (`--skip-scaling`)." in markdown
    assert "## GPU tests\n\nNot run this time (`--skip-tests`)." in markdown
    assert ("This run: `python tools/gpu_check.py --dry-run --skip-tests --skip-scaling --rounds 2 --time-limit 1 "
            f"--data {shapes_data / 'train'} --out {out}`") in markdown, markdown
    assert "(1 workers)" not in markdown and "prefetchd (1 worker)" in markdown
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import gpu_check

    for flag, value in (("--rounds", "0"), ("--scaling-rounds", "0"), ("--time-limit", "0"), ("--steps", "0")):  # refused by argparse, before anything runs
        with pytest.raises(SystemExit) as refused:
            gpu_check.main(["--dry-run", flag, value, "--out", str(tmp_path / "refused" / "gpu.json")])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and f"{flag} 0: give" in err, err
    # A --data or --scaling-buffer-root that cannot serve, and more workers than cores: refused before the GPU tests
    # and the copies (a review: a traceback from os.scandir or step 5, minutes into a lease's call).
    (tmp_path / "empty" / "a").mkdir(parents=True)
    for args, said in ((["--data", str(tmp_path / "none")], "is not a folder"),
                       (["--data", str(tmp_path / "empty")], "holds no images in class folders"),
                       (["--scaling-buffer-root", str(tmp_path / "none")], "--scaling-buffer-root "),
                       (["--workers", "100000"], "--workers 100000 is more than the ")):
        with pytest.raises(SystemExit) as refused:
            gpu_check.main(["--dry-run", *args, "--out", str(tmp_path / "refused" / "gpu.json")])
        err = capsys.readouterr().err
        assert refused.value.code == 2 and said in err, err
    assert not (tmp_path / "refused").exists()
