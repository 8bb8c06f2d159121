"""Many ranks: where a ``prefetchd-train`` process stands under torchrun, and what the ranks agree on.

torchrun starts one trainer per rank and says where each stands in its
environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``).
Rank ``r`` of ``W`` reads the stream ``stream_dir(buffer, r, W)`` that one
daemon per box produces for all of the box's ranks (``prefetchd start
--world-size W --ranks a-b``); the daemon pads every rank's share to the same
number of samples, so every rank runs the same number of steps and DDP's
collectives always pair up.

:class:`Collective` is everything the trainer asks of the other ranks besides
DDP's gradient all-reduce: a stop flag after every step, the epoch's sums, the
per-rank states of a checkpoint, the checkpoint read by rank 0, barriers.
Before every step the ranks also agree whether to take it (``agree_to_stop``): a
rank that a stop found waiting for a batch must not leave the others in DDP's
all-reduce, and a rank that holds its batch must not keep the others waiting for
theirs from a stalled daemon.  A stop is also announced in the process group's
store, where ranks still waiting for a batch look (``stop_announced``) without a
collective.  These go through a gloo group of their own even when the gradients go through NCCL:
they are a few numbers on the CPU, and a CPU all-reduce makes no step wait for the GPU.  That
group's timeout is long (``RANK_WAIT_TIMEOUT``): a rank may wait there while another's daemon
waits for its storage.
With one rank every operation is local and nothing is initialised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.constants import default_pg_timeout

from prefetchd.buffer_protocol import Manifest, daemon_owner, stream_dir
from prefetchd.buffer_protocol.layout import MANIFEST_NAME
from prefetchd.trainer.errors import LoaderError, LoaderTimeout, PeerFailed, SetupError
from prefetchd.trainer.liveness import (DEFAULT_TIMEOUT, MORE_TIME, STATUS_LOOK_SECONDS, FailedDaemon, owner_status, served_world,
                                         unserved_rank, why_no_manifest)

logger = logging.getLogger(__name__)

TORCHRUN_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
_POLL_SECONDS = 0.05
# How long a rank waits for the others in the trainer's own collectives (``Collective``'s group, not DDP's): as
# long as another rank's daemon may wait for its dataset's storage, which the loader waits for past its timeout.
# torch's default, 30 minutes, ended a run whose one box waited that long, saying a rank had left. A rank that
# fails or dies closes its connections, which ends these waits at once; only one that hangs (stopped, in a
# debugger) is waited for this long.
RANK_WAIT_TIMEOUT = timedelta(days=7)
# How often a rank waiting for a batch asks the store whether another rank stopped (a round trip to
# torchrun's store: too often for every 1 ms poll of the wait, and a stop may wait this long).
STOP_LOOK_SECONDS = 0.1
# How the before-step agreement is polled: checked at once a few hundred times (ranks in step agree
# within ~0.5 ms on gloo), then with sleeps from 0.1 ms doubling to 2 ms, so a rank that holds its batch
# while another waits starts its step at most 2 ms late.  Measured on the 2-core EPYC, 2 ranks on gloo,
# 1000 agreements: a blocking all-reduce 0.48 ms each, this 0.47, sleeps of 0.5 ms doubling to 10 ms
# without the spin 0.73.
_AGREE_SPINS = 200
_AGREE_POLL_FIRST = 0.0001
_AGREE_POLL_MAX = 0.002
_STOP_KEY = "stop"
# How long a rank waits for every rank's device before the process group: as long as init_process_group's
# own rendezvous would wait for a rank that does not come (torch's default, 30 minutes), so no run is refused
# that would have started before.  The ranks come together (their launcher starts them at once, and each comes
# here first), so only a rank that hangs before it (a stuck CUDA driver) is waited for this long: one that fails
# or dies makes torchrun (srun, mp.spawn) end the others.
DEVICE_WAIT_TIMEOUT = default_pg_timeout
# How long rank 0, refusing the ranks' devices, waits for the others to have read them all before it leaves.
_READ_WAIT = timedelta(seconds=10)

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's place among the trainer's ranks (one rank without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.world_size and 0 <= self.local_rank < self.local_world_size
                and self.local_world_size <= self.world_size and self.local_rank <= self.rank):
            raise SetupError(
                f"RANK {self.rank}, WORLD_SIZE {self.world_size}, LOCAL_RANK {self.local_rank}, LOCAL_WORLD_SIZE "
                f"{self.local_world_size} do not fit together; launch the trainer with torchrun, which sets them"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Ranks:
        """The ranks torchrun describes in the environment; one rank when it describes none."""
        env = os.environ if environ is None else environ
        present = [name for name in TORCHRUN_VARS if name in env]
        if not present:
            return cls()
        missing = [name for name in TORCHRUN_VARS if name not in env]
        if missing:
            raise SetupError(
                f"{', '.join(present)} {'is' if len(present) == 1 else 'are'} set but {', '.join(missing)} not: "
                "launch the trainer with torchrun (which sets them all), or unset them to train as one process"
            )
        values = {}
        for name in (*TORCHRUN_VARS, "LOCAL_WORLD_SIZE"):
            text = env.get(name)
            if text is None:  # not set by a hand-made launch: one box holds every rank
                continue
            try:
                values[name] = int(text)
            except ValueError:
                raise SetupError(f"{name}={text!r} in the environment is not a number; launch "
                                           "the trainer with torchrun, which sets it") from None
        world = values["WORLD_SIZE"]
        return cls(rank=values["RANK"], world_size=world, local_rank=values["LOCAL_RANK"],
                   local_world_size=values.get("LOCAL_WORLD_SIZE", world))

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that prints, writes metrics and checkpoints."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Local rank 0: the one that starts this box's daemons."""
        return self.local_rank == 0

    @property
    def local_ranks(self) -> range:
        """The ranks on this box; torchrun gives each box one contiguous block of ranks."""
        first = self.rank - self.local_rank
        return range(first, first + self.local_world_size)

    def ranks_flag(self) -> str:
        """The daemon's ``--ranks`` for this box, e.g. ``8-15``."""
        r = self.local_ranks
        return str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}"


