"""What the trainer asks of the other ranks besides DDP's gradient all-reduce, once their process group stands.

:class:`Collective` is a stop flag after every step, the epoch's sums, the
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
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from prefetchd.trainer.errors import PeerFailed, SetupError
from prefetchd.trainer.rank_store import agent_store_serves, agree_on_backend, backend_for, make_store
from prefetchd.trainer.ranks import Ranks

logger = logging.getLogger(__name__)

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

T = TypeVar("T")


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
        "message says why, or its launcher's (torchrun's summary) names the signal that killed it"
    )


def is_peer_failure(exc: BaseException) -> bool:
    """An error of DDP's own collectives (the gradient all-reduce) because another rank left."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        mark in text for mark in ("Connection closed by peer", "Connection reset by peer", "gloo/transport"))


__all__ = ["Collective", "is_peer_failure", "peer_failed"]
