from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from prefetchd.buffer_protocol import (
    DaemonOwner, Manifest, Position, Progress, ProtocolError, RunningJob, State, Status, StorageWait, batch_name, daemon_owner,
    write_batch, write_status,
)
from prefetchd.trainer import (Batch, BufferLoader, DaemonGone, DaemonStuck, JobReplaced, LoaderError, LoaderTimeout,
                               StateMismatch)
from prefetchd.trainer import batch_waiter
from prefetchd.trainer.tensors import IMAGENET_MEAN, IMAGENET_STD
from tests import open_gate
from tests.open_gate import OpenGate
from tests.status_examples import ERRORS, production, stream, write_status_at_heartbeat
from tests.status_examples import status as status_example

if TYPE_CHECKING:  # conftest is pytest's to import; only its types are needed here
    from conftest import FakeJob, MakeJob


def progress(buffer: Path) -> tuple[int, int] | None:
    p = Progress.read(buffer)
    return None if p is None else (p.epoch, p.step)


def later(seconds: float, fn: Callable[[], object]) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        fn()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# -- iteration ------------------------------------------------------------------------


def test_iterates_epochs_in_order_and_rolls_over(make_job: MakeJob) -> None:
    job = make_job(write=2)
    loader = BufferLoader(job.buffer, timeout=5)
    assert len(loader) == 3
    # What a DataLoader user reads off the loader (a learning rate scaled by the batch, say): the daemon's.
    assert (loader.batch_size, loader.drop_last) == (job.manifest.batch_size, False) and loader.batch_size > 1
    seen = []
    for epoch in range(2):
        assert loader.position == (epoch, 0)
        seen.append([(b.epoch, b.step) for b in loader])
        assert loader.position == (epoch + 1, 0)
    assert seen == [[(0, 0), (0, 1), (0, 2)], [(1, 0), (1, 1), (1, 2)]]
    # The manifest's job has 2 epochs: past the end there is nothing more.
    assert list(loader) == []
    assert loader.position == (2, 0)


def test_endless_job_keeps_going(make_job: MakeJob) -> None:
    job = make_job(epochs=None, write=3)
    loader = BufferLoader(job.buffer, timeout=5)
    assert [len(list(loader)) for _ in range(3)] == [3, 3, 3]


def test_batch_unpacks_like_a_dataloader_item(make_job: MakeJob) -> None:
    job = make_job(write=1)
    batch = next(iter(BufferLoader(job.buffer, timeout=5)))
    assert isinstance(batch, Batch)
    images, labels = batch
    assert images is batch.images and labels is batch.labels
    assert len(batch) == 2 and batch[0] is images and batch[1] is labels
    assert batch.indices.dtype == torch.int64
    assert (batch.epoch, batch.step, batch.replaced) == (0, 0, 0)
    _, want_labels, want_indices = job.arrays(0, 0)
    assert batch.indices.tolist() == want_indices.tolist()
    assert labels.tolist() == want_labels.tolist()
    assert "epoch=0, step=0" in repr(batch)


def test_shapes_dtypes_and_channels_last(make_job: MakeJob) -> None:
    job = make_job(write=1, image_size=8)
    batches = list(BufferLoader(job.buffer, timeout=5))
    assert [b.images.shape[0] for b in batches] == [4, 4, 2]  # 10 samples: the last batch is short
    for b in batches:
        assert b.images.shape[1:] == (3, 8, 8)
        assert b.images.dtype == torch.float32
        assert b.images.is_contiguous(memory_format=torch.channels_last)
        assert b.labels.dtype == torch.int64 and b.labels.shape == (b.images.shape[0],)
        assert b.images.device.type == "cpu"


def test_normalize_matches_manual_computation(make_job: MakeJob) -> None:
    job = make_job(write=1)
    loader = BufferLoader(job.buffer, timeout=5)
    for batch in loader:
        raw, _, _ = job.arrays(batch.epoch, batch.step)
        x = torch.from_numpy(raw).permute(0, 3, 1, 2).double() / 255.0
        mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float64).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET_STD, dtype=torch.float64).view(1, 3, 1, 1)
        want = ((x - mean) / std).float()
        torch.testing.assert_close(batch.images, want, atol=1e-5, rtol=1e-5)


def test_normalize_is_within_the_documented_bound_of_torchvisions_float32_order(make_job: MakeJob) -> None:
    """The bound the docs give (5e-7), over every uint8 value of every channel, through the loader."""
    job = make_job(write=0, samples=4, batch_size=4, image_size=16)
    every = np.broadcast_to(np.arange(256, dtype=np.uint8).reshape(16, 16, 1), (4, 16, 16, 3)).copy()
    _, labels, indices = job.arrays(0, 0)
    write_batch(job.path(0, 0), every, labels, indices, epoch=0, step=0, seed=job.manifest.seed, producer="p")
    got = next(iter(BufferLoader(job.buffer, timeout=5))).images
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    want = torch.from_numpy(every).permute(0, 3, 1, 2).float().div(255).sub(mean).div(std)  # ToTensor, Normalize
    assert 0 < (got - want).abs().max().item() <= 5e-7  # not bit for bit, and within the bound


