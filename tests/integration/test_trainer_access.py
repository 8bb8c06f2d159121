"""A trainer that may read a real daemon's buffer but not write its progress file there, run as user nobody
(``as_nobody``): it read the batches the daemon had built, never told the daemon, which deleted none and built
no more, and waited 30 s (or finished, exit 0, where the buffer held the whole run).  Now BufferLoader and
prefetchd-train stop at once, saying whose the folder is and what to do (exit 4); a write refused mid-run is
said with the same words, and as the loader closes; refused past the grace, it is a NoAccess too (AccessLost: it
was a LoaderError, and prefetchd-train exited 3), after the last step's checkpoint; a lock file it may not open is
said with whose it is."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from prefetchd.buffer_protocol import Progress, list_batches
from prefetchd.trainer import BufferLoader, progress_file
from prefetchd.trainer.checkpoint import load_checkpoint
from prefetchd.trainer.train import EXIT_BUFFER, EXIT_NO_ACCESS, main
from tests.as_nobody import NOBODY, as_nobody

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="plays the daemon's user and another one, nobody")

ARGS = ["--batch-size", "8", "--image-size", "32", "--workers", "1", "--seed", "7", "--epochs", "2",
        "--high-water", "3", "--low-water", "1"]


def _buffer_of(shm_dir: Path, group_access: bool) -> Path:
    """A buffer folder of root's, in nobody's group (``group_access``) or in root's."""
    os.chmod(shm_dir, 0o755)
    buffer = shm_dir / "bf"
    buffer.mkdir()
    os.chown(buffer, 0, NOBODY if group_access else 0)
    os.chmod(buffer, 0o2770 if group_access else 0o755)  # a daemon without --group-access keeps 0755, with a warning
    return buffer


def _warm_up(shm_dir: Path) -> None:
    """What a run imports, imported before the fork (``as_nobody``): no daemon serves this buffer."""
    warm = CliRunner().invoke(main, ["--buffer", str(shm_dir / "none"), "--timeout", "0.1", "--device", "cpu"])
    assert warm.exit_code == EXIT_BUFFER, warm.output


def _logged(work: Callable[[], object]) -> dict[str, object]:
    """``work``'s result (or error) and the warnings logged meanwhile, for a forked child to hand back."""
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("prefetchd").addHandler(handler)
    try:
        result = {"result": work()}
    except Exception as exc:
        result = {"error": type(exc).__name__, "message": " ".join(str(exc).split())}
    finally:
        logging.getLogger("prefetchd").removeHandler(handler)
    return {**result, "warnings": said}


@pytest.mark.parametrize("group_access", [True, False], ids=["group-lost-write", "others-world-readable"])
def test_a_trainer_that_may_read_the_buffer_but_not_write_it_stops_at_once(
        shapes_data: Path, shm_dir: Path, start_daemon, group_access: bool) -> None:
    """A --group-access buffer whose group lost its write bit (nobody is in that group), and the buffer of another
    user that every user may read (nobody is not in its group): the loader is refused when it is made, and
    prefetchd-train before its first step with exit 4, naming the folder, whose it is and what to do."""
    buffer = _buffer_of(shm_dir, group_access)
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *ARGS, *(["--group-access"] if group_access else []))
    daemon.wait_until(lambda: len(list_batches(buffer)) == 3, 60, "the high-water mark")
    if group_access:
        os.chmod(buffer, 0o2750)
    _warm_up(shm_dir)

    def as_reader() -> str:
        start = time.monotonic()
        loader = _logged(lambda: BufferLoader(buffer, timeout=10).close())
        made = time.monotonic() - start
        run = CliRunner().invoke(main, ["--buffer", str(buffer), "--timeout", "10", "--device", "cpu", "--threads", "1"])
        return json.dumps({"loader": loader, "made_in": made, "code": run.exit_code, "stderr": run.stderr,
                           "trained_in": time.monotonic() - start - made})

    said = json.loads(as_nobody(as_reader) or "{}")
    mode, group = ("2750", "nogroup") if group_access else ("0755", "root")
    whose = (f"{buffer}: permission denied: it belongs to root (uid 0) and group {group} (mode {mode}): its group may "
             "not write it either; ask root (uid 0) for access")
    why = (f"cannot write progress.json in {buffer}: a trainer reading it tells the daemon there which batches it has "
           f"consumed, without which the daemon deletes none and builds no further than its high-water mark: {whose}")
    assert said["loader"] == {"error": "NoAccess", "message": why, "warnings": []}, said
    assert said["made_in"] < 5, said
    assert said["code"] == EXIT_NO_ACCESS == 4, said
    assert " ".join(said["stderr"].split()) == f"prefetchd-train: {why}", said
    assert said["trained_in"] < 10, said
    assert not (buffer / "progress.json").exists() and not (buffer / "progress.json.lock").exists()
    assert sorted(list_batches(buffer)) == [(0, 0), (0, 1), (0, 2)]  # the daemon was told nothing, deleted nothing