# -- which stream this rank reads ------------------------------------------------------


def _world_mismatch(buffer: Path, served: int, manifest: Path, ranks: Ranks) -> SetupError:
    found = f"the daemon of {buffer} produces streams for --world-size {served} ({manifest})"
    if ranks.distributed:
        w = ranks.world_size
        other = (f"launch torchrun with {served} processes in all (--nnodes x --nproc-per-node = {served})"
                 if served > 1 else "run the trainer as one process, without torchrun")
        return SetupError(
            f"{found}, but torchrun runs {w} ranks (WORLD_SIZE={w}). Restart the daemon for {w} ranks "
            f"(`prefetchd stop --buffer {buffer}`, then `prefetchd start --buffer {buffer} ... --world-size {w} --reset`: "
            f"--reset deletes the batches of --world-size {served}), "
            f"or {other}"
        )
    return SetupError(
        f"{found}, but this trainer runs as one process (not under torchrun). Launch it under torchrun or "
        f"`accelerate launch` with {served} processes in all (e.g. `torchrun --nproc-per-node {served} train.py` "
        "or `... -m prefetchd.trainer.train`), or restart the daemon without --world-size and with --reset (which "
        f"deletes the batches of --world-size {served})"
    )


def wait_for_stream(buffer: Path, ranks: Ranks, timeout: float, split: str = "train") -> Path:
    """This rank's stream directory of ``buffer``, once the daemon has written its manifest there.

    ``split`` is what the caller reads the buffer for: the command that starts a missing daemon says it.

    A daemon producing for another number of ranks would leave this rank
    waiting for a stream that never comes (or hand it another rank's share):
    that is refused at once, naming both numbers and the fix.
    """
    if buffer.exists() and not buffer.is_dir():
        raise LoaderError(f"{buffer} is not a directory; pass the daemon's --buffer directory")
    own = stream_dir(buffer, ranks.rank, ranks.world_size)
    deadline = time.monotonic() + timeout
    next_look = time.monotonic()
    logged = False
    failed = FailedDaemon(buffer)
    while True:
        served = served_world(buffer)
        if served is not None and served[0] != ranks.world_size:
            raise _world_mismatch(buffer, served[0], served[1], ranks)
        if served is not None and served[0] > 1 and served[1].parent == buffer:
            # A manifest of a many-rank job at the top: this is one rank's stream directory, not the buffer.
            raise SetupError(
                f"{buffer} is the stream of one rank (its {MANIFEST_NAME} says rank "
                f"{Manifest.read(buffer).rank} of --world-size {served[0]}), not a buffer; every rank finds its own "
                f"stream under the buffer: pass the daemon's --buffer, {buffer.parent}"
            )
        there = (own / MANIFEST_NAME).is_file()
        if there or time.monotonic() >= next_look:
            # Also once the stream is there: an earlier run of the job may have left it (its daemon restarted
            # with fewer --ranks), and the batches waited for would never come.
            next_look = time.monotonic() + STATUS_LOOK_SECONDS
            owner, status = owner_status(own)
            unserved = unserved_rank(own, owner, status) if ranks.distributed else None
            if unserved is not None:
                raise SetupError(
                    f"{unserved}. Restart it with this box's ranks (`prefetchd stop --buffer {buffer}`, then `prefetchd "
                    f"start --buffer {buffer} ... --world-size {ranks.world_size} --ranks {ranks.ranks_flag()}`), or "
                    "point this box's ranks at a buffer of their own daemon")
            if there:
                return own
            failed.check(owner, status)
        if time.monotonic() >= deadline:
            raise LoaderTimeout(_no_stream_message(buffer, own, ranks, timeout, split) + failed.said())
        if not logged:
            logger.info("waiting up to %g s for %s", timeout, own / MANIFEST_NAME)
            logged = True
        time.sleep(_POLL_SECONDS)


