"""JobInbox against requests put back: job.json renamed aside and back by whoever may rename the buffer's files
(any member of a --group-access buffer's group) is an old request, not a new one, while a new one is taken
however soon it follows the last.  (tests/integration/test_job_owner.py does it with real users and a daemon.)"""

from __future__ import annotations

import logging
import os
import resource
import time
from pathlib import Path

import pytest

from prefetchd.buffer_protocol import JobRequest
from prefetchd.buffer_protocol.job_request import MAX_RECORD_RENAME_SECONDS
from prefetchd.buffer_protocol.layout import ACCEPTED_JOB_NAME, JOB_NAME
from prefetchd.daemon.config import DaemonConfig
from prefetchd.daemon.job_inbox import JobInbox


def answered(inbox: JobInbox) -> DaemonConfig | None:
    """``inbox.poll`` of a waiting daemon, and what the daemon does with a job it takes: starts it, answers, settles."""
    job = inbox.poll(None)
    if job is not None:
        inbox.answer(inbox.pending_id, True, f"producing {job.data}", inbox.pending_owner)
        inbox.accepted(job)
        inbox.settle()
    return job


def test_a_request_renamed_back_after_a_newer_one_was_answered_is_refused(shm_buffer: Path) -> None:
    """Renamed back within seconds: JobRequest.read takes it (its ctime is close to its mtime), and only the
    newer request answered meanwhile tells it is old."""
    inbox = JobInbox(shm_buffer, DaemonConfig(buffer=shm_buffer), ignore_current=False)
    old = JobRequest({"data": "/data/old", "batch_size": 4})
    old.write(shm_buffer)
    assert answered(inbox) is not None
    (shm_buffer / JOB_NAME).rename(shm_buffer / "kept.json")  # kept aside before the next request replaces it
    assert answered(inbox) is None
    time.sleep(0.02)  # past the filesystem clock's tick (jiffies: 4 ms at HZ=250)
    new = JobRequest({"data": "/data/new", "batch_size": 4})
    new.write(shm_buffer)
    job = answered(inbox)
    assert job is not None and str(job.data) == "/data/new"
    assert os.stat(shm_buffer / "kept.json").st_mtime_ns < os.stat(shm_buffer / JOB_NAME).st_mtime_ns

    (shm_buffer / "kept.json").rename(shm_buffer / JOB_NAME)
    assert answered(inbox) is None, "the old request was taken again"
    result = inbox.result
    assert result is not None and (result.job_id, result.accepted, result.submitter) == (old.job_id, False,
                                                                                         os.geteuid()), result
    reason = result.reason
    assert str(shm_buffer / JOB_NAME) in reason and f"uid {os.geteuid()}" in reason and "renamed back" in reason, reason
    assert f"older than job {new.job_id}" in reason and f"prefetchd submit --buffer {shm_buffer}" in reason, reason
    running = inbox.running_job()
    assert running is not None and running.job_id == new.job_id

    # Its owner submits it again: a new file, taken.
    again = JobRequest(old.settings)
    again.write(shm_buffer)
    job = answered(inbox)
    assert job is not None and str(job.data) == "/data/old"


def test_requests_written_in_one_clock_tick_are_each_taken(shm_buffer: Path) -> None:
    """Two submits within a tick of the filesystem's clock have the same mtime: neither is older."""
    inbox = JobInbox(shm_buffer, DaemonConfig(buffer=shm_buffer), ignore_current=False)
    first = JobRequest({"data": "/data/a", "batch_size": 4})
    first.write(shm_buffer)
    tick = os.stat(shm_buffer / JOB_NAME).st_mtime_ns
    assert answered(inbox) is not None
    second = JobRequest({"data": "/data/b", "batch_size": 4})
    second.write(shm_buffer)
    os.utime(shm_buffer / JOB_NAME, ns=(tick, tick))  # written in the same tick as the first
    job = answered(inbox)
    assert job is not None and str(job.data) == "/data/b", inbox.result
    # And the very same job again, at once, by the same user: a new request like any other.
    third = JobRequest(second.settings)
    third.write(shm_buffer)
    assert answered(inbox) is not None, inbox.result
    result = inbox.result
    assert result is not None and (result.job_id, result.accepted) == (third.job_id, True), result


