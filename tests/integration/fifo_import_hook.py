"""A --transform hook for test_worker_hangs.py whose module does not finish importing while the file that
$PREFETCHD_TEST_IMPORT_GATE names is there (as hung_import_hook's), in code whose source file is said to be the FIFO
that $PREFETCHD_TEST_IMPORT_FIFO names: whoever reads that code's lines to show them blocks, as a reader of a module
on the hung mount its import waits on does (a stat or an open there never returns)."""

from __future__ import annotations

import os
from typing import Any

_LOOP = """\
import os, time
while os.path.exists(os.environ.get("PREFETCHD_TEST_IMPORT_GATE", "")):
    time.sleep(0.1)
"""
exec(compile(_LOOP, os.environ.get("PREFETCHD_TEST_IMPORT_FIFO", "<no fifo>"), "exec"))


def identity(image: Any, rng: Any) -> Any:
    return image
