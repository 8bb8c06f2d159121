"""Wording shared by the daemon's and the trainer's messages."""

from __future__ import annotations

import signal
import time


def counted(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural unless one: "1 worker", "2 workers", "0 epochs", "2 retries", "3 classes"."""
    if count == 1:
        return f"{count} {noun}"
    if noun.endswith("y") and noun[-2:-1] not in "aeiou":
        return f"{count} {noun[:-1]}ies"
    # "tch", not "ch": an epoch is counted in epochs, a batch in batches.
    return f"{count} {noun}es" if noun.endswith(("s", "x", "sh", "tch")) else f"{count} {noun}s"


def agreeing(count: int, one: str, many: str) -> str:
    """``one`` when ``count`` is 1, else ``many``: the words that agree with ``counted(count, ...)``,
    as in f"{counted(n, 'file')} {agreeing(n, 'is', 'are')} ..."."""
    return one if count == 1 else many


def all_epochs(epochs: int) -> str:
    """A job's every epoch: "all 90 epochs", but "the 1 epoch" ("all 1 epoch" read wrong)."""
    return f"{agreeing(epochs, 'the', 'all')} {counted(epochs, 'epoch')}"


def rank_ranges(ranks: list[int]) -> str:
    """"0-3,6" for [0, 1, 2, 3, 6]; how --ranks is written."""
    parts: list[str] = []
    for rank in sorted(set(ranks)):
        if parts and rank == int(parts[-1].rpartition("-")[2]) + 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{rank}"
        else:
            parts.append(str(rank))
    return ",".join(parts)


def binary_size(n: float) -> str:
    """"1.5 GiB" from 1.5 * 2**30 bytes, "12.0 MiB" below a GiB, "48.0 KiB" below a MiB, "200 bytes" below
    a KiB: the unit of every size said in a message, so that a small one never reads "0.0 MiB"."""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else counted(int(n), "byte")


def epochs_flag(epochs: int | None) -> str:
    """A job's end as its flag says it: "--epochs 3", or "no --epochs (no end)"."""
    return f"--epochs {epochs}" if epochs is not None else "no --epochs (no end)"


def moment(when: float) -> str:
    """``when`` (a time.time()) as local time, "2025-03-01 14:02:07", for messages; a time no calendar of this
    system holds (1e300 written into a job.json by hand made `prefetchd status` a traceback) as its number."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
    except (OverflowError, OSError, ValueError):
        return f"time {when:g} (out of range)"


def ended(exitcode: int | None) -> str:
    """How a process ended, from its exit code (-N: signal N): "exit code 1", "signal SIGKILL"."""
    if exitcode is None:
        return "exit status unknown"
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def one_line(text: str) -> str:
    """``text`` with its control characters (newlines, escapes, line separators) written as Python escapes: a
    job's fields come from any member of the buffer's group and reach log messages, where a newline would start
    a line of their own making (a forged timestamp and level, in the journal or the log file); a path's reach
    the terminal of whoever runs a command (an escape in a folder's name turned it red: a walk)."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


__all__ = ["agreeing", "binary_size", "counted", "ended", "epochs_flag", "moment", "one_line", "rank_ranges"]

