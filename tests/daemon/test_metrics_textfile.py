"""The metrics textfile (prefetchd/daemon/metrics.py) as node-exporter, another user, reads it."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from prefetchd.buffer_protocol import State
from prefetchd.daemon.errors import ConfigError
from prefetchd.daemon.metrics import Metrics
from tests.status_examples import ERRORS, STORAGE_WAIT, production
from tests.status_examples import status as status_example


def test_the_textfile_is_world_readable_under_the_services_umask(shm_buffer: Path) -> None:
    """UMask=0007 made it -rw-rw----: node-exporter got Permission denied."""
    os.chmod(shm_buffer, 0o755)
    textfile = shm_buffer / "prefetchd-bf.prom"
    metrics = Metrics(shm_buffer, None, "127.0.0.1", textfile)
    old = os.umask(0o007)
    try:
        metrics.update(status_example())
        metrics.update(status_example())  # a rewrite replaces it the same way
    finally:
        os.umask(old)
        metrics.close()
    assert stat.S_IMODE(os.stat(textfile).st_mode) == 0o644
    assert "prefetchd_batches_waiting" in textfile.read_text()
    assert sorted(p.name for p in shm_buffer.iterdir()) == [textfile.name]  # no temp file left
    if os.geteuid() == 0:
        other = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "cat", str(textfile)],
                               capture_output=True, text=True)
        assert other.returncode == 0 and "prefetchd_batches_waiting" in other.stdout, other.stderr


def test_a_textfile_that_cannot_be_written_is_a_warning(shm_buffer: Path, caplog: pytest.LogCaptureFixture) -> None:
    textfile = shm_buffer / "missing-dir" / "prefetchd.prom"
    metrics = Metrics(shm_buffer, None, "127.0.0.1", textfile)
    for _status in range(5):  # a status a second
        metrics.update(status_example())
    assert f"cannot write metrics to {textfile}" in caplog.text
    # Once a minute, not at every status: 86,000 lines a day (a walk as a non-root user).
    assert caplog.text.count("cannot write metrics to") == 1, caplog.text


def test_a_textfile_another_running_daemon_writes_is_refused(shm_buffer: Path, tmp_path: Path) -> None:
    """Two daemons given one --metrics-textfile (a config file shared by a train and a val daemon) overwrote each
    other's metrics every second, without a word (a walk).  The second is refused; the same buffer's restart, or a
    textfile a stopped daemon left, is taken."""
    textfile = tmp_path / "shared.prom"
    first = Metrics(shm_buffer, None, "127.0.0.1", textfile)
    first.update(dataclasses.replace(status_example(), heartbeat=time.time()))
    other = tmp_path / 'val "quoted"'
    with pytest.raises(ConfigError, match=rf'metrics textfile {textfile} is written by the daemon on {shm_buffer}, '
                                          r"which runs \(state filling, 0 s ago\): two daemons on one textfile"):
        Metrics(other, None, "127.0.0.1", textfile)
    Metrics(shm_buffer, None, "127.0.0.1", textfile).close()  # its own restart
    first.update(dataclasses.replace(status_example(), heartbeat=time.time(), state=State.STOPPED))
    Metrics(other, None, "127.0.0.1", textfile).close()  # what a stopped daemon left
    Metrics(other, None, "127.0.0.1", textfile).update(dataclasses.replace(status_example(), heartbeat=time.time()))
    with pytest.raises(ConfigError, match=r'is written by the daemon on .*/val "quoted", which runs'):
        Metrics(shm_buffer, None, "127.0.0.1", textfile)  # a buffer label with a quote, escaped in the file
    first.close()


def test_the_waits_and_counts_of_the_status_are_metrics(shm_buffer: Path, tmp_path: Path) -> None:
    """A storage wait, a stalled worker and four counters were in status.json alone: write_failures_total rose
    for a store gone and for a full tmpfs alike, and nothing in /metrics told them apart (a walk)."""
    textfile = tmp_path / "bf.prom"
    metrics = Metrics(shm_buffer, None, "127.0.0.1", textfile)
    errors = dataclasses.replace(ERRORS, low_space_pauses=2, vanished_batches=3, progress_rejected=4, progress_rewinds=5)
    metrics.update(status_example(production=production(storage_wait=STORAGE_WAIT, errors=errors)))
    label = f'{{buffer="{shm_buffer}"}}'
    waiting = textfile.read_text()
    since = next(line for line in waiting.splitlines() if line.startswith("prefetchd_storage_wait_since_timestamp"))
    assert float(since.split()[-1]) == STORAGE_WAIT.since
    for line in (f"prefetchd_storage_waiting{label} 1.0", f"prefetchd_worker_stalled{label} 0.0",
                 f"prefetchd_low_space_pauses_total{label} 2.0", f"prefetchd_vanished_batches_total{label} 3.0",
                 f"prefetchd_progress_rejected_total{label} 4.0", f"prefetchd_progress_rewinds_total{label} 5.0"):
        assert line in waiting, line
    metrics.update(status_example())
    assert f"prefetchd_storage_waiting{label} 0.0" in textfile.read_text()
    assert "prefetchd_storage_wait_since_timestamp_seconds" not in textfile.read_text()  # absent while not waiting
    metrics.close()