def test_a_loader_that_may_not_read_the_buffer_says_whose_it_is(shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """A --group-access buffer of a group the trainer's user is not in: BufferLoader read the manifest first and
    raised ProtocolError, "cannot open a manifest document (Permission denied)" (a review walking it as another
    user), where README promises NoAccess in the words of `prefetchd status` (prefetchd-train checked first)."""
    buffer = _buffer_of(shm_dir, group_access=False)
    os.chmod(buffer, 0o700)
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *ARGS, "--group-access")
    daemon.wait_until(lambda: len(list_batches(buffer)) == 3, 60, "the high-water mark")
    _warm_up(shm_dir)
    said = json.loads(as_nobody(lambda: json.dumps(_logged(lambda: BufferLoader(buffer, timeout=10).close()))) or "{}")
    assert said["error"] == "NoAccess", said
    assert said["message"].startswith(f"cannot read {buffer}: {buffer}: permission denied: it belongs to root (uid 0) "
                                      "and group root (mode 2770)"), said


def _take_group_write_at_step_1(buffer: Path) -> subprocess.Popen[bytes]:
    """A process of root's that takes the group's write bit off ``buffer`` once its trainer has written step 1 or
    later (nobody cannot): a trainer that does not wait for it may be past step 1 at the watcher's look."""
    return subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "from prefetchd.buffer_protocol import Progress\n"
        "buffer = sys.argv[1]\n"
        "def at(): p = Progress.read(buffer); return (p.epoch, p.step) if p is not None else (0, 0)\n"
        "while at() < (0, 1): time.sleep(0.01)\n"
        "os.chmod(buffer, 0o2750)\n"), str(buffer)], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_write_access_lost_mid_run_is_said_with_whose_the_folder_is_and_again_as_the_loader_closes(
        shapes_data: Path, shm_dir: Path, start_daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """The group's write bit removed while nobody's loader reads: the writes are retried for the grace (a
    permission put back in time lets it go on), said with whose the folder is, then an error with those words;
    closing, the loader says where the daemon still thinks it is."""
    monkeypatch.setattr(progress_file, "PROGRESS_WRITE_GRACE", 2.0)  # the child, forked, has it too
    buffer = _buffer_of(shm_dir, group_access=True)
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *ARGS, "--group-access")
    daemon.wait_until(lambda: len(list_batches(buffer)) == 3, 60, "the high-water mark")
    _warm_up(shm_dir)
    watcher = _take_group_write_at_step_1(buffer)

    def as_reader() -> str:
        def read() -> int:
            loader = BufferLoader(buffer, normalize=False, timeout=30)
            try:
                it = iter(loader)
                next(it), next(it)  # progress names step 1
                while os.stat(buffer).st_mode & 0o020:
                    time.sleep(0.01)
                return sum(1 for _ in it)
            finally:
                loader.close()
        return json.dumps(_logged(read))

    try:
        said = json.loads(as_nobody(as_reader) or "{}")
        assert watcher.wait(10) == 0
    finally:
        watcher.kill()
    path = buffer / "progress.json"
    whose = (f"{buffer}: permission denied: it belongs to root (uid 0) and group nogroup (mode 2750): its group may "
             "not write it either; ask root (uid 0) for access")
    assert said["error"] == "AccessLost", said  # a NoAccess, as at the start
    assert said["message"] == (f"{path}: cannot write it (Permission denied) for 2 s, so the daemon still goes by "
                               "epoch 0 step 1, the last position this loader wrote (it deletes no batch from there "
                               f"on and builds no further than its high-water mark): {whose}; then resume from the "
                               "last checkpoint"), said
    warnings = said["warnings"]
    assert warnings[0].startswith(f"cannot write {path} (Permission denied); the loader goes on with the batches"), said
    assert warnings[0].endswith(f"it stops with an error; {whose}"), said
    assert re.fullmatch(re.escape(f"closing {buffer}: {path}: cannot write it (Permission denied, for ") + r"[234]" +
                        re.escape(" s) as the loader closes, so the daemon was not told where this trainer stopped nor "
                                  "that it left: it goes by epoch 0 step 1, the last position this loader wrote; "
                                  f"{whose}"), warnings[-1]), said
    assert Progress.read(buffer) == Progress(0, 1)


