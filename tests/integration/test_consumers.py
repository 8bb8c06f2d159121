"""Several trainers on one daemon (issue 15), with real processes: three consumers at different
speeds over two epochs each get every batch exactly once and the same batches; one SIGKILLed
mid-epoch and resumed from its checkpoint gets exactly the batches it missed; one that stops
(SIGSTOP: alive, silent) stops holding batches after --consumer-timeout; and the batch files
never exceed --max-buffer-bytes."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torchvision.datasets import ImageFolder

from prefetchd.buffer_protocol import BatchLayout, Progress, State, batch_name, list_batches, read_status, stream_dir
from prefetchd.trainer import Batch, BufferLoader
from tests.waiting import wait_for

EPOCHS, BATCH, SIZE, HIGH, CAP = 2, 8, 32, 4, 6
TIMEOUT = 5.0  # --consumer-timeout: above the loader's 2 s refresh while it waits
ARGS = ["--batch-size", str(BATCH), "--image-size", str(SIZE), "--workers", "1", "--seed", "7",
        "--epochs", str(EPOCHS), "--high-water", str(HIGH), "--low-water", "2",
        "--max-buffer-bytes", str(CAP * BatchLayout.plan(BATCH, SIZE, SIZE).file_len),
        "--consumer-timeout", str(TIMEOUT)]

# A trainer in its own process: logs every batch it takes (one write per line, whole even under
# SIGKILL) and checkpoints after each, as a real one would every N steps.
CONSUMER = r'''
import hashlib, json, os, sys, time
from pathlib import Path
import torch
from prefetchd.trainer import BufferLoader
from prefetchd.trainer.checkpoint import save_checkpoint

buffer, name, ckpt, log, pause = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), float(sys.argv[5])
loader = BufferLoader(buffer, normalize=False, timeout=60, daemon_grace=60, consumer=name, start=(0, 0))
fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
while loader.position[0] < 2:
    for b in loader:
        images = b.images.permute(0, 2, 3, 1).contiguous().numpy()
        rec = {"epoch": b.epoch, "step": b.step, "indices": b.indices.tolist(),
               "sha256": hashlib.sha256(images.tobytes()).hexdigest()}
        save_checkpoint(ckpt, {"loader": loader.state_dict()})
        os.write(fd, (json.dumps(rec) + "\n").encode())
        time.sleep(pause)
loader.close()
'''


def record(b: Batch) -> dict[str, Any]:
    images = b.images.permute(0, 2, 3, 1).contiguous().numpy()
    return {"epoch": b.epoch, "step": b.step, "indices": b.indices.tolist(),
            "sha256": hashlib.sha256(images.tobytes()).hexdigest()}


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def consume(loader: BufferLoader, out: list[dict[str, Any]], pause: float) -> None:
    with loader:
        while loader.position[0] < EPOCHS:
            for b in loader:
                out.append(record(b))
                time.sleep(pause)


def consumer_status(buffer: Path, name: str) -> Any:
    status = read_status(buffer)
    if status is None or status.production is None:
        return None
    return next((c for c in status.production.streams[0].consumers if c.name == name), None)



def test_three_consumers_one_killed_one_silent_share_one_capped_buffer(
    shapes_data: Path, shm_dir: Path, start_daemon: Any, tmp_path: Path
) -> None:
    data = shapes_data / "train"
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", data, *ARGS)
    steps = -(-len(ImageFolder(str(data)).samples) // BATCH)
    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER)

    def spawn(name: str, pause: float) -> tuple[subprocess.Popen[bytes], Path, Path]:
        ckpt, log = tmp_path / f"{name}.pt", tmp_path / f"{name}.log"
        argv = [str(script), str(buffer), name, str(ckpt), str(log), str(pause)]
        return subprocess.Popen([sys.executable, *argv]), ckpt, log

    # Two subprocesses (they can be killed and stopped) and two threads of this process.  The threads start
    # once "killed" is mid-epoch, and it is killed after their first batch: the slow one (0.8 s a batch) is still
    # reading when its death is noticed, however slowly "killed" got there (a CI run's checkpoint writes beside
    # other tests': the slow thread had read everything by then, and the killed consumer, with no other live one
    # left, held its window again, as a single trainer that went away does).
    killed, killed_ckpt, killed_log = spawn("killed", 0.3)
    silent, _, silent_log = spawn("silent", 0.2)
    most_files = [0]
    stop = threading.Event()

    def watch_files() -> None:  # the cap, as the tmpfs sees it
        while not stop.is_set():
            most_files[0] = max(most_files[0], len(list_batches(buffer)))
            time.sleep(0.003)

    watcher = threading.Thread(target=watch_files, daemon=True)
    watcher.start()
    results: dict[str, list[dict[str, Any]]] = {"fast": [], "slow": [], "resumed": []}
    errors: list[BaseException] = []

    def run(name: str, pause: float, loader_factory: Any) -> threading.Thread:
        def body() -> None:
            try:
                consume(loader_factory(), results[name], pause)
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)
        thread = threading.Thread(target=body)
        thread.start()
        return thread

    try:
        wait_for(lambda: (buffer / "manifest.json").exists(), 60, "the manifest")
        wait_for(lambda: len(read_log(silent_log)) >= 3 and len(read_log(killed_log)) >= 1, 60, "the subprocess consumers")
        # "silent" stops: its pid stays alive, its progress file goes stale.
        silent.send_signal(signal.SIGSTOP)
        stopped = Progress.read(buffer, "silent")
        assert stopped is not None
        wait_for(lambda: len(read_log(killed_log)) >= steps // 2, 60, "the killed consumer's mid-epoch")
        fast = run("fast", 0.0, lambda: BufferLoader(buffer, normalize=False, timeout=60, consumer="fast", start=(0, 0)))
        slow = run("slow", 0.8, lambda: BufferLoader(buffer, normalize=False, timeout=60, consumer="slow", start=(0, 0)))
        wait_for(lambda: results["slow"] and results["fast"], 60, "the threads' first batches")
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        # Its pid is gone: it stops holding batches at once, while the slow consumer reads on.
        wait_for(lambda: (c := consumer_status(buffer, "killed")) is not None and c.trainer.alive is False
             and not c.holding, 30, "the killed consumer to count as gone")
        state = torch.load(killed_ckpt, weights_only=True)["loader"]
        resumed_loader = BufferLoader(buffer, normalize=False, timeout=60, consumer="killed")
        resumed_loader.load_state_dict(state)
        resumed_at = (state["epoch"], state["step"])
        resumed = run("resumed", 0.02, lambda: resumed_loader)

        wait_for(lambda: (c := consumer_status(buffer, "silent")) is not None and not c.holding, 3 * TIMEOUT + 10,
             "the silent consumer to stop holding batches")
        c = consumer_status(buffer, "silent")
        assert c.trainer.alive is True and c.window == 0, c  # alive, yet silent past the timeout
        # Its next batch goes once the others have passed it, although it never consumed it.
        gone = buffer / batch_name(stopped.epoch, stopped.step)
        wait_for(lambda: not gone.exists(), 60, f"{gone.name}, held by nobody, to be deleted")
        for thread in (fast, slow, resumed):
            thread.join(90)
            assert not thread.is_alive()
        assert not errors, errors
        assert daemon.wait_exit(30) == 0, "the daemon ends once every live consumer consumed both epochs"
    finally:
        stop.set()
        for proc in (killed, silent):
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    every = [(e, s) for e in range(EPOCHS) for s in range(steps)]
    reference = results["fast"]
    assert [(r["epoch"], r["step"]) for r in reference] == every, "each batch exactly once, in order"
    assert results["slow"] == reference, "a slower consumer gets the same batches, bit for bit"
    before_kill = read_log(killed_log)
    position = every.index(resumed_at)
    assert before_kill[:position] == reference[:position]
    assert results["resumed"] == reference[position:], "the resumed consumer gets exactly what it missed"
    assert len(before_kill) >= position  # the batches after its checkpoint were logged and taken again
    assert read_log(silent_log) == reference[: len(read_log(silent_log))]
    assert 0 < most_files[0] <= CAP, f"{most_files[0]} batch files at once, cap {CAP}"
    log = daemon.log
    assert "'silent'" in log and "--consumer-timeout" in log
    assert "consumer 'killed' (pid" in log and "has gone away" in log and "consumer 'killed' is back" in log


def test_each_rank_of_a_multi_rank_job_serves_its_own_consumers(
    shapes_data: Path, shm_dir: Path, start_daemon: Any
) -> None:
    """Two ranks, two consumers each (threads here): every consumer of a rank gets that rank's
    batches once, the same as its sibling, and the ranks' batches differ."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", "--batch-size", "8", "--image-size", "16",
                          "--workers", "1", "--epochs", "1", "--high-water", "3", "--low-water", "1",
                          "--world-size", "2")
    results: dict[tuple[int, str], list[dict[str, Any]]] = {}
    errors: list[BaseException] = []

    def body(rank: int, name: str, pause: float) -> None:
        try:
            loader = BufferLoader(stream_dir(buffer, rank, 2), normalize=False, timeout=60, consumer=name,
                                  start=(0, 0))
            got = results[(rank, name)] = []
            with loader:
                for b in loader:
                    got.append(record(b))
                    time.sleep(pause)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    wait_for(lambda: all((stream_dir(buffer, r, 2) / "manifest.json").exists() for r in range(2)), 60, "the manifests")
    threads = [threading.Thread(target=body, args=(rank, name, pause))
               for rank in range(2) for name, pause in (("a", 0.0), ("b", 0.05))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert daemon.wait_exit(30) == 0
    for rank in range(2):
        a, b = results[(rank, "a")], results[(rank, "b")]
        assert a == b and [r["step"] for r in a] == list(range(len(a))) and a
    assert results[(0, "a")][0]["indices"] != results[(1, "a")][0]["indices"], "the ranks read different samples"


def test_a_consumer_that_left_shows_its_process_gone_once_it_exits(shapes_data: Path, shm_dir: Path,
                                                                    start_daemon) -> None:
    """Its leaving is no news for the log, but the status and metrics must not keep calling a
    process alive that has exited."""
    buffer = shm_dir / "bf"
    start_daemon(buffer, "--data", shapes_data / "train", *ARGS)
    stayer = BufferLoader(buffer, normalize=False, timeout=60, consumer="stayer", start=(0, 0))
    next(iter(stayer))
    code = ("import sys; from prefetchd.trainer import BufferLoader\n"
            "loader = BufferLoader(sys.argv[1], normalize=False, timeout=60, consumer='leaver', start=(0, 0))\n"
            "batches = iter(loader); next(batches); next(batches); loader.close()\n")
    leaver = subprocess.run([sys.executable, "-c", code, str(buffer)], capture_output=True, text=True, timeout=120)
    assert leaver.returncode == 0, leaver.stderr
    try:
        wait_for(lambda: (c := consumer_status(buffer, "leaver")) is not None and c.closed and c.trainer.alive is False,
                 15, "the status to show the leaver's process gone")
    finally:
        stayer.close()


def test_a_flood_of_progress_files_leaves_the_status_readable_and_the_consumers_served(
        shapes_data: Path, shm_dir: Path, start_daemon: Any) -> None:
    """Any member of a --group-access buffer's group writes progress files: 20,000 planted ones made
    status.json 6.3 MB (its readers take 1 MiB: every trainer read the daemon as gone), each heartbeat
    3.5-4 s and the log 20,000 warnings.  The daemon takes its cap of consumers, keeps the one it had,
    and says the rest in one line."""
    import os
    import re

    from prefetchd.buffer_protocol.json_files import MAX_DOCUMENT_LEN
    from prefetchd.buffer_protocol.layout import STATUS_NAME
    from prefetchd.daemon.stream import MAX_CONSUMERS

    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *ARGS)
    with BufferLoader(buffer, normalize=False, timeout=60, consumer="early", start=(0, 0)) as loader:
        batches = iter(loader)
        next(batches)
        planted = 20_000
        doc = json.dumps({"format": "prefetchd.progress", "version": 1, "epoch": 0, "step": 0, "pid": os.getpid(),
                          "time": time.time()})
        for i in range(planted):  # names that sort before "early"
            (buffer / f"progress.c{i:05d}.json").write_text(doc)
        ignored = planted - (MAX_CONSUMERS - 2)  # the default consumer and "early" are known
        said = f"{ignored} progress files in {buffer} ignored"

        def ignored_said() -> bool:
            status = read_status(buffer)
            return status is not None and status.production is not None and said in status.production.errors.progress_file

        daemon.wait_until(ignored_said, 20, "the status to say the progress files left alone")
        assert (buffer / STATUS_NAME).stat().st_size < MAX_DOCUMENT_LEN // 10
        assert consumer_status(buffer, "early") is not None
        for _ in range(3):
            next(batches)  # still served
        for _ in range(4):  # the heartbeat keeps its pace (STATUS_SECONDS = 1)
            time.sleep(0.5)
            status = read_status(buffer)
            assert status is not None and time.time() - status.heartbeat < 3.0, status
    assert len(re.findall(r"ignoring \d+ progress files in", daemon.log)) == 1, daemon.log[-3000:]


