"""Job hand-off: a daemon started without a dataset serves jobs submitted into its buffer."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from prefetchd.buffer_protocol import JobRequest, Manifest, Progress, list_batches, map_batch, read_status
from prefetchd.access import user_name
from prefetchd.daemon.job_inbox import MAX_REASON_CHARS
from prefetchd.trainer import BufferLoader, JobEnded, JobReplaced, LoaderTimeout
from tests.status_examples import job_result_of, state_of

CLI = [sys.executable, "-m", "prefetchd"]
JOB = ["--batch-size", "8", "--image-size", "32"]


def submit(buffer: Path, *args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "submit", "--buffer", str(buffer), *map(str, args)],
                          capture_output=True, text=True, timeout=90)


def state(buffer: Path) -> str | None:
    return state_of(buffer)


def waiting_daemon(start_daemon: Any, shm_dir: Path) -> tuple[Path, Any]:
    """A daemon without a dataset on ``shm_dir``/bf, once it waits for a job: its buffer and itself."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--workers", "1", "--high-water", "3")
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 30, "the daemon to wait for a job")
    return buffer, daemon


def test_empty_daemon_waits_then_serves_refuses_and_replaces_jobs(shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    out = subprocess.run([*CLI, "status", "--buffer", str(buffer)], capture_output=True, text=True)
    assert out.returncode == 0 and "waiting-for-job" in out.stdout and "prefetchd submit" in out.stdout
    with pytest.raises(LoaderTimeout, match=rf"it is waiting for a job: give it one with `prefetchd submit --buffer {buffer}"):
        BufferLoader(buffer, timeout=1)  # a trainer before the job: told what the daemon waits for

    bad = submit(buffer, "--data", shm_dir / "missing", *JOB)
    assert bad.returncode == 1 and "refused" in bad.stdout and "does not exist" in bad.stdout
    assert daemon.proc.poll() is None, "a refused job must not stop the daemon"

    good = submit(buffer, "--data", shapes_data / "train", *JOB)
    assert good.returncode == 0 and "accepted" in good.stdout, good.stdout + good.stderr
    loader = BufferLoader(buffer, normalize=False, timeout=30)
    batch = next(iter(loader))
    assert batch.images.shape == (8, 3, 32, 32)
    next(iter(loader))  # the trainer is now active: progress.json was just written

    other = submit(buffer, "--data", shapes_data / "val", "--split", "val", "--batch-size", "4", "--image-size", "32")
    me = user_name(os.getuid())
    assert other.returncode == 1 and "--replace" in other.stdout
    # Whose trainer it would take the buffer from, and which job.
    assert f"a trainer of {me} is consuming the running job on {shapes_data / 'train'} (progress" in other.stdout
    assert Manifest.read(buffer).batch_size == 8, "a refused job leaves the running one alone"

    forced = submit(buffer, "--data", shapes_data / "val", "--split", "val", "--batch-size", "4",
                    "--image-size", "32", "--replace")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    # The log (and the answer) name who submitted it, and what it replaced: it said only "producing ROOT".
    said = f"producing {shapes_data / 'val'} for {me}, replacing the running job on {shapes_data / 'train'}"
    assert said in forced.stdout and f"accepted: {said}" in daemon.log, forced.stdout
    assert "(batch_size: 8 -> 4; data: " in forced.stdout and "split: 'train' -> 'val')" in forced.stdout, forced.stdout
    daemon.wait_until(lambda: Manifest.read(buffer).split == "val", 30, "the new job's manifest")
    fresh = BufferLoader(buffer, normalize=False, timeout=30)
    assert next(iter(fresh)).images.shape[0] == 4
    # The machine-sized defaults, the same for both jobs, are said once (a soak: 4 lines at every job).
    assert daemon.log.count("default: readers = 1 (a local folder)") == 1, daemon.log


@pytest.mark.parametrize("reset", [False, True])
def test_a_restarted_daemon_with_data_resumes_the_job_submitted_to_it(shapes_data: Path, shm_dir: Path,
                                                                     start_daemon, reset: bool) -> None:
    """A job submitted to a daemon with its own --data (a service's config) replaces the configured job.  After
    a crash the daemon started with the configured job, found the submitted one's batches and exited 2 (another
    job's: which the unit does not restart), while that job's trainers waited.  It resumes the submitted job now;
    with --reset (reset = true) the configured job clears the buffer, and the log says the other was dropped."""
    buffer = shm_dir / "bf"
    configured = [*JOB, "--data", shapes_data / "train", "--workers", "1", "--high-water", "3"]
    daemon = start_daemon(buffer, *configured)
    daemon.wait_until(lambda: state(buffer) in ("filling", "full"), 60, "the configured job")
    assert submit(buffer, "--data", shapes_data / "train", *JOB, "--seed", "7").returncode == 0
    daemon.wait_until(lambda: Manifest.read(buffer).seed == 7 and state(buffer) in ("filling", "full"), 60,
                      "the submitted job")
    job_id = JobRequest.read(buffer).job_id  # type: ignore[union-attr]
    daemon.proc.kill()
    daemon.proc.wait()
    again = start_daemon(buffer, *configured, *(["--reset"] if reset else []))
    again.wait_until(lambda: (status := read_status(buffer)) is not None and status.pid == again.proc.pid
                     and status.state in ("filling", "full"), 60, "the restarted daemon to produce")
    if reset:
        assert Manifest.read(buffer).seed == 0
        assert f"not resuming job {job_id}, which the earlier daemon here was producing: reset = true" in again.log
    else:
        assert Manifest.read(buffer).seed == 7 and f"resuming job {job_id} on " in again.log
        result = job_result_of(buffer)
        assert result is not None and result.job_id == job_id and result.accepted, result
        assert result.reason.endswith(", resumed after a restart"), result.reason
    assert again.proc.poll() is None and "Traceback" not in again.log, again.log


def test_a_refused_job_is_not_run_by_a_restarted_daemon(shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """A refused request stays in job.json (the submitter wrote it over the accepted one): a restarted daemon
    ran it, replacing the job a trainer was reading without --replace.  It resumes the job it had accepted
    (its own record, job.accepted.json) and refuses the other again."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    assert submit(buffer, "--data", shapes_data / "train", *JOB, "--seed", "8").returncode == 0
    accepted = JobRequest.recorded(buffer)
    assert accepted is not None and accepted.settings["seed"] == 8 and accepted.owner == os.geteuid()
    loader = BufferLoader(buffer, normalize=False, timeout=60)
    batches = iter(loader)
    next(batches)  # a trainer reads: another job needs --replace
    refused = submit(buffer, "--data", shapes_data / "train", *JOB, "--seed", "9")
    assert refused.returncode == 1 and "submit with --replace" in refused.stdout, refused.stdout
    daemon.proc.kill()
    daemon.proc.wait()
    again = start_daemon(buffer, "--workers", "1", "--high-water", "3")
    again.wait_until(lambda: (status := read_status(buffer)) is not None and status.pid == again.proc.pid
                     and status.state in ("filling", "full"), 60, "the restarted daemon to produce")
    assert Manifest.read(buffer).seed == 8 and f"resuming job {accepted.job_id} on " in again.log, again.log
    next(batches)  # the trainer reads on
    again.wait_until(lambda: (r := job_result_of(buffer)) is not None and not r.accepted, 30, "the other refused again")
    assert Manifest.read(buffer).seed == 8
    loader.close()


# A daemon that keeps no record of the jobs it accepts, as a prefetchd before job.accepted.json: it takes job.json.
RECORDS_NO_JOB = """
import sys
import prefetchd.daemon.job_inbox as inbox


def accepted(self, job=None):
    if self.pending_request is not None:
        request = self.pending_request
        self.running = inbox.RunningJob(request.job_id, request.owner, request.submitted, "")


inbox.JobInbox.accepted = accepted
from prefetchd.cli import main
sys.exit(main())
"""


def test_a_record_of_a_job_another_daemon_replaced_since_is_not_resumed(shapes_data: Path, shm_dir: Path,
                                                                         start_daemon) -> None:
    """A downgrade, then an upgrade back (a user's walk): the older prefetchd took another job from job.json and
    left job.accepted.json naming the one before. The daemon after it resumed that record: it cleared the batches
    and progress of the job produced since, and told its trainer that job was replaced by one nobody submitted."""
    buffer, first = waiting_daemon(start_daemon, shm_dir)
    assert submit(buffer, "--data", shapes_data / "train", *JOB, "--seed", "8").returncode == 0
    stale = JobRequest.recorded(buffer)
    assert stale is not None and stale.settings["seed"] == 8
    first.proc.kill()
    first.proc.wait()

    # -c: the forkserver would run a script's __main__ again in every worker
    older = subprocess.Popen([sys.executable, "-c", RECORDS_NO_JOB, "start", "--buffer", str(buffer), "--workers", "1",
                              "--high-water", "3"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1)
        assert submit(buffer, "--data", shapes_data / "train", *JOB, "--seed", "9", "--replace").returncode == 0
        deadline = time.monotonic() + 60
        while not (Manifest.read(buffer).seed == 9 and state(buffer) in ("filling", "full")):
            assert time.monotonic() < deadline, "the older daemon to produce the seed-9 job"
            time.sleep(0.1)
        loader = BufferLoader(buffer, normalize=False, timeout=60)
        batches = iter(loader)
        assert [next(batches).step for _ in range(3)] == [0, 1, 2]
    finally:
        older.kill()
        older.wait()
    recorded = JobRequest.recorded(buffer)
    assert recorded is not None and recorded.job_id == stale.job_id, "the older daemon left the record as it was"

    again = start_daemon(buffer, "--workers", "1", "--high-water", "3")
    again.wait_until(lambda: (status := read_status(buffer)) is not None and status.pid == again.proc.pid
                     and status.state in ("filling", "full"), 60, "the restarted daemon to produce")
    assert f"not resuming job {stale.job_id} on {shapes_data / 'train'}, which job.accepted.json names as accepted: " \
           "the last daemon here produced job " in again.log, again.log
    assert "clearing" not in again.log and Manifest.read(buffer).seed == 9, again.log
    assert next(batches).step == 3  # the trainer reads on, its job not replaced
    loader.close()


def test_a_daemon_with_data_waits_for_the_next_job_once_a_submitted_one_ends(shapes_data: Path, shm_dir: Path,
                                                                            start_daemon) -> None:
    """A service's daemon (data in its config) that produced a job a trainer submitted exited once that job's
    epochs were read, with code 0, which the unit does not restart: its group had no daemon to submit to."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, *JOB, "--data", shapes_data / "train", "--workers", "1", "--high-water", "3",
                          "--epochs", "1")
    daemon.wait_until(lambda: state(buffer) in ("filling", "full"), 60, "the configured job")
    assert submit(buffer, "--data", shapes_data / "train", *JOB, "--seed", "5", "--epochs", "1").returncode == 0
    daemon.wait_until(lambda: Manifest.read(buffer).seed == 5, 60, "the submitted job")
    loader = BufferLoader(buffer, normalize=False, timeout=30)
    read = sum(1 for _ in loader)
    loader.close()
    assert read == len(loader)
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 60, "the daemon to wait for the next job")
    assert "finished producing" in reason_of(buffer) and daemon.proc.poll() is None, daemon.log
    # Restarted now (the watchdog, `systemctl restart`, an upgrade), it refused the buffer, "holds batches of a
    # different job (seed: 5 -> 0)", with exit 2, which the unit does not restart (a walk of the service).
    daemon.proc.terminate()
    assert daemon.wait_exit(30) == 0, daemon.log
    again = start_daemon(buffer, *JOB, "--data", shapes_data / "train", "--workers", "1", "--high-water", "3",
                         "--epochs", "1")
    again.wait_until(lambda: state(buffer) in ("filling", "full") and Manifest.read(buffer).seed == 0, 60,
                     "the configured job in the finished one's place")
    assert "the configured job on" in again.log and "takes its place" in again.log, again.log
    assert submit(buffer, "--data", shapes_data / "train", *JOB, "--seed", "6", "--epochs", "1").returncode == 0


def test_a_job_refused_at_its_dataset_leaves_the_running_job_producing(shapes_data: Path, shm_dir: Path,
                                                                       start_daemon) -> None:
    """The dataset is opened only after the running job stops for the new one: a missing root
    found then must not leave the buffer without a producer."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    assert submit(buffer, "--data", shapes_data / "train", *JOB).returncode == 0
    loader = BufferLoader(buffer, normalize=False, timeout=30)
    batches = iter(loader)
    first = next(batches)
    # What a member of a --group-access buffer's group can plant: an empty stream directory and a link to
    # one. No job's streams: the running job, restarted after the refusal, must not take them for another's.
    (buffer / "rank-00001").mkdir()
    (buffer / "rank-00002").symlink_to(shapes_data)

    bad = submit(buffer, "--data", shm_dir / "missing", *JOB, "--replace")
    assert bad.returncode == 1 and "does not exist" in bad.stdout, bad.stdout + bad.stderr
    assert f"still producing {shapes_data / 'train'}" in bad.stdout, bad.stdout
    # A URL whose host does not resolve: ftp:// connects as it is opened, and its socket.gaierror killed the
    # daemon, again at every restart on the same job.json (a review).
    unreached = submit(buffer, "--data", "ftp://nohost.invalid/data", *JOB, "--replace")
    assert unreached.returncode == 1 and "cannot reach ftp://nohost.invalid/data" in unreached.stdout, \
        unreached.stdout + unreached.stderr
    assert f"still producing {shapes_data / 'train'}" in unreached.stdout and daemon.proc.poll() is None
    daemon.wait_until(lambda: (r := job_result_of(buffer)) is not None and not r.accepted
                      and state(buffer) in ("filling", "full"), 30, "the running job to go on")
    # Past the 3 batches built before the refusal: the job resumed where the trainer was.
    steps = [(b.epoch, b.step) for b in itertools.islice(batches, 5)]
    assert steps == [(first.epoch, first.step + k) for k in range(1, 6)]
    assert Manifest.read(buffer).batch_size == 8 and daemon.proc.poll() is None
    loader.close()


def test_a_job_that_cannot_resume_after_a_refused_one_leaves_the_daemon_waiting_for_jobs(
        shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """Its dataset cannot be opened any more (here a class folder without images appeared): the daemon
    serving jobs says so and waits, rather than exit."""
    import shutil

    buffer, data = shm_dir / "bf", shm_dir / "copy"
    shutil.copytree(shapes_data / "train", data)
    daemon = start_daemon(buffer, "--workers", "1", "--high-water", "3")
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 30, "the daemon to wait for a job")
    assert submit(buffer, "--data", data, *JOB).returncode == 0
    loader = BufferLoader(buffer, normalize=False, timeout=30)
    next(iter(loader))
    (data / "empty-class").mkdir()  # refused when the dataset is opened again; the running job reads on
    bad = submit(buffer, "--data", shm_dir / "missing", *JOB, "--replace")
    assert bad.returncode == 1 and "does not exist" in bad.stdout, bad.stdout + bad.stderr
    # The refusal is answered before the running job is started again: wait for that start to fail.
    daemon.wait_until(lambda: f"cannot resume the job on {data} after the refused one" in daemon.log, 30,
                      "the daemon to give up resuming the job")
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 30, "the daemon to wait for the next job")
    assert daemon.proc.poll() is None
    loader.close()
    assert submit(buffer, "--data", shapes_data / "train", *JOB, "--replace").returncode == 0


def test_a_job_whose_epochs_were_all_consumed_is_refused_saying_how_to_produce_it_again(
        shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """Submitted again after its trainers read every epoch, the same job has nothing to produce: an
    "accepted: producing" answer would leave the next trainer waiting for batches that never come."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    job = ["--data", shapes_data / "val", "--split", "val", *JOB, "--epochs", "1"]
    assert submit(buffer, *job).returncode == 0
    loader = BufferLoader(buffer, normalize=False, timeout=30)
    assert len(list(loader)) == len(loader) > 0
    loader.close()
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 30, "the daemon to finish the job")
    # Its answer says so: "accepted: producing ..." beside waiting-for-job read as if it were still running.
    done = job_result_of(buffer)
    assert done is not None and done.accepted and done.reason == \
        f"finished producing {shapes_data / 'val'}: every epoch was read", done
    shown = subprocess.run([*CLI, "status", "--buffer", str(buffer)], capture_output=True, text=True, timeout=60).stdout
    assert f"  last job  {done.job_id} finished producing {shapes_data / 'val'}" in shown, shown

    fds = len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))
    for _ in range(3):
        again = submit(buffer, *job)
        assert again.returncode == 1 and "nothing to produce: this job's trainers already consumed the 1 epoch" in \
            again.stdout, again.stdout + again.stderr
    assert f"{buffer / 'progress*.json'}" in again.stdout and daemon.proc.poll() is None
    # Each refused job's worker pool had made its selector and shared file, and nothing closed them (review).
    assert len(os.listdir(f"/proc/{daemon.proc.pid}/fd")) <= fds
    for progress in buffer.glob("progress*.json"):
        progress.unlink()
    assert submit(buffer, *job).returncode == 0
    assert next(iter(BufferLoader(buffer, normalize=False, timeout=30))).step == 0


