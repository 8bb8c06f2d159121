"""What the trainer received in a fault-injection run, judged against the fault-free run.

How the comparison works (see ``driver.py`` for the commit semantics): each
line the trainer logged is either *committed* (it is part of the training
run) or a *replay* (received again after a crash because the checkpoint had
not moved past it).  Committed positions must be exactly 0 .. N-1 in order;
every line, replays included, must equal the fault-free run's batch (indices,
labels, sha256 of the image and label bytes).  The one accepted difference is
a sample the bad-sample policy replaced while the harness had its file moved
away (``dataset_delete``): that slot must hold the next sample of the split,
every other slot must be identical, every slot must carry its sample's label, and the batch
must say ``replaced``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any


class LogReader:
    """The driver's JSON lines, read incrementally; a line cut by a kill is skipped."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.records: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        new = []
        for line in data[: end + 1].splitlines():
            try:
                new.append(json.loads(line))
            except ValueError:
                continue
        self.records.extend(new)
        return new


def read_log(path: Path) -> list[dict[str, Any]]:
    reader = LogReader(path)
    reader.poll()
    return reader.records


def account(records: list[dict[str, Any]], ref: dict[int, dict[str, Any]], steps: int, positions: int,
            samples: int, deleted: frozenset[int] = frozenset(), first: int = 0) -> dict[str, Any]:
    """Compare the trainer's log with the reference (see the module docstring for the rules): positions
    ``first`` .. ``positions - 1`` (a consumer that joined later starts at ``first``)."""
    starts = {r["run"]: r["epoch"] * steps + r["step"] for r in records if r.get("event") == "start"}
    label_of = labels_by_sample(ref)
    runs = sorted(starts)
    problems: list[str] = []
    committed: list[int] = []
    replayed = replaced = different = 0
    for run, nxt in zip(runs, [*runs[1:], None]):
        limit = starts[nxt] if nxt is not None else None
        again = 0
        for r in records:
            if r.get("run") != run or "sha" not in r:
                continue
            g = r["epoch"] * steps + r["step"]
            verdict = compare(r, ref.get(g), samples, deleted, label_of)
            if verdict == "replaced":
                replaced += 1
            elif verdict != "same":
                different += 1
                problems.append(f"run {run} epoch {r['epoch']} step {r['step']}: {verdict}")
            if limit is not None and g >= limit:
                again += 1
            else:
                committed.append(g)
        # The checkpoint follows every step, so a kill costs at most the one batch in training.
        if again > 1:
            problems.append(f"run {nxt} received {again} batches of run {run} again; at most 1 is expected")
        replayed += again
        if nxt is not None and starts[nxt] < starts[run]:
            problems.append(f"run {nxt} resumed at {starts[nxt]}, before run {run}'s start {starts[run]}")
    counts = Counter(committed)
    return {
        "committed": len(committed),
        "lost": sum(1 for g in range(first, positions) if g not in counts),
        "duplicated": sum(c - 1 for c in counts.values() if c > 1),
        "different": different,
        "out_of_order": sum(1 for a, b in zip(committed, committed[1:]) if b != a + 1),
        "replayed": replayed,
        "replaced_by_policy": replaced,
        "problems": problems,
    }


def labels_by_sample(ref: dict[int, dict[str, Any]]) -> dict[int, int]:
    """Each sample's label, as the fault-free run's batches give it."""
    return {i: label for batch in ref.values() for i, label in zip(batch["indices"], batch["labels"])}


def compare(got: dict[str, Any], want: dict[str, Any] | None, n: int, deleted: frozenset[int] = frozenset(),
            label_of: dict[int, int] | None = None) -> str:
    """"same", "replaced" (allowed: a sample replaced by the bad-sample policy) or what differs.  ``label_of``:
    each sample's label (``labels_by_sample``), which a replaced batch's slots must carry, the swapped
    ones too; without it, the reference batch's own."""
    if want is None:
        return "position not in the reference run"
    if got["sha"] == want["sha"] and got["indices"] == want["indices"] and got["labels"] == want["labels"]:
        return "same"
    if not got.get("replaced") or len(got["indices"]) != len(want["indices"]):
        return "different content"
    label_of = label_of if label_of is not None else labels_by_sample({0: want})
    swapped = 0
    for gi, wi, gl, gs, ws in zip(got["indices"], want["indices"], got["labels"], got["slots"], want["slots"]):
        if gi in label_of and gl != label_of[gi]:  # the slots' hashes are of images: labels are checked here
            return f"sample {gi} is labelled {gl}, not {label_of[gi]}"
        if gi == wi:
            if gs != ws:
                return f"sample {gi}'s image differs"
            continue
        # The next member of the split (every sample here) whose file was there: the ones in
        # between, and the sample itself, must be files the harness moved away.
        k = (gi - wi) % n
        if not 1 <= k < 16 or any((wi + j) % n not in deleted for j in range(k)):
            return f"sample {wi} became {gi}, which is not its replacement"
        swapped += 1
    return "replaced" if swapped == got["replaced"] else f"{swapped} samples swapped but {got['replaced']} reported"
