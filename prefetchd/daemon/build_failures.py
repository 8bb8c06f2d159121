"""Why the controller's builds fail, as the status says it: the latest failure (its ``message``, until a
batch is published), and the wait on the dataset's storage (its ``storage_wait``), which the loaders
of the ranks it holds up wait on past their timeout (SPEC)."""

from __future__ import annotations

import time
from collections.abc import Container, Mapping

from prefetchd.buffer_protocol.status import StorageWait

# A batch, as the books name it here: (rank, g), its stream's rank and its global position.
BatchKey = tuple[int, int]


class BuildFailures:
    """The latest failure of a build (``last``) and the wait on the storage (``wait``).  ``held``, where a
    method takes it: by rank, the positions its stream's windows hold now (``Stream.held``)."""

    def __init__(self) -> None:
        self.last: str | None = None
        self.wait: StorageWait | None = None
        # Why each batch failed for the storage, of those not published since; the latest last.
        self.storage_failed: dict[BatchKey, str] = {}

    def failing(self, why: str, held: Mapping[int, Container[int]], storage: BatchKey | None = None) -> None:
        """Builds fail, and ``why`` (the status says it until a batch is published).  ``storage``: the batch
        that failed for the dataset's storage, which its rank's loaders wait on while the status says so.

        The wait lasts until each batch that failed so is published, or no window holds it any more: in a
        partial outage the batches of other objects publish meanwhile, and the trainer that needs the
        failing one next would time out if those ended the wait.  Any other failure ends it, or a loader
        would wait on for good behind a daemon that storage no longer holds up."""
        self.last = why
        if storage is None:
            self.end_wait()
            return
        self.storage_failed.pop(storage, None)
        self.storage_failed[storage] = why
        if self.wait is None:
            self.wait = StorageWait(since=time.time(), reason=why)
        self.left(held)  # a rewind may have cancelled it before its task failed

    def published(self, batch: BatchKey, held: Mapping[int, Container[int]]) -> None:
        """``batch`` is published: builds work again, or the message keeps saying why the batches left
        still fail."""
        self.storage_failed.pop(batch, None)
        self.left(held)
        self.last = self.wait.reason if self.wait is not None else None

    def end_wait(self) -> None:
        """Something other than the storage holds production now (a full tmpfs, a failed write)."""
        self.storage_failed.clear()
        self.wait = None

    def left(self, held: Mapping[int, Container[int]]) -> None:
        """Drop the failed batches no window holds now (the trainers moved past them, or back before them:
        they will not be built, and a wait on them would keep the loaders waiting for good); the wait names
        the latest failure of those left and their ranks (only those ranks' loaders wait on: another rank's
        late batch is late for another reason), each since its own wait began (a rank new to the wait: now,
        as its batch just failed), and ends with the last."""
        self.storage_failed = {key: why for key, why in self.storage_failed.items() if key[1] in held.get(key[0], ())}
        wait = self.wait
        if not self.storage_failed or wait is None:
            self.end_wait()
            return
        now = time.time()
        ranks = tuple(sorted({rank for rank, _ in self.storage_failed}))
        since = tuple(began if (began := wait.since_of(rank)) is not None else now for rank in ranks)
        self.wait = StorageWait(since=min(since), reason=next(reversed(self.storage_failed.values())), ranks=ranks,
                                ranks_since=since)


__all__ = ["BatchKey", "BuildFailures"]
