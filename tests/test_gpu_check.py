"""tools/gpu_check.py --dry-run: every step of the GPU check, on the CPU at toy sizes, so that the
script still runs on the day a GPU machine is lent.  Structure only: the figures mean nothing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FEEDS = ("synthetic", "prefetchd", "DataLoader", "DALI")


def test_dry_run_writes_every_section(tmp_path: Path) -> None:
    docs_before = {p.name: p.read_bytes() for p in (REPO / "docs").iterdir() if p.is_file()}
    out = tmp_path / "result" / "gpu.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--dry-run", "--out", str(out)], cwd=REPO, env=env,
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
    assert rows["DALI"].get("note", "").startswith("skipped:") or "images_per_s" in rows["DALI"]

    # 5. the producer alone, with the floor it is compared with (one worker count on a dry run).
    scaling = doc["scaling"]
    [row] = scaling["rows"]
    assert row["workers"] == 1 and row["images_per_s"] > 0 and row["scaling"] == 1.0
    assert scaling["floor"]["images_per_s"] > 0
    assert abs(row["vs_floor"] - row["images_per_s"] / scaling["floor"]["images_per_s"]) < 2e-3

    markdown = (out.parent / "GPU.md").read_text()
    assert "**Dry run**" in markdown
    for heading in ("## Machine", "## GPU tests", "## Host to device", "## Training", "## The producer on more cores"):
        assert heading in markdown
    for name in FEEDS:
        assert f"| {name}" in markdown
    # A dry run never touches the measured docs.
    assert {p.name: p.read_bytes() for p in (REPO / "docs").iterdir() if p.is_file()} == docs_before


def test_the_producer_is_measured_at_powers_of_two_and_every_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "tools"))
    import gpu_check

    assert gpu_check.scaling_counts(16) == [1, 2, 4, 8, 16]
    assert gpu_check.scaling_counts(6) == [1, 2, 4, 6]
    assert gpu_check.scaling_counts(1) == [1]
