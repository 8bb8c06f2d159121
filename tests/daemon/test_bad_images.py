"""Bad input, one file at a time: the corpus of prefetchd.bad_images through the index, both
decoders and a worker; the policy of replacing, counting and stopping (bad_data_verdict)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torchvision.io
from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import pil_loader

from prefetchd.bad_images import Corpus, make_bad_images
from prefetchd.buffer_protocol.status import BadFile
from prefetchd.daemon.config import DaemonConfig
from prefetchd.daemon.dataset import SampleIndex, scan_class_folders
from prefetchd.daemon.errors import BadDataError
from prefetchd.daemon.bad_samples import BadSamples, bad_data_verdict
from prefetchd.daemon.decode import load_rgb
from prefetchd.daemon.sources import SampleReader, open_dataset
from prefetchd.daemon.sources.shards import INDEX_NAME, pack
from prefetchd.daemon.sources.storage import ImageRefused, StorageUnavailable
from prefetchd.daemon.transforms import augment
from prefetchd.daemon.fill import none_decoded, run_task
from prefetchd.daemon.tasks import Filled, SampleUnrecoverable, Task, WorkerJob, WriteFailed, failure_of

pytestmark = [pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")]

SIZE = 32
TOLERANCE = 12  # JPEG's loss on flat colour


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return make_bad_images(tmp_path_factory.mktemp("bad") / "data")


def test_any_filler_count_makes_a_corpus(tmp_path: Path) -> None:
    """--filler 25 or more ran out of colours (StopIteration) and left half a corpus (a walk)."""
    many = make_bad_images(tmp_path / "data", filler=30)
    plain = [rel for rel in many.valid if Path(rel).name.startswith("plain_")]
    assert len(plain) == 2 * 30 and all((many.root / rel).stat().st_size for rel in plain)


def _halves(image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    third = image.shape[1] // 3
    return image[:, :third].reshape(-1, 3).mean(0), image[:, -third:].reshape(-1, 3).mean(0)


def test_the_index_is_imagefolders_and_lists_no_non_images(corpus: Corpus) -> None:
    index = scan_class_folders(corpus.root)
    ours = [str(index.path(i).relative_to(Path(index.root))) for i in range(len(index))]
    theirs = [str(Path(p).relative_to(corpus.root)) for p, _ in ImageFolder(str(corpus.root), loader=lambda p: p).samples]
    assert ours == theirs
    assert set(ours) == set(corpus.valid) | set(corpus.undecodable)  # hidden, uppercase, FIFO, dead link included
    assert not set(ours) & set(corpus.ignored)


@pytest.mark.parametrize("decoder", ["fast", "pillow"])
def test_valid_images_decode_to_what_they_show(corpus: Corpus, decoder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if decoder == "pillow":  # every JPEG through the fallback as well
        def refuse(*args: object, **kwargs: object) -> None:
            raise RuntimeError("refused for the test")
        monkeypatch.setattr(torchvision.io, "decode_jpeg", refuse)
    for rel, (left, right) in corpus.valid.items():
        out = augment(corpus.root / rel, SIZE, train=False, rng=None)
        assert out.shape == (SIZE, SIZE, 3)
        got_left, got_right = _halves(out)
        assert np.abs(got_left - left).max() <= TOLERANCE, (rel, got_left, left)
        assert np.abs(got_right - right).max() <= TOLERANCE, (rel, got_right, right)


def test_sixteen_bit_keeps_the_high_byte_where_imagefolder_clips(corpus: Corpus) -> None:
    path = corpus.root / "class_a" / "gray16.png"
    with Image.open(path) as raw:
        assert raw.mode == "I;16"
    assert np.asarray(pil_loader(str(path))).min() == 255  # ImageFolder: white
    assert set(np.unique(np.asarray(load_rgb(path)))) == {200}


def test_undecodable_files_raise_promptly_with_a_reason(corpus: Corpus) -> None:
    reasons: dict[str, str] = {}

    def decode_all() -> None:
        for rel in corpus.undecodable:
            try:
                augment(corpus.root / rel, SIZE, train=False, rng=None)
            except Exception as exc:  # what the worker catches
                reasons[rel] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=decode_all, daemon=True)  # a FIFO opened blocking would never return
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "decoding the bad files hung"
    assert set(reasons) == set(corpus.undecodable)
    assert "not a regular file" in reasons["class_b/fifo.jpg"]
    assert "max_image_pixels" in reasons["class_b/bomb.jpg"] and "max_image_pixels" in reasons["class_b/bomb.png"]
    assert "an empty file" in reasons["class_b/empty.jpg"]
    assert "BytesIO" not in " ".join(reasons.values())


def test_the_pixel_limit_holds_before_either_decoder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.jpg"
    Image.new("RGB", (100, 80), (9, 9, 9)).save(path)
    calls: list[object] = []
    monkeypatch.setattr(torchvision.io, "decode_jpeg", lambda *a, **k: calls.append(a))
    with pytest.raises(ImageRefused, match="100 x 80"):
        augment(path, 16, train=False, rng=None, max_pixels=7999)
    assert not calls
    monkeypatch.undo()
    assert augment(path, 16, train=False, rng=None, max_pixels=8000).shape == (16, 16, 3)


def test_a_worker_replaces_bad_samples_deterministically(corpus: Corpus, tmp_path: Path) -> None:
    index = scan_class_folders(corpus.root)
    job = WorkerJob(index, np.arange(len(index), dtype=np.int64), SIZE, False, 0)
    bad = [i for i in range(len(index)) if str(index.path(i).relative_to(Path(index.root))) in corpus.undecodable]
    slot = SIZE * SIZE * 3
    items = list(enumerate(range(len(index))))
    runs = []
    for chunks in ([items], [items[k::3] for k in range(3)]):  # one worker, or three in another order
        path = tmp_path / f"batch-{len(runs)}.tmp"
        path.write_bytes(bytes(len(items) * slot))
        used: dict[int, int] = {}
        for task_id, chunk in enumerate(chunks):
            result = run_task(job, Task(task_id, str(path), 0, slot, 0, tuple(chunk)))
            assert isinstance(result, Filled)
            used.update({s: i for s, i, _ in result.slots})
        runs.append((path.read_bytes(), used))
    assert runs[0] == runs[1]
    used = runs[0][1]
    assert len(used) == len(items)  # every slot filled: the batch keeps its size
    for i in bad:
        replacement = used[i]
        assert replacement not in bad and replacement > i  # the next sample of the split that decodes
        assert all(j in bad for j in range(i + 1, replacement))
    assert all(used[i] == i for i in range(len(index)) if i not in bad)


def _build_first_slot(index: SampleIndex, tmp_path: Path) -> object:
    """A worker's build of a one-slot batch from sample 0 of ``index`` (or its replacements)."""
    path = tmp_path / "batch.tmp"
    path.write_bytes(bytes(SIZE * SIZE * 3))
    return run_task(WorkerJob(index, np.arange(len(index), dtype=np.int64), SIZE, False, 0),
                    Task(0, str(path), 0, SIZE * SIZE * 3, 0, ((0, 0),)))