def test_a_crashed_consumer_resumes_on_the_daemon_restarted_after_the_others_finished(
        shapes_data: Path, shm_dir: Path, start_daemon: Any, tmp_path: Path) -> None:
    """README, "Several trainers": a trainer of a sweep that crashed and resumes after the others finished finds
    no daemon, and the same `prefetchd start` line serves it from its progress.  That daemon said "nothing to
    produce" and exited: the crashed trainer's progress, written before it started, was older than
    --consumer-timeout, so the trainer counted as silent, one not waited for, and the others were done."""
    data, buffer = shapes_data / "train", shm_dir / "bf"
    args = ["--data", data, "--batch-size", str(BATCH), "--image-size", str(SIZE), "--workers", "1", "--seed", "7",
            "--epochs", "1", "--high-water", str(HIGH), "--consumer-timeout", str(TIMEOUT)]
    daemon = start_daemon(buffer, *args)
    steps = -(-len(ImageFolder(str(data)).samples) // BATCH)
    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER)
    ckpt, crashed_log = tmp_path / "crashed.pt", tmp_path / "crashed.log"
    crashed = subprocess.Popen([sys.executable, str(script), str(buffer), "crashed", str(ckpt), str(crashed_log), "0.5"])
    try:
        wait_for(lambda: len(read_log(crashed_log)) >= 2, 60, "the consumer that crashes to read 2 batches")
        crashed.kill()
        crashed.wait(10)
    finally:
        if crashed.poll() is None:
            crashed.kill()
            crashed.wait()
    with BufferLoader(buffer, normalize=False, timeout=60, consumer="done", start=(0, 0)) as loader:
        done = [record(b) for b in loader]
    assert [(r["epoch"], r["step"]) for r in done] == [(0, s) for s in range(steps)]
    assert daemon.wait_exit(30) == 0, "the others done and the crashed one silent: the daemon finishes"
    time.sleep(TIMEOUT + 0.5)  # the crashed consumer's progress now older than --consumer-timeout, as after a while

    # The daemon first, as the README has it: it waits for the crashed consumer, rather than finding it silent.
    restarted = start_daemon(buffer, *args)
    restarted.wait_until(lambda: (st := read_status(buffer)) is not None and st.pid == restarted.proc.pid
                         and st.state in (State.FILLING, State.FULL), 30, "to produce for the crashed consumer")
    state = torch.load(ckpt, weights_only=True)["loader"]
    with BufferLoader(buffer, normalize=False, timeout=60, daemon_grace=10, consumer="crashed") as loader:
        loader.load_state_dict(state)
        resumed = [record(b) for b in loader]
    at = state["epoch"] * steps + state["step"]
    assert 0 < at < steps and resumed == done[at:], "the crashed consumer gets exactly the batches it missed"
    assert restarted.wait_exit(30) == 0, "and the daemon finishes once it has read them"
    assert "nothing to produce" not in restarted.log, restarted.log
