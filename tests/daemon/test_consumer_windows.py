"""Several consumers of one stream: the union of their windows is kept, a batch goes only when no
window holds it, the cap shrinks the slowest window first, and a gone, silent or closed consumer
stops holding batches while another is live (SPEC rule 9)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from prefetchd.buffer_protocol import Manifest, Progress, progress_name, read_status, write_status
from prefetchd.daemon.consumers import plan_windows, union_size
from prefetchd.daemon.sampler import EpochOrders
from prefetchd.daemon.stream import Stream
from prefetchd.daemon.metrics import StatusCollector
from prefetchd.daemon.sdnotify import status_line
from prefetchd.daemon.status_view import format_status
from tests.pid_namespace import foreign_writer, free_pid, unavailable
from tests.status_examples import production, report
from tests.status_examples import status as status_example

HIGH, LOW = 4, 2
OURS = os.stat("/proc/self/ns/pid").st_ino  # this process's pid namespace


def stream(tmp_path: Path, cap: int | None = None, timeout: float = 300.0) -> Stream:
    manifest = Manifest(
        dataset_root="/data", fingerprint="f", classes=["a"], num_samples=80, split="all", seed=0,
        batch_size=8, image_size=32, samples_per_epoch=80, steps_per_epoch=10, epochs=2, producer="test",
    )
    return Stream(tmp_path, manifest, EpochOrders(np.arange(80), shuffle=False), high=HIGH, low=LOW, cap=cap,
                  consumer_timeout=timeout)


def move(s: Stream, name: str, g: int, **fields: object) -> None:
    Progress(*s.key(g), **fields).write(s.dir, name)  # type: ignore[arg-type]
    s.read_progress()
    for stale in s.outside_window()[0]:
        del s.published[stale]


def publish_held(s: Stream) -> None:
    for g in s.held:
        s.published[g] = s.dir / f"{g}.batch"


def test_union_and_plan() -> None:
    assert union_size([(0, 4), (2, 6), (10, 12), (5, 5)]) == 8
    assert plan_windows([0, 2], high=4, cap=8, end=None) == [4, 4]  # overlapping: 6 batches fit
    assert plan_windows([0, 10], high=4, cap=6, end=None) == [2, 4]  # apart: the slowest shrinks first
    assert plan_windows([0, 10, 20], high=4, cap=6, end=None) == [1, 1, 4]  # to one batch, then the next
    assert plan_windows([0, 10, 20], high=4, cap=2, end=None) == [1, 1, 0]  # fewer than the consumers: the fastest waits
    assert plan_windows([18], high=4, cap=4, end=20) == [4]  # the end cuts the window, not the plan


def test_consumers_in_lockstep_share_every_batch(tmp_path: Path) -> None:
    s = stream(tmp_path, cap=2 * HIGH)
    move(s, "a", 0)
    move(s, "b", 0)
    assert s.held == {0, 1, 2, 3}, "the default consumer that never wrote holds nothing once others do"
    publish_held(s)
    move(s, "a", 2)  # a is ahead: 0 and 1 stay for b, a's window reaches 5
    assert sorted(s.published) == [0, 1, 2, 3] and s.held == set(range(6))
    move(s, "b", 2)
    assert sorted(s.published) == [2, 3], "a batch goes once no window holds it"


def test_with_the_default_cap_a_consumer_behind_still_moves(tmp_path: Path) -> None:
    s = stream(tmp_path)  # cap = high-water: one trainer's worth, shared
    move(s, "fast", 10)
    move(s, "slow", 0)
    assert s.consumers["slow"].window == 1 and 0 in s.held and len(s.held) <= HIGH
    publish_held(s)
    move(s, "slow", 1)
    assert s.next_missing() == 1, "the slow consumer's next batch is built: it waits, it never starves"


def test_a_consumer_behind_keeps_its_own_window_until_the_cap_shrinks_it(tmp_path: Path) -> None:
    s = stream(tmp_path, cap=6)
    move(s, "fast", 10)
    move(s, "slow", 0)
    assert s.held == {0, 1} | {10, 11, 12, 13}, "the slowest window shrinks first, to fit the cap"
    assert s.consumers["slow"].window == 2 and s.consumers["fast"].window == 4
    publish_held(s)
    assert s.next_missing() is None
    move(s, "slow", 1)  # one consumed: its window moves, and 2 is built next (it is the one running dry)
    assert s.next_missing() == 2
    assert len(s.held) <= 6


def forge(s: Stream, name: str, g: int, **fields: object) -> None:
    """A progress document as another writer left it (another pid, an older time)."""
    Progress(*s.key(g)).write(s.dir, name)
    path = s.dir / progress_name(name)
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    s.read_progress()


def test_gone_silent_and_closed_consumers_stop_holding_while_another_is_live(tmp_path: Path) -> None:
    s = stream(tmp_path, cap=3 * HIGH, timeout=5.0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    move(s, "live", 4)
    forge(s, "gone", 0, pid=dead.pid)
    s.read_progress()
    assert s.consumers["gone"].alive is False
    assert s.held == {4, 5, 6, 7}
    move(s, "gone", 0)  # it came back (a new process wrote): it holds again
    s.read_progress()
    assert s.consumers["gone"].alive is True and {0, 1, 2, 3} <= s.held

    forge(s, "quiet", 1, time=time.time() - 60)  # alive, but silent for longer than the timeout
    move(s, "gone", 8, closed=True)
    s.read_progress()
    assert not any(s.consumers[name].live(time.time(), 5.0) for name in ("quiet", "gone"))
    assert s.held == {4, 5, 6, 7}, "closed and silent consumers hold nothing while 'live' reads"
    status = {c.name: c for c in s.status().consumers}
    assert not status["quiet"].holding and status["gone"].closed and status["live"].holding


def test_a_gone_or_departed_consumers_wait_share_is_no_longer_reported(tmp_path: Path) -> None:
    """The status and metrics kept a crashed trainer's last wait share (0.8: starving) for as long as the daemon
    ran; only a writer that is there has a share now."""
    s = stream(tmp_path, cap=3 * HIGH, timeout=5.0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    move(s, "live", 4, wait_share=0.25)
    forge(s, "gone", 0, pid=dead.pid, wait_share=0.8)
    move(s, "left", 2, wait_share=0.5, closed=True)
    s.check_trainer()
    shares = {c.name: c.progress.trainer_wait_share for c in s.status().consumers}
    assert shares == {"live": 0.25, "gone": None, "left": None}
    move(s, "gone", 1, wait_share=0.1)  # a new process writes: its share is reported
    assert {c.name: c.progress.trainer_wait_share for c in s.status().consumers}["gone"] == 0.1


@pytest.mark.skipif(bool(unavailable), reason=unavailable)
@pytest.mark.parametrize("numbered", ["as init here", "as nobody here"])
def test_a_consumer_in_another_pid_namespace_holds_while_it_runs_and_not_after(shm_dir: Path, numbered: str) -> None:
    """A trainer in another container that shares the tmpfs: its pid names another process here, init (pid 1,
    there for ever: it held batches after it died) or none (it was taken for gone while it read). It holds
    its window while it runs, and stops once it is killed, as a consumer of the daemon's namespace does."""
    s = stream(shm_dir, cap=3 * HIGH)
    move(s, "near", 8)  # a consumer of this namespace, so that one gone stops holding
    with foreign_writer(shm_dir, "boxed", s.manifest.job_key, pid=1 if numbered == "as init here" else free_pid()) as writer:
        s.read_progress()
        boxed = s.consumers["boxed"]
        assert boxed.alive is True and s.held == set(range(1, 1 + HIGH)) | set(range(8, 8 + HIGH))
        writer.kill()
        s.read_progress()
        assert boxed.alive is False and s.held == set(range(8, 8 + HIGH))
    assert not {c.name: c for c in s.status().consumers}["boxed"].holding


