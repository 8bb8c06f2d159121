"""Before the process group: the ranks' store, and the ranks' agreement in it on one backend.

Ranks whose devices need different backends (gloo on the CPU, nccl on CUDA: ``--device auto`` across a box
with a GPU and one without) would wait for each other in init_process_group until torch's timeout, then fail
with a message that names neither.  So each rank first says its device in the ranks' store, torchrun's agent's
or, launched without it, one rank 0 serves (``make_store``), and where they differ every rank refuses at once,
naming each rank's device (``agree_on_backend``).  ``Collective.start`` then makes the group in that store.
``differs_between_ranks`` words that refusal, and those of the options the ranks compare once the group
stands (``preflight``).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.constants import default_pg_timeout

from prefetchd.trainer.errors import SetupError
from prefetchd.trainer.ranks import Ranks

# How long a rank waits for every rank's device before the process group: as long as init_process_group's
# own rendezvous would wait for a rank that does not come (torch's default, 30 minutes), so no run is refused
# that would have started before.  The ranks come together (their launcher starts them at once, and each comes
# here first), so only a rank that hangs before it (a stuck CUDA driver) is waited for this long: one that fails
# or dies makes torchrun (srun, mp.spawn) end the others.
DEVICE_WAIT_TIMEOUT = default_pg_timeout
# How long rank 0, refusing the ranks' devices, waits for the others to have read them all before it leaves.
_READ_WAIT = timedelta(seconds=10)
# The waits for the others are polled, never one blocking call into torch: a signal's Python handler runs only
# between bytecodes, so a rank blocked in TCPStore's wait or connect could not be stopped (SIGTERM, Ctrl-C) for
# the whole DEVICE_WAIT_TIMEOUT.  (A short wait() or connect timeout in a loop would do, but torch logs each one
# that runs out, with a C++ stack trace for a connect.)  How often a waiting rank looks again, and after how
# long it says, once, whom it waits for (otherwise a rank waiting for one that never starts shows nothing).
_POLL_SECONDS = 0.05
_NOTICE_AFTER = 10.0
# How long TCPStore may take to connect once the server answered (torch retries until then): a server that
# left in between is looked for again, interruptibly.
_CONNECT_SECONDS = 5.0

logger = logging.getLogger(__name__)


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
    if not ranks.is_main:
        try:
            return _connect(addr, port, timeout, f"rank {ranks.rank} waits for rank 0 to serve the ranks' store "
                                                 f"at MASTER_ADDR:MASTER_PORT {addr}:{port}")
        except _Unreachable as exc:
            raise SetupError(
                f"rank {ranks.rank} could not reach the ranks' store at MASTER_ADDR:MASTER_PORT {addr}:{port} "
                f"within {timeout.total_seconds():g} s ({exc}); rank 0 serves it: MASTER_ADDR must be the address "
                "of rank 0's box, reachable from this one, and MASTER_PORT the same on every rank; rank 0's "
                "output says whether it started"
            ) from None
    try:
        # multi_tenant, as torch's env:// store: a second group in this process (train() run again, while DDP
        # keeps the first group and its store alive) serves from the same server rather than failing to bind.
        # (torch.distributed imports TCPStore, its public class, without re-exporting it, so strict mypy does
        # not take it from there.)  Its own client connects at once.
        return dist.TCPStore(addr, port, is_master=True, timeout=timeout,  # type: ignore[attr-defined]
                             multi_tenant=True)
    except dist.DistNetworkError as exc:
        told = _told(exc)
        raise SetupError(
            f"rank 0 could not serve the ranks' store at MASTER_ADDR:MASTER_PORT {addr}:{port} ({told}); "
            "MASTER_PORT must be free on rank 0's box (a run still going there holds it: pick another) and "
            "MASTER_ADDR one of its addresses, the same on every rank"
        ) from None


def _told(exc: BaseException) -> str:
    """The first line of torch's ``exc`` (a C++ stack trace may follow it), or its type where it says nothing."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class _Unreachable(Exception):
    """No server answered at the store's address within the timeout; the message is the last refusal's."""