def test_custom_mean_and_std(make_job: MakeJob) -> None:
    job = make_job(write=1)
    batch = next(iter(BufferLoader(job.buffer, timeout=5, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))))
    raw, _, _ = job.arrays(0, 0)
    want = torch.from_numpy(raw).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    torch.testing.assert_close(batch.images, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="3 values"):
        BufferLoader(job.buffer, timeout=5, mean=(0.5,), std=(0.5,))
    # 0-255 values would shift every image to about -2, silently.
    with pytest.raises(ValueError, match=r"in \[0, 1\] units.*divide them by 255"):
        BufferLoader(job.buffer, timeout=5, mean=(123.7, 116.3, 103.5), std=(58.4, 57.1, 57.4))
    with pytest.raises(ValueError, match="apply only with normalize=True"):
        BufferLoader(job.buffer, timeout=5, normalize=False, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    # One statistic of a dataset's beside ImageNet's other normalises by neither.
    for half in ({"mean": (0.5, 0.5, 0.5)}, {"std": (0.5, 0.5, 0.5)}):
        with pytest.raises(ValueError, match="mean= and std= go together"):
            BufferLoader(job.buffer, timeout=5, **half)  # type: ignore[arg-type]
    with warnings.catch_warnings():  # tensors as torchvision's Normalize takes them, without torch's copy warning
        warnings.simplefilter("error")
        tensors = next(iter(BufferLoader(job.buffer, timeout=5, mean=torch.full((3,), 0.5), std=torch.full((3,), 0.5))))
    torch.testing.assert_close(tensors.images, want, atol=1e-5, rtol=1e-5)


def test_a_second_open_loader_of_one_consumer_in_one_process_is_warned_about(
        make_job: MakeJob, caplog: pytest.LogCaptureFixture) -> None:
    """Two open loaders of one process on one buffer and consumer take turns moving its progress (the
    check for another trainer's writes passes over its own pid): said once the second is made."""
    job = make_job(write=1)
    with caplog.at_level("WARNING", logger="prefetchd.trainer.progress_file"):
        first = BufferLoader(job.buffer, normalize=False, timeout=5)
        named = BufferLoader(job.buffer, normalize=False, timeout=5, consumer="other")  # a consumer of its own
        assert not caplog.records
        second = BufferLoader(job.buffer, normalize=False, timeout=5)
        [warned] = [r.getMessage() for r in caplog.records]
        assert f"{job.buffer}: another BufferLoader of this process reads it as the default consumer and is " \
               "still open" in warned and "consumer= of its own" in warned, warned
        first.close()
        second.close()
        caplog.clear()
        BufferLoader(job.buffer, normalize=False, timeout=5).close()  # the others closed: nothing to say
        assert not caplog.records
        named.close()


def test_what_a_dataloader_user_may_pass_is_refused_or_taken_as_meant(
        make_job: MakeJob, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    job = make_job(write=2)
    if not torch.cuda.is_available():  # DataLoader(dataset, 64) is a batch size; ours would be cuda:64
        with pytest.raises(ValueError, match=r"device=64: the second argument is the device .*`prefetchd start --batch-size`"):
            BufferLoader(job.buffer, 64)
    for timeout in (None, "5"):  # DataLoader's timeout=None habit, or a string from a config file
        with pytest.raises(ValueError, match=rf"timeout={timeout!r}: pass a positive number of seconds"):
            BufferLoader(job.buffer, timeout=timeout)  # type: ignore[arg-type]
    # A relative buffer stays the same buffer after the process changes directory (a notebook's %cd);
    # "~" is the home folder, as the `prefetchd start --buffer ~/...` a message suggests would take it.
    monkeypatch.chdir(job.buffer.parent)
    relative = BufferLoader(job.buffer.name, normalize=False, timeout=5)
    monkeypatch.chdir(tmp_path)
    assert relative.buffer == job.buffer and next(iter(relative)).step == 0
    relative.close()
    monkeypatch.setenv("HOME", str(job.buffer.parent))
    assert BufferLoader(f"~/{job.buffer.name}", normalize=False, timeout=5).buffer == job.buffer
    with BufferLoader(job.buffer, normalize=False, timeout=5) as loader:
        for state in (None, "x", [("epoch", 0)], {"epoch": 1, "step": 0}):  # the last: not "another dataset"
            with pytest.raises(StateMismatch, match="expected the dict BufferLoader.state_dict"):
                loader.load_state_dict(state)  # type: ignore[arg-type]


def test_raw_uint8_equals_the_written_bytes(make_job: MakeJob) -> None:
    job = make_job(write=1)
    for batch in BufferLoader(job.buffer, normalize=False, timeout=5):
        raw, labels, indices = job.arrays(batch.epoch, batch.step)
        assert batch.images.dtype == torch.uint8
        assert batch.images.is_contiguous(memory_format=torch.channels_last)
        assert np.array_equal(batch.images.permute(0, 2, 3, 1).numpy(), raw)
        assert batch.labels.tolist() == labels.tolist()
        assert batch.indices.tolist() == indices.tolist()


def test_one_channel_images(make_job: MakeJob) -> None:
    job = make_job(write=1, channels=1)
    batch = next(iter(BufferLoader(job.buffer, timeout=5)))
    assert batch.images.shape[1] == 1
    assert batch.images.is_contiguous(memory_format=torch.channels_last)


def test_a_new_iteration_ends_the_old_iterator(make_job: MakeJob) -> None:
    job = make_job(write=1)
    loader = BufferLoader(job.buffer, timeout=5)
    first = iter(loader)
    assert next(first).step == 0
    second = iter(loader)
    assert [b.step for b in second] == [1, 2]
    assert list(first) == []


# -- progress -------------------------------------------------------------------------


def test_progress_moves_only_after_a_batch_is_handed_over(make_job: MakeJob) -> None:
    job = make_job(write=2)
    loader = BufferLoader(job.buffer, timeout=5)
    assert progress(job.buffer) is None  # constructing does not touch the daemon's position
    it = iter(loader)
    assert progress(job.buffer) == (0, 0)
    b = next(it)
    assert (b.epoch, b.step) == (0, 0)
    # Handed over but maybe still in use: the daemon must not delete it yet.
    assert progress(job.buffer) == (0, 0)
    assert loader.position == (0, 1)
    assert next(it).step == 1
    assert progress(job.buffer) == (0, 1)
    assert next(it).step == 2
    assert progress(job.buffer) == (0, 2)
    assert loader.position == (1, 0)
    with pytest.raises(StopIteration):
        next(it)
    assert progress(job.buffer) == (1, 0)


def test_progress_is_not_rewritten_when_unchanged(make_job: MakeJob) -> None:
    job = make_job(write=1)
    loader = BufferLoader(job.buffer, timeout=5)
    iter(loader)
    inode = os.stat(job.buffer / "progress.json").st_ino  # every write is a rename: a new inode
    iter(loader)
    iter(loader)
    assert os.stat(job.buffer / "progress.json").st_ino == inode


def test_close_marks_the_last_batch_consumed(make_job: MakeJob) -> None:
    job = make_job(write=1)
    with BufferLoader(job.buffer, timeout=5) as loader:
        for batch in loader:
            if batch.step == 1:
                break
        assert progress(job.buffer) == (0, 1)
    assert progress(job.buffer) == (0, 2)
    with pytest.raises(LoaderError, match="closed"):
        iter(loader)


# A script that never closes its loader; the child it forks ends its interpreter normally, atexit and all.
FORKS_AND_ENDS = """
import os, sys
from prefetchd.buffer_protocol import Progress
from prefetchd.trainer import BufferLoader
loader = BufferLoader(sys.argv[1], normalize=False, timeout=5)
it = iter(loader)
next(it)
if os.fork() == 0:
    sys.exit(0)
os.wait()
print(Progress.read(sys.argv[1]).closed)
"""


def test_a_loader_still_open_at_exit_closes_in_its_own_process_only(make_job: MakeJob) -> None:
    """The interpreter's exit closes a loader the script left open, as close() would (the batch handed
    over last consumed, the file saying it left); a forked child's exit leaves its parent's loader alone."""
    job = make_job(write=1)
    ended = subprocess.run([sys.executable, "-c", FORKS_AND_ENDS, str(job.buffer)], capture_output=True, text=True,
                           timeout=120)
    assert ended.returncode == 0 and ended.stderr == "", ended.stderr
    assert ended.stdout == "False\n", "the forked child's exit closed its parent's loader"
    written = Progress.read(job.buffer)
    assert written is not None and written.closed and (written.epoch, written.step) == (0, 1)


# pytorch/examples' layout: the loader is made in main(), which returns without closing it.
LOADER_IN_MAIN = """
import sys, weakref
from prefetchd.buffer_protocol import Progress
from prefetchd.trainer import BufferLoader
def main():
    loader = BufferLoader(sys.argv[1], normalize=False, timeout=5)
    next(iter(loader))
    return weakref.ref(loader)
gone = main()
written = Progress.read(sys.argv[1])
print(gone() is None, written.closed, written.epoch, written.step)
"""


def test_a_loader_collected_unclosed_says_it_left_as_close_would(make_job: MakeJob) -> None:
    """A loader made in a function that returned was collected before the interpreter's exit, whose close then
    did nothing: the daemon took the trainer for gone, not left."""
    job = make_job(write=1)
    ended = subprocess.run([sys.executable, "-c", LOADER_IN_MAIN, str(job.buffer)], capture_output=True, text=True,
                           timeout=120)
    assert ended.returncode == 0 and ended.stderr == "", ended.stderr
    # Collected (nothing keeps it alive), and its file said it left at once, the batch handed over consumed.
    assert ended.stdout == "True True 0 1\n", ended.stdout
    written = Progress.read(job.buffer)
    assert written is not None and written.closed and (written.epoch, written.step) == (0, 1)
    assert written.read_batches == 1


# A loader collected unclosed while a second one reads as the same consumer: a notebook's cell run again (the first
# still held by its iterator), or another process that writes the consumer's progress (a trainer that ignores the
# lock: an older prefetchd, a reader written from the SPEC).  argv[2]: the second's position (the first wrote
# (0, 1) last), argv[3]: "loader" (this process) or "process".
SECOND_WRITER = """
import subprocess, sys, weakref
from prefetchd.buffer_protocol import Progress
from prefetchd.trainer import BufferLoader
buffer, start, who = sys.argv[1], (0, int(sys.argv[2])), sys.argv[3]
loader = BufferLoader(buffer, normalize=False, timeout=5)
first = weakref.ref(loader)
batches = iter(loader)
next(batches), next(batches)
if who == "loader":
    loader = BufferLoader(buffer, normalize=False, timeout=5, start=start)
    next(iter(loader))
else:
    subprocess.run([sys.executable, "-c", "import sys; from prefetchd.buffer_protocol import Progress; "
                    f"Progress(*{start}).write(sys.argv[1])", buffer], check=True)
    loader = None
batches = None
written = Progress.read(buffer)
print(first() is None, written.pid == __import__("os").getpid(), written.closed, written.epoch, written.step)
if who == "loader":
    loader.close()
    written = Progress.read(buffer)
    print(written.closed, written.epoch, written.step)
"""


@pytest.mark.parametrize("who", ["loader", "process"])
@pytest.mark.parametrize("start", [0, 1])
def test_a_loader_collected_unclosed_leaves_a_later_writers_progress_alone(make_job: MakeJob, who: str,
                                                                           start: int) -> None:
    """The first loader, collected after a second writer of its consumer wrote, must not write over that
    writer's progress that it left: the daemon would take the second trainer for gone, and delete the batch it
    reads next.  The second may write the very position the first wrote last (start 1): the first then wrote
    its own over it, `closed`, a batch further."""
    job = make_job(write=1)
    ended = subprocess.run([sys.executable, "-c", SECOND_WRITER, str(job.buffer), str(start), who],
                           capture_output=True, text=True, timeout=120)
    assert ended.returncode == 0 and "Traceback" not in ended.stderr and "at exit" not in ended.stderr, ended.stderr
    lines = ended.stdout.splitlines()
    # Collected, and the file is the second writer's still: its position, not marked closed.
    assert lines[0] == f"True {who == 'loader'} False 0 {start}", ended.stdout
    if who == "loader":
        assert lines[1] == f"True 0 {start + 1}", "the second loader's own close says it left, where it was"


# -- resume ---------------------------------------------------------------------------
# -- resume ---------------------------------------------------------------------------


def test_state_dict_resumes_exactly(make_job: MakeJob, tmp_path: Path) -> None:
    job = make_job(write=2)
    a = BufferLoader(job.buffer, normalize=False, timeout=5)
    list(a)
    it = iter(a)
    assert next(it).step == 0
    state = a.state_dict()
    assert (state["epoch"], state["step"]) == (1, 1)
    assert state["fingerprint"] == "fp-train" and state["producer"] == "test-producer"
    rest_a = [(b.epoch, b.step, b.indices.tolist(), b.images.clone()) for b in it]

    # Through a checkpoint file, as a trainer would.
    torch.save({"loader": state}, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["loader"]

    b = BufferLoader(job.buffer, normalize=False, timeout=5)
    b.load_state_dict(state)
    assert b.position == (1, 1)
    assert progress(job.buffer) == (1, 1)  # written at once, so the daemon can regenerate from there
    rest_b = [(x.epoch, x.step, x.indices.tolist(), x.images) for x in b]
    assert [r[:3] for r in rest_b] == [r[:3] for r in rest_a] == [
        (1, 1, job.arrays(1, 1)[2].tolist()), (1, 2, job.arrays(1, 2)[2].tolist())
    ]
    for (*_, ia), (*_, ib) in zip(rest_a, rest_b):
        assert torch.equal(ia, ib)


def test_state_dict_at_epoch_end_points_at_the_next_epoch(make_job: MakeJob) -> None:
    job = make_job(write=1)
    loader = BufferLoader(job.buffer, timeout=5)
    for _ in loader:
        pass
    assert (loader.state_dict()["epoch"], loader.state_dict()["step"]) == (1, 0)


def test_load_state_dict_can_rewind(make_job: MakeJob) -> None:
    job = make_job(write=1)
    loader = BufferLoader(job.buffer, timeout=5)
    start = loader.state_dict()
    list(loader)
    assert progress(job.buffer) == (1, 0)
    loader.load_state_dict(start)
    assert progress(job.buffer) == (0, 0)
    assert [b.step for b in loader] == [0, 1, 2]


def test_load_state_dict_refuses_another_dataset(make_job: MakeJob) -> None:
    job = make_job(write=1)
    loader = BufferLoader(job.buffer, timeout=5)
    state = loader.state_dict()
    with pytest.raises(StateMismatch, match="fingerprint 'other'.*another dataset.*Lightning: fit without ckpt_path"):
        loader.load_state_dict({**state, "fingerprint": "other"})
    with pytest.raises(StateMismatch, match="seed: checkpoint 8, buffer 7") as mismatch:
        loader.load_state_dict({**state, "identity": {**state["identity"], "seed": 8}})
    # A trainer user cannot restart a service's daemon, but may submit the checkpoint's job.
    assert f"or submit them as a job (a service's daemon takes one from trainer users): `prefetchd submit --buffer " \
           f"{job.buffer} " in str(mismatch.value) and " --seed 8 " in str(mismatch.value), str(mismatch.value)
    with pytest.raises(StateMismatch, match="restart the daemon with the checkpoint's settings$"):
        loader.load_state_dict({**state, "identity": {**state["identity"], "rank": 1}})  # no job sets another rank
    with pytest.raises(StateMismatch, match="past the end"):
        loader.load_state_dict({**state, "epoch": 2, "step": 1})
    with pytest.raises(StateMismatch, match="has 3 steps"):
        loader.load_state_dict({**state, "step": 3})
    with pytest.raises(StateMismatch, match="non-negative integers"):
        loader.load_state_dict({**state, "step": -1})
    assert progress(job.buffer) is None  # nothing refused reached the daemon
    assert isinstance(StateMismatch("x"), ValueError)


# -- waiting and failures ------------------------------------------------------------------


def test_manifest_timeout_says_how_to_start_a_daemon(buffer: Path) -> None:
    start = time.monotonic()
    with pytest.raises(LoaderTimeout) as info:
        BufferLoader(buffer, timeout=0.2)
    assert time.monotonic() - start < 10  # its 0.2 s timeout, not a hang
    msg = str(info.value)
    assert str(buffer) in msg and "manifest.json" in msg and "no prefetchd daemon" in msg
    assert f"prefetchd start --buffer {buffer}" in msg
    assert isinstance(info.value, TimeoutError)


def test_a_file_for_a_buffer_is_named_as_such(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(LoaderError, match="afile is not a directory; pass the daemon's --buffer directory"):
        BufferLoader(afile, timeout=30)  # at once, and not about permissions


def test_a_job_of_another_world_size_that_removed_the_stream_stops_its_reader(make_job: MakeJob,
                                                                              buffer: Path) -> None:
    """A replacing job for another --world-size deletes the rank streams: the reader of one says
    so (JobReplaced) within a liveness look, not after its timeout."""
    import dataclasses
    import shutil

    job = make_job(buffer / "rank-00000", write=1)
    dataclasses.replace(job.manifest, world_size=2).write(job.buffer)
    job.claim(buffer)  # a live "daemon" owns the buffer
    loader = BufferLoader(job.buffer, timeout=30, daemon_grace=0.5, stall_timeout=None)
    batches = iter(loader)
    next(batches)
    shutil.rmtree(job.buffer)  # the new job's daemon cleared the streams and serves one
    # Its status names who submitted the job: a uid without a name here (a trainer in a container, say) as a uid.
    nameless = next(uid for uid in range(2**31 - 2, 0, -1) if not _has_name(uid))
    write_status(buffer, Status(pid=os.getpid(), state=State.STARTING, heartbeat=time.time(), running_job=RunningJob(
        job_id="a1b2c3d4e5f6", submitter=nameless, submitted=time.time(), answer="")))
    dataclasses.replace(job.manifest, world_size=1, producer="other").write(buffer)
    start = time.monotonic()
    with pytest.raises(JobReplaced, match=rf"another job, for --world-size 1 \(this loader's was 2\), which uid {nameless} "
                                          r"submitted \(job a1b2c3d4e5f6, submitted 20"):
        next(batches)
    assert time.monotonic() - start < 10


def _has_name(uid: int) -> bool:
    import pwd

    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def test_manifest_timeout_for_a_missing_directory(tmp_path: Path) -> None:
    """Its advice names every --data a daemon takes: it said "the class-folder dataset" to users of file lists and packs."""
    missing = tmp_path / "nope"
    with pytest.raises(LoaderTimeout, match=r"does not exist.*`prefetchd start --buffer \S+ --data ROOT` \(ROOT: the "
                       r"dataset: class folders, a file list or shards, local or at a URL\)"):
        BufferLoader(missing, timeout=0.05)


def test_the_top_of_a_buffer_of_rank_streams_is_refused_at_once(make_job: MakeJob, buffer: Path) -> None:
    for rank in (0, 1):
        make_job(buffer / f"rank-0000{rank}")
    start = time.monotonic()
    with pytest.raises(LoaderError, match=r"holds one stream per rank \(rank-00000, rank-00001.*rank_stream\(") as info:
        BufferLoader(buffer, timeout=30)
    assert time.monotonic() - start < 5 and not isinstance(info.value, LoaderTimeout)


def test_waits_for_a_manifest_that_appears_later(make_job: MakeJob, buffer: Path) -> None:
    job = make_job(manifest=False, write=1)
    later(0.1, lambda: job.manifest.write(buffer))
    assert len(BufferLoader(buffer, timeout=5)) == 3


def test_waits_for_a_batch_that_appears_later(make_job: MakeJob) -> None:
    job = make_job()
    job.claim()  # a live "daemon"
    job.write(0, 0)
    loader = BufferLoader(job.buffer, timeout=5, daemon_grace=0.5)
    it = iter(loader)
    next(it)
    later(0.15, lambda: job.write(0, 1))
    start = time.monotonic()
    assert next(it).step == 1
    assert time.monotonic() - start >= 0.1


def test_looks_at_the_daemon_every_liveness_interval_not_at_every_wait(make_job: MakeJob,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer that waits a little for each batch looks at the daemon (its lock's process,
    status.json) once a liveness interval, not once a batch."""
    looks: list[float] = []

    def counted(buffer: Path, status: Status | None = None) -> DaemonOwner | None:
        looks.append(time.monotonic())
        return daemon_owner(buffer, status)

    monkeypatch.setattr(batch_waiter, "daemon_owner", counted)
    job = make_job(samples=40, epochs=1)  # 10 batches
    job.claim()
    loader = BufferLoader(job.buffer, timeout=5, daemon_grace=60.0, stall_timeout=None)
    assert loader._waiter.liveness_interval == 1.0
    steps = []
    start = time.monotonic()
    it = iter(loader)
    for step in range(len(loader)):
        later(0.02, lambda step=step: job.write(0, step))  # each batch is waited for
        steps.append(next(it).step)
    elapsed = time.monotonic() - start
    assert steps == list(range(10))
    assert 1 <= len(looks) <= elapsed / loader._waiter.liveness_interval + 1, (len(looks), elapsed)


def test_a_timeout_shorter_than_the_liveness_interval_still_names_the_daemon(make_job: MakeJob) -> None:
    """The wait that times out right after another wait looked at the daemon (so without a look of
    its own) names the live owner, not "no daemon"."""
    job = make_job()
    job.claim()
    loader = BufferLoader(job.buffer, timeout=0.3, daemon_grace=60.0, stall_timeout=None)
    assert loader._waiter.liveness_interval == 1.0
    it = iter(loader)
    later(0.05, lambda: job.write(0, 0))  # waited for: the loader looks at the daemon
    assert next(it).step == 0
    with pytest.raises(LoaderTimeout) as info:
        next(it)  # step 1 never comes, within the second after that look
    assert f"the daemon (pid {os.getpid()}) owns the buffer" in str(info.value)


def test_batch_timeout_names_the_batch_and_the_daemon_state(make_job: MakeJob) -> None:
    job = make_job()
    job.claim()
    write_status(job.buffer, status_example(
        State.PAUSED_LOW_SPACE, pid=os.getpid(), message="low tmpfs space: 12 MiB free", heartbeat=time.time(),
        production=production(progress=Position(0, 0), waiting=0, high_water=4,
                              errors=dataclasses.replace(ERRORS, write_failures=2)),
    ))
    loader = BufferLoader(job.buffer, timeout=0.2, daemon_grace=0.1)
    start = time.monotonic()
    with pytest.raises(LoaderTimeout) as info:
        next(iter(loader))
    assert time.monotonic() - start < 10  # its 0.2 s timeout, not a hang
    msg = str(info.value)
    assert "e000000-s00000000.batch" in msg and "epoch 0, step 0" in msg
    assert f"pid {os.getpid()}" in msg
    assert "state=paused" in msg and "low tmpfs space" in msg
    assert "write_failures=2" in msg and "replaced_samples" not in msg
    assert f"prefetchd status --buffer {job.buffer}" in msg
    # Paused for space, a longer --timeout only waits longer (a walk): the space is what to mend.
    assert msg.endswith("or free space on the buffer's filesystem (the daemon is paused for it: low tmpfs space: "
                        "12 MiB free)"), msg


def test_daemon_gone_when_the_lock_names_a_dead_pid(make_job: MakeJob, dead_pid: int) -> None:
    job = make_job()
    (job.buffer / "daemon.lock").write_text(f"{dead_pid}\n")  # its daemon died: the kernel let go of its lock
    loader = BufferLoader(job.buffer, timeout=30, daemon_grace=0.2)
    start = time.monotonic()
    with pytest.raises(DaemonGone) as info:
        next(iter(loader))
    assert 0.2 <= time.monotonic() - start < 15  # the dead pid seen, not the 30 s timeout waited out (2.5 s once under a full run)
    msg = str(info.value)
    assert str(job.buffer) in msg and "e000000-s00000000.batch" in msg
    assert f"prefetchd start --buffer {job.buffer} --data /data/fake" in msg
    # Why none owns it: what to look at where the last status still beats.
    assert f"pid {dead_pid}, which {job.buffer / 'daemon.lock'} names, has ended" in msg


def test_daemon_gone_says_a_live_pid_that_holds_no_lock(make_job: MakeJob) -> None:
    """The lock names a live process (this one, as a daemon between letting go and exiting would) and nothing
    holds it: no owner, said so rather than as a daemon that ended."""
    job = make_job()
    lock = job.buffer / "daemon.lock"
    lock.write_text(f"{os.getpid()}\n")
    with pytest.raises(DaemonGone) as info:
        next(iter(BufferLoader(job.buffer, timeout=30, daemon_grace=0.2)))
    assert f"nothing holds {lock}, whose pid {os.getpid()} let go of it" in " ".join(str(info.value).split())


def test_daemon_gone_says_a_held_lock_whose_pid_started_after_it_was_written(make_job: MakeJob) -> None:
    """The lock held and naming this live process, but written before it started (as a pid the kernel gave to
    another process after its daemon died would look; or a wall clock stepped forward since): no owner, and the
    DaemonGone says which check refused it, which a status still beating leaves the user to wonder about."""
    job = make_job()
    job.claim()
    lock = job.buffer / "daemon.lock"
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    with pytest.raises(DaemonGone) as info:
        next(iter(BufferLoader(job.buffer, timeout=30, daemon_grace=0.2)))
    assert (f"pid {os.getpid()}, which {lock} names, is not running, or is another process started after the file was "
            "written") in " ".join(str(info.value).split())


def test_a_daemon_that_failed_is_not_simply_to_be_restarted(make_job: MakeJob, dead_pid: int) -> None:
    """Its restart command names the job, not its --max-bad-* limits: followed as it is, it would
    silently change the policy, or fail again for the same cause."""
    job = make_job()
    (job.buffer / "daemon.lock").write_text(f"{dead_pid}\n")  # its daemon died: the kernel let go of its lock
    write_status(job.buffer, Status(pid=dead_pid, state=State.FAILED, heartbeat=time.time(),
                                    message="12 undecodable files, more than --max-bad-samples 10"))
    with pytest.raises(DaemonGone) as info:
        next(iter(BufferLoader(job.buffer, timeout=30, daemon_grace=0.2)))
    msg = " ".join(str(info.value).split())
    assert "state=failed" in msg and "more than --max-bad-samples 10" in msg
    assert "It failed (the message in its status, above): fix that first" in msg and "daemon's own it was started with (such as --workers, --strict or --max-bad-*)" in msg
    assert "Restart it with" not in msg


def test_daemon_gone_without_a_lock_file(make_job: MakeJob) -> None:
    job = make_job()
    with pytest.raises(DaemonGone) as info:
        next(iter(BufferLoader(job.buffer, timeout=30, daemon_grace=0.05)))
    assert f"none seen for 0.05 s: there is no {job.buffer / 'daemon.lock'})" in str(info.value)


# -- a stuck daemon: only a stale heartbeat counts (real stopped daemons: tests/integration/test_liveness.py)


def test_slow_but_beating_daemon_is_not_stuck(make_job: MakeJob) -> None:
    """A "daemon" (this process) that beats but publishes a batch only after more than
    stall_timeout is waited for, not called stuck."""
    job = make_job()
    job.claim()
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            write_status(job.buffer, Status(pid=os.getpid(), state=State.FILLING, heartbeat=time.time()))
            stop.wait(0.2)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        loader = BufferLoader(job.buffer, timeout=30, stall_timeout=1.0)
        timer = threading.Timer(2.5, lambda: job.write(0, 0))
        timer.start()
        assert next(iter(loader)).step == 0
    finally:
        stop.set()
        thread.join()


def test_status_of_another_pid_is_no_heartbeat(make_job: MakeJob) -> None:
    """A fresh-looking status.json left by the previous daemon (another pid) does not vouch for the
    current owner: without a heartbeat of its own it is stuck after stall_timeout."""
    job = make_job()
    job.claim()
    write_status(job.buffer, Status(pid=os.getpid() + 1, state=State.FILLING, heartbeat=time.time() + 3600))
    loader = BufferLoader(job.buffer, timeout=30, stall_timeout=0.5)
    start = time.monotonic()
    with pytest.raises(DaemonStuck, match="no heartbeat at all"):
        next(iter(loader))
    assert 0.5 <= time.monotonic() - start < 0.5 + 4.0


@pytest.mark.parametrize("consumer, progress", [(None, "progress.json"), ("trial-3", "progress.trial-3.json")])
def test_stale_heartbeat_of_the_owner_is_stuck_at_once(make_job: MakeJob, consumer: str | None, progress: str) -> None:
    job = make_job()
    job.claim()
    write_status_at_heartbeat(job.buffer, Status(pid=os.getpid(), state=State.FILLING, heartbeat=time.time() - 100))
    with pytest.raises(DaemonStuck, match=r"no heartbeat for 10\d\.\d s.*last state filling") as info:
        next(iter(BufferLoader(job.buffer, timeout=30, stall_timeout=60, consumer=consumer)))
    # The restart DaemonGone suggests, caveat included: the command names the job, not --high-water & co.
    msg = str(info.value)
    assert f"Restart it with `prefetchd start --buffer {job.buffer} --data /data/fake" in msg, msg
    assert "and the daemon's own flags it was started with (such as --workers or --high-water)" in msg, msg
    assert f"it resumes from {progress}. " in msg, msg  # a sweep's trainer: its own file, not progress.json


def test_stall_timeout_none_disables_the_check(make_job: MakeJob) -> None:
    job = make_job()
    job.claim()
    write_status_at_heartbeat(job.buffer, Status(pid=os.getpid(), state=State.FILLING, heartbeat=time.time() - 100))
    with pytest.raises(LoaderTimeout):
        next(iter(BufferLoader(job.buffer, timeout=0.5, stall_timeout=None)))
    with pytest.raises(ValueError, match="stall_timeout"):
        BufferLoader(job.buffer, timeout=1, stall_timeout=0)


# -- a daemon waiting for its storage (a real outage: tests/integration/test_liveness.py)


def test_only_the_loaders_of_the_ranks_whose_batches_wait_for_the_storage_wait_on(make_job: MakeJob,
                                                                                buffer: Path) -> None:
    """The daemon (this process, beating) says rank 0's builds wait for the storage: rank 1's loader, whose
    batch is late for another reason, times out at its timeout (one wait for the whole daemon held it past
    its timeout too), while rank 0's waits on past its own for its batch."""
    jobs = [make_job(buffer / f"rank-0000{rank}") for rank in (0, 1)]
    for rank, job in enumerate(jobs):
        job.manifest = dataclasses.replace(job.manifest, rank=rank, world_size=2)
        job.manifest.write(job.buffer)
    jobs[0].claim(buffer)
    outage = StorageWait(since=time.time(), reason="batch e000000-s00000000.tmp: reading s3://b/x.jpg: still failing "
                         "after 6 tries", ranks=(0,))
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            write_status(buffer, status_example(pid=os.getpid(), heartbeat=time.time(), production=production(
                streams=(stream(0), stream(1)), storage_wait=outage)))
            stop.wait(0.2)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        rank1 = BufferLoader(jobs[1].buffer, timeout=1.0, stall_timeout=5.0)
        timer = threading.Timer(3.0, lambda: jobs[1].write(0, 0))  # were it waited on: a batch, not LoaderTimeout
        timer.start()
        start = time.monotonic()
        try:
            with pytest.raises(LoaderTimeout, match=r"waited 1 s for batch e000000-s00000000\.batch"):
                next(iter(rank1))
        finally:
            timer.cancel()
        assert time.monotonic() - start < 2.5
        rank0 = BufferLoader(jobs[0].buffer, timeout=1.0, stall_timeout=5.0)
        timer = threading.Timer(2.5, lambda: jobs[0].write(0, 0))
        timer.start()
        start = time.monotonic()
        assert next(iter(rank0)).step == 0
        assert time.monotonic() - start >= 2.0
    finally:
        stop.set()
        thread.join()


def test_a_loader_waiting_for_the_storage_says_since_when_its_own_ranks_builds_wait(
        make_job: MakeJob, buffer: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0's batches failed 10 minutes ago, rank 1's one: rank 1's trainer logged that the daemon had waited
    10 minutes for its batches."""
    jobs = [make_job(buffer / f"rank-0000{rank}") for rank in (0, 1)]
    for rank, job in enumerate(jobs):
        job.manifest = dataclasses.replace(job.manifest, rank=rank, world_size=2)
        job.manifest.write(job.buffer)
    jobs[0].claim(buffer)  # this process plays the daemon: it holds daemon.lock
    now = time.time()
    outage = StorageWait(since=now - 600, reason="batch e000000-s00000000.tmp: reading s3://b/x.jpg: still failing "
                         "after 6 tries", ranks=(0, 1), ranks_since=(now - 600, now - 60))
    write_status(buffer, status_example(pid=os.getpid(), heartbeat=time.time(), production=production(
        streams=(stream(0), stream(1)), storage_wait=outage)))
    timer = threading.Timer(0.5, lambda: jobs[1].write(0, 0))
    timer.start()
    try:
        with caplog.at_level(logging.WARNING, logger="prefetchd.trainer.batch_waiter"):
            assert next(iter(BufferLoader(jobs[1].buffer, timeout=5.0, stall_timeout=5.0))).step == 0
    finally:
        timer.cancel()
    said = [r.getMessage() for r in caplog.records if "for its dataset's storage" in r.getMessage()]
    assert said and "has waited 60 s for its dataset's storage to build rank 1's batches" in said[0], said


def test_a_loader_waiting_for_the_storage_words_the_daemons_state_as_that_not_as_write_failures(
        make_job: MakeJob, buffer: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dataset's root moved away: the waiting trainer's message read `errors: write_failures=18`, a tmpfs
    problem to the eye.  Rank 0's, whose builds wait, says they wait for the storage and why; rank 1's, whose
    batch is late for another reason, does not; both say what write_failures counts."""
    monkeypatch.setattr(batch_waiter, "SLOW_WAIT_WARNING", 0.3)
    jobs = [make_job(buffer / f"rank-0000{rank}") for rank in (0, 1)]
    for rank, job in enumerate(jobs):
        job.manifest = dataclasses.replace(job.manifest, rank=rank, world_size=2)
        job.manifest.write(job.buffer)
    jobs[0].claim(buffer)
    why = "batch e000000-s00000000.tmp: reading /data/train/a/1.jpg: No such file or directory"
    write_status(buffer, status_example(
        pid=os.getpid(), heartbeat=time.time(), message=why, production=production(
            streams=(stream(0), stream(1)), errors=dataclasses.replace(ERRORS, write_failures=18),
            storage_wait=StorageWait(since=time.time() - 40, reason=why, ranks=(0,), ranks_since=(time.time() - 40,)))))
    timer = threading.Timer(1.0, lambda: jobs[0].write(0, 0))
    timer.start()
    try:
        with caplog.at_level(logging.WARNING, logger="prefetchd.trainer.batch_waiter"):
            assert next(iter(BufferLoader(jobs[0].buffer, timeout=5.0, stall_timeout=None))).step == 0
    finally:
        timer.cancel()
    [waiting] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("still waiting for ")]
    assert re.search(r"its builds of rank 0's batches have waited 4[01] s for the dataset's storage and resume once "
                     rf"it is back \({re.escape(why)}\)", waiting) and "message=" not in waiting, waiting
    retried = "write_failures=18 (builds retried: a failed write of the batch, or a failed read of the dataset)"
    assert retried in waiting, waiting
    with pytest.raises(LoaderTimeout) as info:
        next(iter(BufferLoader(jobs[1].buffer, timeout=0.5, stall_timeout=None)))
    late = str(info.value)  # the daemon's message says why builds fail, as ever
    assert "for the dataset's storage" not in late and f"message={why}" in late and retried in late, late


def test_leftover_batches_are_served_without_a_daemon(make_job: MakeJob) -> None:
    job = make_job(write=1)
    assert len(list(BufferLoader(job.buffer, timeout=5, daemon_grace=0))) == 3


def test_corrupt_batch_raises_protocol_error(make_job: MakeJob) -> None:
    job = make_job()
    job.path(0, 0).write_bytes(b"garbage" * 100)
    with pytest.raises(ProtocolError, match="e000000-s00000000.batch.*magic"):
        next(iter(BufferLoader(job.buffer, timeout=5)))


def test_batch_with_the_wrong_position_raises_protocol_error(make_job: MakeJob) -> None:
    job = make_job()
    images, labels, indices = job.arrays(0, 1)
    write_batch(job.path(0, 0), images, labels, indices, epoch=0, step=1, seed=7, producer="p")
    with pytest.raises(ProtocolError, match="holds epoch 0 step 1"):
        next(iter(BufferLoader(job.buffer, timeout=5)))


def test_batch_of_another_job_raises_protocol_error(make_job: MakeJob) -> None:
    job = make_job()
    images = np.zeros((4, 16, 16, 3), dtype=np.uint8)
    labels = indices = np.zeros(4, dtype=np.int64)
    write_batch(job.path(0, 0), images, labels, indices, epoch=0, step=0, seed=7, producer="p")
    with pytest.raises(ProtocolError, match="16x16x3.*another job"):
        next(iter(BufferLoader(job.buffer, timeout=5)))


def test_a_short_batch_before_the_epochs_last_and_indices_out_of_range_are_refused(make_job: MakeJob) -> None:
    """Any N from 1 to the batch size passed: a 2-image batch in mid-epoch (or in a --drop-last job, whose every
    batch is full) was handed out, and indices of -5 too (review)."""
    job = make_job(write=0, samples=10, batch_size=4)  # steps of 4, 4, 2
    images, labels, indices = job.arrays(0, 0)
    write_batch(job.path(0, 0), images[:2], labels[:2], indices[:2], epoch=0, step=0, seed=job.manifest.seed,
                producer="p")
    with pytest.raises(ProtocolError, match="2 images of .* promises 4 of .* at step 0"):
        next(iter(BufferLoader(job.buffer, timeout=5)))
    write_batch(job.path(0, 0), images, labels, np.full(4, -5), epoch=0, step=0, seed=job.manifest.seed, producer="p")
    with pytest.raises(ProtocolError, match=r"indices range over \[-5, -5\] but the manifest has 10 samples"):
        next(iter(BufferLoader(job.buffer, timeout=5)))
    job.write(0, 0), job.write(0, 1), job.write(0, 2)
    assert [len(b.indices) for b in BufferLoader(job.buffer, timeout=5)] == [4, 4, 2]  # the last one short


def test_a_label_or_index_one_past_the_manifests_last_is_refused(make_job: MakeJob) -> None:
    """The bounds are exclusive: a label equal to the number of classes would reach the loss (on CUDA, a
    device-side assert far from its cause), an index equal to the number of samples names no sample."""
    job = make_job(write=0, samples=10, batch_size=4, classes=3)
    images, labels, indices = job.arrays(0, 0)
    seed = job.manifest.seed
    write_batch(job.path(0, 0), images, np.full(4, 3), indices, epoch=0, step=0, seed=seed, producer="p")
    with pytest.raises(ProtocolError, match=r"labels range over \[3, 3\] but the manifest has 3 classes"):
        next(iter(BufferLoader(job.buffer, timeout=5)))
    write_batch(job.path(0, 0), images, labels, np.full(4, 10), epoch=0, step=0, seed=seed, producer="p")
    with pytest.raises(ProtocolError, match=r"indices range over \[10, 10\] but the manifest has 10 samples"):
        next(iter(BufferLoader(job.buffer, timeout=5)))
    write_batch(job.path(0, 0), images, np.full(4, 2), np.full(4, 9), epoch=0, step=0, seed=seed, producer="p")
    batch = next(iter(BufferLoader(job.buffer, timeout=5)))  # the last class and sample are in range
    assert batch.labels.tolist() == [2] * 4 and batch.indices.tolist() == [9] * 4


def _keyed(job: FakeJob, **changes: object) -> Manifest:
    """``job``'s manifest as a daemon that names the stream in its batches writes it (with ``changes``), written."""
    job.manifest = dataclasses.replace(job.manifest, keyed_batches=True, **changes)  # type: ignore[arg-type]
    job.manifest.write(job.buffer)
    return job.manifest


def _write_as(job: FakeJob, epoch: int, step: int, manifest: Manifest | None) -> None:
    """Batch (epoch, step) of ``job``, which passes every other check, named as ``manifest``'s stream's (none: as a
    daemon before ``job`` and ``rank`` wrote it)."""
    images, labels, indices = job.arrays(epoch, step)
    write_batch(job.path(epoch, step), images, labels, indices, epoch=epoch, step=step, seed=job.manifest.seed,
                producer="p", job=None if manifest is None else manifest.job_key,
                rank=None if manifest is None else manifest.rank)


def test_a_batch_of_another_rank_or_an_earlier_job_renamed_to_a_streams_name_is_refused(make_job: MakeJob) -> None:
    """A member of a --group-access buffer's group may rename the daemon's files: rank 1's batch of the same
    position over rank 0's, or one kept from an earlier job of the same seed and sizes, passed every check (the
    same position, sizes, seed, label and index ranges, the daemon's user's file) and was handed out."""
    job = make_job()
    ours = _keyed(job, rank=0, world_size=2)
    rank_1 = dataclasses.replace(ours, rank=1)
    earlier = dataclasses.replace(ours, fingerprint="fp-earlier")
    for theirs in (rank_1, earlier):
        _write_as(job, 0, 0, theirs)
        with pytest.raises(ProtocolError) as refused:
            next(iter(BufferLoader(job.buffer, timeout=5)))
        assert str(refused.value).startswith(
            f"{job.path(0, 0)}: is a batch of rank {theirs.rank} of job {theirs.job_key}, at epoch 0 step 0, but this "
            f"stream is rank 0 of job {ours.job_key} (its manifest.json)"), str(refused.value)
        assert "(a member of its group?) renamed it there" in str(refused.value)
        assert "Remove it (the daemon builds that batch again)" in str(refused.value)
    _write_as(job, 0, 0, None)  # one of a daemon before them: this daemon's manifest says its batches name them
    with pytest.raises(ProtocolError, match=r"e000000-s00000000.batch: names no job and rank \(a batch of a prefetchd "
                       r"before batches named them"):
        next(iter(BufferLoader(job.buffer, timeout=5)))
    _write_as(job, 0, 0, ours)
    assert next(iter(BufferLoader(job.buffer, timeout=5))).step == 0


def test_batches_that_name_no_stream_are_read_where_the_manifest_says_its_daemon_writes_none(
        make_job: MakeJob) -> None:
    """A daemon of an earlier build writes neither its batches' ``job`` and ``rank`` nor the manifest's
    ``keyed_batches``, and a trainer reads on: at its start, and once such a daemon is started on its job again in
    place of one that named them (a loader goes by the manifest there now).  A batch that names a stream is checked
    whatever the manifest."""
    job = make_job(write=1)
    assert not job.manifest.keyed_batches
    assert [b.step for b in BufferLoader(job.buffer, timeout=5)] == [0, 1, 2]
    _write_as(job, 0, 0, dataclasses.replace(job.manifest, rank=1))
    with pytest.raises(ProtocolError, match="is a batch of rank 1 of job"):
        next(iter(BufferLoader(job.buffer, timeout=5)))
    ours = _keyed(job)
    _write_as(job, 0, 0, ours)
    loader = BufferLoader(job.buffer, timeout=5)
    it = iter(loader)
    assert next(it).step == 0
    dataclasses.replace(ours, keyed_batches=False, producer="earlier-build").write(job.buffer)
    assert [b.step for b in it] == [1, 2]  # written without job and rank
    loader.close()


def test_a_batch_cut_short_after_it_was_handed_out_faults_no_normalised_batch(make_job: MakeJob) -> None:
    """Labels and indices were views of the mapping even when the images were normalised into a tensor of their
    own: a batch file truncated under the trainer (anyone who may write the buffer can) was a bus error at the
    trainer's next look at its labels (review)."""
    job = make_job(write=1)
    batch = next(iter(BufferLoader(job.buffer, timeout=5)))
    os.truncate(job.path(0, 0), 0)
    assert batch.labels.tolist() == job.arrays(0, 0)[1].tolist()
    assert batch.indices.tolist() == job.arrays(0, 0)[2].tolist()
    assert torch.isfinite(batch.images).all()


def test_bad_arguments(make_job: MakeJob) -> None:
    job = make_job()
    with pytest.raises(ValueError, match="timeout"):
        BufferLoader(job.buffer, timeout=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            BufferLoader(job.buffer, device="cuda", timeout=5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches(make_job: MakeJob) -> None:
    job = make_job(write=1)
    for normalize in (True, False):
        loader = BufferLoader(job.buffer, device="cuda", normalize=normalize, timeout=5)
        for batch in loader:
            raw, labels, _ = job.arrays(batch.epoch, batch.step)
            assert batch.images.is_cuda and batch.labels.is_cuda
            assert batch.images.is_contiguous(memory_format=torch.channels_last)
            assert batch.labels.cpu().tolist() == labels.tolist()
            if not normalize:
                assert np.array_equal(batch.images.permute(0, 2, 3, 1).cpu().numpy(), raw)
        loader.load_state_dict({**loader.state_dict(), "epoch": 0, "step": 0})


def test_wait_meter_share_of_recent_time() -> None:
    from prefetchd.trainer.batch import WaitMeter

    meter = WaitMeter(window=30.0)
    now = time.monotonic()
    assert meter.share() is None
    meter.add(now - 10, now - 5)
    meter.add(now - 4, now - 3)
    assert meter.share() == pytest.approx(0.6, abs=0.01)  # 6 s of waiting in the 10 s since the first wait
    old = WaitMeter(window=2.0)
    old.add(now - 10, now - 9)  # outside the window: forgotten once a newer span arrives
    old.add(now - 1.5, now - 0.5)
    old.add(now - 0.5, now - 0.5)
    assert old.share() == pytest.approx(2 / 3, abs=0.01)  # 1 s waited in the 1.5 s since the kept span began


def test_wait_meter_counts_the_wait_going_on_once() -> None:
    """A wait not yet ended counts up to now (a stuck trainer reads as waiting), and once it ends
    the share is the same as it was just before: the wait is counted once, not twice."""
    from prefetchd.trainer.batch import WaitMeter

    meter = WaitMeter(window=30.0)
    now = time.monotonic()
    meter.begin(now - 10)  # the first wait alone tells nothing
    assert meter.share() is None
    meter.add(now - 10, now - 9)
    meter.begin(now - 8)  # still waiting: 1 s + 8 s of the 10 s since the first wait
    assert meter.share() == pytest.approx(0.9, abs=0.01)
    meter.add(now - 8, time.monotonic())
    assert meter.share() == pytest.approx(0.9, abs=0.01)
    stuck = WaitMeter(window=2.0)
    stuck.add(now - 10, now - 9.9)
    stuck.add(now - 9.8, now - 9.7)
    stuck.begin(now - 9.6)  # waiting for longer than the window: all of it
    assert stuck.share() == pytest.approx(1.0)


def test_wait_meter_running_total_matches_a_full_pass() -> None:
    """The share kept by a running total equals the sum over every span, through thousands of spans
    that enter and leave the window (a span straddling its edge counts in part)."""
    from prefetchd.trainer.batch import WaitMeter

    rng = np.random.default_rng(5)
    meter = WaitMeter(window=3.0)
    spans: list[tuple[float, float]] = []
    t = time.monotonic() - 300.0
    for _ in range(5000):  # ~250 s of spans, ending ~50 s ago
        start = t + rng.uniform(0.0, 0.05)
        t = start + rng.uniform(0.0, 0.05)
        meter.add(start, t)
        spans.append((start, t))
    now = time.monotonic()
    kept = [(a, b) for a, b in spans if b >= t - 3.0]
    lo = max(kept[0][0], now - 3.0)
    expected = sum(max(0.0, b - max(a, lo)) for a, b in kept) / (now - lo)
    assert meter.share() == pytest.approx(expected, abs=1e-6)
    recent = [(now - 2.5, now - 2.0), (now - 1.0, now - 0.5)]
    for span in recent:  # every older span leaves the window
        meter.add(*span)
    kept = [(a, b) for a, b in [*spans, *recent] if b >= now - 0.5 - 3.0]
    assert len(kept) == 2
    lo = max(kept[0][0], time.monotonic() - 3.0)
    expected = sum(max(0.0, b - max(a, lo)) for a, b in kept) / (time.monotonic() - lo)
    assert meter.share() == pytest.approx(expected, rel=1e-3)


def _give(folder: Path, uid: int) -> None:
    """``folder`` and every file in it to ``uid``: what a member of a --group-access buffer's group makes."""
    for path in [folder, *folder.iterdir()]:
        os.chown(path, uid, uid)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder another owner")
def test_a_loader_reads_no_stream_folder_of_another_user_than_the_buffers(make_job: MakeJob, buffer: Path) -> None:
    """A member of a --group-access buffer's group may rename a rank-NNNNN folder of theirs in under a rank's name,
    with their own manifest and batches (the batch check compared a batch with its own folder, theirs too): the
    loader refuses it, before it starts and when it is swapped in under a loader that reads, naming the folder, both
    owners and what to do."""
    real = make_job(buffer / "rank-00001", write=1)
    real.manifest = dataclasses.replace(real.manifest, rank=1, world_size=2)
    real.manifest.write(real.buffer)
    real.claim(buffer)
    forged = make_job(buffer / "forged", write=2)
    forged.manifest = real.manifest
    forged.manifest.write(forged.buffer)
    _give(forged.buffer, 65534)
    refused = (rf"{buffer}/rank-00001: belongs to \S+ \(uid 65534\), not to \S+ \(uid 0\) who owns the buffer {buffer} "
               r"and makes its stream folders: .*remove it \(`rm -r ")
    loader = BufferLoader(real.buffer, timeout=5, stall_timeout=None)
    batches = iter(loader)
    assert next(batches).step == 0
    real.buffer.rename(buffer / "away")
    forged.buffer.rename(buffer / "rank-00001")
    with pytest.raises(ProtocolError, match=refused):
        next(batches)
    loader.close()
    with pytest.raises(ProtocolError, match=refused):
        BufferLoader(buffer / "rank-00001", timeout=5, stall_timeout=None)
    # A link to a folder of the buffer's owner under the rank's name is refused too.
    (buffer / "rank-00001").rename(buffer / "forged")
    (buffer / "rank-00001").symlink_to(buffer / "away")
    with pytest.raises(ProtocolError, match=rf"{buffer}/rank-00001: is a symbolic link"):
        BufferLoader(buffer / "rank-00001", timeout=5, stall_timeout=None)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder another owner")
@pytest.mark.skipif(open_gate.unavailable() is not None,
                    reason=f"holds an open with fanotify: {open_gate.unavailable()}")
def test_a_loader_reads_its_batches_from_the_stream_folder_it_checked(make_job: MakeJob, buffer: Path) -> None:
    """A member of a --group-access buffer's group may rename a folder of theirs in under a rank's name, and out
    again, while a loader opens a batch there: one of the daemon's user's (renamed from another rank's folder), which
    no owner check of the file refuses.  The loader opened the batch by path and then lstat'ed the folder, by then
    the daemon's again, and handed out the member's choice.  The swap back is made here while the open is held: the
    loader looks its batches up in the folder it checked when it started, never opens theirs, and refuses the
    folder at its path."""
    real = make_job(buffer / "rank-00001", write=1)
    real.manifest = dataclasses.replace(real.manifest, rank=1, world_size=2)
    real.manifest.write(real.buffer)
    real.claim(buffer)
    member = buffer / "member"
    member.mkdir()
    images, labels, indices = real.arrays(0, 1)
    planted = member / batch_name(0, 1)
    write_batch(planted, np.zeros_like(images), labels, indices, epoch=0, step=1, seed=real.manifest.seed,
                producer=real.manifest.producer)
    os.chown(member, 65534, 65534)
    loader = BufferLoader(real.buffer, normalize=False, timeout=5, stall_timeout=None)
    batches = iter(loader)
    assert next(batches).step == 0

    def out_again() -> None:
        (buffer / "rank-00001").rename(member)
        (buffer / "away").rename(buffer / "rank-00001")

    with OpenGate(planted, out_again) as gate:
        real.buffer.rename(buffer / "away")
        member.rename(buffer / "rank-00001")
        with pytest.raises(ProtocolError, match=rf"{buffer}/rank-00001: belongs to \S+ \(uid 65534\), not to \S+ "
                                                r"\(uid 0\) who owns the buffer"):
            handed = next(batches)
            pytest.fail(f"handed out {'the planted batch' if not handed.images.any() else 'a batch'}, the planted "
                        f"file opened {gate.opened} times")
    assert gate.opened == 0
    loader.close()


def test_a_loader_waiting_in_a_stream_folder_the_daemon_made_again_says_so_at_once(make_job: MakeJob,
                                                                                   buffer: Path) -> None:
    """The daemon makes a rank's stream folder again (`prefetchd start --reset`, a job of another world size), the
    same job's manifest in it: the batches go there, never to the folder the loader reads, which says so within a
    look at the daemon, not at its timeout."""
    job = make_job(buffer / "rank-00001", write=0)
    job.manifest = dataclasses.replace(job.manifest, rank=1, world_size=2)
    job.manifest.write(job.buffer)
    job.write(0, 0)
    job.claim(buffer)
    loader = BufferLoader(job.buffer, normalize=False, timeout=30, stall_timeout=None)
    batches = iter(loader)
    assert next(batches).step == 0
    job.buffer.rename(buffer / "removed")  # kept, so that the new folder cannot reuse its inode number
    job.buffer.mkdir()
    job.manifest.write(job.buffer)
    job.write(0, 1)
    began = time.monotonic()
    with pytest.raises(LoaderError, match=rf"{job.buffer}: the daemon made this stream folder again since this "
                                          r"loader started \(`prefetchd start --reset`.*start the trainer again, "
                                          r"from its last checkpoint \(prefetchd-train --resume\)"):
        next(batches)
    assert time.monotonic() - began < 10 * loader._waiter.liveness_interval
    loader.close()


def test_a_loader_reads_through_one_folder_fd_closed_with_it_or_once_collected(make_job: MakeJob) -> None:
    """The folder a loader reads its batches from is open for the loader's life: close() closes it, and so does
    collecting a loader never closed."""
    job = make_job(write=1)

    def folder_fds() -> int:
        return sum(os.path.realpath(f"/proc/self/fd/{fd}") == str(job.buffer) for fd in os.listdir("/proc/self/fd"))

    loader = BufferLoader(job.buffer, normalize=False, timeout=5, stall_timeout=None)
    batches = iter(loader)
    assert [next(batches).step, next(batches).step] == [0, 1]
    assert folder_fds() == 1
    loader.close()
    assert folder_fds() == 0
    loader = BufferLoader(job.buffer, normalize=False, timeout=5, stall_timeout=None)
    assert folder_fds() == 1
    del loader
    gc.collect()
    assert folder_fds() == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file another owner")
def test_a_loader_reads_no_manifest_or_batch_of_another_user_than_the_buffers(make_job: MakeJob, buffer: Path) -> None:
    """Files of a member in the daemon's own stream folder: a manifest is refused by the owner of the buffer (the
    daemon's user), and a batch by the owner of the folder the loader reads, which it checked is the buffer's."""
    job = make_job(buffer / "rank-00000", write=2)
    job.manifest = dataclasses.replace(job.manifest, rank=0, world_size=2)
    job.manifest.write(job.buffer)
    job.claim(buffer)
    os.chown(job.path(0, 1), 65534, 65534)
    loader = BufferLoader(job.buffer, timeout=5, stall_timeout=None)
    batches = iter(loader)
    assert next(batches).step == 0
    with pytest.raises(ProtocolError, match=rf"{job.path(0, 1)}: belongs to \S+ \(uid 65534\), not to \S+ \(uid 0\) "
                                            rf"who owns its folder {job.buffer} and writes its batches"):
        next(batches)
    loader.close()
    os.chown(job.buffer / "manifest.json", 65534, 65534)
    with pytest.raises(ProtocolError, match=r"manifest.json: belongs to \S+ \(uid 65534\), not to \S+ \(uid 0\)"):
        BufferLoader(job.buffer, timeout=5, stall_timeout=None)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder another owner")
def test_a_loader_reads_no_stream_folder_of_a_member_who_removed_the_daemons_lock(make_job: MakeJob,
                                                                                   buffer: Path) -> None:
    """A member of a --group-access buffer's group (2770, no sticky bit) may remove its daemon.lock too: the rank's
    folder of theirs beside it was then taken for a buffer of its own, and the loader read their manifest and
    batches.  It is refused as without the lock."""
    real = make_job(buffer / "rank-00001", write=1)
    real.manifest = dataclasses.replace(real.manifest, rank=1, world_size=2)
    real.manifest.write(real.buffer)
    real.claim(buffer)
    os.chmod(buffer, 0o2770)
    forged = make_job(buffer / "forged", write=2)
    forged.manifest = real.manifest
    forged.manifest.write(forged.buffer)
    _give(forged.buffer, 65534)
    real.buffer.rename(buffer / "away")
    forged.buffer.rename(buffer / "rank-00001")
    (buffer / "daemon.lock").rename(buffer / "lock-away")
    with pytest.raises(ProtocolError, match=rf"{buffer}/rank-00001: belongs to \S+ \(uid 65534\), not to \S+ "
                                            rf"\(uid 0\) who owns the buffer {buffer} "):
        BufferLoader(buffer / "rank-00001", timeout=5, stall_timeout=None)
    (buffer / "lock-away").rename(buffer / "daemon.lock")


def test_a_wait_message_says_a_stalled_worker_with_its_bound_first_and_a_failed_daemons_message_whole() -> None:
    """The daemon's note of a stalled worker (its message) names the task's files before the --task-timeout that
    ends the stall, and a wait message cut it at 300 characters, before the option; a failed daemon's verdict
    (the file, the option, what to run: 500 characters and more) was cut alike."""
    import dataclasses

    from prefetchd.buffer_protocol import State
    from prefetchd.trainer.daemon_status import _summary_parts
    from tests.status_examples import WORKER_STALL, production, status

    note = WORKER_STALL.reason + ", /data/train/b/y.jpg" * 20
    stall = dataclasses.replace(WORKER_STALL, reason=note)
    parts = _summary_parts(status(message=note, production=production(worker_stall=stall)))
    said = [p for p in parts if "is killed at its" in p]
    assert len(said) == 1 and said[0].startswith("a worker of it has made no progress for"), parts
    assert "is killed at its --task-timeout of 600 s, its tasks built on another (worker pid 4321" in said[0], said
    assert not [p for p in parts if p.startswith("message=")], "the note is said once"
    starting = dataclasses.replace(stall, starting=True, timeout=300.0)
    parts = _summary_parts(status(message=note, production=production(worker_stall=starting)))
    assert any("has not got ready for" in p and "its --worker-start-timeout of 300 s" in p for p in parts), parts
    verdict = "no worker gets ready: " + "x" * 600 + " or raise --worker-start-timeout if a start can take that long"
    parts = _summary_parts(status(State.FAILED, message=verdict, production=production(worker_stall=stall)))
    assert f"message={verdict}" in parts and not [p for p in parts if "is killed at its" in p], parts
    # Nor, of a failed daemon, that its builds wait for the storage and resume once it is back (an S3 walk).
    from tests.status_examples import STORAGE_WAIT

    parts = _summary_parts(status(State.FAILED, message=verdict, production=production(storage_wait=STORAGE_WAIT)))
    assert f"message={verdict}" in parts and not [p for p in parts if "resume once it is back" in p], parts
    parts = _summary_parts(status(message="x", production=production(storage_wait=STORAGE_WAIT)))
    assert [p for p in parts if "resume once it is back" in p], parts


# -- misuse (a walk of the API as users write it) -----------------------------------------------------------


def test_a_loader_refuses_to_be_pickled_or_copied(make_job: MakeJob) -> None:
    """A copy kept the number of this process's folder descriptor: in another process (pickle, multiprocessing's
    spawn) it failed at its first batch with "cannot open batch file (Bad file descriptor); check the buffer's
    permissions"."""
    import copy
    import pickle

    job = make_job(write=1)
    with BufferLoader(job.buffer, normalize=False, timeout=5) as loader:
        for make_copy in (pickle.dumps, copy.deepcopy, copy.copy):
            with pytest.raises(TypeError, match=rf"a BufferLoader cannot be pickled or copied \(it holds "
                                                 rf"{re.escape(str(job.buffer))} open"):
                make_copy(loader)
        assert next(iter(loader)).step == 0  # the loader itself goes on


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"normalize": "false"}, r"normalize='false': pass True \(float32, normalised\) or False \(raw uint8\)"),
    ({"daemon_grace": "1"}, r"daemon_grace='1': pass a non-negative number of seconds"),
    ({"stall_timeout": "60"}, r"stall_timeout='60': pass a positive number of seconds"),
    ({"mean": 0.5, "std": 0.5}, r"mean=0.5: pass one number per channel"),
    ({"start": (1,)}, r"start=\(1,\): pass \(epoch, step\), two non-negative integers"),
    ({"start": "0,0"}, r"start='0,0': pass \(epoch, step\)"),
    ({"start": (0, -1)}, r"start=\(0, -1\): pass \(epoch, step\)"),
    ({"device": "gpu"}, r"device='gpu' is no device torch knows; pass 'cpu', 'cuda' or 'cuda:N'"),
    ({"device": None}, r"device=None is no device torch knows"),
    ({"device": "meta"}, r"device='meta': batches go to the CPU or a CUDA device"),
])
def test_arguments_of_the_wrong_kind_are_refused_naming_them(make_job: MakeJob, kwargs: dict[str, object],
                                                             said: str) -> None:
    """Before: "false" normalised (a string is true), the others failed inside with TypeError, IndexError
    or "loader state has epoch='0', step=','", naming no argument."""
    job = make_job(write=1)
    with pytest.raises(ValueError, match=said):
        BufferLoader(job.buffer, timeout=5, **kwargs)  # type: ignore[arg-type]


def test_a_buffer_that_is_no_path_and_a_timeout_that_is_no_bound_are_refused_naming_them(
        make_job: MakeJob, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """BufferLoader(None) said "expected str, bytes or os.PathLike object" (bytes are refused), "" was the folder
    the script ran in; rank_stream(timeout="x") was a TypeError from inside and timeout=-1 returned at once."""
    from prefetchd.trainer import rank_stream

    job = make_job(write=1)
    for buffer in (None, 5, job.buffer.as_posix().encode()):
        with pytest.raises(TypeError, match=r"buffer=.*: pass the daemon's --buffer folder as a str or pathlib.Path"):
            BufferLoader(buffer, timeout=5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"buffer=.*: pass the daemon's --buffer folder"):
            rank_stream(buffer)  # type: ignore[arg-type]
    monkeypatch.chdir(job.buffer)  # "" was this folder, the buffer: taken without a word
    with pytest.raises(ValueError, match=r"buffer='': an empty path \(an unset variable\?\); pass the buffer folder, "
                                         r"e.g. /dev/shm/bf"):
        BufferLoader("", timeout=5)
    for timeout in ("x", -1, 0, math.nan):
        with pytest.raises(ValueError, match=r"timeout=.*: pass a positive number of seconds"):
            rank_stream(job.buffer, timeout=timeout)  # type: ignore[arg-type]
    assert rank_stream(str(job.buffer), timeout=5) == job.buffer


def test_a_start_past_an_epochs_last_step_says_which_position_is_next(make_job: MakeJob) -> None:
    """start=(0, steps) said "loader state has step N" of an argument that is no state, without the position meant."""
    job = make_job(write=1)
    steps = job.manifest.steps_per_epoch
    with pytest.raises(StateMismatch, match=rf"^start=\(0, {steps}\) has step {steps}, but an epoch of .* has {steps} "
                                            rf"steps \(0-{steps - 1}; the next epoch's first is epoch 1 step 0\)"):
        BufferLoader(job.buffer, timeout=5, start=(0, steps))


def test_a_loader_state_of_another_format_or_a_later_version_is_refused(make_job: MakeJob) -> None:
    """Neither was looked at: a state of a later prefetchd (or any dict with a fingerprint) moved the loader."""
    job = make_job(write=2)
    with BufferLoader(job.buffer, normalize=False, timeout=5) as loader:
        state = {**loader.state_dict(), "step": 1}
        with pytest.raises(StateMismatch, match=r"loader state is version 2 of 'prefetchd.loader_state', which a later "
                                                r"prefetchd wrote; this one reads version 1"):
            loader.load_state_dict({**state, "version": 2})
        for bad in ({**state, "format": "x"}, {**state, "version": "1"}, {**state, "version": True}):
            with pytest.raises(StateMismatch, match=r"this prefetchd reads 'prefetchd.loader_state' version 1: it was "
                                                    r"not written by prefetchd's BufferLoader"):
                loader.load_state_dict(bad)
        assert loader.position == (0, 0)
        loader.load_state_dict(state)
        assert loader.position == (0, 1)


def test_every_rank_refuses_what_is_no_loader_and_states_that_are_no_dict(make_job: MakeJob) -> None:
    """EveryRank(None) was taken and failed at the first checkpoint, inside Accelerate's save_state; a state of
    None or a list was a TypeError or AttributeError from inside."""
    from prefetchd.trainer import EveryRank
    from prefetchd.trainer.ranks import Ranks

    for wrapped in (None, 5, "x"):
        with pytest.raises(TypeError, match=r"EveryRank\(.*\): pass the BufferLoader whose position to keep"):
            EveryRank(wrapped)  # type: ignore[arg-type]
    job = make_job(write=1)
    with BufferLoader(job.buffer, normalize=False, timeout=5) as loader:
        every = EveryRank(loader, Ranks())
        for state in (None, [1]):
            with pytest.raises(StateMismatch, match=r"the checkpoint's loader state .*: expected the dict "
                                                    r"EveryRank.state_dict\(\) returns"):
                every.load_state_dict(state)  # type: ignore[arg-type]
        later = {**every.state_dict(), "version": 2}
        with pytest.raises(StateMismatch, match="which a later prefetchd wrote"):
            every.load_state_dict(later)


def test_a_closed_loader_says_so_in_its_repr_and_at_a_second_with(make_job: MakeJob) -> None:
    job = make_job(write=1)
    with BufferLoader(job.buffer, normalize=False, timeout=5) as loader:
        assert "closed" not in repr(loader)
    assert repr(loader).endswith(", closed)")
    with pytest.raises(LoaderError, match="is closed; create a new one"):
        with loader:
            pass


def test_a_folder_every_user_may_write_is_no_buffer(tmp_path: Path) -> None:
    """BufferLoader("/dev/shm") waited its whole timeout, then advised `prefetchd start --buffer /dev/shm`, which
    start refuses (a folder every user may write)."""
    shared = tmp_path / "shm"
    shared.mkdir()
    shared.chmod(0o1777)
    start = time.monotonic()
    with pytest.raises(LoaderError, match=rf"{re.escape(str(shared))} is writable by every user \(mode 1777\), which no "
                                          rf"daemon takes as its buffer; .* such as {re.escape(str(shared / 'bf'))}"):
        BufferLoader(shared, timeout=60)
    assert time.monotonic() - start < 30, "said at once, not after the timeout"


def test_numpy_integers_are_epochs_and_steps_too(make_job: MakeJob) -> None:
    """``for epoch in np.arange(n): loader.set_epoch(epoch)`` was refused as "not a non-negative integer"."""
    job = make_job(write=2)
    with BufferLoader(job.buffer, normalize=False, timeout=5, start=(np.int64(0), np.int64(1))) as loader:
        assert next(iter(loader)).step == 1
        loader.set_epoch(np.int64(1))
        assert loader.position == (1, 0) and type(loader.position[0]) is int
        loader.load_state_dict({**loader.state_dict(), "epoch": np.int64(0), "step": np.int64(2)})
        assert [(b.epoch, b.step) for b in loader] == [(0, 2)]
    mean = np.array(IMAGENET_MEAN)  # an array of statistics, as a 1-d tensor is taken
    assert next(iter(BufferLoader(job.buffer, timeout=5, mean=mean, std=np.array(IMAGENET_STD)))).step == 0


def test_a_loader_another_replaced_leaves_the_progress_file_to_it(make_job: MakeJob) -> None:
    """A notebook cell run twice, the first loader still referenced: the second read the job to its end, and
    the first, closed at the interpreter's exit, wrote its own old position back over the end: the daemon of an
    --epochs job said the trainer left at epoch 0 step 1 and never finished."""
    job = make_job(write=2)
    old = BufferLoader(job.buffer, normalize=False, timeout=5)
    next(iter(old))
    with BufferLoader(job.buffer, normalize=False, timeout=5) as new:
        assert len([b for _ in range(2) for b in new]) == 6
    end = Progress.read(job.buffer)
    assert end is not None and (end.epoch, end.step, end.closed) == (2, 0, True), end
    old.close()
    assert Progress.read(job.buffer) == end and Progress.read(job.buffer).time == end.time  # type: ignore[union-attr]


def test_two_threads_at_one_loader_are_refused(make_job: MakeJob) -> None:
    """The loader is not thread-safe: two threads iterating it handed one batch out twice, skipped another and
    waited out the timeout on a batch the daemon had deleted, the message pointing nowhere near the cause."""
    job = make_job()
    job.claim()
    loader = BufferLoader(job.buffer, normalize=False, timeout=10, stall_timeout=None)
    got: list[int] = []

    def two_batches() -> None:
        batches = iter(loader)
        got.extend(next(batches).step for _ in range(2))

    waiting = threading.Thread(target=two_batches)
    waiting.start()  # waits for batch (0, 0), which is not there yet
    try:
        time.sleep(0.3)
        for step_in in (lambda: next(iter(loader)), lambda: iter(loader)):  # a new iterator would end the other's
            with pytest.raises(LoaderError, match=r"another thread is fetching a batch from this BufferLoader: a "
                                                  r"loader is not thread-safe"):
                step_in()
    finally:
        job.write(0, 0)
        job.write(0, 1)
        waiting.join(10)
    assert got == [0, 1]
    loader.close()


def test_set_epoch_right_after_load_state_dict_warns_that_the_epoch_starts_over(
        make_job: MakeJob, caplog: pytest.LogCaptureFixture) -> None:
    """A resume written `load_state_dict(ckpt)` then `for epoch ...: set_epoch(epoch)` trained the epoch's first
    steps again without a word (the docs' order is the other way round)."""
    job = make_job(write=2)
    with BufferLoader(job.buffer, normalize=False, timeout=5) as loader, caplog.at_level(logging.WARNING):
        state = {**loader.state_dict(), "epoch": 0, "step": 2}
        loader.set_epoch(0)
        loader.load_state_dict(state)  # the documented order: no word
        assert not caplog.records and loader.position == (0, 2)
        loader.load_state_dict(state)
        loader.set_epoch(0)
        [said] = [r.getMessage() for r in caplog.records]
        assert said == (f"{job.buffer}: set_epoch(0) right after load_state_dict moves the loader back from step 2 "
                        "to the epoch's first batch, so steps 0-1 are read again: call load_state_dict after "
                        "set_epoch to resume mid-epoch"), said
        assert [(b.epoch, b.step) for b in loader] == [(0, 0), (0, 1), (0, 2)]
        caplog.clear()
        loader.set_epoch(1)  # an uninterrupted loop's: no word
        assert not caplog.records


def test_a_loader_that_starts_the_job_over_unasked_says_where_the_last_trainer_left(
        make_job: MakeJob, caplog: pytest.LogCaptureFixture) -> None:
    """Accelerate without register_for_checkpointing (or Lightning without ckpt_path): the resumed run started
    at (0, 0), trained epoch 0 again and skipped the rest of the epoch it stopped in, without a word (a user's
    walk).  Said once where nothing chose the position; not after load_state_dict or set_epoch, nor after a
    run that finished the job."""
    job = make_job(write=2)  # 3 steps an epoch, 2 epochs
    with BufferLoader(job.buffer, normalize=False, timeout=5) as first:
        batches = iter(first)
        next(batches), next(batches), next(batches)  # left at (0, 2): the third was handed out, not yet consumed
    with caplog.at_level(logging.WARNING, logger="prefetchd.trainer.loader"):
        for choose in (lambda loader: loader.set_epoch(0),
                       lambda loader: loader.load_state_dict({**loader.state_dict(), "epoch": 0, "step": 0})):
            with BufferLoader(job.buffer, normalize=False, timeout=5) as loader:
                choose(loader)
                iter(loader)
            Progress(0, 2, job=loader.manifest.job_key).write(job.buffer)  # as the first left it
        assert not caplog.records
        with BufferLoader(job.buffer, normalize=False, timeout=5) as loader:
            assert next(iter(loader)).step == 0
            iter(loader)  # once
        assert [r.getMessage() for r in caplog.records] == [
            f"{job.buffer}: this loader starts the job over at epoch 0 step 0, where the last trainer reading it as "
            "the default consumer left at epoch 0 step 2. Right for a new run; a resume loads its checkpoint's "
            "loader state first (loader.load_state_dict(state); Accelerate: register_for_checkpointing before "
            "load_state; Lightning: ckpt_path=; prefetchd-train: --resume), or it trains those batches again"]
        with BufferLoader(job.buffer, normalize=False, timeout=5) as loader:
            assert len([b for _ in range(2) for b in loader]) == 6  # to the job's end (said: the last left at 0, 1)
        caplog.clear()
        with BufferLoader(job.buffer, normalize=False, timeout=5) as loader:
            iter(loader)
        assert not caplog.records