@pytest.mark.skipif(bool(unavailable), reason=unavailable)
def test_prefetchd_status_says_that_a_consumers_pid_is_of_another_pid_namespace(shm_dir: Path) -> None:
    """A trainer in another container that shares the tmpfs: status.json carried its pid alone, which `prefetchd
    status` showed bare, as if it named a process of the reader's (here the daemon's namespace)."""
    s = stream(shm_dir, cap=3 * HIGH)
    move(s, "near", 8)
    pid = free_pid()
    with foreign_writer(shm_dir, "boxed", s.manifest.job_key, pid=pid) as writer:
        s.read_progress()
        theirs = os.stat(f"/proc/{writer.here().pid}/ns/pid").st_ino
        written = s.status()
    trainers = {c.name: c.trainer for c in written.consumers}
    assert (trainers["boxed"].pid, trainers["boxed"].pid_namespace) == (pid, theirs) and theirs != OURS
    assert (trainers["near"].pid, trainers["near"].pid_namespace) == (os.getpid(), OURS)
    text = format_status(report(status_example(production=production(streams=(written,), high_water=HIGH))))
    assert f"consumer  boxed at epoch 0 step 1; pid {pid} of another pid namespace alive" in text, text
    assert f"consumer  near at epoch 0 step 8; pid {os.getpid()} alive" in text, text