def _connect(addr: str, port: int, timeout: timedelta, waiting: str) -> distributed_c10d.Store:
    """A client of the TCPStore served at ``addr``:``port``, once it answers, within ``timeout``.

    Whether it answers is asked with a plain socket, in Python, every ``_POLL_SECONDS``: TCPStore's own
    connect retries inside C++ until its timeout, where no SIGTERM or Ctrl-C reaches Python (and logs a C++
    stack trace for each try).  The client's timeout, for the keys waited for later, is ``timeout``.
    ``waiting`` is said once in the log after ``_NOTICE_AFTER`` seconds without an answer."""
    started = time.monotonic()
    deadline = started + timeout.total_seconds()
    noticed = False
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(0.01, min(1.0, left))):
                pass
        except OSError as exc:
            told = exc.strerror or str(exc) or type(exc).__name__
        else:
            try:
                store = dist.TCPStore(addr, port, is_master=False,  # type: ignore[attr-defined]
                                      timeout=timedelta(seconds=max(0.01, min(_CONNECT_SECONDS, left))))
            except dist.DistNetworkError as exc:  # the server left since it answered
                told = _told(exc)
            else:
                store.set_timeout(timeout)
                return store
        if time.monotonic() >= deadline:
            raise _Unreachable(told)
        if not noticed and time.monotonic() - started >= _NOTICE_AFTER:
            logger.warning("%s (nothing answers there after %g s: %s); it waits up to %g s in all, and SIGTERM or "
                           "Ctrl-C stops it", waiting, _NOTICE_AFTER, told, timeout.total_seconds())
            noticed = True
        time.sleep(min(_POLL_SECONDS, max(0.0, deadline - time.monotonic())))


def _wait(store: distributed_c10d.Store, keys: Sequence[str], timeout: timedelta,
          waiting: Callable[[list[int]], str] | None = None) -> bool:
    """Whether all ``keys`` are set in ``store`` within ``timeout``, asked every ``_POLL_SECONDS`` (see there).
    ``waiting``, given the indices of the keys not set yet, is said once in the log after ``_NOTICE_AFTER``
    seconds.  The store's errors (its server gone: DistNetworkError) are raised."""
    started = time.monotonic()
    deadline = started + timeout.total_seconds()
    noticed = waiting is None
    while not store.check(list(keys)):
        now = time.monotonic()
        if now >= deadline:
            return False
        if not noticed and now - started >= _NOTICE_AFTER:
            assert waiting is not None
            logger.warning("%s", waiting([i for i, key in enumerate(keys) if not store.check([key])]))
            noticed = True
        time.sleep(min(_POLL_SECONDS, deadline - now))
    return True


def _not_started(me: int, missing: list[int], timeout: timedelta) -> str:
    """What rank ``me`` says while it waits for ranks ``missing`` to say their devices."""
    them = ", ".join(str(rank) for rank in missing)
    one = len(missing) == 1
    who, it = (f"rank {them}", "it has not said its") if one else (f"ranks {them}", "they have not said their")
    named, boxes = ("it", "its box says why it has") if one else ("them", "their boxes say why they have")
    return (f"rank {me} waits for {who} to start ({it} device after {_NOTICE_AFTER:g} s); it waits up to "
            f"{timeout.total_seconds():g} s in all, then refuses naming {named}, and SIGTERM or Ctrl-C stops it; "
            f"the output of {boxes} not started")


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
        addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        try:
            store = _connect(addr, port, timeout, f"rank {ranks.rank} waits for torchrun's agent to serve the "
                                                  f"ranks' store at MASTER_ADDR:MASTER_PORT {addr}:{port}")
        except _Unreachable as exc:
            raise SetupError(
                f"rank {ranks.rank} could not reach torchrun's agent's store at MASTER_ADDR:MASTER_PORT "
                f"{addr}:{port} within {timeout.total_seconds():g} s ({exc}); torchrun sets them: was this rank "
                "started by another launcher with TORCHELASTIC_USE_AGENT_STORE=True left in its environment?"
            ) from None
    # The agent's store lives as long as torchrun: keys of this attempt alone, so that a group torchrun
    # restarts (--max-restarts: the next restart count) or grows (--nnodes MIN:MAX: the same restart count, a
    # new world size) reads no device of the last attempt.  (A store of make_store's lives as long as its run.)
    attempt = "/".join(env.get(name, "") for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                                                      "WORLD_SIZE"))
    keys = [f"prefetchd-train/device/{attempt}/{rank}" for rank in range(ranks.world_size)]
    store.set(keys[ranks.rank], str(device))
    try:
        came = _wait(store, keys, timeout, lambda missing: _not_started(ranks.rank, missing, timeout))
        missing = "" if came else ", ".join(f"rank {rank}" for rank, key in enumerate(keys) if not store.check([key]))
    except dist.DistError as exc:  # the store's server gone (DistNetworkError): rank 0, serving make_store's
        raise SetupError(  # store, failed or ran out first
            f"rank {ranks.rank} lost the ranks' store while it waited for every rank's device before making the "
            f"process group ({_told(exc)}); its server is rank 0's (launched without torchrun) or torchrun's agent's "
            "on rank 0's box, whose output says why it left"
        ) from None
    if not came:
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
            _wait(store, read, _READ_WAIT)
        raise SetupError(differs_between_ranks(
            "the device", [f"{theirs} ({backend_for(theirs)})" for theirs in every],
            "gloo and nccl ranks cannot form one process group (--device auto is cuda only on a box with a GPU): "
            "give every box the same --device, e.g. --device cpu, or a GPU to every rank"))


__all__ = ["agent_store_serves", "agree_on_backend", "backend_for", "differs_between_ranks", "make_store"]
