"""prefetchd-train's progress display: click's bar with steps and loss on a terminal, quarter lines in a log."""

from __future__ import annotations

import io
import os
import select

from prefetchd.trainer.report import ProgressLine


def _read_all(fd: int) -> str:
    chunks = []
    while select.select([fd], [], [], 0.5)[0]:
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode()


def test_a_terminal_gets_a_bar_with_steps_and_loss() -> None:
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=True) as tty:
            assert tty.isatty()
            with ProgressLine(tty, "epoch 1/2 train", 4, enabled=True) as progress:
                for done in range(1, 5):
                    progress.update(done, lambda: 2.0 / done)  # read at once, inside update
            tty.flush()
            shown = _read_all(master)
    finally:
        os.close(master)
    assert "epoch 1/2 train" in shown
    assert "4/4" in shown
    assert "4/4  loss 0.5000" in shown  # the last step always reads the loss
    assert "\x1b[?25h" in shown  # finished: the cursor click hid is shown again


def test_a_log_gets_a_line_at_every_quarter() -> None:
    out = io.StringIO()
    with ProgressLine(out, "epoch 1/1 val", 8, enabled=True) as progress:
        for done in range(1, 9):
            progress.update(done, lambda: 0.25)
    assert out.getvalue().splitlines() == [f"epoch 1/1 val {n}/8  loss 0.2500" for n in (2, 4, 6, 8)]


def test_disabled_shows_nothing_and_never_reads_the_loss() -> None:
    out = io.StringIO()

    def loss() -> float:
        raise AssertionError("the loss was read although nothing is shown")

    with ProgressLine(out, "epoch 1/1 train", 3, enabled=False) as progress:
        for done in range(1, 4):
            progress.update(done, loss)
    assert out.getvalue() == ""
