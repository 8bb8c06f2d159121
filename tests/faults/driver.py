"""The fault suite's trainer: a real process that consumes the buffer as a training loop would.

For every batch it appends one JSON line to the log (and fsyncs it), "trains"
for ``--step-seconds``, then atomically replaces its checkpoint (the loader's
``state_dict()``).  A SIGKILLed driver restarted with the same arguments resumes
from the checkpoint.

Commit semantics, which the harness relies on:

- A log line for position ``q`` (``epoch * steps + step``) is written *before*
  the checkpoint that moves past ``q``.  Each run starts by logging a ``start``
  event with the position its checkpoint names.
- A line of run ``i`` is *committed* when its position is below the start
  position of run ``i + 1`` (or run ``i`` is the last one); lines at or past it
  were received again by run ``i + 1`` and are *replays*, expected after a
  crash.  Replays must still be bit-identical to the fault-free run; any other
  repetition is a real duplicate.

A daemon that stops beating for ``--daemon-timeout`` seconds makes the loader
raise ``DaemonStuck``; the driver logs a ``daemon_stuck`` event with the pid the
buffer's lock names and waits on (the harness kills or continues that daemon, as
``prefetchd-train --spawn-daemon`` would restart it).

A batch that fails the protocol's checks (``ProtocolError``) is logged as a
``protocol_error`` event, deleted as the error message says to, and waited for
again: the daemon rebuilds missing batches.  After ``MAX_BAD_REPEATS`` bad
copies of the same batch the driver gives up with the error (a crash loop would
be a failure the harness reports).

With ``--consumer NAME`` it reads the buffer as a named consumer (SPEC rule 9,
``progress.NAME.json``) beside the trainer, joining where the others are; with
``--batches N`` it stops, closing its loader, N positions after where its first
run began (the end is kept in the checkpoint, so a resumed run stops there too).
A run without a checkpoint writes one before its first batch: a consumer killed
during that batch resumes where it joined, not where the others are by then.

Each line holds the sha256 of the batch's image bytes (HWC, as in the file) and
labels, plus a short hash per image so that a sample replaced under the
bad-sample policy can be told apart from a wrong batch.

Once the file ``--sprint`` names exists the driver stops "training": the harness
touches it after its last fault, and the rest of the job is read as fast as the
daemon makes it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from prefetchd.buffer_protocol import ProtocolError, batch_name, daemon_pid
from prefetchd.trainer import BufferLoader
from prefetchd.trainer.errors import DaemonStuck

MAX_BAD_REPEATS = 20


class Log:
    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        # One write per line: whole lines even when SIGKILL lands mid-step.
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
        os.fsync(self._fd)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def record(batch: Any, run: int) -> dict[str, Any]:
    images = batch.images.permute(0, 2, 3, 1).contiguous().numpy()  # the file's HWC bytes
    labels = batch.labels.numpy().astype("<i8")
    digest = hashlib.sha256(images.tobytes())
    digest.update(labels.tobytes())
    return {
        "run": run, "epoch": batch.epoch, "step": batch.step, "t": time.time(),
        "indices": batch.indices.tolist(), "labels": labels.tolist(), "replaced": batch.replaced,
        "sha": digest.hexdigest(),
        "slots": [hashlib.sha256(im.tobytes()).hexdigest()[:16] for im in images],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--buffer", type=Path, required=True)
    p.add_argument("--log", type=Path, required=True)
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--run", type=int, default=0)
    p.add_argument("--step-seconds", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--daemon-timeout", type=float, default=60.0, help="the loader's stall_timeout")
    p.add_argument("--consumer", help="read as this named consumer (progress.NAME.json); default: the trainer")
    p.add_argument("--batches", type=int, help="stop this many positions after the first run's start")
    p.add_argument("--go", type=Path, help="start only once this file exists (a spare, its imports done)")
    p.add_argument("--sprint", type=Path, help="no --step-seconds once this file exists (the faults are over)")
    args = p.parse_args(argv)
    while args.go is not None and not args.go.exists():
        time.sleep(0.005)

    log = Log(args.log)
    loader = BufferLoader(args.buffer, normalize=False, timeout=args.timeout, daemon_grace=args.timeout,
                          stall_timeout=args.daemon_timeout, consumer=args.consumer)
    epochs = loader.manifest.epochs
    if epochs is None:
        raise SystemExit("the fault suite runs a job with --epochs")
    steps = loader.manifest.steps_per_epoch
    count = 0
    end: int | None = None  # the position to stop at (--batches), else the job's end
    if args.checkpoint.exists():
        state = json.loads(args.checkpoint.read_text())
        loader.load_state_dict(state["loader"])
        count, end = state["count"], state.get("end")
    else:
        if args.batches is not None:
            end = loader.position[0] * steps + loader.position[1] + args.batches
        save_checkpoint(args.checkpoint, {"loader": loader.state_dict(), "count": count, "end": end})

    def more() -> bool:
        epoch, step = loader.position
        return epoch < epochs and (end is None or epoch * steps + step < end)

    epoch, step = loader.position
    log.write({"event": "start", "run": args.run, "pid": os.getpid(), "epoch": epoch, "step": step, "t": time.time()})
    bad: dict[tuple[int, int], int] = {}
    while more():
        try:
            for batch in loader:
                log.write(record(batch, args.run))
                if args.step_seconds and not (args.sprint is not None and args.sprint.exists()):
                    time.sleep(args.step_seconds)
                count += 1
                save_checkpoint(args.checkpoint, {"loader": loader.state_dict(), "count": count, "end": end})
                if not more():
                    break
        except DaemonStuck as exc:
            key = loader.position
            log.write({"event": "daemon_stuck", "run": args.run, "pid": daemon_pid(args.buffer), "epoch": key[0],
                       "step": key[1], "t": time.time(), "error": str(exc)[:300]})
            time.sleep(0.2)  # the same daemon is asked again; its answer changes only once someone acts
        except ProtocolError as exc:
            key = loader.position
            bad[key] = bad.get(key, 0) + 1
            log.write({"event": "protocol_error", "run": args.run, "epoch": key[0], "step": key[1],
                       "t": time.time(), "error": str(exc)[:300]})
            if bad[key] >= MAX_BAD_REPEATS:
                raise
            # What the message says to do: delete it, the daemon builds it again.
            (args.buffer / batch_name(*key)).unlink(missing_ok=True)
    loader.close()
    log.write({"event": "done", "run": args.run, "count": count, "t": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
