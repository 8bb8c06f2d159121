"""Ranks whose devices need different backends (gloo on a box without a GPU, nccl on one with) waited for each
other inside init_process_group until torch's timeout.  Before the group the ranks compare their devices through
the ranks' store (``agree_on_backend``), and every rank refuses at once, naming each rank's device.  Two real
ranks under torchrun (its agent serves the store), and two started by hand with MASTER_ADDR/MASTER_PORT as SLURM
scripts and mp.spawn start them (rank 0 serves it, ``make_store``); the devices are given to the exchange, as no
box here has a GPU to resolve one from."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import tests.torchrun

from prefetchd.trainer.collective import Collective
from prefetchd.trainer.errors import SetupError
from prefetchd.trainer.rank_store import agree_on_backend, make_store
from prefetchd.trainer.ranks import Ranks

SCRIPT = r"""
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from prefetchd.trainer.errors import SetupError
from prefetchd.trainer.rank_store import agree_on_backend
from prefetchd.trainer.ranks import Ranks
ranks = Ranks.from_env()
device = sys.argv[1].split(",")[ranks.rank]
if device == "absent":  # a rank that never comes to the exchange
    sys.exit(0)
started = time.monotonic()
try:
    agree_on_backend(ranks, torch.device(device), timeout=timedelta(seconds=float(sys.argv[2])))
except SetupError as exc:
    print(f"rank {ranks.rank} refused after {time.monotonic() - started:.1f} s: {exc}", flush=True)
    sys.exit(1)
dist.init_process_group("gloo", timeout=timedelta(seconds=30))  # the exchange's connection left none behind
dist.barrier()
print(f"rank {ranks.rank} agreed and joined the group", flush=True)
dist.destroy_process_group()
"""


def exchange(tmp_path: Path, devices: str, timeout: float = 60) -> str:
    """torchrun's output of two ranks exchanging ``devices`` (rank 0's, rank 1's); fails on a hang."""
    script = tmp_path / "exchange.py"
    script.write_text(SCRIPT)
    run = tests.torchrun.run(["--standalone", "--nproc-per-node", "2", script, devices, str(timeout)], 120)
    return run.stdout + run.stderr


def refusals(out: str) -> dict[int, tuple[float, str]]:
    return {int(rank): (float(seconds), message)
            for rank, seconds, message in re.findall(r"rank (\d) refused after ([\d.]+) s: (.*)", out)}


def test_ranks_on_cpu_and_cuda_both_refuse_at_once_naming_each_device(tmp_path: Path) -> None:
    out = exchange(tmp_path, "cpu,cuda:0")
    refused = refusals(out)
    assert sorted(refused) == [0, 1], out[-3000:]
    for seconds, message in refused.values():
        assert seconds < 10, "the exchange ends when both devices are known, not at a timeout"
        assert message.startswith("the device differs between ranks (rank 0: cpu (gloo), rank 1: cuda:0 (nccl)); ")
        assert "--device cpu" in message
    assert "joined the group" not in out


def test_ranks_on_one_device_type_agree_and_then_make_their_group(tmp_path: Path) -> None:
    out = exchange(tmp_path, "cpu,cpu")
    assert "rank 0 agreed and joined the group" in out and "rank 1 agreed and joined the group" in out, out[-3000:]
    assert not refusals(out)


def test_a_rank_that_never_says_its_device_is_named_after_the_timeout(tmp_path: Path) -> None:
    refused = refusals(exchange(tmp_path, "cpu,absent", timeout=2))
    assert list(refused) == [0]
    seconds, message = refused[0]
    assert 2 <= seconds < 10
    assert message == ("rank 0 waited 2 s for every rank's device before making the process group, and these "
                       "never said theirs: rank 1; the output of their boxes says why")


def test_without_torchruns_agent_store_and_a_store_given_nothing_is_exchanged() -> None:
    """MASTER_* set by hand and no store given: no agent serves one to ask (Collective.start makes one and
    passes it, below).  Here MASTER_PORT names no server: a rank that asked would fail to connect."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    rank_1 = Ranks(rank=1, world_size=2, local_world_size=1)
    agree_on_backend(rank_1, torch.device("cuda", 0), env, timeout=timedelta(seconds=1))
    # The same rank under torchrun's agent store does ask.
    with pytest.raises(SetupError, match=r"^rank 1 could not reach torchrun's agent's store at MASTER_ADDR:MASTER_PORT "
                                         r"127\.0\.0\.1:1 within 1 s \("):
        agree_on_backend(rank_1, torch.device("cuda", 0), {**env, "TORCHELASTIC_USE_AGENT_STORE": "True"},
                         timeout=timedelta(seconds=1))


HAND_LAUNCHED = r"""
import sys, time
import torch, torch.distributed as dist
from prefetchd.trainer.collective import Collective
from prefetchd.trainer.errors import SetupError
from prefetchd.trainer.ranks import Ranks
ranks = Ranks.from_env()
device = sys.argv[1].split(",")[ranks.rank]
started = time.monotonic()
try:
    coll = Collective.start(ranks, torch.device(device))
