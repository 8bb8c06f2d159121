"""Where a local worker is, in a few words of shared memory (``Whereabouts``): the task and the
sample it is on, a count of its moves, and before it is ready the step of its start
(``START_STEPS``).  The controller reads them (``pool``, ``worker_health``) to tell a worker that
hangs (a read that never returns, a hook that loops, a start that never ends) from one that is slow,
and to name the file.  The worker writes them as it begins each task and sample (``begin``); a Ray
worker writes none, and has each sample it begins told to whom ``tell_begun`` names instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from prefetchd.daemon.tasks import WorkerJob
from prefetchd.daemon.transforms import needed_modules


class Whereabouts:
    """Where a local worker is, for the controller's hang check (``pool.WorkerPool.stalled``): four words of
    shared memory the worker writes and the controller only reads::

        [0] moves   bumped when the worker begins a task and each sample of it (each replacement tried too);
                    -1 until it is ready for its first task (a hook's module, torch, imported)
        [1] task    the id of the task it is on
        [2] sample  the sample it is on; -1 before the task's first
        [3] step    until it is ready, what it does to get there: an index into ``START_STEPS``

    No lock: a read torn between the worker's writes is of a worker that moves, which is no hang."""

    MOVES, TASK, SAMPLE, STEP = range(4)
    INITIAL = (-1, -1, -1, 0)  # not ready, no task, no sample, step 0 (``START_STEPS``)

    def __init__(self, cells: Any) -> None:
        self.cells = cells  # a RawArray('q', INITIAL) from the pool's multiprocessing context

    @property
    def moves(self) -> int:
        return int(self.cells[self.MOVES])

    @property
    def ready_yet(self) -> bool:
        return self.moves >= 0

    @property
    def task(self) -> int:
        return int(self.cells[self.TASK])

    @property
    def sample(self) -> int:
        return int(self.cells[self.SAMPLE])

    @property
    def step(self) -> int:
        return int(self.cells[self.STEP])

    def starting(self, step: int) -> None:
        """The worker, not ready yet, goes on to ``step`` of ``START_STEPS``."""
        self.cells[self.STEP] = step

    def ready(self) -> None:
        self.cells[self.MOVES] = 0

    def begin(self, task: int, sample: int = -1) -> None:
        """The worker begins ``sample`` of ``task`` (-1: the task itself); the move is written last."""
        self.cells[self.TASK] = task
        self.cells[self.SAMPLE] = sample
        self.cells[self.MOVES] += 1


# START_STEPS: what a local worker does before it is ready for its first task (``Whereabouts.step``), in order: the
# controller names the step a worker that does not get ready is stuck on (``start_step``).  Each may hang where
# nothing else would: a hook's module that blocks when imported, torch imported from a hung filesystem, an object
# store's client.
START_FORKED, START_IMPORTS, START_HOOK, START_STORAGE = range(4)


def start_step(job: WorkerJob, step: int) -> str:
    """What a worker of ``job`` does at ``step`` of its start, as the log and the status say it."""
    if step == START_IMPORTS:
        modules = needed_modules(job.augment)
        return f"importing {' and '.join(modules)}" if modules else "setting up its decoder"
    if step == START_HOOK:
        module = (job.augment.transform or "").partition(":")[0]
        return f"importing the --transform hook's module {module}"
    if step == START_STORAGE:
        return f"opening the dataset's storage ({job.index.root})"
    return "starting: made by the worker server, it has not begun the worker's code"


# This process's, in a local worker (``worker_main``); None elsewhere (a Ray worker, the bridge, a test).
_whereabouts: Whereabouts | None = None


# Whom each sample a thread begins is told to (``tell_begun``): a Ray slice built an item at a time (``remote.task``),
# whose Ray worker writes no whereabouts.  Per thread: a build a cancellation left behind tells none of a later one's.
_told = threading.local()


def set_whereabouts(whereabouts: Whereabouts) -> None:
    """This process is the local worker whose ``whereabouts`` these are: ``begin`` writes them from now on."""
    global _whereabouts
    _whereabouts = whereabouts


def begin(task: int, sample: int = -1) -> None:
    """This process begins ``sample`` of ``task`` (-1: the task itself): its whereabouts say so, and whom
    ``tell_begun`` named is told."""
    if _whereabouts is not None:
        _whereabouts.begin(task, sample)
    tell: Callable[[int], None] | None = getattr(_told, "tell", None)
    if tell is not None and sample >= 0:
        tell(sample)


def tell_begun(tell: Callable[[int], None] | None) -> None:
    """Have each sample that this thread's tasks begin, a replacement tried too, handed to ``tell`` before it is
    read (None: to nobody), as a local worker's whereabouts say it."""
    _told.tell = tell