@pytest.mark.parametrize(("bad", "good", "said"), [
    (3, 0, "sample 0 and the 2 samples after it, the whole split, could not be decoded"),
    (1, 0, "sample 0 and no other sample of the split could not be decoded"),
    (20, 2, "sample 0 and the 15 samples after it could not be decoded"),
])
def test_a_run_of_undecodable_samples_stops_the_job_as_bad_data_saying_how_many(
        tmp_path: Path, bad: int, good: int, said: str) -> None:
    """Past MAX_REPLACEMENT_TRIES undecodable samples in a row (or the whole of a smaller split) the
    job stops as bad data (exit 4, not restarted) with the count it really tried."""
    folder = tmp_path / "data" / "a"
    folder.mkdir(parents=True)
    for k in range(bad):
        (folder / f"bad-{k:03d}.jpg").write_text("not an image")
    for k in range(good):
        Image.new("RGB", (8, 8)).save(folder / f"ok-{k:03d}.png")  # after the bad ones
    index = scan_class_folders(tmp_path / "data")
    with pytest.raises(SampleUnrecoverable) as raised:
        _build_first_slot(index, tmp_path)
    result = failure_of(0, raised.value)  # what the worker reports to the controller
    assert result.fatal is BadDataError, result
    assert said in result.reason and "next 15 that decodes" in result.reason, result.reason
    assert result.reason.endswith("are these files images? Remove the ones that are not (or that are damaged)")


