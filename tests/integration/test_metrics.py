"""Prometheus metrics scraped over loopback from a real daemon."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from prefetchd.buffer_protocol import State
from tests.status_examples import state_of

SMALL = ["--batch-size", "8", "--image-size", "32", "--workers", "1", "--high-water", "3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_endpoint_and_textfile_agree_with_the_status(shapes_data: Path, shm_dir: Path, tmp_path: Path, start_daemon) -> None:
    buffer, port, textfile = shm_dir / "bf", free_port(), tmp_path / "prefetchd.prom"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *SMALL, "--metrics-port", port,
                          "--metrics-textfile", textfile)
    daemon.wait_until(lambda: state_of(buffer) == State.FULL, 30, "a full buffer")
    daemon.wait_until(lambda: textfile.exists() and "prefetchd_state" in textfile.read_text(), 10, "the textfile")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        scraped = samples(response.read().decode())
    label = (("buffer", str(buffer)),)
    assert scraped[("prefetchd_batches_waiting", label)] == 3
    assert scraped[("prefetchd_high_water_batches", label)] == 3
    assert scraped[("prefetchd_state", (("buffer", str(buffer)), ("state", "full")))] == 1
    assert scraped[("prefetchd_state", (("buffer", str(buffer)), ("state", "filling")))] == 0
    assert scraped[("prefetchd_produced_batches_total", label)] >= 3
    assert ("prefetchd_batches_waiting", label) in samples(textfile.read_text())
    decode = {q: scraped[("prefetchd_stage_seconds", (("buffer", str(buffer)), ("quantile", q), ("stage", "decode")))]
              for q in ("0.5", "0.9", "0.99")}
    assert 0 < decode["0.5"] <= decode["0.9"] <= decode["0.99"] < 10


def test_metrics_port_in_use_is_a_clear_error(shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        daemon = start_daemon(shm_dir / "bf", "--data", shapes_data / "train", *SMALL, "--metrics-port", port)
        assert daemon.wait_exit(30) == 2
    assert f"cannot serve metrics on 127.0.0.1:{port}: it is in use" in daemon.log