except SetupError as exc:
    print(f"rank {ranks.rank} refused after {time.monotonic() - started:.1f} s: {exc}", flush=True)
    sys.exit(1)
sums, _ = coll.reduce([ranks.rank + 1.0], [0.0])
word = coll.broadcast(f"from rank {ranks.rank}")
if ranks.rank == 1:  # through the default group's store, where ranks waiting for a batch look
    coll.announce_stop()
coll.barrier("after the announcement", 10)
print(f"rank {ranks.rank} joined {coll.backend}: sum {sums[0]:g}, {word}, stop announced {coll.stop_announced()}",
      flush=True)
coll.close()
"""


def hand_launched(tmp_path: Path, devices: str, timeout: float = 30) -> tuple[list[int], str]:
    """Two ranks started as SLURM scripts or mp.spawn start them: MASTER_*, RANK, WORLD_SIZE, LOCAL_RANK set by
    hand, no torchrun agent.  Their exit codes and output; past ``timeout`` seconds both are killed (a hang)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "hand_launched.py"
    script.write_text(HAND_LAUNCHED)
    env = {name: value for name, value in os.environ.items() if not name.startswith("TORCHELASTIC_")}
    procs = [subprocess.Popen([sys.executable, script, devices],
                              env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                                   "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    deadline = time.monotonic() + timeout
    try:
        outs = [proc.communicate(timeout=max(0.1, deadline - time.monotonic()))[0] for proc in procs]
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the hand-launched ranks did not finish within {timeout} s (a hang)") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return [proc.returncode for proc in procs], "".join(outs)


def test_hand_launched_ranks_on_cpu_and_cuda_both_refuse_at_once_naming_each_device(tmp_path: Path) -> None:
    """Without torchrun's agent rank 0 made the store inside init_process_group, the devices were not compared,
    and the CPU rank waited there for the nccl one until torch's 30 minutes.  The CUDA rank refuses before it
    touches CUDA (no box here has it), as it must on a box that has one, lest it set up a GPU to wait on."""
    codes, out = hand_launched(tmp_path, "cpu,cuda:0")
    refused = refusals(out)
    assert codes == [1, 1] and sorted(refused) == [0, 1], out[-3000:]
    for seconds, message in refused.values():
        assert seconds < 10, "the exchange ends when both devices are known, not at a timeout"
        assert message.startswith("the device differs between ranks (rank 0: cpu (gloo), rank 1: cuda:0 (nccl)); ")
    assert "joined" not in out


def test_hand_launched_ranks_on_the_cpu_form_a_gloo_group_in_rank_0s_store(tmp_path: Path) -> None:
    """The group is made in the store the devices were compared in (torch binds MASTER_PORT no second time),
    its collectives work, and a stop announced in the default group's store is seen by the other rank."""
    codes, out = hand_launched(tmp_path, "cpu,cpu")
    assert codes == [0, 0], out[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} joined gloo: sum 3, from rank 0, stop announced True" in out, out[-3000:]


def test_a_hand_launch_without_master_addr_or_port_says_which_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch said "Error initializing torch.distributed using env:// rendezvous: environment variable
    MASTER_ADDR expected, but not set", a ValueError that prefetchd-train showed as a traceback."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(SetupError, match=r"^RANK, WORLD_SIZE and LOCAL_RANK are set but MASTER_ADDR not: set "
                                         r"MASTER_ADDR to the address of rank 0's box"):
        Collective.start(Ranks(rank=1, world_size=2, local_world_size=1), torch.device("cpu"))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "http")
    with pytest.raises(SetupError, match=r"^MASTER_PORT='http' in the environment is not a port \(1-65535\)"):
        Collective.start(Ranks(rank=1, world_size=2, local_world_size=1), torch.device("cpu"))


def test_rank_0_on_a_port_another_process_holds_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch raised its DistNetworkError ("... EADDRINUSE ...") from inside init_process_group."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(SetupError) as refused:
            Collective.start(Ranks(rank=0, world_size=2, local_world_size=1), torch.device("cpu"))
    message = str(refused.value)
    assert message.startswith(f"rank 0 could not serve the ranks' store at MASTER_ADDR:MASTER_PORT 127.0.0.1:{port} (")
    assert "address already in use" in message and "pick another" in message


def test_a_rank_that_cannot_reach_rank_0s_store_names_the_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed: nothing serves it
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    with pytest.raises(SetupError, match=rf"^rank 1 could not reach the ranks' store at MASTER_ADDR:MASTER_PORT "
                                         rf"127\.0\.0\.1:{port} within 1 s \(.*\); rank 0 serves it"):
        make_store(Ranks(rank=1, world_size=2, local_world_size=1), env, timeout=timedelta(seconds=1))


def test_a_rank_whose_store_server_leaves_mid_wait_says_so_not_a_traceback() -> None:
    """Rank 0 serves make_store's store and may leave first (it failed, or ran out of waiting for a rank that
    never came): a rank still waiting got torch's DistNetworkError "Failed to recv" from the wait, and again from
    asking which ranks had said theirs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, torch.distributed as dist\n"
        f"store = dist.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False)\n"
        "print('serving', flush=True)\n"
        "sys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "serving\n"
        store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        assert server.stdin is not None
        server.stdin.close()  # rank 0 leaves now, while rank 1 waits below for rank 0's device
        started = time.monotonic()
        with pytest.raises(SetupError) as refused:
            agree_on_backend(Ranks(rank=1, world_size=2, local_world_size=1), torch.device("cpu"), {},
                             timeout=timedelta(seconds=30), store=store)
        assert time.monotonic() - started < 20, "told when the server left, not at the timeout"
    finally:
        server.kill()
        server.wait()
    assert str(refused.value).startswith("rank 1 lost the ranks' store while it waited for every rank's device ")
    assert "rank 0's box" in str(refused.value)


TRAINER = r"""
import os, sys
from prefetchd.trainer.train import main
# torchrun gives every rank one command line: the boxes' --device auto differing is played by the local rank.
device = sys.argv[2].split(",")[int(os.environ["LOCAL_RANK"])]
main(["--buffer", sys.argv[1], "--device", device, "--epochs", "1"])
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefetchd_train_on_a_gpu_rank_and_a_cpu_rank_refuses_on_both(tmp_path: Path) -> None:
    """The real mixture, on a box with a GPU: `prefetchd-train` with rank 0 on CUDA (nccl) and rank 1 on the
    CPU (gloo), which waited in init_process_group until torch's 30 minutes.  Both ranks exit 1 at once, naming
    each rank's device, before any buffer is looked at (there is none)."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    run = tests.torchrun.run(["--standalone", "--nproc-per-node", "2", script, tmp_path / "no-buffer", "cuda,cpu"], 180)
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    assert "the device differs between ranks (rank 0: cuda:0 (nccl), rank 1: cpu (gloo))" in out, out[-3000:]
    assert "exitcode  : 1" in out, out[-3000:]  # torchrun's summary: a SetupError's code (the other may be its SIGTERM)


def stopped_while_waiting(tmp_path: Path, rank: int, notice: str) -> tuple[int | None, float, str]:
    """`prefetchd-train` started by hand as ``rank`` of a world of 2 whose other rank never comes (rank 1's
    MASTER_PORT serves nothing): once it says ``notice`` (10 s into its wait: a minute is allowed, for a loaded
    machine's start), SIGTERM.  Its exit code (None: still
    running 5 s later, then killed), the seconds from the SIGTERM to its exit, and its output."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    port = held.getsockname()[1]
    if rank == 0:  # rank 0 serves the store there itself
        held.close()
    # Else kept bound, never listening: a connection there is refused, and no other process of a full run takes
    # the port meanwhile.  Freed at once, it was taken by another test's server once, which answered; rank 1's
    # TCPStore then timed out in its handshake and torch printed a C++ stack trace, which the test forbids.
    env = {name: value for name, value in os.environ.items() if not name.startswith("TORCHELASTIC_")}
    log = tmp_path / f"rank-{rank}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefetchd.trainer.train", "--buffer", str(tmp_path / "no-buffer"),
             "--device", "cpu", "--threads", "1", "--epochs", "1"],
            env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2",
                 "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"},
            stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while notice not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        termed = time.monotonic()
        try:
            code: int | None = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - termed, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        held.close()