def test_a_request_written_in_the_future_neither_bars_new_requests_nor_lets_old_ones_back(shm_buffer: Path) -> None:
    """Only its owner can give a job.json an mtime in the future.  Taken for the newest answered, it made every
    later request look old, or, the daemon taking it for a clock set back, let any old one be renamed back."""
    inbox = JobInbox(shm_buffer, DaemonConfig(buffer=shm_buffer), ignore_current=False)
    old = JobRequest({"data": "/data/old"})
    old.write(shm_buffer)
    assert answered(inbox) is not None
    (shm_buffer / JOB_NAME).rename(shm_buffer / "kept.json")
    time.sleep(0.02)  # past the filesystem clock's tick
    JobRequest({"data": "/data/new"}).write(shm_buffer)
    assert answered(inbox) is not None
    JobRequest({"data": "/data/future"}).write(shm_buffer)
    later = time.time_ns() + 3600 * 10**9
    os.utime(shm_buffer / JOB_NAME, ns=(later, later))
    assert answered(inbox) is not None

    (shm_buffer / "kept.json").rename(shm_buffer / JOB_NAME)
    assert answered(inbox) is None, "the old request was taken again"
    assert inbox.result is not None and inbox.result.job_id == old.job_id and not inbox.result.accepted
    JobRequest({"data": "/data/next"}).write(shm_buffer)
    job = answered(inbox)
    assert job is not None and str(job.data) == "/data/next", inbox.result


def test_a_record_renamed_aside_and_back_over_a_later_one_is_no_record(shm_buffer: Path) -> None:
    """The daemon's record of the job it accepted (job.accepted.json) is what a restart resumes.  A member kept it
    aside while the daemon accepted another job, and renamed it back over that one's record: the restarted daemon
    resumed the job that had been replaced.  The daemon empties its record, wherever it was renamed, once it records
    no running job; and a record renamed long after it was written is refused."""
    inbox = JobInbox(shm_buffer, DaemonConfig(buffer=shm_buffer), ignore_current=False)
    JobRequest({"data": "/data/old", "batch_size": 4}).write(shm_buffer)
    assert answered(inbox) is not None
    (shm_buffer / ACCEPTED_JOB_NAME).rename(shm_buffer / "kept.json")
    time.sleep(0.02)  # past the filesystem clock's tick
    JobRequest({"data": "/data/new", "batch_size": 4}).write(shm_buffer)
    assert answered(inbox) is not None
    (shm_buffer / "kept.json").rename(shm_buffer / ACCEPTED_JOB_NAME)
    restarted = JobInbox(shm_buffer, DaemonConfig(buffer=shm_buffer), ignore_current=False)
    assert restarted.resumable() is None, "the replaced job was resumed"

    # One the daemon no longer holds (written by a daemon since restarted), renamed aside and back a while later.
    JobRequest({"data": "/data/next", "batch_size": 4}).write(shm_buffer)
    assert answered(restarted) is not None
    job = JobInbox(shm_buffer, DaemonConfig(buffer=shm_buffer), ignore_current=False).resumable()
    assert job is not None and str(job.data) == "/data/next"
    time.sleep(MAX_RECORD_RENAME_SECONDS + 0.1)
    (shm_buffer / ACCEPTED_JOB_NAME).rename(shm_buffer / "kept.json")
    (shm_buffer / "kept.json").rename(shm_buffer / ACCEPTED_JOB_NAME)
    assert JobInbox(shm_buffer, DaemonConfig(buffer=shm_buffer), ignore_current=False).resumable() is None


def test_the_request_answered_last_renamed_back_after_a_refused_one_is_not_answered_again(shm_buffer: Path) -> None:
    """Renamed aside, and back within MAX_JOB_RENAME_SECONDS after a request that raised no bar (a member's own, its
    mtime set a second back, refused as older): its mtime equals that of the newest answered, which let it pass for
    another request written in the same tick, and the daemon answered the same request again."""
    inbox = JobInbox(shm_buffer, DaemonConfig(buffer=shm_buffer), ignore_current=False)
    theirs = JobRequest({"data": "/data/theirs", "batch_size": 4})
    theirs.write(shm_buffer)
    written = os.stat(shm_buffer / JOB_NAME).st_mtime_ns
    assert answered(inbox) is not None
    (shm_buffer / JOB_NAME).rename(shm_buffer / "kept.json")
    assert answered(inbox) is None
    JobRequest({"data": "/data/mine", "batch_size": 4}).write(shm_buffer)
    os.utime(shm_buffer / JOB_NAME, ns=(written - 10**9, written - 10**9))
    assert answered(inbox) is None and inbox.result is not None and "older than job" in inbox.result.reason
    (shm_buffer / "kept.json").rename(shm_buffer / JOB_NAME)
    assert answered(inbox) is None, "the request was answered again"
    result = inbox.result
    assert result is not None and (result.job_id, result.accepted) == (theirs.job_id, False), result
    assert f"is job {theirs.job_id}, which this daemon answered already" in result.reason, result.reason
    # Submitted again, it is a new request.
    JobRequest(theirs.settings).write(shm_buffer)
    assert answered(inbox) is not None, inbox.result