@pytest.mark.parametrize(("case", "hint"), [
    ("macOS metadata", "files named '._*' are macOS metadata, not images: delete them (`find {root} -name '._*' -delete`)"),
    ("files gone", "is the dataset readable, and all still there?"),
])
def test_the_stop_for_a_run_of_undecodable_samples_says_the_likeliest_cause(tmp_path: Path, case: str,
                                                                           hint: str) -> None:
    """'Is the dataset readable?' was said of an unmounted dataset and of readable files that are not images."""
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    for k in range(3):
        name = f"._{k}.jpg" if case == "macOS metadata" else f"{k}.jpg"
        if case == "macOS metadata":
            (root / "a" / name).write_bytes(b"\x00\x05\x16\x07" + bytes(60))
        else:
            Image.new("RGB", (8, 8)).save(root / "a" / name)
    index = scan_class_folders(root)
    if case == "files gone":
        for path in (root / "a").iterdir():
            path.unlink()
    with pytest.raises(SampleUnrecoverable) as raised:
        _build_first_slot(index, tmp_path)
    assert hint.format(root=root.resolve()) in str(raised.value), raised.value


def test_a_run_of_files_that_each_ended_their_worker_names_the_hook_too(tmp_path: Path) -> None:
    """Good images whose --transform hook ends its worker (os._exit) stopped the job with "are these files images?
    Remove the ones that are not" (a walk of hooks): the crashes are said as such, the hook among the causes."""
    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    for k in range(3):
        Image.new("RGB", (8, 8)).save(root / "a" / f"{k}.jpg")
    index = scan_class_folders(root)
    run = [(k, "crashed its worker 2 times (exit code 5)") for k in range(3)]
    said = none_decoded(index, 3, run, index.name)
    assert said.endswith("each ended the worker decoding it: a decoder that crashes on such files, or a --transform "
                         "hook that ends its process (os._exit, a signal); run one file through the hook by hand to "
                         "tell"), said
    assert "Remove the ones" not in said


@pytest.mark.parametrize(("gone", "said"), [("removed", "is gone (unmounted?)"), ("emptied", "is empty (unmounted?)"),
                                           ("closed", "cannot be listed (Permission denied; its permissions changed?)")])
def test_a_dataset_root_gone_makes_the_build_wait_rather_than_replace_samples(shm_dir: Path, gone: str,
                                                                             said: str) -> None:
    """An unmounted dataset (its root gone, or its mount point left bare) is no sample's fault: the task
    fails as an outage does, to be built again later, not with replaced samples or a stopped job.  A root whose
    permission was taken away waits too, and is said so: it was "gone or empty" of a root that was there (a
    walk; as nobody, whom the permission stops)."""
    if gone == "closed" and os.geteuid() != 0:
        pytest.skip("plays a user the permission stops (root reads any folder)")
    from tests.as_nobody import as_nobody

    shm_dir.chmod(0o755)
    root = shm_dir / "data"
    (root / "a").mkdir(parents=True)
    for k in range(3):
        Image.new("RGB", (8, 8)).save(root / "a" / f"{k}.jpg")
    index = scan_class_folders(root)
    if gone == "closed":
        root.chmod(0o700)  # root's: nobody may no longer list or enter it

        def build() -> str:
            try:
                _build_first_slot(index, shm_dir / "nobodys")
            except StorageUnavailable as exc:
                return f"waits: {exc}; fatal: {failure_of(0, exc).fatal}"
            return "built"

        (shm_dir / "nobodys").mkdir()
        os.chown(shm_dir / "nobodys", 65534, 65534)  # where nobody writes its one-slot batch file
        answer = as_nobody(build)
        assert answer.startswith("waits: ") and answer.endswith("; fatal: None"), answer
        assert f"the dataset root {root.resolve()} {said}: the batches wait" in answer, answer
        return
    shutil.rmtree(root if gone == "removed" else root / "a")
    with pytest.raises(StorageUnavailable) as raised:
        _build_first_slot(index, shm_dir)
    assert f"the dataset root {root.resolve()} {said}: the batches wait" in str(raised.value), raised.value
    assert failure_of(0, raised.value).fatal is None  # retried, the job goes on