def test_a_job_submitted_again_while_it_ran_is_answered_finished_once_it_ends(shapes_data: Path, shm_dir: Path,
                                                                             start_daemon) -> None:
    """A trainer that resubmits its running job (resuming after a crash: "already producing this job", status's
    `later`) left that answer as the last one: once the job ended, status said "last job ... accepted: already
    producing this job" beside waiting-for-job, as if it still ran.  That answer is about the running job too."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    job = ["--data", shapes_data / "val", "--split", "val", *JOB, "--epochs", "1"]
    running = submit(buffer, *job)
    assert running.returncode == 0, running.stdout + running.stderr
    loader = BufferLoader(buffer, normalize=False, timeout=30)
    batches = iter(loader)
    read = [next(batches)]
    same = submit(buffer, *job)
    assert same.returncode == 0 and "already producing this job" in same.stdout, same.stdout + same.stderr
    read += list(batches)
    loader.close()
    assert len(read) == len(loader)
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 30, "the daemon to finish the job")
    done = job_result_of(buffer)
    assert done is not None and done.job_id == running.stdout.split()[1] and done.reason == \
        f"finished producing {shapes_data / 'val'}: every epoch was read", done
    shown = subprocess.run([*CLI, "status", "--buffer", str(buffer)], capture_output=True, text=True, timeout=60).stdout
    assert f"  last job  {done.job_id} finished producing" in shown and "already producing" not in shown, shown


def test_a_trainer_started_after_its_job_finished_is_told_so_at_once(shapes_data: Path, shm_dir: Path,
                                                                     start_daemon) -> None:
    """The finished job's manifest stays in the buffer: a trainer started then waited its whole --timeout for a
    batch never to be built, and was told to wait longer "if the daemon is just slow"."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    job = ["--data", shapes_data / "val", "--split", "val", *JOB, "--epochs", "1"]
    assert submit(buffer, *job).returncode == 0
    with BufferLoader(buffer, normalize=False, timeout=30) as first:
        assert len(list(first)) == len(first) > 0
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 30, "the daemon to finish the job")
    late = BufferLoader(buffer, normalize=False, timeout=60, consumer="late")
    began = time.monotonic()
    with pytest.raises(JobEnded) as ended:
        next(iter(late))
    late.close()
    assert time.monotonic() - began < 10
    said = " ".join(str(ended.value).split())
    again = f"prefetchd submit --buffer {buffer} --data {shapes_data / 'val'} --split val --batch-size 8"
    assert "is done with this loader's job (its last answer to a job: finished producing" in said, said
    assert "and waits for a job, so batch" in said and f"`{again}" in said and "--epochs 1`" in said, said
    assert f'refuses it ("nothing to produce") until their progress files ({buffer / "progress*.json"}) are ' \
        "removed" in said, said