def test_a_single_trainer_that_goes_away_keeps_its_window(tmp_path: Path) -> None:
    s = stream(tmp_path, timeout=0.01)
    move(s, "", 3)
    time.sleep(0.05)  # silent for longer than the timeout, and no other consumer: it still holds
    s.read_progress()
    assert s.held == {3, 4, 5, 6} and not s.finished


def test_when_every_consumer_left_before_the_end_their_windows_stay_for_the_next(tmp_path: Path) -> None:
    """SPEC rule 9: a closed consumer stops holding batches while another is live.  With none left
    the buffer keeps their windows, filled, for the next trainer, as for one that went away."""
    s = stream(tmp_path, cap=4 * HIGH)
    move(s, "a", 3)
    move(s, "b", 12)
    move(s, "a", 5, closed=True)
    assert s.held == set(range(12, 12 + HIGH)), "b is live: a, closed, holds nothing"
    move(s, "b", 13, closed=True)
    assert s.held == set(range(5, 5 + HIGH)) | set(range(13, 13 + HIGH)) and not s.finished


def test_the_stream_is_finished_when_every_expected_consumer_is_at_the_end(tmp_path: Path) -> None:
    s = stream(tmp_path, timeout=300.0)
    move(s, "a", 20)
    move(s, "b", 15)
    assert not s.finished
    move(s, "c", 3, closed=True)  # left: not waited for
    move(s, "b", 20)
    assert s.finished and s.held == set()


def test_status_lists_the_consumers_and_old_documents_read_without_them(tmp_path: Path) -> None:
    s = stream(tmp_path, cap=6)
    move(s, "fast", 10, wait_share=0.25)
    move(s, "slow", 0)
    st = s.status()
    assert [c.name for c in st.consumers] == ["fast", "slow"]
    fast, slow = st.consumers
    assert (fast.progress.epoch, fast.progress.step, fast.progress.trainer_wait_share) == (1, 0, 0.25)
    assert (fast.window, slow.window, fast.holding, slow.holding) == (4, 2, True, True)
    assert (st.progress.epoch, st.progress.step) == (0, 0), "the stream's progress is the slowest holder's"
    old = status_example().to_doc()
    for entry in old["streams"]:
        del entry["consumers"]
    (tmp_path / "status.json").write_text(json.dumps(old))
    back = read_status(tmp_path)
    assert back is not None and back.production is not None and back.production.streams[0].consumers == ()
    write_status(tmp_path, status_example())
    again = read_status(tmp_path)
    assert again is not None and again.production is not None and again.production.streams[0].consumers[0].name == "trial-3"


def test_prefetchd_status_lists_each_consumer(tmp_path: Path) -> None:
    s = stream(tmp_path, cap=6)
    move(s, "fast", 10, wait_share=0.5)
    move(s, "slow", 0)
    move(s, "gone", 3, closed=True)
    prod = production(streams=(s.status(),), high_water=HIGH)  # the stream's own mark, as a daemon writes it
    info = report(status_example(production=prod), buffer=tmp_path)
    lines = [x for x in format_status(info).splitlines() if x.startswith("  consumer")]
    assert len(lines) == 3
    fast, gone, slow = lines
    assert "fast at epoch 1 step 0, waiting for data 50.0%" in fast and "window 4" in fast
    assert "gone at epoch 0 step 3" in gone and "left" in gone and "holds nothing" in gone
    assert "slow at epoch 0 step 0" in slow and "alive" in slow and "window 2" in slow
    # A single trainer's status shows no consumer lines: nothing changes for it.
    (tmp_path / "single").mkdir()
    single = stream(tmp_path / "single")
    move(single, "", 4)
    info = dataclasses.replace(info, status=status_example(production=production(streams=(single.status(),), high_water=HIGH)))
    assert "consumer" not in format_status(info)


