"""The layer contracts of pyproject.toml ([tool.importlinter]): the protocol at the bottom,
the trainer and the launcher never importing the daemon, the daemon never reaching up to
its consumers. Run here too, so the README's test command checks them, not only CI."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_layer_contract_is_kept() -> None:
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint, "lint-imports is missing: pip install -e '.[test]' installs import-linter"
    run = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