def test_a_hand_launched_rank_0_waiting_for_a_rank_that_never_comes_stops_at_once_on_sigterm(tmp_path: Path) -> None:
    """It waited in TCPStore's wait, in C++, where Python's SIGTERM handler never ran: for up to 30 minutes,
    saying nothing.  Now it says, once, whom it waits for, and SIGTERM stops it as before training: 143."""
    code, seconds, out = stopped_while_waiting(tmp_path, 0, "rank 0 waits for rank 1 to start")
    assert code == 143, f"still running {seconds:.1f} s after SIGTERM: {out[-3000:]}"
    assert "stopped by SIGTERM before training began" in out, out[-3000:]
    assert ("rank 0 waits for rank 1 to start (it has not said its device after 10 s); it waits up to 1800 s in "
            "all") in out, out[-3000:]


def test_a_hand_launched_rank_1_whose_rank_0_never_serves_stops_at_once_on_sigterm(tmp_path: Path) -> None:
    """It connected to rank 0's store inside TCPStore, in C++, retrying for 30 minutes; a SIGTERM printed a
    C++ stack trace ("Interrupted system call") and it went on retrying."""
    code, seconds, out = stopped_while_waiting(tmp_path, 1, "rank 1 waits for rank 0 to serve the ranks' store")
    assert code == 143, f"still running {seconds:.1f} s after SIGTERM: {out[-3000:]}"
    assert "stopped by SIGTERM before training began" in out, out[-3000:]
    assert "frame #" not in out and "Exception raised from" not in out, out[-3000:]
    assert "rank 1 waits for rank 0 to serve the ranks' store at MASTER_ADDR:MASTER_PORT 127.0.0.1:" in out
