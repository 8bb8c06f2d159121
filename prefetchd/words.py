"""Wording shared by the daemon's and the trainer's messages."""

from __future__ import annotations


def counted(count: int, noun: str) -> str:
    """``count`` and ``noun``, plural unless one: "1 worker", "2 workers", "0 epochs"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


__all__ = ["counted"]