def rank_stream(buffer: str | os.PathLike[str], timeout: float = DEFAULT_TIMEOUT) -> Path:
    """The stream of ``buffer`` that this process reads: the buffer itself as one process, its
    rank's stream directory under torchrun, ``accelerate launch`` or any launcher that sets
    torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).  Pass it to BufferLoader."""
    return wait_for_stream(Path(buffer), Ranks.from_env(), timeout)


def _no_stream_message(buffer: Path, own: Path, ranks: Ranks, timeout: float, split: str = "train") -> str:
    world = (" --split val" if split == "val" else "") + (f" --world-size {ranks.world_size}" if ranks.distributed
                                                          else "")
    owner = daemon_owner(buffer)
    if owner is not None:
        extra = (f"; it may produce only other ranks: its --ranks must include {ranks.rank}"
                 if ranks.distributed else "")
        return (f"{own}: the daemon ({owner}) owns {buffer} but wrote no manifest.json there within "
                f"{timeout:g} s{extra}; {why_no_manifest(buffer)}")
    where = "does not exist" if not own.exists() else "has no manifest.json"
    return (f"{own} {where} after waiting {timeout:g} s for the daemon's manifest.json, and no prefetchd daemon "
            f"owns {buffer}. Start one with `prefetchd start --buffer {buffer} --data ROOT{world}` (ROOT: the "
            f"{'validation ' if split == 'val' else ''}dataset: class folders, a file list or shards, local or at a "
            f"URL), or {MORE_TIME} if one is still starting")


# -- what the ranks agree on --------------------------------------------------------------


def differs_between_ranks(name: str, each: list[str], fix: str, aside: str = "") -> str:
    """The refusal of ``name`` (an option, or the device it resolves to) given other values on other ranks: each
    rank's value as ``each`` says it (``aside`` after them), then ``fix``."""
    values = ", ".join(f"rank {rank}: {value}" for rank, value in enumerate(each))
    return f"{name} differs between ranks ({values}{aside}); {fix}"


