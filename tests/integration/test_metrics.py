"""Prometheus metrics scraped over loopback from a real daemon."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from prefetchd.buffer_protocol import State
from prefetchd.trainer import BufferLoader
from tests.status_examples import production_of, state_of

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


def test_batches_a_trainer_skipped_are_not_counted_consumed(shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """A forward jump of a consumer's position (load_state_dict of a later checkpoint) was counted as that many
    batches consumed, in the status's totals and rate and in prefetchd_consumed_batches_total: none was read."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *SMALL)  # 9 steps an epoch
    with BufferLoader(buffer, normalize=False, timeout=60) as loader:
        it = iter(loader)
        next(it), next(it), next(it)  # the third asks past the second: two consumed
        daemon.wait_until(lambda: consumed(buffer) == 2, 30, "two batches counted consumed")
        loader.load_state_dict({**loader.state_dict(), "epoch": 1, "step": 4})  # 14 batches further on
        daemon.wait_until(lambda: progress_of(buffer) == (1, 4), 30, "the jump to be read")
        assert consumed(buffer) == 3, "the batch handed out before the jump, and none of those jumped over"
        for _ in zip(range(2), loader):
            pass
        next(iter(loader))  # asks past the second: two more read
        daemon.wait_until(lambda: progress_of(buffer) == (1, 6), 30, "the reads after the jump")
        assert consumed(buffer) == 5, daemon.log


def consumed(buffer: Path) -> int | None:
    production = production_of(buffer)
    return production.totals.consumed_batches if production is not None else None


def progress_of(buffer: Path) -> tuple[int, int] | None:
    production = production_of(buffer)
    return (production.progress.epoch, production.progress.step) if production is not None else None