def test_prefetchd_train_that_loses_write_access_mid_run_exits_4_with_its_checkpoint_saved(
        shapes_data: Path, shm_dir: Path, start_daemon, monkeypatch: pytest.MonkeyPatch) -> None:
    """The group's write bit removed while nobody's prefetchd-train runs: once the writes have failed for the
    grace it stops with exit 4 (NoAccess, as one refused at the start; it was 3, a buffer error), saying which
    position the daemon still goes by, which the progress file keeps, and whose the folder is; the last step's
    checkpoint is saved first."""
    monkeypatch.setattr(progress_file, "PROGRESS_WRITE_GRACE", 2.0)  # the child, forked, has it too
    buffer = _buffer_of(shm_dir, group_access=True)
    checkpoints = shm_dir / "ckpt"
    checkpoints.mkdir()
    os.chown(checkpoints, NOBODY, NOBODY)
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *ARGS, "--group-access")
    daemon.wait_until(lambda: len(list_batches(buffer)) == 3, 60, "the high-water mark")
    _warm_up(shm_dir)
    watcher = _take_group_write_at_step_1(buffer)

    def as_trainer() -> str:
        run = CliRunner().invoke(main, ["--buffer", str(buffer), "--timeout", "30", "--device", "cpu", "--threads",
                                        "1", "--checkpoint-dir", str(checkpoints), "--quiet"])
        return json.dumps({"code": run.exit_code, "stdout": run.stdout, "stderr": run.stderr})

    try:
        said = json.loads(as_nobody(as_trainer) or "{}")
        assert watcher.wait(10) == 0
    finally:
        watcher.kill()
    stderr = " ".join(said["stderr"].split())
    assert said["code"] == EXIT_NO_ACCESS == 4, said
    written = Progress.read(buffer)
    assert written is not None and written.epoch == 0 and written.step >= 1, said
    whose = (f"{buffer}: permission denied: it belongs to root (uid 0) and group nogroup (mode 2750): its group may "
             "not write it either; ask root (uid 0) for access")
    assert stderr.endswith(
        f"prefetchd-train: {buffer / 'progress.json'}: cannot write it (Permission denied) for 2 s, so the daemon "
        f"still goes by epoch 0 step {written.step}, the last position this loader wrote (it deletes no batch from "
        f"there on and builds no further than its high-water mark): {whose}; then resume from the last checkpoint"), \
        said
    saved = re.search(r"saved a checkpoint of global step (\d+) before stopping on the error below", said["stdout"])
    assert saved is not None, said
    checkpoint = load_checkpoint(checkpoints / "last.pt")
    trained = int(saved[1])
    assert trained >= written.step and checkpoint["global_step"] == trained, said
    assert checkpoint["loaders"]["train"]["step"] == trained, said  # resumed, it asks for the batch after the last
    assert sorted(list_batches(buffer))[0] == (0, written.step)  # the daemon kept what it was told was not consumed


def test_a_lock_file_the_trainer_may_not_open_is_said_with_whose_it_is_and_the_run_goes_on(
        shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """progress.json.lock left 0600 by another user's older trainer (a umask of 077) in a --group-access buffer: the
    loader cannot lock it, warns naming its owner and what to do, and reads the whole job, which the daemon
    deletes behind it and ends: the folder is writable, so the progress is written."""
    buffer = _buffer_of(shm_dir, group_access=True)
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *ARGS, "--group-access")
    daemon.wait_until(lambda: len(list_batches(buffer)) == 3, 60, "the high-water mark")
    # Once the daemon runs: root's, it gives its group read on its own files that lack it when it starts.
    lock = buffer / "progress.json.lock"
    lock.touch(0o600)
    _warm_up(shm_dir)

    def as_reader() -> str:
        def read() -> int:
            with BufferLoader(buffer, normalize=False, timeout=30) as loader:
                return sum(1 for _ in loader) + sum(1 for _ in loader)
        return json.dumps(_logged(read))

    said = json.loads(as_nobody(as_reader) or "{}")
    assert said["result"] == 18, said  # 72 images, 8 a batch, 2 epochs
    assert said["warnings"] == [
        f"{lock}: cannot lock it (Permission denied): it belongs to root (uid 0) and has mode 0600 (a trainer of an "
        "older prefetchd, under a umask that takes the group's bits, makes it so). Remove it while no trainer reads "
        f"as the default consumer (`rm {lock}`), and update that user's prefetchd; another trainer reading {buffer} "
        "as the default consumer is noticed only by its writes"], said
    assert Progress.read(buffer) == Progress(2, 0)
    daemon.wait_until(lambda: not list_batches(buffer), 30, "the consumed batches to be deleted")
