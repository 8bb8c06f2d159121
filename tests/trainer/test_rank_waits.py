"""The trainer's own collectives (the agreement before each step, the epoch's sums, the checkpoint's gather) run
on a gloo group of their own with a long timeout (``RANK_WAIT_TIMEOUT``): a rank may wait there as long as another
rank's daemon waits for its storage, which the loader allows past its timeout.  They ran on the default group,
whose timeout (torch's 30 minutes) ended the run saying a rank had left.  Two real ranks on loopback, their
default group's timeout cut to 2 s."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

SCRIPT = r"""
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from prefetchd.trainer.collective import Collective
from prefetchd.trainer.ranks import Ranks
# The caller's own process group, with a default timeout far shorter than the other rank's wait below.
dist.init_process_group("gloo", timeout=timedelta(seconds=float(sys.argv[1])))
coll = Collective.start(Ranks.from_env(), torch.device("cpu"))
if dist.get_rank() == 1:
    time.sleep(float(sys.argv[2]))  # as a rank whose daemon waits for its storage, its batch not there yet
started = time.monotonic()
stop = coll.agree_to_stop(False, lambda: False)
print(f"agreed {stop} after {time.monotonic() - started:.1f} s", flush=True)
coll.close()
"""


def test_a_rank_waits_for_another_past_the_process_groups_timeout() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    timeout, late = 2.0, 6.0
    ranks = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(timeout), str(late)],
                              env={**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                   "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        done = [proc.communicate(timeout=120) for proc in ranks]
    finally:
        for proc in ranks:
            proc.kill()
    for rank, (proc, (out, err)) in enumerate(zip(ranks, done)):
        assert proc.returncode == 0 and "agreed False" in out, f"rank {rank}: {out}{err[-3000:]}"
    waited = float(done[0][0].split(" after ")[1].split(" s")[0])
    assert waited > timeout, "rank 0 waited in the agreement for rank 1, longer than the group's timeout"