def test_the_systemd_status_line_counts_the_consumers(tmp_path: Path) -> None:
    s = stream(tmp_path, cap=6)
    move(s, "a", 10)
    move(s, "b", 0)
    move(s, "c", 3, closed=True)
    line = status_line(status_example(production=production(streams=(s.status(),))))
    assert "3 consumers, 2 holding" in line


def test_metrics_carry_per_consumer_figures(tmp_path: Path) -> None:
    s = stream(tmp_path, cap=6)
    move(s, "a", 12, wait_share=0.125)
    move(s, "b", 0)
    move(s, "c", 3, closed=True)  # a finished run: not alive, as one that went away, but closed
    status = status_example(production=production(streams=(s.status(),)))
    samples = {(m.name, sm.labels.get("consumer")): sm.value
               for m in StatusCollector(tmp_path, lambda: status).collect() for sm in m.samples}
    assert samples[("prefetchd_consumer_closed", "c")] == 1 and samples[("prefetchd_consumer_closed", "a")] == 0
    assert samples[("prefetchd_consumer_epoch", "a")] == 1 and samples[("prefetchd_consumer_step", "a")] == 2
    assert samples[("prefetchd_consumer_wait_share", "a")] == 0.125
    assert samples[("prefetchd_consumer_window_batches", "a")] == 4 and samples[("prefetchd_consumer_window_batches", "b")] == 2
    assert ("prefetchd_consumer_alive", "b") in samples


def test_a_cap_below_one_batch_per_consumer_makes_the_fastest_wait(tmp_path: Path, caplog: Any) -> None:
    caplog.set_level(logging.INFO, logger="prefetchd.daemon.stream")
    s = stream(tmp_path, cap=2)
    move(s, "a", 0)
    move(s, "b", 5)
    move(s, "c", 9)
    assert s.held == {0, 5} and s.consumers["c"].window == 0
    assert "'c' waits" in caplog.text
    publish_held(s)
    move(s, "b", 9)  # b caught up with c: they share a batch, and both move again
    assert s.held == {0, 9}


def test_a_consumer_starved_by_turns_is_said_to_wait_once_a_minute(tmp_path: Path, caplog: Any) -> None:
    """Three consumers at a cap of two batches starve by turns, at every poll: the line came four times in half
    a second (review)."""
    caplog.set_level(logging.INFO, logger="prefetchd.daemon.stream")
    s = stream(tmp_path, cap=2)
    move(s, "a", 0)
    move(s, "b", 5)
    move(s, "c", 9)
    assert s.consumers["c"].window == 0
    for b in (9, 12, 9, 12):  # b with c (both fed), then the fastest, past the cap (b waits), and again
        publish_held(s)
        move(s, "b", b)
    assert caplog.text.count("'c' waits") == 1 and caplog.text.count("'b' waits") == 1, caplog.text


def test_consumers_that_left_are_not_said_to_wait(tmp_path: Path, caplog: Any) -> None:
    """Every consumer closed under a small cap: their windows stay for the next trainer, but the log said
    "consumer 'b' waits" of consumers that had left (review)."""
    caplog.set_level(logging.INFO, logger="prefetchd.daemon.stream")
    s = stream(tmp_path, cap=2)
    move(s, "a", 0)
    move(s, "b", 5)
    move(s, "c", 9)
    caplog.clear()
    for name, g in (("a", 1), ("b", 6), ("c", 10)):
        move(s, name, g, closed=True)
    assert "waits" not in caplog.text, caplog.text


