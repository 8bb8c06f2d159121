"""The bad-image corpus through real daemons: valid images arrive as they look, undecodable
ones are replaced (full batches, equal ranks), logged once, listed in the status; --strict
and a bad-sample budget stop the job with exit code 4 and a message naming a file."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from prefetchd.bad_images import Corpus, make_bad_images
from prefetchd.buffer_protocol import State, read_status, stream_dir
from prefetchd.daemon.dataset import scan_class_folders
from prefetchd.daemon.errors import EXIT_BAD_DATA
from prefetchd.daemon.sources.shards import pack
from prefetchd.trainer import BufferLoader
from tests.status_examples import production_of, state_of

SMALL = ["--split", "val", "--batch-size", "4", "--image-size", "32", "--workers", "2", "--epochs", "1"]
TOLERANCE = 12
# A bad file as the log says it: "cannot decode PATH (...)", "cannot read PATH (...)", "PATH is missing (...)" or
# "PATH is a link to TARGET, which is missing".
BAD_FILE = r"(?:cannot (?:decode|read) (?P<said>\S+) \(|(?P<missing>\S+) is (?:missing \(|a link to ))"


def bad_files(text: str, after: str = "") -> list[str]:
    """The paths of the bad files ``text`` names (each followed by ``after``, a pattern), in order."""
    return [found["said"] or found["missing"] for found in re.finditer(BAD_FILE + after, text)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    return make_bad_images(tmp_path_factory.mktemp("bad") / "data")


def test_the_corpus_runs_through_with_replacements(corpus: Corpus, shm_dir: Path, start_daemon) -> None:
    index = scan_class_folders(corpus.root)
    rel = [str(index.path(i).relative_to(Path(index.root))) for i in range(len(index))]
    bad = {i for i, r in enumerate(rel) if r in corpus.undecodable}
    buffer = shm_dir / "bf"
    # Bad input in the buffer too: a directory planted under the name of rank 1's first temp
    # file. The daemon keeps going, counts a write failure a second, and builds the batch
    # once the name is free.
    planted = buffer / "rank-00001" / "e000000-s00000000.tmp"
    planted.mkdir(parents=True)
    buffer.chmod(0o700)
    planted.parent.chmod(0o700)
    daemon = start_daemon(buffer, "--data", corpus.root, *SMALL, "--world-size", "2", "--high-water", "8")
    daemon.wait_until(lambda: (p := production_of(buffer)) is not None and p.errors.write_failures >= 1, 120,
                      "a write failure for the planted directory")
    assert f"cannot create {planted}" in daemon.log
    planted.rmdir()
    # Everything is produced before anyone consumes: every bad file has been met.
    daemon.wait_until(lambda: state_of(buffer) == State.DONE, 120, "the whole epoch produced")
    shown = subprocess.run([sys.executable, "-m", "prefetchd", "status", "--buffer", str(buffer)],
                           capture_output=True, text=True, timeout=60).stdout
    assert f"{len(bad)} bad files" in shown, shown
    assert len(re.findall(r"^  bad file  ", shown, re.M)) == 5 and f"and {len(bad) - 5} more" in shown, shown

    per_rank = []
    for rank in (0, 1):
        loader = BufferLoader(stream_dir(buffer, rank, 2), normalize=False, timeout=120)
        sizes, indices, replaced = [], [], 0
        for batch in loader:
            sizes.append(len(batch.indices))
            replaced += batch.replaced
            for image, i in zip(batch.images.permute(0, 2, 3, 1).numpy(), batch.indices.tolist()):
                assert i not in bad, f"{rel[i]} cannot be decoded, yet it is in a batch"
                left, right = corpus.valid[rel[i]]
                third = image.shape[1] // 3
                assert np.abs(image[:, :third].reshape(-1, 3).mean(0) - left).max() <= TOLERANCE, rel[i]
                assert np.abs(image[:, -third:].reshape(-1, 3).mean(0) - right).max() <= TOLERANCE, rel[i]
                indices.append(i)
        loader.close()
        per_rank.append((sizes, indices, replaced))
    assert daemon.wait_exit(60) == 0, daemon.log
    (sizes0, got0, rep0), (sizes1, got1, rep1) = per_rank
    per_rank_samples = -(-len(index) // 2)
    assert sizes0 == sizes1 and sum(sizes0) == per_rank_samples, "replacing must keep batch sizes and ranks equal"
    assert set(got0 + got1) == set(range(len(index))) - bad  # every valid sample is there
    assert rep0 + rep1 >= len(bad)  # (the padding may repeat a bad one)

    p = production_of(buffer)
    assert p is not None
    errors = p.errors
    assert errors.undecodable_files == len(bad) and errors.replaced_samples == rep0 + rep1
    listed = {Path(b.path).relative_to(Path(index.root)).as_posix(): b.reason for b in errors.undecodable}
    assert set(listed) == set(corpus.undecodable)
    assert "not a regular file" in listed["class_b/fifo.jpg"] and "max_image_pixels" in listed["class_b/bomb.jpg"]
    assert not [b.path for b in errors.undecodable if b.path in b.reason], "the path stands beside its reason, once"
    assert listed["class_b/broken_link.jpg"] == "a link to does-not-exist.jpg, which is missing", listed
    logged = Counter(bad_files(daemon.log))
    assert {Path(p).relative_to(Path(index.root)).as_posix() for p in logged} == set(corpus.undecodable)
    assert set(logged.values()) == {1}, "each bad file is logged once"


def test_a_packed_bad_image_is_shown_with_the_file_it_was_packed_from(corpus: Corpus, tmp_path: Path,
                                                                      shm_dir: Path, start_daemon) -> None:
    """Reviewer's case: `cannot decode .../packed/shard-000000.tar (bytes 512-2512) (OSError: image file is
    truncated ...)`, the source file never named.  The log and the status name it beside the shard and
    bytes, each bad sample still logged once and counted once."""
    packed = tmp_path / "packed"
    pack(scan_class_folders(corpus.root), packed, shard_size=100_000)
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", packed, *SMALL, "--high-water", "64")
    daemon.wait_until(lambda: state_of(buffer) == State.DONE, 120, "the whole epoch produced")
    p = production_of(buffer)
    assert p is not None
    named = re.compile(rf"{re.escape(str(packed))}/shard-\d{{6}}\.tar \(bytes \d+-\d+, packed from (.+)\)")
    listed: dict[str, str] = {}
    for b in p.errors.undecodable:
        found = named.fullmatch(b.path)
        assert found, b.path
        listed[Path(found[1]).relative_to(corpus.root.resolve()).as_posix()] = b.path
        assert daemon.log.count(f"cannot decode {b.path} (") == 1, daemon.log
    assert set(listed) == set(corpus.undecodable) and p.errors.undecodable_files == len(listed)


def test_strict_fails_the_job_naming_the_file(corpus: Corpus, shm_dir: Path, start_daemon) -> None:
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", corpus.root, *SMALL, "--strict")
    assert daemon.wait_exit(120) == EXIT_BAD_DATA, daemon.log
    message = bad_files(daemon.log, after=".*, or start without --strict to replace such files")
    assert message and "--strict: " in daemon.log, daemon.log
    assert Path(message[0]).relative_to(corpus.root.resolve()).as_posix() in corpus.undecodable
    assert "replacing it" not in daemon.log  # the first bad file stops the job; none is replaced
    status = read_status(buffer)
    assert status is not None and status.state == State.FAILED and "--strict" in status.message


def test_a_bad_sample_budget_stops_the_job(corpus: Corpus, shm_dir: Path, start_daemon) -> None:
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", corpus.root, *SMALL, "--max-bad-samples", "2")
    assert daemon.wait_exit(120) == EXIT_BAD_DATA, daemon.log
    # The third distinct file stops it, named as the last; the two before it were replaced.
    stopped = re.search(r"3 files could not be decoded \(or read\), more than --max-bad-samples 2 allows \(the last: (.*)",
                        daemon.log)
    assert stopped and bad_files(stopped[1]), daemon.log
    replaced = bad_files(daemon.log, after=".*; replacing it")
    assert len(set(replaced)) == 2 and bad_files(stopped[1])[0] not in replaced, daemon.log


def test_a_run_no_replacement_survives_is_counted_in_the_status(tmp_path: Path, shm_dir: Path, start_daemon) -> None:
    """The files of the run that stopped the job count as undecodable too: the status said 0 of a
    job stopped by 16 of them (the error named only the last)."""
    folder = tmp_path / "data" / "a"
    folder.mkdir(parents=True)
    for k in range(20):
        (folder / f"{k:02d}.jpg").write_text("not an image")
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", tmp_path / "data", "--split", "val", "--batch-size", "4", "--image-size", "32", "--workers", "1")
    assert daemon.wait_exit(120) == EXIT_BAD_DATA, daemon.log
    assert "sample 0 and the 15 samples after it could not be decoded" in daemon.log, daemon.log
    p = production_of(buffer)
    assert p is not None and p.errors.undecodable_files == 16, p
    assert [Path(b.path).name for b in p.errors.undecodable] == [f"{k:02d}.jpg" for k in range(16)]
    # The status says "the daemon's log names every one": it named the run's last alone (a walk).
    assert all(f"cannot decode {folder / f'{k:02d}.jpg'}" in daemon.log for k in range(16)), daemon.log


def test_a_packed_run_no_replacement_survives_names_the_files_it_was_packed_from(tmp_path: Path, shm_dir: Path,
                                                                                 start_daemon) -> None:
    """The stop for such a run named a packed sample by its shard and bytes alone: worded in the worker,
    which holds no files packed.  The controller words it, as it shows every failure, with the file to mend."""
    folder = tmp_path / "data" / "a"
    folder.mkdir(parents=True)
    for k in range(20):
        (folder / f"{k:02d}.jpg").write_text("not an image")
    packed = tmp_path / "packed"
    pack(scan_class_folders(tmp_path / "data"), packed, shard_size=10**6)
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", packed, "--split", "val", "--batch-size", "4", "--image-size", "32",
                          "--workers", "1")
    assert daemon.wait_exit(120) == EXIT_BAD_DATA, daemon.log
    stop = re.compile(rf"sample 0 and the 15 samples after it could not be decoded \(last: {re.escape(str(packed))}/"
                      rf"shard-000000\.tar \(bytes \d+-\d+, packed from {re.escape(str((folder / '15.jpg').resolve()))}\)"
                      r": \w+: .*; a sample is replaced by one of the next 15 that decodes, and none did: are "
                      r"these files images\?")
    assert stop.search(daemon.log), daemon.log
    status = read_status(buffer)
    assert status is not None and status.state == State.FAILED and stop.search(status.message), status


def test_a_listed_file_that_is_gone_is_said_missing_in_the_log_and_the_status(tmp_path: Path, shm_dir: Path,
                                                                               start_daemon) -> None:
    """It was logged "cannot decode /d/gone.png (FileNotFoundError: No such file or directory)" and counted
    as an undecodable file: it is said missing, with the list that names it, and counted as a bad file."""
    folder = tmp_path / "data"
    folder.mkdir()
    rows = []
    for k in range(6):
        Image.new("RGB", (40, 40), (40 * k, 20, 200)).save(folder / f"{k}.png")
        rows.append(f"{folder / f'{k}.png'},{k % 2}")
    gone = folder / "gone.png"
    rows.insert(2, f"{gone},0")
    listed = tmp_path / "train.csv"
    listed.write_text("\n".join(rows) + "\n")
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", listed, *SMALL)
    daemon.wait_until(lambda: state_of(buffer) == State.DONE, 120, "the whole epoch produced")
    said = f"missing (listed in {listed}; deleted or moved since?)"
    assert f"{gone} is {said}; replacing it with the next sample of the split" in daemon.log, daemon.log
    shown = subprocess.run([sys.executable, "-m", "prefetchd", "status", "--buffer", str(buffer)],
                           capture_output=True, text=True, timeout=60).stdout
    assert "1 replaced sample, 1 bad file, " in shown and f"bad file  {gone}: {said}" in shown, shown
