"""Worker processes: a local worker's loop (``worker_main``), and the set-up of every process that
runs tasks (``prepare_process``: a local worker, a Ray worker on any node, the Ray bridge).

A local worker gets its job once and then tasks over its own pipe (``tasks``), fills each
(``fill.run_task``) and answers, and says where it is meanwhile (``whereabouts``).  With ``readers``
> 1 it also starts the reads of the task queued behind the current one, so that a task's first read
does not wait, unoverlapped, for the decode of the one before.

Each worker runs its kernels with one thread (torch's too, where a job needs
torch): k workers on k cores, each kernel single-threaded, is the fastest
arrangement for many small images and keeps workers from fighting over cores.

Workers are processes, not threads of the controller.  decode_jpeg and the
resize release the GIL, so threads scale too, but less: the Python around the
kernels (header parse, box draws, bookkeeping) holds it.  Measured on this
project's 2-core machine (shared with other jobs, so medians of 8 alternating
rounds of 100 ImageNet-like JPEGs per worker, RandomResizedCrop 224 + flip):
1 process 354 img/s, 2 processes 681 (x1.92); 1 thread 360, 2 threads 633
(x1.76).  Processes also keep a crashing decoder away from the controller.
Their cost is memory: a spawned worker that imports torch + torchvision holds
~370 MiB of private memory and needs seconds to start; forked from a
forkserver that preloaded them (``forkserver_preload``) it holds ~13 MiB and starts in
0.1 s (same machine, CUDA wheels of torch 2.14 / torchvision 0.29).  With the C
extension most jobs need neither (``transforms.needed_modules``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from prefetchd.daemon.fill import run_task
from prefetchd.daemon.jpeg_crop import CleanFiles
from prefetchd.daemon.sources import SampleReader
from prefetchd.daemon.hook import HookError, load_hook
from prefetchd.daemon.tasks import Filled, Task, WorkerJob, WriteFailed, failure_of
from prefetchd.daemon.transforms import needed_modules, preload
from prefetchd.daemon.whereabouts import (START_HOOK, START_IMPORTS, START_STORAGE, Whereabouts, begin,
                                          set_whereabouts)


def prepare_process(job: WorkerJob) -> None:
    """Set up a process that runs ``job``'s tasks: a local worker, or a Ray worker on any node."""
    # augment() applies the job's max_image_pixels before decoding; Pillow's own
    # limit would refuse, with its own words, images the user allowed.
    Image.MAX_IMAGE_PIXELS = None
    preload(job.augment)  # first: a job that imports torch has it by the time threads are limited
    limit_threads()
    keep_heap()
    reseed_global_generators()


def reseed_global_generators() -> None:
    """Fresh seeds for numpy's and torch's global generators in this process.  Local workers are forked from the
    worker server, which imported both, so each began with the same state: a --transform hook drawing from
    np.random or torch.rand (as augmentation code written for a DataLoader does, which reseeds its workers so) gave
    the k-th image of every worker the same draws (a walk: 152 of 400 samples in pairs at 2 workers).  Python's
    random reseeds itself at a fork.  Such a hook's batches still differ from run to run (README)."""
    np.random.seed(np.frombuffer(os.urandom(16), dtype=np.uint32))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)


# Added to a worker's oom_score_adj (the most is 1000): the kernel's OOM killer takes the highest score.
OOM_SCORE_VOLUNTEER = 500
OOM_SCORE_FILE = Path("/proc/self/oom_score_adj")


def oom_order_lost() -> str | None:
    """Where this process (the controller) already has an ``oom_score_adj`` so high that its workers, however
    they volunteer, cannot come before it (the most is 1000): what to say.  None where they can, or where it
    cannot be read."""
    now = _oom_score_adj()
    if now is None or now + OOM_SCORE_VOLUNTEER <= 1000:
        return None
    return (f"this daemon's oom_score_adj is {now} (inherited from the process that started it): its workers, "
            f"which volunteer for the kernel's out-of-memory killer ({OOM_SCORE_VOLUNTEER:+d} each), cannot come "
            "before it, so where memory runs out the daemon may be killed rather than a worker; start it from a "
            "process with a lower one (systemd: OOMScoreAdjust=)")


def volunteer_for_oom_killer() -> None:
    """Be the OOM killer's choice before the controller and a trainer in the same cgroup: a worker's death costs a
    restart and its task begun again, said by the controller with what killed it; the controller's, the job,
    silently (in a 512 MiB cgroup the controller, the largest process, was the one killed).  The worker server
    volunteers too (``worker_server``), so its workers, volunteering once more, come before it.  Raising one's own
    score takes no privilege."""
    now = _oom_score_adj()
    if now is None:
        return
    try:
        OOM_SCORE_FILE.write_text(str(min(1000, now + OOM_SCORE_VOLUNTEER)))
    except OSError:  # a sandbox that forbids it
        pass