# Holds a write lease on argv[1] until its stdin closes: opening the file with O_NONBLOCK (as the
# workers do) then fails with EAGAIN, as it does on a file whose lease knfsd or Samba holds for a client.
LEASE_HOLDER = """
import fcntl, os, signal, sys
signal.signal(signal.SIGIO, signal.SIG_IGN)  # the lease-break notice
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
print("leased", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _lease_held(path: Path) -> Iterator[None]:
    holder = subprocess.Popen([sys.executable, "-c", LEASE_HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "leased\n"
        yield
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(10)


@contextlib.contextmanager
def _open_files_exhausted(path: Path) -> Iterator[None]:
    """The open-file limit lowered to the descriptors this process holds, the free ones under it taken."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    taken: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1, hard))
        while True:
            try:
                taken.append(os.open(os.devnull, os.O_RDONLY))
            except OSError as exc:
                assert exc.errno == errno.EMFILE
                break
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize(("fault", "said"), [
    (_lease_held, "Resource temporarily unavailable (EAGAIN; the filesystem's failure, not the file's)"),
    (_open_files_exhausted, "Too many open files (EMFILE; the daemon's open-file limit is reached"),
], ids=["EAGAIN", "EMFILE"])
def test_a_filesystem_that_says_try_again_makes_the_build_wait_rather_than_replace_samples(
        tmp_path: Path, fault: Callable[[Path], contextlib.AbstractContextManager[None]], said: str) -> None:
    """EAGAIN or EMFILE, like ESTALE or ETIMEDOUT on NFS, says nothing of the file: replacing the sample
    would make another batch for the same (seed, epoch, step) than the next run makes.  Real errors: a
    lease another process holds on the sample, or every descriptor under a lowered limit taken.  The
    images go to a ``Rows`` sink (a remote task's), which opens no file, so the sample's read is what fails."""
    from prefetchd.daemon.remote.task import build_rows

    root = tmp_path / "data"
    (root / "a").mkdir(parents=True)
    for k in range(3):
        Image.new("RGB", (8, 8), (40 * k, 0, 0)).save(root / "a" / f"{k}.png")
    index = scan_class_folders(root)
    job = WorkerJob(index, np.arange(len(index), dtype=np.int64), SIZE, False, 0)
    task = Task(0, "unused", 0, SIZE * SIZE * 3, 0, ((0, 0), (1, 1)))
    reader = SampleReader(index)
    before, pixels = build_rows(job, task, reader)
    assert isinstance(before, Filled) and pixels is not None
    with fault(root / "a" / "0.png"):
        during, _ = build_rows(job, task, reader)
    assert isinstance(during, WriteFailed), f"a sample was replaced: {during}"
    assert during.fatal is None and not during.failures  # retried later, the job goes on, nothing counted as bad
    assert f"cannot read {root / 'a' / '0.png'}: {said}" in during.reason, during.reason
    after, again = build_rows(job, task, reader)
    assert isinstance(after, Filled) and after.slots == before.slots and not after.failures
    assert again is not None and all(np.array_equal(x, y) for x, y in zip(again, pixels))


def _cfg(**kw: object) -> DaemonConfig:
    return DaemonConfig(buffer=Path("/dev/shm/x"), **kw)  # type: ignore[arg-type]


def test_replacing_is_the_default_and_limits_stop_the_job() -> None:
    assert bad_data_verdict(_cfg(), 10**6, 10, "p") is None
    assert bad_data_verdict(_cfg(max_bad_samples=3), 3, 100, "p") is None
    verdict = bad_data_verdict(_cfg(max_bad_samples=3), 4, 100, "cannot decode /d/x.jpg (OSError: truncated)")
    assert verdict is not None and "4 files" in verdict and "--max-bad-samples 3" in verdict and "/d/x.jpg" in verdict
    assert bad_data_verdict(_cfg(max_bad_fraction=0.05), 5, 100, "p") is None
    verdict = bad_data_verdict(_cfg(max_bad_fraction=0.05), 6, 100, "p")
    assert verdict is not None and "--max-bad-fraction 0.05 of 100 samples" in verdict
    both = bad_data_verdict(_cfg(max_bad_samples=1, max_bad_fraction=0.01), 2, 100, "p")
    assert both is not None and "--max-bad-samples 1 and --max-bad-fraction" in both
    strict = bad_data_verdict(_cfg(strict=True), 1, 100, "cannot decode /d/y.jpg (empty)")
    assert strict == ("--strict: cannot decode /d/y.jpg (empty); fix or remove the file, or start without --strict "
                      "to replace such files with the next sample of the split")