def backend_for(device: torch.device) -> str:
    """The process group's backend for ranks on ``device``: nccl on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def agent_store_serves(environ: Mapping[str, str] | None = None) -> bool:
    """Whether torchrun's agent serves the ranks' store at MASTER_ADDR:MASTER_PORT (``TORCHELASTIC_USE_AGENT_STORE``),
    before any rank starts; without it rank 0 serves it (``make_store``)."""
    env = os.environ if environ is None else environ
    return env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def make_store(ranks: Ranks, environ: Mapping[str, str] | None = None,
               timeout: timedelta = DEVICE_WAIT_TIMEOUT) -> distributed_c10d.Store:
    """The ranks' store when no torchrun agent serves one: rank 0 serves it at MASTER_ADDR:MASTER_PORT, the other
    ranks connect to it, as init_process_group's ``env://`` does (SLURM scripts, mpirun, torch.multiprocessing.spawn).

    Made before the process group, so the ranks can compare their devices in it (``agree_on_backend``); the group
    is then made in it (``store=``), and torch does not bind MASTER_PORT again.  ``timeout`` is how long a rank
    waits to reach rank 0's server, and then for a key: init_process_group's own (30 minutes), as a rank 0 that
    starts late (a box still starting) is waited for as long as before.
    """
    env = os.environ if environ is None else environ
    addr, port_text = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    unset = [name for name, value in (("MASTER_ADDR", addr), ("MASTER_PORT", port_text)) if not value]
    if unset:
        raise SetupError(
            f"RANK, WORLD_SIZE and LOCAL_RANK are set but {' and '.join(unset)} not: set MASTER_ADDR to the address "
            "of rank 0's box and MASTER_PORT to a free port there, the same on every rank, or launch with torchrun, "
            "which sets them"
        )
    try:
        port = int(port_text)
    except ValueError:
        port = 0
    if not 0 < port < 2**16:
        raise SetupError(f"MASTER_PORT={port_text!r} in the environment is not a port (1-65535): set it to a free "
                         "port of rank 0's box, the same on every rank")
    try:
        # multi_tenant, as torch's env:// store: a second group in this process (train() run again, while DDP
        # keeps the first group and its store alive) serves from the same server rather than failing to bind.
        # (torch.distributed imports TCPStore, its public class, without re-exporting it, so strict mypy does
        # not take it from there.)
        return dist.TCPStore(addr, port, is_master=ranks.is_main, timeout=timeout,  # type: ignore[attr-defined]
                             multi_tenant=True)
    except dist.DistNetworkError as exc:
        told = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if ranks.is_main:
            raise SetupError(
                f"rank 0 could not serve the ranks' store at MASTER_ADDR:MASTER_PORT {addr}:{port} ({told}); "
                "MASTER_PORT must be free on rank 0's box (a run still going there holds it: pick another) and "
                "MASTER_ADDR one of its addresses, the same on every rank"
            ) from None
        raise SetupError(
            f"rank {ranks.rank} could not reach the ranks' store at MASTER_ADDR:MASTER_PORT {addr}:{port} within "
            f"{timeout.total_seconds():g} s ({told}); rank 0 serves it: MASTER_ADDR must be the address of rank 0's "
            "box, reachable from this one, and MASTER_PORT the same on every rank; rank 0's output says whether it "
            "started"
        ) from None


def agree_on_backend(ranks: Ranks, device: torch.device, environ: Mapping[str, str] | None = None,
                     timeout: timedelta = DEVICE_WAIT_TIMEOUT, store: distributed_c10d.Store | None = None) -> None:
    """Refuse, on every rank, ranks whose devices need different backends, before the process group is made.

    Ranks that init_process_group with gloo and nccl wait for each other there until torch's timeout, then
    fail with a message that names neither (``--device auto`` across a box with a GPU and one without).  So
    each rank first says its device in the ranks' store and waits up to ``timeout`` for the others'.  That store
    is ``store`` (``make_store``'s, which rank 0 serves), or else torchrun's agent's (``TORCHELASTIC_USE_AGENT_STORE``),
    serving at MASTER_ADDR:MASTER_PORT before any rank starts.  With neither there is nothing to talk through: the
    ranks are not compared (``Collective.start`` passes ``make_store``'s store when no agent serves one).
    """
    env = os.environ if environ is None else environ
    if not ranks.distributed:
        return
    if store is None:
        if not agent_store_serves(env):
            return
        # A client of its own, dropped on return; init_process_group connects its own.
        store = dist.TCPStore(  # type: ignore[attr-defined]
            env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout)
    # The agent's store lives as long as torchrun: keys of this attempt alone, so that a group torchrun
    # restarts (--max-restarts: the next restart count) or grows (--nnodes MIN:MAX: the same restart count, a
    # new world size) reads no device of the last attempt.  (A store of make_store's lives as long as its run.)
    attempt = "/".join(env.get(name, "") for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                                                      "WORLD_SIZE"))
    keys = [f"prefetchd-train/device/{attempt}/{rank}" for rank in range(ranks.world_size)]
    store.set(keys[ranks.rank], str(device))
    try:
        store.wait(keys, timeout)
    except dist.DistStoreError:
        missing = ", ".join(f"rank {rank}" for rank, key in enumerate(keys) if not store.check([key]))
        raise SetupError(
            f"rank {ranks.rank} waited {timeout.total_seconds():g} s for every rank's device before making the "
            f"process group, and these never said theirs: {missing}; the output of their boxes says why"
        ) from None
    every = [torch.device(store.get(key).decode()) for key in keys]  # a name: no rank's CUDA is touched
    if any(theirs.type != device.type for theirs in every):
        # Rank 0 may serve the store (make_store's) and leaves with this refusal: only once every rank has read
        # every device, so that none is cut off mid-read and each refuses naming them all.  They have all come,
        # so the reads take milliseconds: the bound is for a rank killed meanwhile.
        read = [f"{key}/read" for key in keys]
        store.set(read[ranks.rank], "1")
        if ranks.is_main:
            with contextlib.suppress(dist.DistStoreError):
                store.wait(read, _READ_WAIT)
        raise SetupError(differs_between_ranks(
            "the device", [f"{theirs} ({backend_for(theirs)})" for theirs in every],
            "gloo and nccl ranks cannot form one process group (--device auto is cuda only on a box with a GPU): "
            "give every box the same --device, e.g. --device cpu, or a GPU to every rank"))


class Collective:
    """Cross-rank operations of the trainer, on a CPU (gloo) group; local with one rank."""

    def __init__(self, ranks: Ranks, group: Any = None, owned: bool = False, store: Any = None) -> None:
        self.ranks = ranks
        self._group = group
        self._owned = owned
        self._store = store  # where a stop is announced (None with one rank)
        self._announced = False
        self._next_stop_look = 0.0

    @classmethod
    def start(cls, ranks: Ranks, device: torch.device) -> Collective:
        """Join the ranks' process group (gloo on the CPU, nccl on CUDA), once they agree on that backend
        (``agree_on_backend``); nothing with one rank.

        The group's store is torchrun's agent's, or, launched without it (MASTER_ADDR, MASTER_PORT, RANK,
        WORLD_SIZE and LOCAL_RANK set by a SLURM script, mpirun or torch.multiprocessing.spawn), one rank 0
        serves (``make_store``).  A group the caller made is joined as it is."""
        if not ranks.distributed:
            return cls(ranks)
        if dist.is_initialized():  # the caller's own group (train() called from a script)
            if dist.get_world_size() != ranks.world_size or dist.get_rank() != ranks.rank:
                raise SetupError(
                    f"the initialised process group has rank {dist.get_rank()} of {dist.get_world_size()}, but "
                    f"the environment says rank {ranks.rank} of {ranks.world_size}"
                )
            owned = False
        else:
            store = None if agent_store_serves() else make_store(ranks)
            agree_on_backend(ranks, device, store=store)  # where gloo and nccl ranks would wait for each other
            backend = backend_for(device)
            if device.type == "cuda":  # after the agreement: a CPU rank's peer on "cuda" is refused, not set up
                torch.cuda.set_device(device)
            dist.init_process_group(
                backend, rank=ranks.rank, world_size=ranks.world_size,
                device_id=device if device.type == "cuda" else None,
                # Under the prefix torch's env:// puts the group's keys under, beside the devices' keys.
                store=None if store is None else distributed_c10d.PrefixStore("default_pg", store))
            owned = True
        group = dist.new_group(backend="gloo", timeout=RANK_WAIT_TIMEOUT)
        coll = cls(ranks, group, owned)
        # Keys of this run alone: the store outlives a run when a script calls train() twice in one group.
        # The default group's store (torchrun's rendezvous's or make_store's); torch has no public getter for it.
        # Without it (another torch), a rank waiting for a batch learns of a stop only from its own signal.
        run = coll.broadcast(uuid.uuid4().hex)
        default_store = getattr(distributed_c10d, "_get_default_store", None)
        if default_store is not None:
            coll._store = distributed_c10d.PrefixStore(f"prefetchd-train/{run}/", default_store())
        return coll

    @property
    def backend(self) -> str | None:
        return str(dist.get_backend()) if self.ranks.distributed and dist.is_initialized() else None

    def close(self) -> None:
        if self._owned and dist.is_initialized():
            dist.destroy_process_group()
            self._owned = False

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any: a stop every rank takes at the same step."""
        if not self.ranks.distributed:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        with self._peers():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return bool(t.item())

    def announce_stop(self) -> None:
        """Tell the ranks still waiting for a batch that this one stops (``stop_announced``)."""
        if self._store is not None and not self._announced:
            with self._peers("announcing a stop"):
                self._store.set(_STOP_KEY, "1")
            self._announced = True

    def stop_announced(self) -> bool:
        """Whether any rank announced a stop; no collective, so a rank waiting for a batch may ask (the store
        is asked every ``STOP_LOOK_SECONDS`` at most)."""
        if self._store is None:
            return False
        if self._announced:
            return True
        now = time.monotonic()
        if now < self._next_stop_look:
            return False
        self._next_stop_look = now + STOP_LOOK_SECONDS
        with self._peers("looking whether another rank stops"):
            self._announced = bool(self._store.check([_STOP_KEY]))
        return self._announced

    def agree_to_stop(self, stopping: bool, should_stop: Callable[[], bool]) -> bool:
        """Before a step: True on every rank if any rank stops there (``stopping``, or ``should_stop()`` while
        this rank waits for the others).

        A rank here holds its batch, or a stop ended its wait for one; the others may still wait for
        theirs. A stop asked meanwhile is announced in the store, where those waits look, so they end and
        come here too: the agreement never waits on a stalled daemon once any rank is asked to stop. The
        wait polls rather than blocks, because a signal's Python handler runs only between bytecodes.
        """
        if not self.ranks.distributed:
            return stopping or should_stop()
        if stopping:
            self.announce_stop()
        t = torch.tensor([1 if stopping else 0], dtype=torch.int32)
        with self._peers("before a step, agreeing whether to stop"):
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
            for _ in range(_AGREE_SPINS):  # ranks in step agree within a fraction of a millisecond
                if work.is_completed():
                    break
            delay = _AGREE_POLL_FIRST
            while not work.is_completed():
                if not stopping and should_stop():
                    stopping = True
                    self.announce_stop()
                time.sleep(delay)
                delay = min(delay * 2, _AGREE_POLL_MAX)
            work.wait()
        return bool(t.item())

    def reduce(self, sums: Sequence[float], maxima: Sequence[float]) -> tuple[list[float], list[float]]:
        """``sums`` summed and ``maxima`` maximised over the ranks (float64)."""
        if not self.ranks.distributed:
            return list(sums), list(maxima)
        s = torch.tensor(list(sums), dtype=torch.float64)
        m = torch.tensor(list(maxima), dtype=torch.float64)
        with self._peers():
            dist.all_reduce(s, op=dist.ReduceOp.SUM, group=self._group)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=self._group)
        return s.tolist(), m.tolist()

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's ``obj``, in rank order."""
        if not self.ranks.distributed:
            return [obj]
        out: list[Any] = [None] * self.ranks.world_size
        with self._peers():
            dist.all_gather_object(out, obj, group=self._group)
        return out

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's ``obj`` on rank 0, in rank order; None elsewhere."""
        if not self.ranks.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.ranks.world_size if self.ranks.is_main else None
        with self._peers():
            dist.gather_object(obj, out, dst=0, group=self._group)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        if not self.ranks.distributed:
            return obj
        box: list[Any] = [obj]
        with self._peers():
            dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def _peers(self, what: str = "in a step all ranks take together") -> Iterator[None]:
        """A collective's failure is a rank that left: it has printed why, so one line says so here
        (the library's text, a gloo connection error, goes to the debug log)."""
        try:
            yield
        except RuntimeError as exc:
            logger.debug("collective failed: %s", exc)
            raise peer_failed(self.ranks, what) from None

    def barrier(self, what: str, timeout: float) -> None:
        """Wait until every rank is here; after ``timeout`` say which ranks did not come, and for what."""
        if not self.ranks.distributed:
            return
        started = time.monotonic()
        try:
            dist.monitored_barrier(group=self._group, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
        except RuntimeError as exc:
            logger.debug("barrier failed: %s", exc)
            if time.monotonic() - started < timeout:  # not the timeout: a rank left before it got there
                raise peer_failed(self.ranks, what) from None
            raise SetupError(
                f"rank {self.ranks.rank} waited {timeout:g} s for every rank ({what}), and not every rank came; "
                "the messages of the other ranks say why"
            ) from None


def peer_failed(ranks: Ranks, what: str) -> PeerFailed:
    return PeerFailed(
        f"rank {ranks.rank}: another rank stopped while this one waited for it ({what}); that rank's own "
        "message, above, says why, or torchrun's summary names the signal that killed it"
    )


def is_peer_failure(exc: BaseException) -> bool:
    """An error of DDP's own collectives (the gradient all-reduce) because another rank left."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        mark in text for mark in ("Connection closed by peer", "Connection reset by peer", "gloo/transport"))


__all__ = ["Collective", "Ranks", "TORCHRUN_VARS", "agent_store_serves", "agree_on_backend", "backend_for",
           "differs_between_ranks", "is_peer_failure", "make_store", "peer_failed", "wait_for_stream"]