def test_a_consumer_that_left_does_not_hold_the_job_against_a_new_one(shapes_data: Path, shm_dir: Path,
                                                                      start_daemon) -> None:
    """Only a trainer still consuming (progress written in the last 30 s) makes a new job need
    --replace; one that closed its loader has left, however recently."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    assert submit(buffer, "--data", shapes_data / "train", *JOB).returncode == 0
    with BufferLoader(buffer, normalize=False, timeout=30, consumer="trial-1") as loader:
        next(iter(loader))
    other = submit(buffer, "--data", shapes_data / "val", "--split", "val", *JOB)
    assert other.returncode == 0 and "accepted" in other.stdout, other.stdout + other.stderr


BROKEN_HOOK = "os:getcwd"  # imports and is callable, so it passes validation; called with (image, rng): TypeError


def test_a_job_whose_hook_fails_while_producing_is_answered_and_the_daemon_serves_the_next(
        shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """A submitted job that fails only once its workers run (its hook raises) must not take the
    daemon down: a supervisor would restart it into the same job.json, to fail again."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    assert submit(buffer, "--data", shapes_data / "train", *JOB, "--transform", BROKEN_HOOK).returncode == 0
    daemon.wait_until(lambda: (r := job_result_of(buffer)) is not None and not r.accepted, 60, "the job's failure")
    result = job_result_of(buffer)
    assert result is not None and result.reason.startswith(f"failed while producing {shapes_data / 'train'}: "), result
    assert f"transform {BROKEN_HOOK} failed on " in result.reason and "TypeError" in result.reason, result
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 30, "the daemon to wait for the next job")
    out = subprocess.run([*CLI, "status", "--buffer", str(buffer)], capture_output=True, text=True)
    assert f"last job  {result.job_id} failed while producing" in out.stdout, out.stdout

    good = submit(buffer, "--data", shapes_data / "train", *JOB)
    assert good.returncode == 0 and "accepted" in good.stdout, good.stdout + good.stderr
    assert next(iter(BufferLoader(buffer, normalize=False, timeout=30))).images.shape == (8, 3, 32, 32)


def test_a_hook_that_fails_in_the_job_given_at_start_is_a_configuration_error(shapes_data: Path, shm_dir: Path,
                                                                             start_daemon) -> None:
    """Exit 2, which the service unit does not restart: a restart would fail the same way."""
    daemon = start_daemon(shm_dir / "bf", "--data", shapes_data / "train", *JOB, "--workers", "1",
                          "--transform", BROKEN_HOOK)
    assert daemon.proc.wait(timeout=90) == 2, daemon.log
    assert f"transform {BROKEN_HOOK} failed on " in daemon.log


