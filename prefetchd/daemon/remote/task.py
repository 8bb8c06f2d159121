"""What runs on a Ray worker: the probe of a node's access to the dataset, and one slice of a batch,
by the local workers' ``run_task``, into images that the task returns through the object store
(see ``prefetchd.daemon.remote``)."""

from __future__ import annotations

import functools
import hashlib
import queue
import socket
import threading
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import prefetchd
from prefetchd import __version__
from prefetchd.daemon import jpeg_crop
from prefetchd.daemon.hook import HookError, load_hook
from prefetchd.daemon.sources import SampleReader
from prefetchd.daemon.fill import run_task
from prefetchd.daemon.tasks import Filled, Task, WorkerJob, WriteFailed, failure_of
from prefetchd.daemon.whereabouts import tell_begun
from prefetchd.daemon.workers import prepare_process
from prefetchd.words import counted

PROBE_SAMPLES = 8  # samples spread over the split that a node must read before it gets slices

# A sample as the daemon's box reads it: its index and the digest of its bytes there (``digest``).
Sample = tuple[int, str]


@dataclass(frozen=True)
class Shipment:
    """What goes to the object store once per job: the job, and the samples a node must read with
    the same bytes as the daemon's own box (ones the box reads, so that a bad file is not mistaken
    for a bad node; the same bytes, so that another version of the dataset is not taken for it)."""

    job: WorkerJob
    probe: tuple[Sample, ...]
    version: str  # the daemon's prefetchd (``build``): a node must run the same for the batches to be the same bits
    origin: str = ""  # where the daemon's prefetchd is (``origin``): a node there whose build differs saw it change


@dataclass(frozen=True)
class NodeAnswer:
    """A node's answer to the probe; ``failures`` and ``unable`` empty: it reads every probed sample
    and can run the job."""

    node_id: str  # Ray's node id, for label selectors
    host: str
    checked: int
    failures: tuple[str, ...]  # "name (Error: text)" per sample it could not read
    unable: str = ""  # why it cannot run the job at all, and what to install; then no sample is read

    @property
    def fit(self) -> bool:
        return not self.failures and not self.unable

    @property
    def node(self) -> str:
        return node_label(self.host, self.node_id)


def node_label(host: str, node_id: str) -> str:
    """How the log and status name a node: host name and the start of Ray's node id."""
    return f"{host}/{node_id[:8]}"


def probe_samples(job: WorkerJob, reader: SampleReader, count: int = PROBE_SAMPLES) -> tuple[Sample, ...]:
    """Up to ``count`` samples spread evenly over the split (its first and last included) that this
    box reads, with their digests; run by the bridge on the daemon's box."""
    members = job.members
    picks = sorted({int(members[i]) for i in np.linspace(0, len(members) - 1, min(count, len(members))).astype(int)})
    return tuple(sample for sample in (sample_here(reader, i) for i in picks) if sample is not None)


def sample_here(reader: SampleReader, index: int) -> Sample | None:
    """Sample ``index`` as ``reader`` reads it here, or None where it cannot."""
    try:
        return index, digest(reader.read(index))
    except Exception:
        return None


def digest(data: bytes | bytearray) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def unreadable(job: WorkerJob, reader: SampleReader, samples: tuple[Sample, ...]) -> tuple[str, ...]:
    """"name (Error: text)" for each of ``samples`` that ``reader`` cannot read here, or reads with
    other bytes than the daemon's box."""
    return tuple(f for f in (_failure(job, reader, i, box) for i, box in samples) if f)


@functools.lru_cache(maxsize=1)
def build() -> str:
    """This prefetchd as a node must match the daemon's: its version, + a digest of its Python sources.  The version
    alone has been 0.1.0 at every commit, so nodes of other checkouts passed as the daemon's (a packaging walk)."""
    root = Path(prefetchd.__file__).parent
    sources = hashlib.blake2b(digest_size=6)
    for path in sorted(root.rglob("*.py")):
        sources.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return f"{__version__}+{sources.hexdigest()}"


def origin() -> str:
    """This box and the folder of the prefetchd it imported."""
    return f"{socket.gethostname()}:{Path(prefetchd.__file__).parent}"


