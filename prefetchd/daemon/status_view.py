"""`prefetchd status`: what it finds about a buffer (``describe_status``, a typed ``StatusReport``) and how
it shows it, as text (``format_status``) or as JSON (``status_json``, the one place the report becomes a
document).  The click command is in cli.py."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from prefetchd.buffer_protocol import (ConsumerStatus, Errors, Manifest, Production, ProtocolError, RemoteStatus, State,
                                       Status, StorageWait, StreamStatus, TrainerStatus, daemon_owner, lock_holders,
                                       pid_named, read_status, same_pid_namespace, writer_named)
from prefetchd.buffer_protocol.layout import LOCK_NAME, SPARE_PREFIX, STREAM_PREFIX, owning_buffer
from prefetchd.buffer_protocol.manifest import exact_number
from prefetchd.buffer_protocol.progress import pid_namespace
from prefetchd.access import no_access
from prefetchd.daemon.buffer_dir import free_bytes
from prefetchd.daemon.dataset import held_out_count
from prefetchd.daemon.job_inbox import FAILED_WHILE_PRODUCING, job_verdict
from prefetchd.daemon.mounts import filesystem_of
from prefetchd.daemon.production_stats import RATE_WINDOW_SECONDS, STAGES
from prefetchd.access import user_name
from prefetchd.words import agreeing, binary_size, counted, moment, one_line, rank_ranges

STALE_HEARTBEAT_SECONDS = 10.0
SHOWN_BAD_FILES = 5  # bad files (undecodable, missing, unreadable) named in the text status
# Too little to replace status.json (a new file of a few pages beside the old); the daemon's own
# floor (--min-free-mb, 1 MiB at least by default) stops it well above this: something else took the rest.
FULL_FILESYSTEM_BYTES = 256 << 10


@dataclass(frozen=True)
class StatusReport:
    """What `prefetchd status` found about ``buffer``; `--json` shows a key per field (SPEC, status document)."""

    buffer: Path
    owner: Path  # the buffer whose daemon owns a rank's directory; ``buffer`` itself otherwise
    rank: int | None  # the rank whose stream directory ``buffer`` is
    running: bool
    pid: int | None  # the live owner's, from the lock
    heartbeat_age_s: float | None
    stale: bool
    status: Status | None  # narrowed to ``rank``'s stream for a rank's directory
    manifest: Manifest | None
    problems: tuple[str, ...]
    no_rank: bool = False  # ``buffer`` is a rank's directory that is not there: nothing else was read
    # False for a rank's directory its daemon does not write now, there (left by a job of more ranks, or another
    # box's rank of the world) or not (``no_rank``): `prefetchd status` exits 3, as where no daemon runs.
    served: bool = True
    # ``pid`` is the owner's in another pid namespace (a daemon in another container, or on the host): it names no
    # process here (SPEC rule 8).
    other_pid_namespace: bool = False
    # This command's pid namespace (None where /proc does not say), for `--json`: a trainer's pid in ``status`` names
    # a process here only where the trainer's ``pid_namespace`` is this one, or either is unknown (as the text's
    # ``writer_named`` says it, SPEC rule 8).
    command_pid_namespace: int | None = field(default_factory=pid_namespace)
    # False: this user may not read ``buffer`` (a --group-access buffer of a group it is not in); ``problems`` says
    # whose it is and what to do, nothing else was read, and ``running`` is false only for want of knowing.
    readable: bool = True

    @property
    def ended_unsaid(self) -> bool:
        """No daemon runs, and the one before wrote no last state (stopped, failed): it was killed (SIGKILL, the
        OOM killer) or crashed, so the status it left shows a moment of its work, not its end."""
        return (self.readable and not self.running and self.status is not None
                and self.status.state not in (State.STOPPED, State.FAILED))


def spare_files(owner: Path) -> tuple[int, int]:
    """How many consumed batch files the daemon of ``owner`` keeps to build in again, in all its streams, and the
    bytes they hold on the filesystem (not in the status: Production.buffer_bytes counts batches)."""
    count = held = 0
    for directory in [owner, *owner.glob(f"{STREAM_PREFIX}*")]:
        for path in directory.glob(f"{SPARE_PREFIX}*"):
            try:
                held += path.lstat().st_blocks * 512
                count += 1
            except OSError:  # reused or removed meanwhile
                continue
    return count, held


def describe_status(buffer: Path) -> StatusReport:
    """What `prefetchd status` shows (``format_status`` as text, ``status_json`` as JSON)."""
    denied = no_access(buffer)
    if denied is not None:
        return StatusReport(buffer=buffer, owner=buffer, rank=None, running=False, pid=None, heartbeat_age_s=None,
                            stale=False, status=None, manifest=None, problems=(denied,), readable=False)
    owner = owning_buffer(buffer)
    if owner != buffer and not buffer.exists():  # the status read would be the parent's, of other ranks
        return StatusReport(buffer=buffer, owner=owner, rank=int(buffer.name.removeprefix(STREAM_PREFIX)), running=False,
                            pid=None, heartbeat_age_s=None, stale=False, status=None, manifest=None, no_rank=True,
                            served=False,
                            problems=(f"no such rank: the daemon on {owner} writes no {buffer.name}; "
                                      f"`prefetchd status --buffer {owner}` shows the ranks it serves",))
    status: Status | None = None
    manifest: Manifest | None = None
    # A typo, not a stopped daemon: said in --json's problems too, which were [] as for a clean stop.
    problems = [] if buffer.exists() else [f"{buffer} does not exist"]
    try:
        status = read_status(buffer)
    except ProtocolError as exc:
        problems.append(str(exc))
    daemon = daemon_owner(buffer, status)
    if daemon is not None and daemon.here:  # the pid `prefetchd stop` would refuse to signal, said here too
        holders = lock_holders(owner / LOCK_NAME)
        if holders is not None and daemon.pid not in holders and not exiting(status, daemon.pid):
            problems.append(not_the_holder(owner / LOCK_NAME, daemon.pid, holders))
    elif daemon is None and (held := foreign_lock(owner / LOCK_NAME)) is not None:
        problems.append(held)
    if daemon is not None and (stopped := daemon.stopped_note()) is not None:
        problems.append(stopped)  # its heartbeat stops too: the warning below would blame it for being stuck
    rank, served = None, True
    if owner != buffer:  # one rank's stream directory: show that rank, not every rank of its daemon
        rank = int(buffer.name.removeprefix(STREAM_PREFIX))
        status, unserved = _one_rank(status, rank, owner)
        served = unserved is None
        problems += [unserved] if unserved is not None else []
    # With several ranks the manifests live in the stream directories; they share everything shown.
    for directory in [buffer, *sorted(buffer.glob(f"{STREAM_PREFIX}*"))]:
        try:
            manifest = Manifest.read(directory)
            break
        except FileNotFoundError:
            continue
        except ProtocolError as exc:
            problems.append(str(exc))
            break
    free = _free_bytes(owner)
    full = free if daemon is not None and free is not None and free < FULL_FILESYSTEM_BYTES else None  # bytes left
    if daemon is not None and status is not None and not daemon.wrote(status):
        # The one a daemon before it left (stopped, killed): shown as this one's, a daemon that starts read as
        # "stopped".  On a full filesystem too, where it was not this daemon's to write over (write_status).
        earlier = pid_named(status.pid, same_pid_namespace(status.pid_namespace))
        said = f"{status.state}: {status.message}" if status.message else str(status.state)
        problems.append(f"status.json is the one an earlier daemon ({earlier}) left, {said}; this daemon has written "
                        "none yet" + (", having no room for it" if full is not None else ""))
        status = None
    age = time.time() - status.heartbeat if status is not None else None
    if full is not None:
        # status.json is rewritten in its own pages; one grown past them, only its mtime beats (SPEC rule 8).
        figures = ("; a status grown past them leaves the figures above as last written" if status is not None
                   else "; its log says more")
        spares, _ = spare_files(owner)
        # It said "can build no batch" while the daemon built one in a consumed batch's file for each read; but not
        # "builds" either: a trainer that cannot write its progress there has the daemon build nothing (a walk).
        builds = (f"can build a batch only in the file of a consumed one it kept ({spares} now)," if spares
                  else "can build no batch,")
        problems.append(f"the buffer's filesystem is full ({binary_size(full)} free): the daemon {builds} and "
                        f"rewrites its status only within the pages status.json has{figures}; free space "
                        f"on {filesystem_of(owner).point} (what else fills it?)")
    return StatusReport(
        buffer=buffer,
        owner=owner,
        rank=rank,
        running=daemon is not None,
        pid=daemon.pid if daemon is not None else None,
        heartbeat_age_s=round(age, 1) if age is not None else None,
        stale=daemon is not None and age is not None and age > STALE_HEARTBEAT_SECONDS,
        status=status,
        manifest=manifest,
        problems=tuple(problems),
        other_pid_namespace=daemon is not None and not daemon.here,
        served=served,
    )


def foreign_lock(lock: Path) -> str | None:
    """Where no daemon owns the buffer but a process holds its ``lock`` all the same, which and what to do:
    `prefetchd start` stops at it (exit 5), while status and stop said only that no daemon runs (a review)."""
    holders = lock_holders(lock)
    if not holders:
        return None
    pids = ", ".join(str(pid) for pid in sorted(holders))
    return (f"{lock} is locked by pid {pids}, which is not a running prefetchd daemon (a daemon names itself "
            f"in the file as it takes the lock): `prefetchd start` on this buffer stops at it; find it with "
            f"`fuser -v {lock}` and end it, or pick another --buffer")


def exiting(status: Status | None, pid: int) -> bool:
    """Whether daemon ``pid`` wrote its last word in ``status`` (stopped, failed): it is exiting, and its lock may
    outlive it for a moment in a process of it still exiting, which /proc/locks shows as no visible holder.  Taken
    for a daemon of another pid namespace, a second `prefetchd stop` racing the first failed (a walk)."""
    return status is not None and status.pid == pid and status.state in (State.STOPPED, State.FAILED)


def not_the_holder(lock: Path, pid: int, holders: set[int]) -> str:
    """Why ``pid``, which ``lock`` names though here its lock is held by ``holders`` (``lock_holders``) instead,
    may not be the daemon (`prefetchd stop` does not SIGTERM it; `prefetchd status` says so), and what to do."""
    if holders:
        holder = f"{agreeing(len(holders), 'pid', 'pids')} {', '.join(map(str, sorted(holders)))}"
    else:
        holder = "a process not visible from this pid namespace"
    return (f"{lock} names pid {pid}, but here its lock is held by {holder}, not by pid {pid}: most likely a daemon "
            "of another pid namespace (another container, or the host) that has not written its first status yet, "
            "which will say so; otherwise something that is not a prefetchd daemon; try again in a moment, stop the "
            f"daemon where it runs, or find the holder with `fuser -v {lock}`")


def _free_bytes(path: Path) -> int | None:
    try:
        return free_bytes(path)
    except OSError:
        return None


def _one_rank(status: Status | None, rank: int, owner: Path) -> tuple[Status | None, str | None]:
    """``status`` narrowed to rank ``rank``'s stream: its trainer, position, fill and wait for the storage
    (the rates, memory and errors stay the daemon's); with a problem line when the daemon serves no such
    rank now, else None."""
    pr = status.production if status is not None else None
    if status is None or pr is None:
        return status, None
    stream = next((s for s in pr.streams if s.rank == rank), None)
    if stream is None:  # nor its fill or trainer: the other ranks' would be shown under this rank's heading
        served = rank_ranges([s.rank for s in pr.streams]) or "none"
        return dataclasses.replace(status, production=None), (
            f"the daemon on {owner} does not serve rank {rank} now (it serves {served}); "
            f"`prefetchd status --buffer {owner}` shows them")
    share = len(pr.streams)
    narrowed = dataclasses.replace(pr, streams=(stream,), progress=stream.progress, trainer=stream.trainer,
                                   waiting=stream.waiting, building=stream.building,
                                   high_water=pr.high_water // share, low_water=pr.low_water // share,
                                   storage_wait=_rank_storage_wait(pr.storage_wait, rank))
    return dataclasses.replace(status, production=narrowed), None


def _storage_waited(wait: StorageWait) -> str:
    """How long the builds have waited: one figure, or the shortest and the longest of the ranks' own waits
    (one rank's batches may fail minutes after another's)."""
    now = time.time()
    began = sorted(zip(wait.ranks_since, wait.ranks)) if wait.ranks and wait.ranks_since else [(wait.since, None)]
    (first, eldest), (last, youngest) = began[0], began[-1]
    longest, shortest = f"{max(0.0, now - first):.0f} s", f"{max(0.0, now - last):.0f} s"
    return longest if longest == shortest else f"{shortest} (rank {youngest}) to {longest} (rank {eldest})"


def _rank_storage_wait(wait: StorageWait | None, rank: int) -> StorageWait | None:
    """``wait`` as rank ``rank``'s trainer sees it: none when no batch of the rank's holds it (its trainer
    times out as ever), else since the rank's own wait began."""
    since = wait.since_of(rank) if wait is not None else None
    if wait is None or since is None:
        return None
    if wait.ranks is None:  # a daemon of an earlier build: one wait for every rank, and no rank named
        return wait
    return dataclasses.replace(wait, since=since, ranks=(rank,), ranks_since=(since,))


def status_json(report: StatusReport, indent: int | None = 1) -> str:
    """``report`` as `prefetchd status --json` prints it: a key per field, the status as status.json holds it
    and the manifest as manifest.json does.  ``indent=None``: on one line, as --watch --json prints one
    document per line."""
    doc = {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}
    doc.update(ended_unsaid=report.ended_unsaid, buffer=str(report.buffer), owner=str(report.owner), problems=list(report.problems),
               status=report.status.to_doc() if report.status is not None else None,
               manifest=report.manifest.to_doc() if report.manifest is not None else None)
    if not report.readable:  # unknown, as the text says, not false (a review); so are the answers that follow from it
        doc.update(running=None, stale=None, served=None, ended_unsaid=None)
    return json.dumps(doc, indent=indent, sort_keys=True)


def format_status(report: StatusReport) -> str:
    """The text of `prefetchd status`; read_status has checked every field it shows.  Each line is one line: a
    path's newline (a buffer's, the dataset's, a bad file's) broke a line in two, and its terminal escapes reached
    the terminal, where the log writes them out (``one_line``; a walk with odd paths)."""
    return "\n".join(one_line(line) for line in _status_lines(report))


def _status_lines(report: StatusReport) -> list[str]:
    buffer, mf, st = report.buffer, report.manifest, report.status
    if not report.readable:
        return [f"prefetchd on {buffer}: cannot be read by this user, so whether a daemon runs is unknown",
                *report.problems]
    if report.no_rank:  # a rank directory no daemon writes: its buffer's daemon may well run
        return [f"prefetchd on {buffer}: no such rank", *report.problems]
    if not report.running:
        line = f"prefetchd on {buffer}: not running"
        if st:
            line += f" (last state: {st.state}{': ' + st.message if st.message else ''})"
        if report.ended_unsaid:  # a killed daemon read as one whose last word was "full"
            line += ("; it ended without writing its last state: killed (SIGKILL, the OOM killer: `dmesg`, or a "
                     "signal other than the SIGTERM, SIGINT and SIGHUP it stops on) or crashed (its log says more)")
        # What went wrong in the job it last produced (the bad files to mend) is not gone with it.
        e = st.production.errors if st is not None and st.production is not None else None
        told = [_errors_line(e), *_bad_file_lines(e)] if e is not None and (
            e.replaced_samples or e.undecodable_files or e.worker_restarts or e.worker_hangs or e.write_failures) else []
        return [line, *told, *report.problems]
    state = st.state if st else "starting"
    meaning = " (every batch of the job's epochs is built; trainers may still be reading)" if state == State.DONE else ""
    pid = pid_named(report.pid, not report.other_pid_namespace)
    lines = [f"prefetchd on {buffer}: running ({pid}), state {state}{meaning}"]
    if report.rank is not None and (st is None or st.production is None):  # a rank it leaves to another box, or
        # one its ranks were before a restart: "its trainer and fill" of a rank it does not serve (a review)
        lines.append(f"  stream    rank {report.rank} of the daemon on {report.owner}, which builds no batches for it "
                     "now; the state above is the daemon's")
    elif report.rank is not None:
        lines.append(f"  stream    rank {report.rank} of the daemon on {report.owner}: its trainer and fill; "
                     "the rates, memory and errors are the whole daemon's")
    if report.stale:  # then nothing below is of now: "alive", "written 2 s ago" and the rates are as the daemon last saw
        age = f"{report.heartbeat_age_s:.0f} s"
        lines.append(f"  WARNING  no heartbeat for {age}: the daemon may be stuck or stopped, and the figures below are its last "
                     f"status's, {age} old or more")
    if st and st.message:
        lines.append(f"  note      {st.message}")
    pr = st.production if st else None
    outage = pr.storage_wait if pr is not None else None
    if pr is not None and outage is not None:  # the note says why; this, what it means for the trainers
        whose = ""  # every rank's: one stream, or a daemon of an earlier build that did not say which
        if outage.ranks is not None and len(pr.streams) > 1:
            whose = f" of {agreeing(len(outage.ranks), 'rank', 'ranks')} {rank_ranges(list(outage.ranks))}"
        lines.append(f"  storage   the builds{whose} have waited {_storage_waited(outage)} for the "
                     f"dataset's storage; they resume when it is back, and trainers{whose} wait on past their "
                     "--timeout meanwhile")
    if mf and state != State.WAITING_FOR_JOB:  # a finished job's manifest stays until the next job replaces it
        lines.append(
            f"  dataset   {mf.dataset_root} ({counted(mf.num_samples, 'sample')}, {counted(len(mf.classes), 'class')}), "
            f"split {_split_size(mf)}, batch {mf.batch_size} x {mf.image_size}px, {counted(mf.steps_per_epoch, 'step')}/epoch"
            + (" (short last batch left out)" if mf.drop_last else "")
            + f", seed {mf.seed}"  # jobs that differ in their seed alone are told apart
        )
    world = mf.world_size if mf else 1
    if world > 1 and (pr is not None or report.rank is None):  # one stream directory per rank: which are here
        served = rank_ranges([s.rank for s in pr.streams]) if pr is not None and pr.streams else "some"
        lines.append(f"  ranks     {served} of world size {world}, each in {report.owner}/{STREAM_PREFIX}NNNNN")
    if pr is not None:  # None while the daemon waits for a job or starts one
        p, r, e = pr.progress, pr.rates, pr.errors
        share = p.trainer_wait_share
        fed = f", waiting for data {share:.1%} of its time" if share is not None else ""
        where = (f"no trainer yet (the buffer starts at epoch {p.epoch} step {p.step})" if pr.no_trainer_yet else
                 f"{_lead_name(pr)} at epoch {p.epoch} step {p.step}{fed}{_trainer_note(pr.trainer, _lead_left(pr))}")
        lines += [
            f"  progress  {where}",
            f"  fill      {fill_bar(pr.waiting, pr.high_water)} {pr.waiting}/{pr.high_water} batches waiting"
            + (", " if state == State.DONE else f" (builds again at {pr.low_water} waiting), ") + f"{pr.building} building",
            *_cap_line(pr),
            f"  memory    {binary_size(pr.buffer_bytes)} in the buffer{_spares_held(report.owner)}, "
            f"{binary_size(pr.free_bytes)} free on its filesystem",
            # The rates are over the last 10 s, the CPU share is now: "produce 382 img/s (0% CPU)" just after the
            # buffer filled read as a contradiction, and consumption in batches/s beside img/s (a walk).
            f"  rates     produce {r.samples_per_s:.0f} img/s, consume {r.consumed_batches_per_s:.2f} batches/s"
            + (f" ({r.consumed_batches_per_s * report.manifest.batch_size:.0f} img/s)" if report.manifest else "")
            + f" over the last {RATE_WINDOW_SECONDS:.0f} s; {counted(pr.workers, 'worker')} at "
            f"{pr.workers_cpu_percent:.0f}% CPU now",
            _errors_line(e),
        ]
        if pr.remote is not None:
            lines += _remote_lines(pr.remote, pr.totals.samples)
        lines += _bad_file_lines(e)
        stages = pr.stages
        if stages:
            lines.append("  per image " + ", ".join(
                f"{name} {stages[name].p50 * 1e3:.2f}/{stages[name].p90 * 1e3:.2f}/{stages[name].p99 * 1e3:.2f}"
                for name in STAGES if name in stages
            ) + " ms (p50/p90/p99)")
        if e.progress_file:
            lines.append(f"  progress file problem: {e.progress_file}")
        streams = pr.streams
        if len(streams) > 1:
            per_rank = pr.high_water // len(streams)
            for s in streams:
                sp = s.progress
                share = sp.trainer_wait_share
                waits = f", waiting for data {share:.1%}" if share is not None else ""
                where = "no trainer yet" if s.no_trainer_yet else f"trainer at epoch {sp.epoch} step {sp.step}"
                lines.append(f"  rank {s.rank:<5} {fill_bar(s.waiting, per_rank, 12)} {s.waiting}/{per_rank} "
                             f"waiting, {where}{waits}")
        for s in streams:
            # Several trainers share the buffer (or one named consumer reads it): one line each.
            if _consumer_lines_shown(s):
                rank = f" of rank {s.rank}" if len(streams) > 1 else ""
                lines += [_consumer_line(c, rank) for c in s.consumers]
    lines += _job_lines(st) if st else []
    lines += report.problems
    return lines


def _spares_held(owner: Path) -> str:
    count, held = spare_files(owner)
    return f" (and {binary_size(held)} in {counted(count, 'consumed batch file')} kept to build in again)" if count else ""


def _job_lines(st: Status) -> list[str]:
    """The submitted job that runs (who submitted it, when, and the daemon's answer), and apart from it the answer to
    a later request: "last job" alone showed that answer, a refusal, say, as if the refused job ran."""
    run, last = st.running_job, st.job_result
    lines = []
    if run is not None:
        lines.append(f"  job       {run.job_id} submitted by {user_name(run.submitter)} at {moment(run.submitted)}: "
                     f"{run.answer or 'starting'}")
    # The running job's own answer is the line above; a refusal under its id is a later request's (the daemon's
    # record renamed back to job.json by a member of the group, say), which a review found hidden here.
    if last is None or (run is not None and (last.job_id == run.job_id and last.accepted or last.time < run.submitted)):
        # An answer from before the running job was submitted is the job's before it, whose answer the daemon
        # replaces as this one starts: it read as "later ... (the job above runs on)" meanwhile (a race walk).
        return lines
    job_id = last.job_id or "(unreadable)"
    # No job runs (waiting, stopped, starting the job it was given), or a daemon of an earlier 0.1 build did not say
    # which: the answer to its latest request is all there is ("later ... the job being produced runs on" would say
    # that the job it runs is another than the one it accepted).
    who = f" submitted by {user_name(last.submitter)}" if last.submitter is not None else ""
    if run is None and (st.production is None or not st.running_job_known):
        if not last.accepted and not last.reason.startswith(FAILED_WHILE_PRODUCING):
            # Not "last job": a request refused while a job ran, which then ended, read as the job that ran, its
            # reason naming a trainer long gone (a user's walk); the job that ended is in the log.
            return [*lines, f"  REFUSED   {job_id}{who}, answered at {moment(last.time)}: {last.reason}"]
        return [*lines, f"  last job  {job_id} {job_verdict(last.accepted, last.reason)}"]
    # A request answered while the job above (or the one the daemon was started with) runs on: "already producing
    # this job", or a refusal, which its submitter looks for here.
    goes_on = "the job above runs on" if run is not None else "the job being produced runs on"
    said = f"  REFUSED   {job_id}{who}, answered at {moment(last.time)} ({goes_on}): {last.reason}" if not last.accepted \
        else f"  later     {job_id}{who}, answered at {moment(last.time)} ({goes_on}): accepted: {last.reason}"
    return [*lines, said]


def _split_size(mf: Manifest) -> str:
    """"train of 1350 samples (--val-fraction 0.1 holds out 150)": the split and, where --val-fraction cut it
    from the dataset, its own count (the dataset's is all splits'); just "train" where it is the whole dataset."""
    if mf.val_fraction is None:
        return mf.split
    val = held_out_count(mf.num_samples, mf.val_fraction)
    fraction = f"--val-fraction {exact_number(mf.val_fraction)}"
    if mf.split == "val":
        return f"val of {counted(val, 'sample')} (held out by {fraction})"
    return f"{mf.split} of {counted(mf.num_samples - val, 'sample')} ({fraction} holds out {val})"


def _cap_line(pr: Production) -> list[str]:
    """A line when --max-buffer-bytes, not the high-water mark, bounds the buffer: a consumer's window
    is narrower than the high-water mark only then (consumers.plan_windows), also where the job's end
    leaves fewer batches to build."""
    per_rank = pr.high_water // max(1, len(pr.streams))
    capped = [c.window for s in pr.streams for c in s.consumers if c.holding and c.window < per_rank]
    if not capped:
        return []
    return [f"  capped    --max-buffer-bytes (max_buffer_bytes in the config), not the high-water mark, limits the "
            f"buffer: it keeps {min(capped)} of {per_rank} batches ({binary_size(pr.batch_bytes)} each) for "
            f"{counted(len(capped), 'consumer')}; raise it for a deeper buffer"]


def _remote_lines(rm: RemoteStatus, samples: int) -> list[str]:
    """Where batches are built: the Ray cluster's share (--ray), a line per node that built some, and
    one per node that gets no slices because it cannot read --data."""
    # remote.images counts a slice when it arrives, samples a batch when it is committed: slices of batches
    # still being built, or aborted (a rewind), can put the cluster's count ahead of all images by a few slices.
    share = f" ({min(rm.images, samples) / samples:.0%} of all)" if samples else ""
    copy = f", copied in at {rm.copied_bytes / rm.copy_seconds / 2**20:.0f} MiB/s" if rm.copy_seconds > 0 else ""
    built = (f"{counted(rm.in_flight, 'slice')} in flight; {rm.images} img built there{share}{copy}, "
             f"{counted(rm.retries, 'retry')}, {counted(rm.stragglers, 'straggler')}, "
             f"{counted(rm.disconnects, 'disconnect')}")
    if rm.connected:
        head = (f"  remote    ray {rm.address} connected: {counted(rm.cluster_nodes, 'node')}, "
                f"{counted(rm.cluster_cpus, 'CPU')}{' (' + rm.message + ')' if rm.message else ''}; {built}")
    elif rm.message.startswith(RemoteStatus.GIVEN_UP):
        why = rm.message.removeprefix(f"{RemoteStatus.GIVEN_UP}, ")
        head = f"  remote    ray {rm.address} GIVEN UP for this job ({why}); {built}"
    else:
        head = f"  remote    ray {rm.address} NOT CONNECTED ({rm.message.removeprefix('not connected: ')}); {built}"
    return ([head] + [f"  node      {n.node}: {n.images} img, {n.images_per_s:.0f} img/s, slice p50 "
                      f"{n.latency_p50_s:.2f} s" for n in rm.nodes]
            + [f"  UNFIT     {unfit}" for unfit in rm.unfit_nodes])


def _consumer_line(c: ConsumerStatus, rank: str) -> str:
    """"  consumer  trial-3 at epoch 1 step 4, waiting for data 3.0%, alive, window 8" from one entry."""
    p = c.progress
    share = f", waiting for data {p.trainer_wait_share:.1%}" if p.trainer_wait_share is not None else ""
    alive = {True: "alive", False: "GONE", None: "alive?"}[c.trainer.alive]
    if c.closed:
        alive = "left"
    age = c.trainer.progress_age_s
    wrote = f", wrote {age:.0f} s ago" if age is not None else ""
    held = f"window {c.window}" if c.holding else "holds nothing"
    name = c.name or "(default)"
    return (f"  consumer  {name}{rank} at epoch {p.epoch} step {p.step}{share}; {writer_named(c.trainer)} {alive}{wrote}; "
            f"{held}")


def _errors_line(e: Errors) -> str:
    # Hung workers only once there was one: the daemon's log names the worker, batch and file of each.
    hung = f", {counted(e.worker_hangs, 'hung worker')} killed" if e.worker_hangs else ""
    # A trainer's moves back (a checkpoint loaded, a restart from an earlier position) rebuild batches: once there
    # was one, as --json had them alone (a walk).
    back = f", {counted(e.progress_rewinds, 'trainer rewind')} (batches built again)" if e.progress_rewinds else ""
    return (f"  errors    {counted(e.replaced_samples, 'replaced sample')}, "
            f"{counted(e.undecodable_files, 'bad file')}, {counted(e.worker_restarts, 'worker restart')}{hung}, "
            f"{counted(e.write_failures, 'failed build')}{back}")


def _bad_file_lines(e: Errors) -> list[str]:
    bad = e.undecodable
    lines = [f"  bad file  {b.path}: {b.reason}" for b in bad[:SHOWN_BAD_FILES]]
    if e.undecodable_files > SHOWN_BAD_FILES:
        lines.append(f"            and {e.undecodable_files - SHOWN_BAD_FILES} more: `--json` lists {len(bad)}, "
                     "the daemon's log names every one")
    return lines


def _consumer_lines_shown(s: StreamStatus) -> bool:
    return len(s.consumers) > 1 or any(c.name for c in s.consumers)


def _lead_name(pr: Production) -> str:
    """Whom the progress line is about: with consumer lines below, the slowest consumer that holds batches
    (status.json's ``progress``), which is one of them; else the one trainer."""
    # "holding": the slowest of all may be one that left or timed out, whose batches are not kept (a walk).
    return "slowest holding consumer" if any(_consumer_lines_shown(s) for s in pr.streams) else "trainer"


def _lead_left(pr: Production) -> bool:
    """Whether the trainer the progress line names (status.json's ``trainer``: the first rank's) closed its loader.
    Every rank's were asked: rank 0's that left beside rank 1's killed read "GONE" (a review of "Many ranks")."""
    return pr.streams[0].all_left if pr.streams else pr.all_left


def _trainer_note(trainer: TrainerStatus, left: bool = False) -> str:
    """"; trainer pid 123 alive, progress written 4 s ago" from status.json's ``trainer``; "" when unknown."""
    if trainer.pid is None:
        return ""
    state = trainer.alive
    # Gone, it still holds its window (SPEC rule 8): the buffer may still be filling, not yet full.
    keeps = "the daemon fills the buffer to the high-water mark and keeps it for when one comes back"
    # One that closed its loader has left, whether its process runs on (a notebook's kernel) or not.
    alive = (f"left (closed its loader; {keeps})" if left else "alive" if state is True else
             f"GONE ({keeps})" if state is False else "?")
    age = trainer.progress_age_s
    wrote = f", progress written {age:.0f} s ago" if age is not None else ""
    return f"; trainer {writer_named(trainer)} {alive}{wrote}"


def fill_bar(waiting: int, high: int, width: int = 24) -> str:
    # Clamped both ways: status.json is a file others may write, and "." * -10**10 is a MemoryError.
    filled = round(width * max(0, min(waiting, high)) / max(high, 1)) if high > 0 else 0
    return "[" + "#" * filled + "." * (width - filled) + "]"
