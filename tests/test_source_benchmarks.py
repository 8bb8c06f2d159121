"""tools/bench_index.py and tools/bench_sources.py run end to end on tiny data (numbers not checked)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from click.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    # tools/ is a folder of scripts, not a package.
    spec = importlib.util.spec_from_file_location(f"tools_{name}", REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_bench_index_reports_every_column_and_cleans_up(tmp_path: Path) -> None:
    result = CliRunner().invoke(_load("bench_index").main, ["--files", "300", "--classes", "7", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    row = result.output.strip().splitlines()[-1]
    assert row.startswith("| 300 |") and row.count("|") == 7
    assert list(tmp_path.iterdir()) == []


def test_bench_sources_reads_every_layout_and_an_extra_location(tmp_path: Path) -> None:
    bench = _load("bench_sources")
    layouts = bench.local_layouts(tmp_path, 20, 10**6)
    assert len({bench.reads_per_second(loc, 0.05)[2] for loc in layouts.values()}) == 1  # same samples everywhere
    result = CliRunner().invoke(bench.main, ["--images", "20", "--seconds", "0.05", "--dir", str(tmp_path),
                                             "--location", f"again={layouts['shards']}"])
    assert result.exit_code == 0, result.output
    rows = [ln for ln in result.output.splitlines() if ln.startswith("| ") and "reads/s" not in ln]
    assert [r.split("|")[1].strip() for r in rows] == [*layouts, "again"]