def test_a_replaced_jobs_trainer_stops_and_the_new_job_starts_at_its_beginning(shapes_data: Path, shm_dir: Path,
                                                                               start_daemon) -> None:
    """`submit --replace` under a live trainer: that trainer must not take the new job's batches
    (smaller ones passed its checks), and its position, written back before it notices, must not
    become the new job's (a 1-epoch job would count as consumed at once)."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    assert submit(buffer, "--data", shapes_data / "train", *JOB, "--epochs", "3").returncode == 0
    old = BufferLoader(buffer, normalize=False, timeout=30)
    old_key = old.manifest.job_key
    batches = (batch for _ in range(3) for batch in old)  # its 3 epochs, one iter() each
    sizes = [next(batches).images.shape[0] for _ in range(old.manifest.steps_per_epoch + 2)]  # into epoch 1

    forced = submit(buffer, "--data", shapes_data / "train", "--batch-size", "4", "--image-size", "32",
                    "--epochs", "1", "--replace")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    Progress(1, 2, job=old_key).write(buffer)  # the old trainer's position, as it would write it back
    with pytest.raises(JobReplaced,
                       match=r"serves another job \(batch_size: 8 -> 4; epochs: 3 -> 1\).*prefetchd submit --buffer") as told:
        for batch in batches:
            sizes.append(batch.images.shape[0])
    # Who did it, from the daemon's status (running_job), where it said "someone".
    job_id = forced.stdout.split()[1]
    assert f"{user_name(os.getuid())} replaced this loader's job (job {job_id}, submitted 20" in str(told.value), told.value
    assert set(sizes) == {8}, "the old trainer got a batch of the new job"
    # Seen before the new trainer writes its own position over it (a busy daemon may read later).
    daemon.wait_until(lambda: "wrote it for another job" in daemon.log, 30, "the old position to be set aside")
    # What every --replace leaves: not a warning (a soak counted 84 of its 84 warnings so).
    assert re.search(r"INFO +\S+: ignoring \S+progress.json: pid \d+ wrote it for another job", daemon.log), daemon.log

    new = BufferLoader(buffer, normalize=False, timeout=30)
    steps = [(b.epoch, b.step, b.images.shape[0]) for b in new]
    assert steps == [(0, k, 4) for k in range(new.manifest.steps_per_epoch)]
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 30, "the new job to be consumed")
    stop = subprocess.run([*CLI, "stop", "--buffer", str(buffer)], capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert state(buffer) == "stopped"  # its last word, not "waiting for a job: prefetchd submit ..."


def test_a_trainer_whose_next_batch_is_the_replacing_jobs_is_told_its_job_was_replaced(
        shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """The new job writes the batch names the old trainer reads next: a batch of another seed, mapped
    there, is the replacement (JobReplaced), not a stray file to delete with the daemon stopped."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    assert submit(buffer, "--data", shapes_data / "train", *JOB, "--epochs", "1", "--seed", "5").returncode == 0
    old = BufferLoader(buffer, normalize=False, timeout=30)
    batches = iter(old)
    next(batches), next(batches)
    forced = submit(buffer, "--data", shapes_data / "train", *JOB, "--epochs", "1", "--seed", "6", "--replace")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    daemon.wait_until(lambda: (buffer / "e000000-s00000002.batch").exists() and Manifest.read(buffer).seed == 6, 30,
                      "the new job's batch under the name the old trainer reads next")
    with pytest.raises(JobReplaced, match=r"serves another job \(seed: 5 -> 6"):
        next(batches)


def test_a_trainer_whose_job_is_submitted_again_for_other_epochs_is_told_so(shapes_data: Path, shm_dir: Path,
                                                                           start_daemon) -> None:
    """--epochs is not the job's identity (its batches stay, the daemon goes on from the trainer's position), but
    the trainer's end is no longer the daemon's: it read on past the new one and waited out its timeout for a
    batch the daemon, done, would never write ("waiting for a job").  It stops at its next batch, naming the
    epochs and what to do."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    assert submit(buffer, "--data", shapes_data / "train", *JOB, "--epochs", "3").returncode == 0
    old = BufferLoader(buffer, normalize=False, timeout=10)
    batches = (batch for _ in range(3) for batch in old)  # its 3 epochs, one iter() each
    next(batches), next(batches)
    forced = submit(buffer, "--data", shapes_data / "train", *JOB, "--epochs", "1", "--replace")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    with pytest.raises(JobReplaced) as told:
        for _ in batches:
            pass
    message = str(told.value)
    assert "--epochs 1 (this loader's had --epochs 3)" in message, message
    assert f"{user_name(os.getuid())} submitted it again (job {forced.stdout.split()[1]}, submitted 20" in message, message
    assert "start the trainer again" in message and "--epochs 3 --replace" in message, message
    assert "kept" in daemon.log, "the batches of the same job stay"


def test_a_trainer_whose_job_is_submitted_again_for_more_epochs_reads_on_to_its_own_end(
        shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """A later end costs the running trainer nothing: it ends where it counted on, not with an error."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    assert submit(buffer, "--data", shapes_data / "train", *JOB, "--epochs", "2").returncode == 0
    loader = BufferLoader(buffer, normalize=False, timeout=30)
    read = [next(iter(loader))]
    assert submit(buffer, "--data", shapes_data / "train", *JOB, "--epochs", "4", "--replace").returncode == 0
    read += [batch for batch in loader] + [batch for batch in loader]  # the rest of epoch 0, then epoch 1
    assert len(read) == 2 * len(loader) and loader.position == (2, 0)  # its 2 epochs, to the end
    loader.close()