def test_a_packed_bad_sample_is_counted_by_its_shard_and_shown_with_its_file(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The status and the verdict show the file a packed sample was packed from, read from the pack's
    index at the first failure shown (the workers' index holds none); counting keys on the shard and
    bytes.  An index that cannot be read then leaves the shard and bytes, said once in the debug log."""
    (tmp_path / "data" / "a").mkdir(parents=True)
    for name in ("x.jpg", "y.jpg"):
        (tmp_path / "data" / "a" / name).write_bytes(b"not an image")
    pack(scan_class_folders(tmp_path / "data"), tmp_path / "packed", shard_size=10**6)
    shards = open_dataset(tmp_path / "packed")
    unread = BadSamples(_cfg(), shards, len(shards))
    bad = BadSamples(_cfg(strict=True), shards, len(shards))
    assert bad.count(1, "OSError: truncated") and not bad.count(1, "OSError: truncated")
    assert bad.files == {shards.name(1)}
    shown = f"{shards.name(1)[:-1]}, packed from {(tmp_path / 'data' / 'a' / 'y.jpg').resolve()})"
    assert bad.listed[0].path == shown
    verdict = bad.verdict(1, "OSError: truncated")
    assert verdict is not None and verdict.startswith(f"--strict: cannot decode {shown} (OSError: truncated)")

    (tmp_path / "packed" / INDEX_NAME).unlink()  # not read before the first failure shown: now it cannot be
    with caplog.at_level(logging.DEBUG, logger="prefetchd.daemon.bad_samples"):
        assert unread.count(0, "r") and unread.count(1, "r")
    assert [b.path for b in unread.listed] == [shards.name(0), shards.name(1)]
    assert [r.getMessage() for r in caplog.records] == [
        f"not naming the files {shards.root} was packed from: cannot read shard index "
        f"{shards.root}/{INDEX_NAME}: No such file or directory"]


def test_a_packed_bad_samples_stop_says_to_mend_the_file_packed_and_pack_again(tmp_path: Path) -> None:
    """`--strict` on a pack said "fix or remove the file" of the file it was packed from, which changes
    nothing the daemon reads until the pack is made again: the stops say so, with the command."""
    (tmp_path / "data" / "a").mkdir(parents=True)
    for name in ("x.jpg", "y.jpg"):
        (tmp_path / "data" / "a" / name).write_bytes(b"not an image")
    pack(scan_class_folders(tmp_path / "data"), tmp_path / "packed", shard_size=10**6)
    shards = open_dataset(tmp_path / "packed")
    source = (tmp_path / "data" / "a" / "y.jpg").resolve()
    again = (f"pack it again from the class folders or file list it was made from: `prefetchd pack <that folder or "
             f"list> {shards.root} --force`, then start with --reset (the buffer's batches are the old pack's)")
    strict = BadSamples(_cfg(strict=True), shards, len(shards))
    assert strict.count(1, "OSError: truncated")
    assert strict.verdict(1, "OSError: truncated") == (
        f"--strict: cannot decode {shards.name(1)[:-1]}, packed from {source}) (OSError: truncated); mend {source} "
        f"and {again}, or start without --strict to replace such files with the next sample of the split")
    budget = BadSamples(_cfg(max_bad_samples=1), shards, len(shards))
    assert budget.count(0, "OSError: truncated") and budget.verdict(0, "OSError: truncated") is None
    assert budget.count(1, "OSError: truncated")
    verdict = budget.verdict(1, "OSError: truncated")
    assert verdict is not None and verdict.endswith(f"; mend them where they were packed from and {again}, or raise "
                                                    "the limit"), verdict
    (tmp_path / "packed" / INDEX_NAME).unlink()  # the files packed from cannot be named now: the advice stands
    unnamed = BadSamples(_cfg(strict=True), shards, len(shards))
    assert unnamed.count(0, "OSError: truncated")
    assert f"; mend the file it was packed from and {again}, or start without --strict" in str(unnamed.verdict(0, "r"))


def _failures(index: SampleIndex, tmp_path: Path) -> dict[int, str]:
    """(sample: reason) of each sample of ``index`` a worker could not use, as it reports them."""
    path = tmp_path / "batch.tmp"
    slot = SIZE * SIZE * 3
    path.write_bytes(bytes(len(index) * slot))
    result = run_task(WorkerJob(index, np.arange(len(index), dtype=np.int64), SIZE, False, 0),
                      Task(0, str(path), 0, slot, 0, tuple((i, i) for i in range(len(index)))))
    assert isinstance(result, Filled), result
    return dict(result.failures)


def test_a_missing_file_is_said_missing_with_where_it_was_named(tmp_path: Path) -> None:
    """It was "cannot decode /d/gone.jpg (FileNotFoundError: No such file or directory)", counted as an
    undecodable file: the log, the status and --strict now say it is missing, and where it was named."""
    data = tmp_path / "data"
    (data / "a").mkdir(parents=True)
    for name in ("0.png", "gone.png", "2.png"):
        Image.new("RGB", (40, 40), (200, 30, 30)).save(data / "a" / name)
    os.symlink("nowhere.png", data / "a" / "link.png")
    (tmp_path / "l.csv").write_text("data/a/0.png,0\ndata/a/gone.png,0\ndata/a/2.png,1\n")
    listed, folders = open_dataset(tmp_path / "l.csv"), scan_class_folders(data)
    (data / "a" / "gone.png").unlink()  # after the list was written and the folders indexed
    gone = listed.name(1)

    bad = BadSamples(_cfg(data=str(tmp_path / "l.csv"), strict=True), listed, len(listed))
    reason = _failures(listed, tmp_path)[1]
    assert bad.count(1, reason)
    said = f"missing (listed in {tmp_path / 'l.csv'}; deleted or moved since?)"
    assert bad.listed[0] == BadFile(gone, said) and bad.failure(1, reason) == f"{gone} is {said}"
    assert bad.verdict(1, reason) == (
        f"--strict: {gone} is {said}; restore the file or take its row out of {tmp_path / 'l.csv'}, or start "
        "without --strict to replace such files with the next sample of the split")

    bad = BadSamples(_cfg(data=str(data), strict=True), folders, len(folders))
    failures = _failures(folders, tmp_path)
    link, gone = (next(i for i in range(len(folders)) if folders.path(i).name == name) for name in ("link.png", "gone.png"))
    assert set(failures) == {link, gone}
    assert bad.failure(gone, failures[gone]) == (f"{folders.name(gone)} is missing (indexed under {folders.root}; deleted "
                                                 "or moved since?)")
    assert bad.failure(link, failures[link]) == f"{folders.name(link)} is a link to nowhere.png, which is missing"
    assert str(bad.verdict(gone, failures[gone])).startswith(
        f"--strict: {folders.name(gone)} is missing (indexed under {folders.root}; deleted or moved since?); restore "
        "the file, or restart to index the folders without it, or start without --strict")
    # A dead link is still in the folder, which a restart indexes again: it said to restart (a review).
    assert str(bad.verdict(link, failures[link])).startswith(
        f"--strict: {folders.name(link)} is a link to nowhere.png, which is missing; restore the file it links to, "
        "or remove the link, or start without --strict")
    # A file there but not readable is said so, a damaged one as before.
    assert bad.failure(0, "PermissionError: Permission denied") == (f"cannot read {folders.name(0)} "
                                                                    "(PermissionError: Permission denied)")
    assert bad.failure(0, "OSError: truncated") == f"cannot decode {folders.name(0)} (OSError: truncated)"


def test_a_non_default_pixel_limit_is_part_of_the_jobs_identity() -> None:
    assert _cfg().augmentation == ""
    assert _cfg(max_image_pixels=10**9).augmentation == "max_image_pixels=1000000000"


def test_the_tool_writes_the_corpus_and_refuses_a_full_folder(tmp_path: Path) -> None:
    import importlib.util

    from click.testing import CliRunner

    spec = importlib.util.spec_from_file_location("tools_make_bad_images",
                                                  Path(__file__).resolve().parents[2] / "tools" / "make_bad_images.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    result = CliRunner().invoke(tool.main, [str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "undecodable  class_b/fifo.jpg" in result.output and "not indexed  class_a/README.txt" in result.output
    again = CliRunner().invoke(tool.main, [str(tmp_path / "out")])
    assert again.exit_code != 0 and "not empty" in again.output
