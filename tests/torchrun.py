"""torchrun for the tests, killed with every rank on a hang.

torchrun starts each rank in a session of its own, so killing torchrun's process group
leaves the ranks running; they are found as its descendants before anything is killed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def start(args: Sequence[str | Path]) -> subprocess.Popen[str]:
    """``torchrun ARGS`` in the background, its output captured."""
    return subprocess.Popen([*TORCHRUN, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def finish(runs: Sequence[subprocess.Popen[str]], timeout: float) -> list[subprocess.CompletedProcess[str]]:
    """Wait for every run; past ``timeout`` seconds in all, kill each with its ranks and fail (a hang)."""
    deadline = time.monotonic() + timeout
    done = []
    try:
        for run in runs:
            out, err = run.communicate(timeout=max(0.1, deadline - time.monotonic()))
            done.append(subprocess.CompletedProcess(run.args, run.returncode, out, err))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"torchrun did not finish within {timeout} s (a hang)") from None
    finally:
        for run in runs:
            kill_with_ranks(run)
    return done


def run(args: Sequence[str | Path], timeout: float) -> subprocess.CompletedProcess[str]:
    """``torchrun ARGS`` to its end; a hang past ``timeout`` seconds kills it with its ranks and fails."""
    return finish([start(args)], timeout)[0]


def kill_with_ranks(run: subprocess.Popen[str]) -> None:
    """SIGKILL a torchrun still running and every process under it; nothing when it has exited."""
    if run.poll() is not None:
        return
    try:
        top = psutil.Process(run.pid)
        family = [top, *top.children(recursive=True)]  # before torchrun dies and its ranks are reparented
    except psutil.NoSuchProcess:
        return
    for proc in family:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    run.communicate()