def test_a_record_the_daemon_could_not_replace_is_removed_not_left_empty(
        shm_buffer: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Accepting the next job empties the record of the one before; where the new record cannot be written (a full
    tmpfs, here a file size limit), the emptied one stayed, and the restarted daemon said it was "renamed away and
    back (any member of the buffer's group may rename the files there)", blaming a member for a write that failed."""
    inbox = JobInbox(shm_buffer, DaemonConfig(buffer=shm_buffer), ignore_current=False)
    JobRequest({"data": "/data/old", "batch_size": 4}).write(shm_buffer)
    assert answered(inbox) is not None
    time.sleep(0.02)  # past the filesystem clock's tick
    new = JobRequest({"data": "/data/new", "batch_size": 4})
    new.write(shm_buffer)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, hard))  # Python ignores SIGXFSZ: the write fails with EFBIG
    try:
        with caplog.at_level(logging.WARNING, logger="prefetchd.daemon.job_inbox"):
            assert answered(inbox) is not None
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert f"cannot keep job {new.job_id} for a restart to resume" in caplog.text, caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prefetchd.daemon.job_inbox"):
        assert JobInbox(shm_buffer, DaemonConfig(buffer=shm_buffer), ignore_current=False).resumable() is None
    assert not (shm_buffer / ACCEPTED_JOB_NAME).exists() and caplog.text == "", caplog.text

    # A record a restart resumed, which its daemon did not write (nor empty), is kept where rewriting it fails.
    JobRequest({"data": "/data/next", "batch_size": 4}).write(shm_buffer)
    assert answered(inbox) is not None
    restarted = JobInbox(shm_buffer, DaemonConfig(buffer=shm_buffer), ignore_current=False)
    resumed = restarted.resumable()
    assert resumed is not None
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, hard))
    try:
        restarted.accepted(resumed)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    job = JobInbox(shm_buffer, DaemonConfig(buffer=shm_buffer), ignore_current=False).resumable()
    assert job is not None and str(job.data) == "/data/next"


def test_a_job_json_that_is_a_link_is_refused_as_one_and_never_followed(shm_buffer: Path) -> None:
    """The daemon looked at job.json through a link (a stat) to see whether it changed: a member of the buffer's
    group could point one at a path whose stat hangs the daemon (an unanswering mount), and one to nothing was no
    request at all, left unanswered.  A link is refused now, without a look at where it leads."""
    inbox = JobInbox(shm_buffer, DaemonConfig(buffer=shm_buffer), ignore_current=False)
    os.symlink(shm_buffer / "nothing-here", shm_buffer / JOB_NAME)
    assert answered(inbox) is None
    result = inbox.result
    assert result is not None and (result.job_id, result.accepted) == (None, False), result
    assert f"{shm_buffer / JOB_NAME}: is a symbolic link, not" in result.reason, result.reason
    assert answered(inbox) is None and inbox.result is result, "the same link is answered once"


def test_a_restart_with_other_flags_resumes_the_job_as_it_was_accepted(shm_buffer: Path) -> None:
    """A request leaves settings to the daemon (its flags, its config).  A daemon restarted with other flags resumed
    the request under those, another job (--image-size 64 became 224), and cleared the batches its trainers read as
    another job's (a walk).  The record keeps what the request was produced as; what it asked stays as asked."""
    first = DaemonConfig(buffer=shm_buffer, image_size=64, seed=3, epochs=5, refresh_index=True)
    JobRequest({"data": "/data/x", "batch_size": 16, "seed": 1}).write(shm_buffer)
    job = answered(JobInbox(shm_buffer, first, ignore_current=False))
    assert job is not None and (job.image_size, job.seed, job.batch_size, job.epochs) == (64, 1, 16, 5)
    other = DaemonConfig(buffer=shm_buffer, image_size=224, seed=9, epochs=90, workers=1)
    resumed = JobInbox(shm_buffer, other, ignore_current=False).resumable()
    assert resumed is not None
    assert (resumed.image_size, resumed.seed, resumed.batch_size, resumed.epochs) == (64, 1, 16, 5), resumed
    assert not resumed.refresh_index and resumed.workers == 1  # one start's setting, and the machine's, are the new


def test_a_job_naming_every_rank_is_the_same_job_as_one_naming_none() -> None:
    """Every suggested submit command spells out "--world-size 1 --ranks 0"; against the same job started without
    --ranks it was another job: refused while a trainer read, "replacing" it with --replace (a walk)."""
    from prefetchd.daemon.job_inbox import job_settings, settings_changed

    def job(world: int, ranks: str | None) -> DaemonConfig:
        return DaemonConfig(buffer=Path("/dev/shm/bf"), data=Path("/data"), world_size=world, ranks=ranks)

    assert job_settings(job(1, "0")) == job_settings(job(1, None))
    assert job_settings(job(4, "0-3")) == job_settings(job(4, "0,1,2,3")) == job_settings(job(4, None))
    assert job_settings(job(4, "0-1")) == job_settings(job(4, "1,0"))
    assert job_settings(job(4, "0-1")) != job_settings(job(4, None))
    assert settings_changed(job(4, "0-1"), job(4, "2-3")) == "ranks: '0,1' -> '2,3'"
