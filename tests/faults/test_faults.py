"""The fault-injection suite (see harness.py): a short seeded schedule by default,
the long one (>= 200 faults, every kind) with ``PREFETCHD_FAULTS=long``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.faults.harness` from any rootdir mode

from tests.faults.harness import KINDS, Settings, run_suite  # noqa: E402

LONG = os.environ.get("PREFETCHD_FAULTS") == "long"


@pytest.mark.faults
@pytest.mark.timeout(3600 if LONG else 300)
def test_every_batch_exactly_once_and_identical_under_faults(shm_dir: Path) -> None:
    settings = Settings(workdir=shm_dir / "faults", faults=260 if LONG else 24, seed=1 if LONG else 3)
    report = run_suite(settings)
    print("\n" + report.table())
    kinds_seen = {f.kind for f in report.faults}
    assert len(report.faults) >= (200 if LONG else 20), report.table()
    expected = set(settings.kinds) if LONG else set(KINDS) - {"enospc"} - (set(KINDS) - set(settings.kinds))
    assert expected <= kinds_seen, f"kinds never injected: {expected - kinds_seen}"
    assert report.lost == report.duplicated == report.different == report.out_of_order == 0, report.table()
    assert report.hangs == 0 and report.unrecovered == 0 and not report.problems, report.table()
    # Every kind is something the system must notice, except a deleted dataset file the daemon
    # never needed while it was gone and garbage the trainer overwrote before the daemon read it.
    quiet = {"dataset_delete", "progress_garbage", "batch_corrupt"}
    missed = [f"{f.kind} ({f.detail})" for f in report.faults if not f.detected and f.kind not in quiet]
    assert not missed, f"faults nobody noticed: {missed}\n{report.table()}"
