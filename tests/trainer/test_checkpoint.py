"""A checkpoint being written is finished before Ctrl-C or SIGTERM act."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from prefetchd.trainer.checkpoint import save_checkpoint


class SignalsWhilePickled:
    """Sends ``signum`` to this process while torch.save pickles it: a signal in mid-write, every time."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def __reduce__(self) -> tuple[Any, ...]:
        os.kill(os.getpid(), self.signum)
        return (dict, ())


def test_ctrl_c_during_a_save_interrupts_after_the_checkpoint_is_written(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, {"step": 7, "model": torch.ones(1000), "late": SignalsWhilePickled(signal.SIGINT)})
    assert torch.load(path, weights_only=False)["step"] == 7, "the checkpoint was written whole"
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"], "no temp file left"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_during_a_save_reaches_its_handler_once_the_checkpoint_is_written(tmp_path: Path,
                                                                                       signum: int) -> None:
    """SIGHUP, which prefetchd-train takes as SIGTERM, was not held: a second one during the checkpoint the first
    asked for lost it (a walk)."""
    path = tmp_path / "last.pt"
    seen: list[bool] = []
    previous = signal.signal(signum, lambda signum, frame: seen.append(path.exists()))
    try:
        save_checkpoint(path, {"step": 3, "late": SignalsWhilePickled(signum)})
    finally:
        signal.signal(signum, previous)
    assert seen == [True], "the handler ran once, after the file was in place"


def test_each_stop_signal_held_during_a_save_is_delivered(tmp_path: Path) -> None:
    """Two held are two: prefetchd-train's second SIGTERM is its "stop now", which one delivery would have lost."""
    path = tmp_path / "last.pt"
    seen: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: seen.append(signum)) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        save_checkpoint(path, {"a": SignalsWhilePickled(signal.SIGTERM), "b": SignalsWhilePickled(signal.SIGTERM),
                               "c": SignalsWhilePickled(signal.SIGHUP)})
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert seen == [signal.SIGTERM, signal.SIGTERM, signal.SIGHUP]


def test_a_save_removes_what_a_killed_save_left(tmp_path: Path) -> None:
    """A SIGKILL in torch.save left .last.pt.tmp-PID, a whole checkpoint's size, for ever (review)."""
    import subprocess
    import sys

    import socket

    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    here = f".last.pt.tmp-{socket.gethostname()}-"
    orphan, live, elsewhere = tmp_path / f"{here}{gone}", tmp_path / f"{here}{os.getppid()}", tmp_path / \
        f".last.pt.tmp-another-host-{gone}"  # on a shared folder: a pid of another machine says nothing here
    for left in (orphan, live, elsewhere):
        left.write_bytes(b"half a checkpoint")
    save_checkpoint(tmp_path / "last.pt", {"step": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["last.pt", live.name, elsewhere.name])