def unable_here(shipment: Shipment) -> str:
    """Why this process cannot build ``shipment``'s slices, or "": it runs another prefetchd than the
    daemon, or cannot import what the job needs (the transform hook, torch).  Run by every Ray worker
    before its first slice of a job, and so by the probe: a node without the hook's module is named
    as unfit when it joins, instead of failing the job with its first slice."""
    here = build()
    if shipment.version != here:
        theirs, _, _ = shipment.version.partition("+")
        if shipment.origin == origin():  # the daemon's own sources, read again after an edit or a git pull
            return (f"runs prefetchd {here} from {Path(prefetchd.__file__).parent}, the daemon {shipment.version} "
                    "from the same folder: its sources changed since the daemon started; restart the daemon (a batch "
                    "must be the same bits wherever it is built)")
        install = (f"install prefetchd[ray]=={theirs}" if theirs != __version__ else
                   "the same version from other sources (another commit): install the daemon box's prefetchd")
        return (f"runs prefetchd {here}, the daemon {shipment.version}: {install} on every node (a batch must be "
                "the same bits wherever it is built)")
    hook = shipment.job.augment.transform
    try:
        if hook is not None:  # before prepare_process: a hook that cannot be imported costs no torch import
            load_hook(hook)
        prepare_process(shipment.job)
    except HookError as exc:
        return str(exc)
    except ImportError as exc:
        return (f"cannot import what the job needs ({type(exc).__name__}: {exc}); install the daemon box's torch "
                "and torchvision there")
    return ""


def _failure(job: WorkerJob, reader: SampleReader, index: int, box: str) -> str:
    try:
        data = reader.read(index)
    except Exception as exc:
        return f"{job.index.name(index)} ({type(exc).__name__}: {exc})"
    if digest(data) != box:
        return f"{job.index.name(index)} (its {counted(len(data), 'byte')} here differ from the daemon's box's copy)"
    return ""


@dataclass
class _JobHere:
    """The job this process read last, and what it knows of it on this node."""

    ref: str  # the shipment's object id
    shipment: Shipment
    reader: SampleReader
    unable: str  # why this process cannot run the job at all (``unable_here``), or ""
    answer: NodeAnswer  # this node's answer to the probe, the latest
    clean: jpeg_crop.CleanFiles | None  # the files this process has decoded cleanly to the end


_job_here: _JobHere | None = None


def _here(box: list[Any]) -> _JobHere:
    """The job of ``box`` (in a list, so that Ray hands the task the reference and this process
    fetches the shipment once per job, not once per task) and this node's answer to its probe."""
    global _job_here
    import ray

    ref = box[0]
    if _job_here is None or _job_here.ref != ref.hex():
        shipment: Shipment = ray.get(ref)
        unable = unable_here(shipment)
        reader = SampleReader(shipment.job.index, shipment.job.readers)
        clean = jpeg_crop.CleanFiles(len(shipment.job.index), shared=False) if jpeg_crop.available() else None
        _job_here = _JobHere(ref.hex(), shipment, reader, unable, _probe(shipment, reader, unable), clean)
    return _job_here


def _probe(shipment: Shipment, reader: SampleReader, unable: str = "", also: tuple[Sample, ...] = ()) -> NodeAnswer:
    """Read the job's probe samples, and ``also`` these, on this node, now (none where it cannot run the job)."""
    import ray

    samples = tuple(dict.fromkeys((*shipment.probe, *also)))
    return NodeAnswer(ray.get_runtime_context().get_node_id(), socket.gethostname(), len(samples),
                      () if unable else unreadable(shipment.job, reader, samples), unable)


def probe_node(box: list[Any], also: tuple[Sample, ...] = ()) -> NodeAnswer:
    """A Ray task pinned to one node: can it read the job's probe samples, and ``also`` these (ones it
    could not use before although the daemon's box does)?  Read afresh each time: a node found unfit
    is probed again, and its mount may be back."""
    here = _here(box)
    here.answer = _probe(here.shipment, here.reader, here.unable, also)
    return here.answer


# What ``build_slice`` yields before its answer: that it has begun (its Ray worker started, the job loaded), and
# when tracked, each sample it begins (a replacement too) before it reads it.  The bridge times a slice from these
# (--task-timeout), and from its submission until the first (--worker-start-timeout).
Progress = int | None
Answer = tuple[Filled | WriteFailed | NodeAnswer, list[np.ndarray] | None, str]


