"""The fault-injection suite (see harness.py): a short seeded schedule by default,
the long one (>= 200 faults, every kind) with ``PREFETCHD_FAULTS=long``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.faults.harness` from any rootdir mode

from tests.faults.harness import Settings, run_suite  # noqa: E402

LONG = os.environ.get("PREFETCHD_FAULTS") == "long"


@pytest.mark.faults
@pytest.mark.timeout(3600 if LONG else 600)
def test_every_batch_exactly_once_and_identical_under_faults(shm_dir: Path) -> None:
    settings = Settings(workdir=shm_dir / "faults", faults=260 if LONG else 11, seed=1 if LONG else 3)
    report = run_suite(settings)
    print("\n" + report.table())
    assert len(report.faults) >= (200 if LONG else 10), report.table()
    # Every kind (enospc only as root: it mounts a tmpfs) was injected at least once.
    missing = set(settings.kinds) - {f.kind for f in report.faults}
    assert not missing, f"kinds never injected: {missing}\n{report.table()}"
    assert report.lost == report.duplicated == report.different == report.out_of_order == 0, report.table()
    assert report.hangs == 0 and report.unrecovered == 0 and not report.problems, report.table()
    # Each fault is one the system must notice, except a metadata byte flip that changed nothing
    # a reader checks (a producer id, say) and a dataset file no batch needed while it was gone.
    quiet = {"batch_corrupt", "dataset_delete"}
    missed = [f"{f.kind} ({f.detail})" for f in report.faults if not f.detected and f.kind not in quiet]
    assert not missed, f"faults nobody noticed: {missed}\n{report.table()}"