def test_the_log_says_a_gone_or_silent_consumer_holds_batches_when_the_others_have_left(
    tmp_path: Path, caplog: Any
) -> None:
    """A consumer gone or silent stops holding batches only while another waits; once the others left
    (closed) it holds, and the log said "it holds no batches while other consumers read" (review)."""
    caplog.set_level(logging.INFO, logger="prefetchd.daemon.stream")
    s = stream(tmp_path, cap=3 * HIGH, timeout=5.0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    move(s, "done", 3, closed=True)
    forge(s, "gone", 1, pid=dead.pid)
    forge(s, "quiet", 6, pid=1, time=time.time() - 60)  # init: a live writer, started before it wrote
    s.check_trainer()
    s.read_progress()
    assert s.consumers["gone"].alive is False and s.consumers["quiet"].alive
    assert {1, 6} <= s.held, "with the others closed, the gone and the silent consumer hold"
    assert "other consumers read" not in caplog.text and "stops holding batches" not in caplog.text, caplog.text
    assert "Keeping the buffer at the high-water mark" in caplog.text, caplog.text
    assert "has written no progress" not in caplog.text, "a silent consumer that still holds is no news"
    move(s, "quiet", 7)
    assert "writes progress again" not in caplog.text, "nor is its coming back, unsaid before"

    move(s, "quiet", 20, closed=True)
    assert "consumer 'quiet' of rank 0 left at epoch 2 step 0; every batch consumed" in caplog.text, caplog.text


def test_a_consumer_counts_what_it_consumed_here_not_where_it_joined(tmp_path: Path) -> None:
    """A named consumer joining at batch 12 (or a trainer resuming there under a new daemon) had consumed
    12 batches by the status's count, and the consume rate jumped with every join."""
    s = stream(tmp_path, cap=4 * HIGH)
    move(s, "a", 12)
    move(s, "b", 12)
    assert s.consumed == 0 and s.consumers["a"].rewinds == 0
    move(s, "a", 15)
    move(s, "b", 13)
    move(s, "b", 12)  # back one: a rewind, no consumption
    assert s.consumed == 4 and s.consumers["b"].rewinds == 1


def test_reads_before_the_first_document_seen_count_when_the_loader_is_newer_than_the_stream(tmp_path: Path) -> None:
    """A loader that read 3 batches before the stream's first look at its progress (a trainer started as the job
    did) had consumed none by the status (6 of 9 at a job's end); one older than the stream may have read another
    daemon's batches (a resumed run's), which are not this stream's to count."""
    s = stream(tmp_path, cap=4 * HIGH)
    newer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        s.started = psutil.Process(newer.pid).create_time() - 2  # past create_time's second of slack
        forge(s, "new", 3, pid=newer.pid, read_batches=3)
        forge(s, "old", 5, pid=1, read_batches=5)  # init: started before the stream
        assert s.consumers["new"].consumed == 3 and s.consumers["old"].consumed == 0
        forge(s, "new", 4, pid=newer.pid, read_batches=4)
        assert s.consumed == 4
    finally:
        newer.kill()
        newer.wait()


def test_a_consumer_whose_progress_file_is_removed_is_forgotten(tmp_path: Path) -> None:
    """The way to drop a consumer that will not come back: it held its window for ever (when none was live),
    pinning where newcomers join, and stayed in the status."""
    s = stream(tmp_path, cap=4 * HIGH)
    move(s, "a", 2)
    move(s, "b", 9)
    move(s, "a", 5)
    move(s, "a", 4)
    assert set(s.consumers) == {"", "a", "b"} and 4 in s.held
    (tmp_path / progress_name("a")).unlink()
    s.read_progress()
    assert set(s.consumers) == {"", "b"} and min(s.held) == 9
    assert (s.consumed, s.progress_rewinds) == (3, 1), "the status's totals do not go back"


def test_a_stream_takes_its_cap_of_consumers_keeps_those_it_has_and_says_the_rest_once(
        tmp_path: Path, caplog: Any) -> None:
    """Any member of a --group-access buffer's group writes progress files: a stream took every one, and
    20,000 planted ones made each poll take seconds, 20,000 warnings and a status.json past what its
    readers take.  Now it takes MAX_CONSUMERS (the default one included), never drops one it has for a
    newcomer, and says the files it leaves alone in one line, at most every IGNORED_SAID_SECONDS."""
    from prefetchd.daemon.stream import MAX_CONSUMERS

    caplog.set_level(logging.INFO, logger="prefetchd.daemon.stream")
    s = stream(tmp_path, cap=4 * HIGH)
    move(s, "trial-a", 3)
    move(s, "trial-b", 3)
    planted = [f"c{i:05d}" for i in range(MAX_CONSUMERS + 100)]  # names that sort before the trials'
    for name in planted:
        Progress(0, 0, pid=1).write(s.dir, name)
    Progress(0, 5).write(s.dir)  # the default consumer: there from the start, never crowded out
    s.read_progress()
    taken = MAX_CONSUMERS - 3
    assert set(s.consumers) == {"", "trial-a", "trial-b", *planted[:taken]}
    assert s.consumers[""].position == 5 and s.consumers["trial-a"].position == 3
    ignored = len(planted) - taken
    said = f"ignoring {ignored} progress files in {s.dir}"
    assert caplog.text.count("progress files in") == 1 and said in caplog.text, caplog.text
    assert f"{ignored} progress files in {s.dir} ignored" in s.status().progress_file
    assert len(s.status().consumers) == MAX_CONSUMERS
    move(s, "trial-a", 4)
    s.read_progress()
    assert s.consumers["trial-a"].position == 4 and caplog.text.count("progress files in") == 1, "said once"
    (tmp_path / progress_name("trial-b")).unlink()  # a consumer forgotten: the next planted one takes its place
    s.read_progress()
    assert "trial-b" not in s.consumers and planted[taken] in s.consumers and s.ignored == ignored - 1
    for name in planted[taken:]:
        (tmp_path / progress_name(name)).unlink()
    s.read_progress()
    assert s.ignored == 0 and s.status().progress_file == ""


def test_files_that_give_no_position_take_no_consumers_place_and_a_poll_reads_a_bounded_number(
        tmp_path: Path, caplog: Any) -> None:
    """Any member of a --group-access buffer's group may put files under progress names.  Those that were no
    progress document took the places of consumers as well, and a trainer that came after them was shut out
    until they were removed.  Now they take none; a poll reads at most ``max_reads`` files, those written last
    first, so the trainer joins at the first poll however many there are; each is refused once, said in one
    line, and read again only when it is replaced."""
    caplog.set_level(logging.INFO, logger="prefetchd.daemon.stream")
    s = stream(tmp_path, cap=4 * HIGH)
    move(s, "trial-a", 3)
    junk = [f"c{i:05d}" for i in range(1000)]  # more than the stream takes, and names that sort before the trials'
    old = time.time_ns() - 10**10
    for i, name in enumerate(junk):
        path = tmp_path / progress_name(name)
        if i % 2:
            path.symlink_to(tmp_path / progress_name("trial-a"))  # never read through
        else:
            path.write_text("not a progress document")
        os.utime(path, ns=(old, old), follow_symlinks=False)
    move(s, "trial-b", 5)
    assert s.consumers["trial-b"].position == 5 and set(s.consumers) == {"", "trial-a", "trial-b"}
    assert s.refused == s.max_reads - 2, "a poll read more than max_reads files (trial-a's and trial-b's among them)"
    polls = 1
    while s.refused < len(junk):
        before = s.refused
        s.read_progress()
        polls += 1
        assert s.refused - before <= s.max_reads - 2
    assert polls == -(-len(junk) // (s.max_reads - 2))
    rejected = s.progress_rejected
    assert rejected == len(junk)
    s.read_progress()
    assert s.progress_rejected == rejected, "a file refused was read and counted again"
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ignoring")]
    assert len(said) == 1 and ("symbolic link" in said[0] or "not valid JSON" in said[0]), said
    assert f"{len(junk)} progress files in {s.dir} refused" in s.status().progress_file
    assert [c.name for c in s.status().consumers] == ["trial-a", "trial-b"]
    Progress(*s.key(7)).write(s.dir, junk[0])  # renamed over the junk: read again, and taken
    s.read_progress()
    assert s.consumers[junk[0]].position == 7 and s.refused == len(junk) - 1


@pytest.mark.skipif(os.geteuid() != 0, reason="plants a file the daemon's user (nobody) may not read: needs root")
def test_a_progress_file_refused_for_its_mode_is_counted_once_not_again_as_ignored_for_the_cap(
        shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A progress file the daemon may not read (an older trainer's, 0600) is refused, and read again now and then
    (its owner's chmod gives it no new inode).  Once the stream was full, each such look found it left unread for
    the cap, and the status counted it twice, refused and ignored, with the cap's advice (remove the files of
    consumers that will not come back) beside the chmod it needs.  A readable file past the cap is still ignored."""
    from prefetchd.daemon import stream_progress
    from tests.as_nobody import NOBODY, as_nobody

    monkeypatch.setattr(stream_progress, "UNREADABLE_RETRY_SECONDS", 0.0)  # read again at each poll
    os.chown(shm_dir, NOBODY, NOBODY)  # the daemon's user's buffer
    Progress(0, 0).write(shm_dir, "old")  # root's, 0600: an older trainer's under umask 077
    os.chmod(shm_dir / progress_name("old"), 0o600)

    def daemon() -> str:
        manifest = Manifest(dataset_root="/data", fingerprint="f", classes=["a"], num_samples=80, split="all",
                            seed=0, batch_size=8, image_size=32, samples_per_epoch=80, steps_per_epoch=10, epochs=2,
                            producer="test")
        s = Stream(shm_dir, manifest, EpochOrders(np.arange(80), shuffle=False), high=HIGH, low=LOW, cap=4 * HIGH,
                   max_consumers=2)  # the default consumer and one more
        s.read_progress()
        said = [(s.refused, s.ignored)]
        Progress(0, 1).write(shm_dir, "a")  # takes the last place
        for _ in range(3):
            s.read_progress()
            said.append((s.refused, s.ignored))
        joined = sorted(s.consumers)
        refused_only = s.progress_error
        Progress(0, 2).write(shm_dir, "b")  # readable, past the cap
        s.read_progress()
        return json.dumps([said, joined, refused_only, s.refused, s.ignored, s.progress_error])

    said, joined, refused_only, refused, ignored, error = json.loads(as_nobody(daemon))
    assert joined == ["", "a"]
    assert said == [[1, 0]] * 4, "refused once, and never counted again as left out for the cap"
    assert "may not read it" in refused_only and "ignored" not in refused_only, refused_only
    assert (refused, ignored) == (1, 1) and f"1 progress file in {shm_dir} ignored" in error, error


def test_a_status_of_the_most_ranks_and_consumers_stays_within_what_readers_take(tmp_path: Path) -> None:
    """256 ranks (MAX_LOCAL_RANKS), each with more consumers than it takes, every one refused after it
    was read (both a row and a problem in the status): status.json stays under MAX_DOCUMENT_LEN, or
    every trainer reads the daemon as gone."""
    from prefetchd.buffer_protocol.json_files import MAX_DOCUMENT_LEN
    from prefetchd.buffer_protocol.layout import STATUS_NAME
    from prefetchd.buffer_protocol.layout import DIR_FLAGS
    from prefetchd.daemon.config import MAX_LOCAL_RANKS, DaemonConfig
    from prefetchd.daemon.dataset import SampleIndex, pack_paths
    from prefetchd.daemon.producer import Producer
    from prefetchd.daemon.wakeup import Wakeup

    n, ranks, per_rank = 1000, MAX_LOCAL_RANKS, 20
    blob, offsets = pack_paths([f"a/{i}.jpg".encode() for i in range(n)])
    index = SampleIndex(str(tmp_path), ("a",), blob, offsets, np.zeros(n, np.int64), "f")
    cfg = DaemonConfig(buffer=tmp_path, data=str(tmp_path / "data"), split="train", seed=5, batch_size=8, image_size=32,
                       workers=1, high_water=HIGH, low_water=LOW, world_size=ranks)
    streams = []
    for rank in range(ranks):
        folder = tmp_path / f"rank-{rank:05d}"
        folder.mkdir()
        manifest = Manifest(dataset_root=str(tmp_path), fingerprint="f", classes=["a"], num_samples=n,
                            split="train", seed=5, batch_size=8, image_size=32, samples_per_epoch=4,
                            steps_per_epoch=1, epochs=None, producer="test", rank=rank, world_size=ranks)
        streams.append((folder, manifest, os.open(folder, DIR_FLAGS)))
    producer = Producer(cfg, index, np.arange(n), streams, Wakeup(tmp_path))
    try:
        widest = {"format": "prefetchd.progress", "version": 1, "epoch": 999_999, "step": 0, "pid": 4_194_304,
                  "time": time.time(), "wait_share": 0.1234, "pid_namespace": 4_026_531_836,
                  "read_batches": 2**62, "locked": True}
        for s in producer.streams:
            for i in range(per_rank):
                (s.dir / progress_name(f"{i:02d}{'x' * 30}")).write_text(json.dumps(widest))
        for s in producer.streams:
            s.read_progress()
        for s in producer.streams:
            for path in s.dir.glob("progress.*.json"):
                path.write_text(json.dumps({**widest, "version": "v" * 100_000}))
            s.read_progress()
        write_status(tmp_path, producer.status())
        size = (tmp_path / STATUS_NAME).stat().st_size
        assert size < MAX_DOCUMENT_LEN * 0.8, f"{size} bytes"
        status = read_status(tmp_path)
        assert status is not None and status.production is not None
        assert all(s.consumers and s.progress_file for s in status.production.streams)
    finally:
        producer.shutdown()