def test_the_running_job_to_a_later_end_needs_no_replace_but_to_an_earlier_one_does(
        shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """A resubmit that changes only --epochs gives a reading trainer the same batches: to a later end it costs that
    trainer nothing and is accepted without --replace (it was refused, even to the trainer's own user), saying what
    changed; to an earlier end it would stop that trainer short of its end (JobReplaced), so it still needs
    --replace, and the refusal says why."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    job = ["--data", shapes_data / "train", *JOB]
    assert submit(buffer, *job, "--epochs", "2").returncode == 0
    loader = BufferLoader(buffer, normalize=False, timeout=30)
    batches = iter(loader)
    read = [next(batches), next(batches)]  # the trainer reads: its progress is fresh

    earlier = submit(buffer, *job, "--epochs", "1")
    assert earlier.returncode == 1, earlier.stdout + earlier.stderr
    assert "this job is that one with an earlier end (--epochs 1 instead of --epochs 2)" in earlier.stdout, earlier.stdout
    assert "stop at their next batch (JobReplaced)" in earlier.stdout and "--replace" in earlier.stdout, earlier.stdout

    later = submit(buffer, *job, "--epochs", "4")
    assert later.returncode == 0, later.stdout + later.stderr
    assert (f"producing {shapes_data / 'train'} for {user_name(os.getuid())}, the running job with --epochs 4 "
            "instead of --epochs 2: its batches kept, its trainers read on to their own end") in later.stdout, later.stdout
    daemon.wait_until(lambda: Manifest.read(buffer).epochs == 4, 30, "the later end's manifest")
    read += list(batches) + list(loader)  # the rest of epoch 0, then epoch 1: no JobReplaced
    assert len(read) == 2 * len(loader) and loader.position == (2, 0)  # its 2 epochs, to the end
    loader.close()


def test_status_shows_the_job_that_runs_and_apart_from_it_a_later_refusal(shapes_data: Path, shm_dir: Path,
                                                                            start_daemon) -> None:
    """`prefetchd status` said "last job" of the latest answer: a request refused while another job ran read as the
    job there.  It shows the job that runs (who submitted it, when) and, on a line of its own, a later answer."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    running = submit(buffer, "--data", shapes_data / "train", *JOB, "--seed", "5")
    assert running.returncode == 0, running.stdout + running.stderr
    running_id, me = running.stdout.split()[1], user_name(os.getuid())
    loader = BufferLoader(buffer, normalize=False, timeout=30)
    batches = iter(loader)
    next(batches), next(batches)  # a trainer reads: another job needs --replace
    refused = submit(buffer, "--data", shapes_data / "train", *JOB, "--seed", "6")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    refused_id = refused.stdout.split()[1]

    def status_text() -> str:
        out = subprocess.run([*CLI, "status", "--buffer", str(buffer)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    shown = status_text()
    assert re.search(rf"^  job       {running_id} submitted by {re.escape(me)} at 20[-0-9: ]+: producing "
                     rf"{re.escape(str(shapes_data / 'train'))} for ", shown, re.M), shown
    assert re.search(rf"^  REFUSED   {refused_id} submitted by {re.escape(me)}, answered at 20[-0-9: ]+ \(the job above "
                     rf"runs on\): a trainer of {re.escape(me)} is consuming the running job", shown, re.M), shown
    assert "last job" not in shown, shown
    status = read_status(buffer)
    assert status is not None and status.running_job is not None and status.job_result is not None
    assert (status.running_job.job_id, status.running_job.submitter) == (running_id, os.geteuid())
    assert (status.job_result.job_id, status.job_result.submitter) == (refused_id, os.geteuid())

    same = submit(buffer, "--data", shapes_data / "train", *JOB, "--seed", "5")  # the running job, again
    assert same.returncode == 0 and "already producing this job" in same.stdout, same.stdout + same.stderr
    shown = status_text()
    assert f"  job       {running_id} submitted by {me}" in shown, shown
    assert f"  later     {same.stdout.split()[1]} submitted by {me}, answered at " in shown, shown
    assert "(the job above runs on): accepted: already producing this job" in shown and "REFUSED" not in shown, shown
    # The daemon's record of the running job renamed back to job.json (as a member of the group may): refused under
    # the running job's id, which hid the refusal (a review).
    os.rename(buffer / "job.accepted.json", buffer / "job.json")
    daemon.wait_until(lambda: (r := read_status(buffer)) is not None and r.job_result is not None
                      and not r.job_result.accepted and r.job_result.job_id == running_id, 30, "the record's refusal")
    shown = status_text()
    assert f"  job       {running_id} submitted by {me}" in shown, shown
    assert re.search(rf"^  REFUSED   {running_id} submitted by {re.escape(me)}, answered at .*renamed", shown, re.M), shown
    loader.close()


def test_a_refusal_made_while_a_job_ran_is_not_shown_as_the_last_job_once_that_ends(shapes_data: Path, shm_dir: Path,
                                                                                   start_daemon) -> None:
    """Once the job ended, status said "last job <the refused one> refused: a trainer ... is consuming the running
    job", a job that never ran and a trainer long gone, and the job that ended was not logged (a user's soak)."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    running = submit(buffer, "--data", shapes_data / "train", *JOB, "--epochs", "1")
    assert running.returncode == 0, running.stdout + running.stderr
    running_id, me = running.stdout.split()[1], user_name(os.getuid())
    with BufferLoader(buffer, normalize=False, timeout=30) as loader:
        batches = iter(loader)
        next(batches)
        refused = submit(buffer, "--data", shapes_data / "val", *JOB)
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert len(list(batches)) == len(loader) - 1
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 60, "the job's end")
    shown = subprocess.run([*CLI, "status", "--buffer", str(buffer)], capture_output=True, text=True, timeout=60).stdout
    assert re.search(rf"^  REFUSED   {refused.stdout.split()[1]} submitted by {re.escape(me)}, answered at 20[-0-9: ]+: "
                     rf"a trainer of {re.escape(me)} is consuming", shown, re.M), shown
    assert "last job" not in shown, shown
    assert f"job {running_id} finished producing {shapes_data / 'train'}: every epoch was read" in daemon.log


def test_a_finished_jobs_answer_counts_the_files_it_replaced(shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """Once the job ended, the status (waiting for the next) had no word of its undecodable files: a monitor
    polling every 30 s missed a short job's errors entirely (a user's walk)."""
    import shutil

    data = shm_dir / "data"
    shutil.copytree(shapes_data / "val", data)
    first_class = sorted(p for p in data.iterdir() if p.is_dir())[0]
    (first_class / "zz-broken.jpg").write_bytes(b"\xff\xd8 not a JPEG")
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    assert submit(buffer, "--data", data, "--split", "val", *JOB, "--epochs", "1").returncode == 0
    with BufferLoader(buffer, normalize=False, timeout=30) as loader:
        assert len(list(loader)) == len(loader) > 0
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 30, "the daemon to finish the job")
    done = job_result_of(buffer)
    assert done is not None and done.reason == (f"finished producing {data}: every epoch was read; files that could not "
                                                "be decoded or read: 1, their samples replaced (the daemon's log names "
                                                "them)"), done


def test_a_restart_after_a_job_finished_keeps_its_answer(shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """A restart took job.json again, the job whose epochs were all read: "refused: nothing to produce", and status
    said "last job ... refused" of a job that had run to its end (a user's walk)."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    assert submit(buffer, "--data", shapes_data / "val", "--split", "val", *JOB, "--epochs", "1").returncode == 0
    with BufferLoader(buffer, normalize=False, timeout=30) as loader:
        assert len(list(loader)) == len(loader) > 0
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 30, "the daemon to finish the job")
    done = job_result_of(buffer)
    assert done is not None and done.reason.startswith("finished producing"), done
    daemon.terminate()
    again = start_daemon(buffer, "--workers", "1", "--high-water", "3")
    again.wait_until(lambda: (status := read_status(buffer)) is not None and status.pid == again.proc.pid
                     and status.state == "waiting-for-job", 30, "the restarted daemon to wait for a job")
    time.sleep(1.5)  # its inbox looks at job.json every second
    assert job_result_of(buffer) == done and "refused" not in again.log, again.log
    shown = subprocess.run([*CLI, "status", "--buffer", str(buffer)], capture_output=True, text=True, timeout=60).stdout
    assert f"  last job  {done.job_id} finished producing {shapes_data / 'val'}" in shown, shown


def test_a_refusal_for_a_trainer_killed_moments_ago_says_it_is_gone(shapes_data: Path, shm_dir: Path,
                                                                     start_daemon) -> None:
    """A trainer killed 2 s before still keeps a plain submit off the job (its restart would resume it), but the
    refusal said it "is consuming" the job, as of a live one, pushing its user to --replace (a user's soak)."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    assert submit(buffer, "--data", shapes_data / "train", *JOB).returncode == 0
    reads = ("import sys, time\nfrom prefetchd.trainer import BufferLoader\n"
             f"batches = iter(BufferLoader({str(buffer)!r}, normalize=False, timeout=60))\n"
             "next(batches), next(batches)\nprint('read', flush=True)\ntime.sleep(600)\n")
    trainer = subprocess.Popen([sys.executable, "-c", reads], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout is not None and trainer.stdout.readline() == "read\n"
    finally:
        trainer.kill()
        trainer.wait()
    refused = submit(buffer, "--data", shapes_data / "val", "--split", "val", *JOB)
    said = " ".join(refused.stdout.split())
    assert refused.returncode == 1, said
    assert re.search(rf"a trainer of {re.escape(user_name(os.getuid()))} that wrote its progress \d+ s ago is gone, and "
                     rf"a restart of it within \d+ s would resume the running job on {re.escape(str(shapes_data))}",
                     said), said
    assert "is consuming" not in said and "--replace" in said, said


def test_job_submitted_before_the_daemon_starts_is_adopted(shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    buffer = shm_dir / "bf"
    out = submit(buffer, "--data", shapes_data / "train", *JOB, "--epochs", "1")
    assert out.returncode == 3 and "waits in job.json" in out.stdout  # not accepted (yet): not 0
    assert f"this created {buffer}: if you meant a running daemon's buffer, check the path" in out.stdout  # a typo?
    again = submit(buffer, "--data", shapes_data / "train", *JOB, "--epochs", "1")
    assert again.returncode == 3 and "this created" not in again.stdout
    daemon = start_daemon(buffer, "--workers", "1", "--high-water", "2")
    loader = BufferLoader(buffer, normalize=False, timeout=60)
    assert sum(len(b.indices) for b in loader) == 72  # the whole epoch of the submitted job
    loader.close()
    # A job's epochs consumed: a daemon serving jobs goes back to waiting instead of exiting.
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 30, "the daemon to wait for the next job")
    daemon.wait_until(lambda: "waiting for a job" in daemon.log, 30, "the log to say it waits")
    # Only then: it said so 27 ms before "job ... accepted" as it started on the waiting job.json (a walk).
    assert daemon.log.index("accepted") < daemon.log.index("waiting for a job"), daemon.log


def seeds_waiting(buffer: Path) -> set[int]:
    """The seeds of the finished batches in ``buffer``, read from their headers."""
    return {map_batch(path).meta.seed for path in list_batches(buffer).values()}


def test_a_submit_answered_accepted_leaves_only_the_new_jobs_manifest_and_batches(shapes_data: Path, shm_dir: Path,
                                                                                  start_daemon) -> None:
    """DROP_IN.md section 6: exit 0 means "your job runs (its manifest is written); start the script". A script
    `prefetchd submit ... && python main.py` opens its loader at once: had the answer come before the job it
    replaced was cleared (while the new job's dataset is indexed: minutes for ImageNet's first walk), the loader
    would take that job's manifest and hand out its batches, which a batch of the same shape passes every reader
    check with (the seed aside, which tells them apart here). So the answer is watched for as submit waits: from
    the first status that says accepted, the manifest and the batches are the new job's."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--workers", "1", "--high-water", "3", "--low-water", "1")
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 30, "the daemon to wait for a job")
    assert submit(buffer, "--data", shapes_data / "train", *JOB, "--seed", "5").returncode == 0
    daemon.wait_until(lambda: state(buffer) == "full" and seeds_waiting(buffer) == {5}, 60, "the first job's batches")
    # No trainer read it: the new job needs no --replace, and takes the buffer.
    submitting = subprocess.Popen([*CLI, "submit", "--buffer", str(buffer), "--data", str(shapes_data / "train"),
                                   *JOB, "--seed", "6"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen_then: tuple[int, set[int]] | None = None  # the manifest's seed and the batches' when "accepted" shows
    while seen_then is None and submitting.poll() is None:
        request = JobRequest.read(buffer)
        result = job_result_of(buffer)
        if request is not None and request.settings.get("seed") == 6 and result is not None and result.job_id == request.job_id:
            assert result.accepted, result
            seen_then = Manifest.read(buffer).seed, seeds_waiting(buffer)
    said = submitting.communicate(timeout=90)[0]
    assert submitting.returncode == 0 and "accepted" in said, said
    if seen_then is not None:  # else submit saw the answer first and left: the checks below then stand alone
        assert seen_then[0] == 6, "the status said accepted while the manifest a loader would open was the old job's"
        assert seen_then[1] <= {6}, "the status said accepted while the old job's batches were there to be read"
    assert Manifest.read(buffer).seed == 6 and seeds_waiting(buffer) <= {6}
    with BufferLoader(buffer, normalize=False, timeout=30) as loader:
        assert loader.manifest.seed == 6
        first = next(iter(loader))
    assert (first.epoch, first.step) == (0, 0)


def test_a_submit_the_daemon_does_not_answer_within_its_timeout_exits_1(shapes_data: Path, shm_dir: Path,
                                                                         start_daemon) -> None:
    """README: exit code 1 when no answer comes within --timeout. Exit 0 would have `prefetchd submit ... &&
    python main.py` train on whatever job the buffer serves. A SIGSTOPped daemon (one indexing a large dataset
    looks the same to submit) owns the buffer and answers nothing; continued, it answers the same request."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--workers", "1", "--high-water", "2")
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 30, "the daemon to wait for a job")
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        unanswered = submit(buffer, "--data", shapes_data / "train", *JOB, "--timeout", "2")
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    assert unanswered.returncode == 1, unanswered.stdout + unanswered.stderr
    job_id = JobRequest.read(buffer).job_id  # type: ignore[union-attr]
    assert (f"the daemon on {buffer} did not answer job {job_id} within 2 s; see `prefetchd status --buffer "
            f"{buffer}`") in unanswered.stderr, unanswered.stderr
    assert "accepted" not in unanswered.stdout
    # The request was not lost: the daemon, running again, takes it.
    daemon.wait_until(lambda: (r := job_result_of(buffer)) is not None and r.job_id == job_id and r.accepted, 60,
                      "the answer to the request submit gave up on")


def test_malformed_and_unknown_job_settings_are_refused(shm_dir: Path, start_daemon) -> None:
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--workers", "1")
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 30, "waiting")
    JobRequest({"data": "/x", "colour": "blue"}).write(buffer)
    daemon.wait_until(lambda: (r := job_result_of(buffer)) is not None and r.accepted is False, 30, "a refusal")
    result = job_result_of(buffer)
    assert result is not None
    reason = result.reason
    assert "unknown job settings ['colour']" in reason and "batch_size" in reason
    # A malformed document is answered under its job_id, so that its submitter finds the answer.
    listed = JobRequest({"batch_size": [8]})  # type: ignore[dict-item]
    listed.write(buffer)
    daemon.wait_until(lambda: (r := job_result_of(buffer)) is not None and r.job_id == listed.job_id, 30,
                      "the list setting's refusal")
    assert "setting 'batch_size' is [8]" in reason_of(buffer)
    (buffer / "job.json").write_text("{ not json")
    daemon.wait_until(lambda: (r := job_result_of(buffer)) is not None and "not valid JSON" in r.reason, 30, "a refusal")
    out = subprocess.run([*CLI, "status", "--buffer", str(buffer)], capture_output=True, text=True)
    assert "  REFUSED   (unreadable), answered at " in out.stdout and "None" not in out.stdout, out.stdout
    assert f"job {listed.job_id} refused" in daemon.log and "job (unreadable) refused" in daemon.log
    assert daemon.proc.poll() is None


def test_a_job_with_values_no_setting_can_hold_is_refused_and_the_daemon_goes_on(shm_dir: Path, start_daemon) -> None:
    """Any member of the buffer's group writes job.json: a float of 10**400 (OverflowError) and a NUL in
    its data (ValueError) each stopped the daemon with "internal error", and again at each restart on the
    same job.json.  A megabyte-long value was quoted whole in the refusal, and status.json outgrew what its
    readers take."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--workers", "1")
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 30, "waiting")
    for settings, said in (({"data": "/x", "val_fraction": 10**400}, "expected a finite number"),
                           ({"data": "/x", "epochs": 10**30}, "expected a number below 2**63"),
                           ({"data": "/x\x00y"}, "contains a NUL character"),
                           ({"data": "/x", "ranks": "0-1," * 250_000}, "(1000002 characters)"),
                           ({"data": "/" + "x" * 1_000_000}, "characters in all)"),
                           ({"data": "/x", "k" * 500_000: 1}, "unknown job settings ['kkk"),
                           # written by hand (`submit` makes it absolute): the daemon's cwd is not the submitter's
                           ({"data": "imagenet/train"}, "data 'imagenet/train' is a relative path, which the daemon "
                                                        "would take from its own working directory")):
        request = JobRequest(settings)  # type: ignore[arg-type]
        request.write(buffer)
        daemon.wait_until(lambda: (r := job_result_of(buffer)) is not None and r.job_id == request.job_id, 30,
                          f"the refusal of {list(settings)}")
        reason = reason_of(buffer)
        assert said in reason and len(reason) <= MAX_REASON_CHARS, reason[:3000]
        assert daemon.proc.poll() is None, daemon.log
    assert "Traceback" not in daemon.log and "internal error" not in daemon.log, daemon.log


def reason_of(buffer: Path) -> str:
    result = job_result_of(buffer)
    assert result is not None
    return result.reason


def test_config_show_layers_defaults_file_and_flags(tmp_path: Path, shm_dir: Path) -> None:
    cfg = tmp_path / "bf.toml"
    cfg.write_text('data = "data"\nbatch-size = 64\nseed = 5\n')
    out = subprocess.run([*CLI, "config", "--show", "--config", str(cfg), "--buffer", str(shm_dir), "--seed", "9"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" = ", 1) for line in out.stdout.splitlines() if " = " in line and not line.startswith("#"))
    assert lines["batch_size"] == "64"  # from the file
    assert lines["seed"] == "9"  # the flag beats the file
    assert lines["image_size"] == "224"  # the dataclass default
    assert json.loads(lines["data"]) == str(tmp_path / "data")  # relative to the config file
    assert "# default:" in lines["workers"] and "usable CPUs" in lines["workers"]
    not_yet = shm_dir / "not" / "yet"  # the daemon would create it; sized from the filesystem it would be on
    out = subprocess.run([*CLI, "config", "--show", "--buffer", str(not_yet)], capture_output=True, text=True)
    assert out.returncode == 0 and "high_water = " in out.stdout, out.stderr
    assert not not_yet.exists()
    bad = subprocess.run([*CLI, "config", "--show", "--buffer", str(shm_dir), "--split", "test"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "test" in bad.stderr


def test_show_renders_the_next_waiting_batch(shapes_data: Path, shm_dir: Path, start_daemon, tmp_path: Path) -> None:
    buffer = shm_dir / "bf"
    empty = subprocess.run([*CLI, "show", "--buffer", str(shm_dir), "--out", str(tmp_path / "x.png")],
                           capture_output=True, text=True)
    assert empty.returncode == 1 and "no waiting batch" in empty.stderr
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *JOB, "--workers", "1", "--high-water", "2")
    daemon.wait_until(lambda: state(buffer) == "full", 30, "a full buffer")
    out = subprocess.run([*CLI, "show", "--buffer", str(buffer), "--out", str(tmp_path / "grid.png")],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "epoch 0 step 0" in out.stdout, out.stderr
    grid = Image.open(tmp_path / "grid.png")
    # 8 images of 32 px are scaled to 96 px tiles, 3 columns x 3 rows, with a label strip each.
    assert grid.size == (3 * 96, 3 * (96 + 14))


@pytest.mark.parametrize("journal", [True, False])
def test_log_lines_carry_journald_priorities_under_systemd(shm_dir: Path, journal: bool) -> None:
    env = {**os.environ, "JOURNAL_STREAM": "8:1234"} if journal else {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    out = subprocess.run([*CLI, "start", "--buffer", str(shm_dir / "bf"), "--data", str(shm_dir / "missing")],
                         capture_output=True, text=True, env=env, timeout=60)
    error_line = next(line for line in out.stderr.splitlines() if "does not exist" in line)
    assert error_line.startswith("<3>prefetchd: ") == journal
    assert ("ERROR" in error_line) != journal


def _epoll_fds(pid: int) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd) == "anon_inode:[eventpoll]"
        except FileNotFoundError:  # closed between the listing and the look: the daemon goes on working
            pass
    return count


def test_replacing_a_job_by_one_of_another_world_size(shapes_data: Path, shm_dir: Path, start_daemon) -> None:
    """World size 1 -> 3 -> 2 by `submit --replace`: the single-rank trainer is told at once (it waited
    out its timeout for a LoaderTimeout), the third rank's stream goes with its job (it went on serving
    the replaced job's batches to a loader opened there), and no job change leaves a descriptor open."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    assert submit(buffer, "--data", shapes_data / "train", *JOB, "--seed", "5").returncode == 0
    single = iter(BufferLoader(buffer, normalize=False, timeout=60))
    next(single), next(single)
    epolls = _epoll_fds(daemon.proc.pid)

    wide = submit(buffer, "--data", shapes_data / "train", *JOB, "--seed", "6", "--world-size", "3", "--replace")
    assert wide.returncode == 0, wide.stdout + wide.stderr
    # Who submitted it, from the daemon's status (running_job).
    who = rf"which {re.escape(user_name(os.getuid()))} submitted \(job {wide.stdout.split()[1]}, submitted 20[-0-9: ]+\)"
    with pytest.raises(JobReplaced, match=rf"for --world-size 3 \(this loader's was 1\), {who}, and keeps "
                                          "one stream per rank"):
        for _ in single:
            pass
    daemon.wait_until(lambda: len(list(buffer.glob("rank-*/e000000-s00000000.batch"))) == 3, 60, "three ranks' batches")
    third = BufferLoader(buffer / "rank-00002", normalize=False, timeout=60)  # holds rank 2's consumer lock file
    next(iter(third))

    narrow = submit(buffer, "--data", shapes_data / "train", *JOB, "--seed", "7", "--world-size", "2", "--replace")
    assert narrow.returncode == 0, narrow.stdout + narrow.stderr
    daemon.wait_until(lambda: (buffer / "rank-00001" / "e000000-s00000000.batch").exists()
                      and Manifest.read(buffer / "rank-00001").seed == 7, 60, "the two-rank job's batches")
    assert sorted(p.name for p in buffer.glob("rank-*")) == ["rank-00000", "rank-00001"], daemon.log
    assert _epoll_fds(daemon.proc.pid) == epolls, "a job change left the old pool's selector open"
    third.close()


def test_a_trainer_of_one_rank_keeps_a_job_from_being_replaced_without_replace(tmp_path: Path) -> None:
    """The guard looked only at the buffer's top, where a many-rank job has no progress file: a plain
    submit replaced a job whose ranks' trainers were reading."""
    from prefetchd.daemon.job_inbox import freshest_progress

    (tmp_path / "rank-00001").mkdir()
    assert freshest_progress(tmp_path) == (float("inf"), None, False)
    Progress(0, 3).write(tmp_path / "rank-00001")
    idle, writer, gone = freshest_progress(tmp_path)
    assert idle < 5 and writer == os.getuid() and not gone  # written by this test process, alive


def test_the_freshest_trainer_killed_is_not_said_gone_while_another_reads_on(tmp_path: Path) -> None:
    """Two consumers, the freshest killed: a plain submit was refused saying the trainer "is gone", and its user
    sent to --replace, while the other read on (a regression walk)."""
    from prefetchd.daemon.job_inbox import freshest_progress

    Progress(0, 3).write(tmp_path, "alice")  # this test process: alive
    time.sleep(0.05)
    subprocess.run([sys.executable, "-c", "import sys; from prefetchd.buffer_protocol import Progress; "
                    "Progress(0, 5).write(sys.argv[1], 'bob')", str(tmp_path)], check=True, timeout=60)
    idle, writer, gone = freshest_progress(tmp_path)
    assert not gone and idle < 5 and writer == os.getuid()
    os.unlink(tmp_path / "progress.alice.json")
    assert freshest_progress(tmp_path)[2], "bob alone: gone"


def test_a_flood_of_progress_files_costs_a_submission_a_bounded_number_of_reads(tmp_path: Path) -> None:
    """Any member of a --group-access buffer's group may put progress files there, and each job.json read every
    one to see whether its consumer had left: 20,000 made a submission wait a second.  At most
    MAX_PROGRESS_READS are read, the freshest first; past them the next counts whether or not its consumer left."""
    from prefetchd.daemon.consumers import MAX_PROGRESS_READS
    from prefetchd.daemon.job_inbox import freshest_progress

    (tmp_path / "rank-00001").mkdir()
    Progress(0, 3).write(tmp_path / "rank-00001")  # a trainer, last heard of an hour ago
    now = time.time()
    os.utime(tmp_path / "rank-00001" / "progress.json", (now - 3600, now - 3600))
    for i in range(MAX_PROGRESS_READS + 10):  # consumers that left, newer than it
        Progress(0, 0, closed=True).write(tmp_path, f"c{i:05d}")
        os.utime(tmp_path / f"progress.c{i:05d}.json", (now - 10 - i, now - 10 - i))
    for i in range(1000):  # and older junk, never read
        (tmp_path / f"progress.j{i:05d}.json").write_text("not a progress document")
        os.utime(tmp_path / f"progress.j{i:05d}.json", (now - 7200, now - 7200))
    idle, writer, _ = freshest_progress(tmp_path)
    assert idle == pytest.approx(10 + MAX_PROGRESS_READS, abs=5) and writer == os.getuid()
    for i in range(MAX_PROGRESS_READS, MAX_PROGRESS_READS + 10):
        os.unlink(tmp_path / f"progress.c{i:05d}.json")
    idle, _, _ = freshest_progress(tmp_path)
    assert idle == pytest.approx(3600, abs=5), "within the bound, consumers that left do not count"


def test_a_restart_with_fewer_ranks_leaves_the_other_ranks_streams(shapes_data: Path, shm_dir: Path,
                                                                   start_daemon) -> None:
    """Only another job's streams go when a job starts: the same job's ranks another daemon (or a later
    restart) may serve are its data, kept as the served ranks' batches are."""
    buffer = shm_dir / "bf"
    wide = ["--data", shapes_data / "train", *JOB, "--world-size", "2", "--workers", "1", "--high-water", "2"]
    first = start_daemon(buffer, *wide)
    first.wait_until(lambda: (buffer / "rank-00001" / "e000000-s00000001.batch").exists(), 60, "rank 1's batches")
    first.terminate()
    assert first.wait_exit() == 0
    second = start_daemon(buffer, *wide, "--ranks", "0")
    second.wait_until(lambda: "producing" in second.log, 60, "the job to start")
    assert (buffer / "rank-00001" / "e000000-s00000001.batch").exists(), second.log


def test_a_folder_put_in_an_old_stream_folder_does_not_stop_a_job_switch(shapes_data: Path, shm_dir: Path,
                                                                         start_daemon) -> None:
    """A group member who made a folder inside a stream folder of the daemon's (`mkdir rank-00009/sub`) made
    every job switch crash the daemon (rmdir: not empty), and each restart again on the same job.json."""
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--workers", "1", "--high-water", "3", "--group-access")
    daemon.wait_until(lambda: state(buffer) == "waiting-for-job", 30, "the daemon to wait for a job")
    assert submit(buffer, "--data", shapes_data / "train", *JOB).returncode == 0
    daemon.wait_until(lambda: (buffer / "manifest.json").exists(), 30, "the first job's manifest")
    (buffer / "rank-00009" / "sub").mkdir(parents=True)
    (buffer / "rank-00009" / "e000000-s00000000.batch").write_bytes(b"an old job's")
    forced = submit(buffer, "--data", shapes_data / "train", *JOB, "--seed", "1", "--replace")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    daemon.wait_until(lambda: Manifest.read(buffer).seed == 1, 30, "the new job's manifest")
    assert daemon.proc.poll() is None, daemon.log
    assert "could not remove" in daemon.log and "rank-00009" in daemon.log


def test_a_newline_in_a_jobs_fields_forges_no_log_line(shm_dir: Path, start_daemon) -> None:
    """Any member of the buffer's group may submit a job: its data echoed in the refusal must not start a line
    of its own making in the daemon's log."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    forged = "2026-01-01 00:00:00,000 WARNING prefetchd.daemon.main: FORGED LINE"
    bad = submit(buffer, "--data", f"{shm_dir}/nope\n{forged}", *JOB)
    assert bad.returncode == 1 and "does not exist" in bad.stdout, bad.stdout + bad.stderr
    daemon.wait_until(lambda: "FORGED LINE" in daemon.log, 30, "the refusal in the log")
    assert not any(line.startswith("2026-01-01") for line in daemon.log.splitlines()), daemon.log
    assert r"nope\n2026-01-01" in daemon.log


def test_a_refusals_reason_shows_a_jobs_control_characters_escaped(shm_dir: Path, start_daemon) -> None:
    """The reason quotes the job's data, which any member of the buffer's group wrote: `prefetchd submit` and
    `prefetchd status` (whoever runs them) show its newline and terminal escape as the log does, never as such."""
    buffer, daemon = waiting_daemon(start_daemon, shm_dir)
    bad = submit(buffer, "--data", f"{shm_dir}/nope\nFORGED LINE\x1b[2J", *JOB)
    assert bad.returncode == 1 and "does not exist" in bad.stdout, bad.stdout + bad.stderr
    assert bad.stdout.count("\n") == 1 and "\x1b" not in bad.stdout, repr(bad.stdout)
    assert r"nope\nFORGED LINE\x1b[2J" in bad.stdout, bad.stdout
    reason = reason_of(buffer)
    assert reason.isprintable() and r"nope\nFORGED LINE\x1b[2J" in reason, reason
    out = subprocess.run([*CLI, "status", "--buffer", str(buffer)], capture_output=True, text=True)
    assert "\x1b" not in out.stdout and not any(line.startswith("FORGED") for line in out.stdout.splitlines())
    assert "  REFUSED   " in out.stdout and r"nope\nFORGED LINE\x1b[2J" in out.stdout, out.stdout


def test_a_stream_folder_swapped_for_a_link_while_a_job_runs_gets_no_file(shapes_data: Path, shm_dir: Path,
                                                                         start_daemon) -> None:
    """A group member who renamed a running job's stream folder away and put a link to another folder of the
    daemon's user in its place had the daemon write its manifest and batches there ("vanished ... building it
    again").  The daemon stops instead, naming the folder."""
    private = shm_dir / "private"
    private.mkdir(mode=0o700)
    (private / "e000000-s00000000.batch").write_bytes(b"precious")
    buffer = shm_dir / "bf"
    daemon = start_daemon(buffer, "--data", shapes_data / "train", *JOB, "--world-size", "2", "--workers", "1",
                          "--high-water", "3", "--group-access")
    daemon.wait_until(lambda: len(list_batches(buffer / "rank-00001")) >= 1, 60, "rank 1's first batch")
    os.rename(buffer / "rank-00001", buffer / "moved-away")
    os.symlink(private, buffer / "rank-00001")
    for path in list_batches(buffer / "moved-away").values():  # consumed: the daemon builds them again
        path.unlink()
    assert daemon.proc.wait(timeout=30) != 0
    assert sorted(os.listdir(private)) == ["e000000-s00000000.batch"]
    assert (private / "e000000-s00000000.batch").read_bytes() == b"precious"
    assert f"stream folder {buffer}/rank-00001 of rank 1 was replaced by a link to {private}" in daemon.log