def _oom_score_adj() -> int | None:
    """This process's ``oom_score_adj``; None where it cannot be read (not Linux)."""
    try:
        return int(OOM_SCORE_FILE.read_text())
    except (OSError, ValueError):
        return None


# Named, not imported: its import is what it does, and it is for the worker server alone.
SERVER_SETUP = "prefetchd.daemon.worker_server"


def forkserver_preload() -> list[str]:
    """What the worker server imports once, so that the workers it forks share these pages instead
    of importing their own copies (see the module docstring): the worker code and what augmenting
    needs without options (a job's colour jitter or hook imports the rest in each worker).  The worker
    code is the modules of its loop and of the filling of a task, which import the rest of it (its
    tasks, its whereabouts), named by the functions themselves so that moving either keeps it here."""
    return [worker_main.__module__, run_task.__module__, *needed_modules(), SERVER_SETUP]


# glibc's mallopt parameters, and the values of its dynamic mmap threshold at its ceiling.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_HEAP_SETTINGS = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 64 << 20), (_M_TOP_PAD, 16 << 20))


def keep_heap() -> None:
    """Keep the heap's pages instead of handing them back to the kernel and faulting them in again.

    Every image allocates its file's bytes, the decoded box (100 KB to a few MB) and the
    resized output (150 KB at 224 x 224).  glibc starts by mapping anything over 128 KB
    afresh (page faults on every touch, munmap on free) and trims the heap top as soon as
    a large block there is freed; it raises those thresholds only as it sees larger blocks
    freed.  Set at once to the ceiling that adaptation reaches (32 MiB mapped, 64 MiB
    trimmed) and with 16 MiB of padding per heap extension, the worker reuses its pages.
    Measured on the 2-core EPYC (photos, 2 workers, consumer on the same cores, 3
    alternating 8 s runs against the code without it): the workers' CPU per image 0.92 ->
    0.89 ms and 1980-2083 -> 2107-2139 img/s, for 1 MiB more RSS per worker.  Not glibc (musl): nothing to do."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    for param, value in _HEAP_SETTINGS:
        mallopt(param, value)


def limit_threads() -> None:
    """One compute thread per worker process (see the module docstring).

    torch is not imported for this: a worker whose job the C extension resizes never imports it
    (``transforms.needed_modules``; ``prepare_process`` preloads it before this where the job needs
    it).  One that imports it later, for a JPEG the crop-aware decoder refuses, reads
    OMP_NUM_THREADS then."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch = sys.modules.get("torch")
    if torch is None:
        return
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only possible before any inter-op work; a fresh worker has done none
        pass


def worker_main(conn: Connection, job: WorkerJob, clean: CleanFiles | None = None, where: Any = None) -> None:
    """A local worker's loop; ``where``: its ``Whereabouts`` cells, which the controller watches."""
    # Ctrl-C reaches the whole process group; the controller alone decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    whereabouts = Whereabouts(where) if where is not None else None
    step: Callable[[int], None] = whereabouts.starting if whereabouts is not None else (lambda _step: None)
    # Each step of the start is said, and the start timed as a whole (--worker-start-timeout, ``worker_health``): one
    # that never ends (a hook's module that blocks when imported) is killed and another started in its place.
    volunteer_for_oom_killer()
    step(START_IMPORTS)
    prepare_process(job)
    if job.augment.transform is not None:
        step(START_HOOK)  # now, not in the first image: a hang there is the hook's import, not that image's
        with contextlib.suppress(HookError):  # its first call raises it again, and the job stops with it
            load_hook(job.augment.transform)
    step(START_STORAGE)
    reader = SampleReader(job.index, job.readers)
    if whereabouts is not None:
        set_whereabouts(whereabouts)
        whereabouts.ready()
    queued: deque[tuple[Task, list[Future[bytearray]] | None]] = deque()
    stopping = False
    while True:
        # The next task now, and with readers the one after it if the controller queued it
        # already, so that its reads run while this one decodes.  None (stop) or a closed
        # pipe ends the loop once what was received is done, as when tasks came one by one.
        while not stopping and (not queued or (job.readers > 1 and len(queued) < 2 and _ready(conn))):
            try:
                got = conn.recv()
            except (EOFError, OSError):  # the controller went away (killed: the pipe may be reset)
                got = None
            if got is None:
                stopping = True
            else:
                queued.append((got, reader.start(i for _slot, i in got.items) if job.readers > 1 else None))
        if not queued:
            return
        task, reads = queued.popleft()
        begin(task.task_id)
        try:
            result: Filled | WriteFailed = run_task(job, task, reader, reads, clean=clean)
        except Exception as exc:
            result = failure_of(task.task_id, exc)
        try:
            conn.send(result)
        except OSError:  # a SIGKILLed controller: nobody to answer, and no traceback for its successor's log
            return


def _ready(conn: Connection) -> bool:
    try:
        return conn.poll(0)
    except (EOFError, OSError):
        return True  # recv() then sees the end and stops
