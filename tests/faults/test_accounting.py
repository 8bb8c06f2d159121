"""The fault suite's bookkeeping must be able to fail: lost, duplicated, different and
replayed batches are told apart (no processes here, just logs)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from prefetchd.buffer_protocol import batch_name, write_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.faults.accounting import account, compare  # noqa: E402
from tests.faults.harness import Fault, reads_the_same  # noqa: E402

STEPS, POSITIONS, SAMPLES = 3, 6, 12


def line(run: int, g: int, sha: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"run": run, "epoch": g // STEPS, "step": g % STEPS, "t": float(g), "indices": [2 * g, 2 * g + 1],
            "labels": [0, 1], "replaced": 0, "sha": sha or f"h{g}", "slots": [f"s{2 * g}", f"s{2 * g + 1}"], **extra}


def start(run: int, g: int) -> dict[str, Any]:
    return {"event": "start", "run": run, "epoch": g // STEPS, "step": g % STEPS, "t": 0.0}


REF = {g: line(-1, g) for g in range(POSITIONS)}


def test_a_clean_run_and_a_replay_after_a_kill_are_fine() -> None:
    # Run 0 logged 0..2 and was killed before checkpointing after 2: run 1 resumes at 2.
    records = [start(0, 0), *(line(0, g) for g in range(3)), start(1, 2), *(line(1, g) for g in range(2, 6))]
    acc = account(records, REF, STEPS, POSITIONS, SAMPLES)
    assert acc["lost"] == acc["duplicated"] == acc["different"] == acc["out_of_order"] == 0, acc
    assert acc["replayed"] == 1 and acc["committed"] == 6 and not acc["problems"]


def test_lost_duplicated_different_and_reordered_batches_are_counted() -> None:
    records = [start(0, 0), line(0, 0), line(0, 1), line(0, 1), line(0, 3, sha="bad"), line(0, 2), line(0, 5)]
    acc = account(records, REF, STEPS, POSITIONS, SAMPLES)
    assert acc["lost"] == 1  # 4
    assert acc["duplicated"] == 1  # 1 twice in one run
    assert acc["different"] == 1  # 3's content
    assert acc["out_of_order"] == 4  # 1->1, 1->3, 3->2, 2->5
    assert any("different content" in p for p in acc["problems"])


def test_a_replay_must_match_too_and_a_resume_too_far_back_is_reported() -> None:
    records = [start(0, 0), *(line(0, g) for g in range(4)), line(0, 4, sha="bad"), start(1, 1),
               *(line(1, g) for g in range(1, 6))]
    acc = account(records, REF, STEPS, POSITIONS, SAMPLES)
    assert acc["different"] == 1 and acc["replayed"] == 4
    assert any("again" in p for p in acc["problems"])


def test_only_the_bad_sample_policy_may_change_a_batch() -> None:
    want = line(-1, 1)  # indices 2, 3
    replaced = {**line(0, 1, sha="x"), "indices": [2, 4], "labels": [0, 0], "slots": ["s2", "other"], "replaced": 1}
    gone = frozenset({3})  # the harness moved sample 3's file away
    labels = {i: i % 2 for i in range(SAMPLES)}  # as the reference run's batches give them (line())
    assert compare(replaced, want, SAMPLES, gone, labels) == "replaced"
    # The replacement under the replaced sample's label (a worker's or the controller's slip): the slots'
    # hashes are of images alone, so only the labels tell (mutation review).
    assert compare({**replaced, "labels": [0, 1]}, want, SAMPLES, gone, labels) == "sample 4 is labelled 1, not 0"
    assert compare({**replaced, "labels": [1, 0]}, want, SAMPLES, gone, labels) == "sample 2 is labelled 1, not 0"
    assert "not its replacement" in compare(replaced, want, SAMPLES)  # nothing was moved away
    assert compare({**replaced, "replaced": 0}, want, SAMPLES, gone) == "different content"
    assert "not its replacement" in compare({**replaced, "indices": [2, 9]}, want, SAMPLES, gone)
    assert "image differs" in compare({**replaced, "slots": ["zz", "other"]}, want, SAMPLES, gone)


def test_a_consumer_that_joined_later_is_held_to_its_own_positions() -> None:
    # consumer_kill's extra consumer joined at 2 and must read 2..4: killed after 3, resumed at 3.
    records = [start(0, 2), line(0, 2), line(0, 3), start(1, 3), line(1, 3), line(1, 4)]
    acc = account(records, REF, STEPS, 5, SAMPLES, first=2)
    assert acc["lost"] == acc["duplicated"] == acc["out_of_order"] == 0 and acc["committed"] == 3, acc
    assert acc["replayed"] == 1
    # Resumed one past its checkpoint: the batch it missed is lost.
    acc = account([start(0, 2), line(0, 2), start(1, 4), line(1, 4)], REF, STEPS, 5, SAMPLES, first=2)
    assert acc["lost"] == 1, acc


def test_a_run_that_stops_short_loses_its_last_batches() -> None:
    # The last position is the one a trainer that exits one step early never asks for.
    acc = account([start(0, 0), *(line(0, g) for g in range(POSITIONS - 1))], REF, STEPS, POSITIONS, SAMPLES)
    assert acc["lost"] == 1 and acc["committed"] == POSITIONS - 1, acc
    acc = account([start(0, 2), line(0, 2), line(0, 3)], REF, STEPS, 5, SAMPLES, first=2)
    assert acc["lost"] == 1, acc  # 4, the joined consumer's last


def test_only_a_flip_no_reader_checks_and_a_file_nobody_read_may_go_unnoticed(tmp_path: Path) -> None:
    """The suite exempted every batch_corrupt and dataset_delete fault from detection, not just the two harmless
    cases RELIABILITY.md names (a review)."""
    path = tmp_path / batch_name(0, 0)
    write_batch(path, np.zeros((2, 4, 4, 3), np.uint8), np.array([1, 2]), np.array([10, 20]), epoch=0, step=3,
                seed=7, producer="pppp")
    data = path.read_bytes()

    def flipped(marker: bytes, bit: int = 0) -> bytes:
        at = data.index(marker) + len(marker) - 1
        return data[:at] + bytes([data[at] ^ (1 << bit)]) + data[at + 1:]

    assert reads_the_same(data, flipped(b"pppp"))  # "pppq": a producer id no reader checks
    assert not reads_the_same(data, flipped(b"\xa4step\x03"))  # step 3 -> 2: another position
    assert not reads_the_same(data, flipped(b"\xa4seed\x07"))
    assert not reads_the_same(data, flipped(b"\xa6format"))  # a key renamed: it no longer parses
    quiet = Fault("batch_corrupt", 0, 0.0, detail="byte 90, nothing a reader checks")
    loud = Fault("batch_corrupt", 0, 0.0, detail="byte 90")
    unread = Fault("dataset_delete", 0, 0.0, detail="not read while gone")
    assert not quiet.missed and loud.missed and not unread.missed
    assert Fault("dataset_delete", 0, 0.0, detail="replaced").missed
    assert not Fault("dataset_delete", 0, 0.0, detail="replaced", detected=True).missed
