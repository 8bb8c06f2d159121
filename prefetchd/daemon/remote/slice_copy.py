"""One submission of a slice to the Ray cluster, as the bridge follows it: the stream of its Ray task
(``task.build_slice``, a streaming task that yields when it begins and, built an item at a time, each sample it
begins), how far it got, and its answer (``SliceCopy``); and its completion as ``Bridge._finish`` takes it
(``StreamedAnswer``).  A slice has one copy, two once it is a straggler started again (``bridge_slices.py``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prefetchd.daemon.remote.task import Answer


@dataclass
class SliceCopy:
    """One submission of a slice: the stream of its Ray task (``build_slice``) and how far it got."""

    gen: Any  # the ObjectRefGenerator
    track: bool  # built an item at a time, each sample it begins (a replacement too) yielded first
    submitted: float = field(default_factory=time.monotonic)  # made as it is submitted: its start is timed from then
    moved: float | None = None  # when it last moved on (began, or began an item); None: not begun yet
    on: int | None = None  # tracked: the sample of the item it is on
    answer: Answer | None = None  # taken from the stream while polling it
    error: Exception | None = None  # ... or the error it holds instead

    def poll(self, ray: Any, now: float) -> None:
        """Take what the slice has yielded since the last look (what it is on; its answer, if it came)."""
        while self.error is None and self.answer is None and self.gen.next_ready():
            try:
                self._took(ray.get(next(self.gen)), now)
            except StopIteration:
                return
            except Exception as exc:  # the task's failure, raised again by ``outcome``
                self.error = exc

    def outcome(self, ray: Any, completed: Any) -> Answer:
        """The slice's answer once its task completed (``completed``: the future of ``gen.completed()``);
        raises what ended it otherwise: its worker's death, a cancellation, an error there."""
        completed.result()
        for ref in self.gen:
            self._took(ray.get(ref), time.monotonic())
        if self.error is not None:
            raise self.error
        if self.answer is None:
            raise RuntimeError("a slice's Ray task ended without an answer")
        return self.answer

    def _took(self, value: Any, now: float) -> None:
        if isinstance(value, tuple):
            self.answer = value
            return
        self.moved, self.on = now, value if value is not None else self.on


class StreamedAnswer:
    """A slice's completion as ``Bridge._finish`` takes it: ``result()`` is its answer, or raises."""

    def __init__(self, ray: Any, copy: SliceCopy, completed: Any) -> None:
        self.ray, self.copy, self.completed = ray, copy, completed

    def result(self) -> Answer:
        return self.copy.outcome(self.ray, self.completed)


__all__ = ["SliceCopy", "StreamedAnswer"]