def build_slice(box: list[Any], task: Task, track: bool = False) -> Iterator[Progress | Answer]:
    """A Ray task (a streaming one): run ``task`` with the local workers' code; its last item is the
    answer, (result, pixels: an image per item, node), and the items before it say how far it got.

    It yields None once it has begun: a Ray worker's start (importing torch for a hook, seconds; reading the
    probe samples) is not the slice's time, which --task-timeout bounds from there; the bridge bounds the start
    by --worker-start-timeout from the slice's submission, as a local worker's is (a hook's module whose import
    blocks on a node, --data on a hung mount there: ``BridgeSlices._hand_back_hung``).  ``track``: a slice that
    hung or killed its Ray worker before is built an item at a time, each sample it begins (a replacement too)
    yielded first, so that the bridge knows the file it hangs on or dies on (a yield per image costs the object
    store a report to the bridge each: kept for those).

    A node that fails the probe answers with the probe's result instead: building there would
    replace every sample as undecodable (or fail the job once no replacement reads), and so
    differ from a build on the daemon's box.  The probe runs before the process's first slice of
    the job, and again after a slice that replaced a sample or failed: a mount that went away
    since is caught there, and the slice goes to another node.  A node that cannot import the
    transform hook is unfit from the start (``unable_here``), so a hook that raises here while it
    runs is the hook's bug, as on the daemon's box: it stops the job (``failure_of``).
    """
    here = _here(box)
    yield None
    if not here.answer.fit:  # this process found the node unfit; the bridge sent this slice: look again
        here.answer = _probe(here.shipment, here.reader, here.unable)
    answer = here.answer
    if not answer.fit:
        yield answer, None, answer.node
        return
    if track:
        result, pixels = yield from build_rows_tracked(here.shipment.job, task, here.reader, here.clean)
    else:
        result, pixels = build_rows(here.shipment.job, task, here.reader, here.clean)
    if not isinstance(result, Filled) or result.failures:
        again = _probe(here.shipment, here.reader)
        if again.failures:
            here.answer = again
            yield again, None, again.node
            return
    yield result, pixels, answer.node


def build_rows_tracked(job: WorkerJob, task: Task, reader: SampleReader, clean: jpeg_crop.CleanFiles | None = None
                       ) -> Generator[int, None, tuple[Filled | WriteFailed, list[np.ndarray] | None]]:
    """``build_rows``, yielding each sample it begins before it reads it: each item's, and each replacement it
    tries for one that did not decode, so that the sample a death or a hang is on is the one said last, as a
    local worker's whereabouts say it (an item's own sample alone blamed an undecodable file for the death of
    its replacement, and the slice went round for good).  The build runs on a thread that waits at each sample
    until this generator has yielded it (``tell_begun``), and so until the bridge took it; the same images and
    result as ``build_rows``'s."""
    begun: queue.SimpleQueue[int | None] = queue.SimpleQueue()
    taken = threading.Semaphore(0)
    built: list[tuple[Filled | WriteFailed, list[np.ndarray] | None]] = []

    def tell(sample: int) -> None:
        begun.put(sample)
        taken.acquire()  # for good where this slice was cancelled: its thread builds no more

    def build() -> None:
        tell_begun(tell)
        try:
            built.append(build_rows(job, task, reader, clean))
        finally:
            begun.put(None)

    thread = threading.Thread(target=build, name="prefetchd-tracked-slice", daemon=True)
    thread.start()
    while (sample := begun.get()) is not None:
        yield sample
        taken.release()
    thread.join()
    return built[0]


def build_rows(job: WorkerJob, task: Task, reader: SampleReader,
               clean: jpeg_crop.CleanFiles | None = None) -> tuple[Filled | WriteFailed, list[np.ndarray] | None]:
    """``task`` built by ``run_task`` into rows (an image per item, in order, None unless it filled):
    on a node, and on the daemon's box where the bridge checks a node's slice."""
    rows = Rows(task.items)
    try:
        result = run_task(job, task, reader, sink=rows, clean=clean)
    except Exception as exc:
        result = failure_of(task.task_id, exc)
    return result, rows.pixels if isinstance(result, Filled) else None


class Rows:
    """A ``SlotSink`` keeping each slot's image, in the order of the task's items, for the task to
    return.  The images themselves, not copies into one array: Ray copies them into the object store
    anyway, and a row array first cost a copy per image (~3 % of the remote path's img/s here)."""

    def __init__(self, items: tuple[tuple[int, int], ...]) -> None:
        self.pixels: list[np.ndarray] = [np.empty(0, np.uint8)] * len(items)
        self.rows = {slot: row for row, (slot, _index) in enumerate(items)}

    def slot(self, slot: int) -> None:
        return None  # each image as it was made

    def fill(self, slot: int, image: memoryview) -> None:
        self.pixels[self.rows[slot]] = np.frombuffer(image, np.uint8)


__all__ = ["Answer", "NodeAnswer", "Progress", "Rows", "Sample", "Shipment", "build_rows", "build_rows_tracked",
           "build_slice", "node_label", "probe_node", "probe_samples", "sample_here", "unable_here", "unreadable"]
