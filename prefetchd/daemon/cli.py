"""The daemon's commands of `prefetchd` (start, stop, status, submit, show, pack, config);
prefetchd/cli.py assembles them with bench and demo.  `start` options are generated from
DaemonConfig, so flags, config keys and their help text come from one place."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from collections.abc import Callable, Collection, Iterator
from typing import Any

import click
import psutil
import tomli_w

from prefetchd.buffer_protocol import (BufferBusy, ConsumerStatus, Errors, JobRequest, Manifest, Production, ProtocolError, RemoteStatus, State, Status, StreamStatus,
                                       TrainerStatus, daemon_pid, read_status)
from prefetchd.buffer_protocol.layout import STREAM_PREFIX, owning_buffer
from prefetchd.daemon.config import FIELDS, DaemonConfig, fill_defaults, load_toml
from prefetchd.daemon.main import FAILED_WHILE_PRODUCING, JOB_FIELDS
from prefetchd.daemon.mounts import filesystem_of
from prefetchd.daemon.producer import STAGES
from prefetchd.daemon.logs import setup_logging
from prefetchd.daemon.errors import EXIT_BUFFER_BUSY, EXIT_FAILURE, EXIT_NOT_RUNNING, EXIT_USAGE, ConfigError, DaemonError
from prefetchd.locations import is_url, normalize
from prefetchd.options import FiniteFloat, click_options
from prefetchd.words import counted, rank_ranges

log = logging.getLogger("prefetchd")

STALE_HEARTBEAT_SECONDS = 10.0
SHOWN_BAD_FILES = 5  # undecodable files named in the text status
# Too little to rewrite status.json (it takes a few pages, its temp file as many again); the daemon's own
# floor (--min-free-mb, 1 MiB at least by default) stops it well above this: something else took the rest.
FULL_FILESYSTEM_BYTES = 256 << 10


def config_options(only: Collection[str] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Click options for DaemonConfig's fields (or the ``only`` ones), in declaration order; layered over --config."""
    return click_options(DaemonConfig, only, layered=True)


def build_config(ctx: click.Context, config_file: Path | None, params: dict[str, Any]) -> DaemonConfig:
    """Dataclass defaults, then the config file, then flags given on the command line."""
    values = load_toml(config_file) if config_file else {}
    flags = {name: value for name, value in params.items()
             if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE}
    from_file = set(values) - set(flags)
    values.update(flags)
    try:
        return DaemonConfig(**values)
    except ConfigError as exc:
        raise ConfigError(where_it_came_from(str(exc), flags, config_file, from_file)) from None


def where_it_came_from(message: str, flags: dict[str, Any], config_file: Path | None, from_file: set[str]) -> str:
    """A config error's ``key = value`` as the user gave it: each value from a flag as that flag
    ("--val-fraction -0.1: must be at least 0.0"), and an error that starts with a key of the
    config file under the file's name ("prefetchd.toml: workers = 0 leaves ...")."""
    for key, value in flags.items():
        forms = {repr(value), str(value)} | ({repr(os.fspath(value))} if isinstance(value, os.PathLike) else set())
        for written in sorted(forms, key=len, reverse=True):
            message = re.sub(rf"(?<![\w-]){key} = {re.escape(written)}(?![\w.])",
                             lambda _: f"--{key.replace('_', '-')} {value}", message)
    if config_file is not None and message.partition(" = ")[0] in from_file:
        return f"{config_file}: {message}"
    return message


CONFIG_FILE_OPTION = click.option(
    "--config", "config_file", type=click.Path(path_type=Path, dir_okay=False),
    help="TOML file with the same keys as these flags; flags override it.",
)


@click.command()
@config_options()
@CONFIG_FILE_OPTION
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
@click.pass_context
def start(ctx: click.Context, /, config_file: Path | None, log_level: str, **params: Any) -> None:
    """Run the daemon in the foreground until stopped (SIGTERM, SIGINT or `prefetchd stop`).

    Without a dataset (--data or `data` in the config) it waits for jobs from
    `prefetchd submit` and serves them one after another.
    """
    setup_logging(log_level)
    try:
        from prefetchd.daemon.main import run_daemon

        cfg = build_config(ctx, config_file, params)
        code = run_daemon(cfg)
    except BufferBusy as exc:  # its own code: a supervisor can tell "already served" from a failure
        log.error("%s", exc)
        sys.exit(EXIT_BUFFER_BUSY)
    except (DaemonError, ProtocolError) as exc:
        log.error("%s", exc)
        sys.exit(getattr(exc, "exit_code", EXIT_FAILURE))
    sys.exit(code)


@click.command("config")
@config_options()
@CONFIG_FILE_OPTION
@click.option("--show", is_flag=True, help="Print the effective configuration as TOML.")
@click.pass_context
def config_command(ctx: click.Context, /, config_file: Path | None, show: bool, **params: Any) -> None:
    """Check a configuration: defaults < --config file < flags, with machine-sized defaults filled in."""
    try:
        cfg = build_config(ctx, config_file, params)
        filled, notes = fill_defaults(cfg)
    except DaemonError as exc:
        raise click.UsageError(str(exc)) from None
    # Values are checked; the dataset is opened only at start, so say now if a local one is not there.
    missing = filled.data is not None and not is_url(filled.data) and not Path(filled.data).exists()
    if not show:
        click.echo(f"configuration is valid, but data {filled.data} does not exist (yet): `prefetchd start` would "
                   "stop at it" if missing else "configuration is valid")
        return
    click.echo(format_toml(filled, dict(note.split(" = ", 1) for note in notes)))
    if missing:
        click.echo(f"# note: data {filled.data} does not exist (yet)", err=True)


def format_toml(cfg: DaemonConfig, sized: dict[str, str]) -> str:
    """One ``key = value`` line per field, written by tomli-w (which quotes and escapes any path
    or string as TOML needs), with the notes as comments, which tomli-w does not write."""
    lines = ["# effective prefetchd configuration: defaults < --config file < flags"]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is None:
            lines.append(f"# {f.name} = (unset)")
            continue
        pair = tomli_w.dumps({f.name: str(value) if isinstance(value, Path) else value}).rstrip("\n")
        # A note reads "VALUE (why)": the comment is the why.
        note = f"  # default: {sized[f.name].split(' ', 1)[1].removeprefix('(').removesuffix(')')}" if f.name in sized else ""
        lines.append(f"{pair}{note}")
    return "\n".join(lines)


@click.command()
@config_options(only=JOB_FIELDS)
@click.option("--buffer", type=click.Path(path_type=Path, file_okay=False), required=True, help="The daemon's buffer directory.")
@CONFIG_FILE_OPTION
@click.option("--replace", is_flag=True, help="Replace the running job even while a trainer consumes it.")
@click.option("--timeout", type=FiniteFloat(), default=60.0, show_default=True, help="Seconds to wait for the daemon's answer.")
@click.pass_context
def submit(ctx: click.Context, /, buffer: Path, config_file: Path | None, replace: bool, timeout: float, **params: Any) -> None:
    """Ask the daemon on BUFFER to produce a job (it validates it and answers in its status)."""
    settings: dict[str, Any] = {}
    if config_file:
        settings.update({k: v for k, v in load_toml(config_file).items() if k in JOB_FIELDS})
    settings.update({k: v for k, v in params.items() if ctx.get_parameter_source(k) is click.core.ParameterSource.COMMANDLINE})
    settings = {k: str(Path(v).resolve()) if isinstance(v, Path) else normalize(v) if FIELDS[k].metadata.get("location")
                and isinstance(v, str) else v for k, v in settings.items()}  # the daemon's cwd is not ours
    created = not buffer.exists()
    buffer.mkdir(mode=0o700, parents=True, exist_ok=True)  # as the daemon would create it
    request = JobRequest(settings, replace)
    request.write(buffer)
    if daemon_pid(buffer) is None:
        made = (f" (this created {buffer}: if you meant a running daemon's buffer, check the path; a service's "
                "daemon refuses a buffer another user made)") if created else ""
        click.echo(f"submitted job {request.job_id}; no daemon owns {buffer} yet, the job waits in job.json until "
                   f"one starts{made}")
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            answer = read_status(buffer)
        except ProtocolError:  # a damaged status: the daemon rewrites it within a second
            answer = None
        result = answer.job_result if answer is not None else None
        if result is not None and result.job_id == request.job_id:
            verdict = "accepted" if result.accepted else "refused"
            click.echo(f"job {request.job_id} {verdict}: {result.reason}")
            sys.exit(0 if result.accepted else EXIT_FAILURE)
        time.sleep(0.1)
    click.echo(f"the daemon on {buffer} did not answer job {request.job_id} within {timeout:.0f} s; "
               f"see `prefetchd status --buffer {buffer}`", err=True)
    sys.exit(EXIT_FAILURE)


@click.command()
@click.option("--buffer", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--timeout", type=FiniteFloat(), default=30.0, show_default=True, help="Seconds to wait for the daemon to exit.")
def stop(buffer: Path, timeout: float) -> None:
    """Stop the daemon that owns BUFFER gracefully (SIGTERM) and wait until it has exited."""
    pid = daemon_pid(buffer)
    if pid is None:
        click.echo(f"no daemon is running on {buffer}")
        return
    owner = owning_buffer(buffer)
    if owner != buffer:  # stopping it would stop every rank's stream, not just this one
        click.echo(f"{buffer} is a rank's stream directory of the daemon on {owner} (pid {pid}), which serves all "
                   f"its ranks; to stop it, run `prefetchd stop --buffer {owner}`", err=True)
        sys.exit(EXIT_USAGE)
    try:
        os.kill(pid, signal.SIGTERM)
    except PermissionError:
        click.echo(f"cannot stop the daemon on {buffer}: {not_ours_to_signal(pid)}", err=True)
        sys.exit(EXIT_FAILURE)
    except ProcessLookupError:  # it exited between the look and the signal
        pass
    # The lock goes before the interpreter exits: "stopped" means the process is gone
    # (a zombie is gone too: its parent, not us, has to reap it).
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _exited(pid):
            click.echo(f"stopped the daemon on {buffer} (pid {pid})")
            return
        time.sleep(0.05)
    click.echo(f"the daemon on {buffer} (pid {pid}) did not exit within {timeout:.0f} s; `kill -9 {pid}` ends it", err=True)
    sys.exit(EXIT_FAILURE)


def not_ours_to_signal(pid: int) -> str:
    """Why `prefetchd stop` may not SIGTERM ``pid`` (another user's process), and who can: its
    systemd unit when it runs as one, read from /proc/PID/cgroup, or its user or root."""
    try:
        user = f"user {psutil.Process(pid).username()}"
    except (psutil.Error, KeyError):  # hidden by hidepid, or gone
        user = "another user"
    unit = None
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
            found = re.search(r"/([^/\s]+\.service)$", f.read(), re.MULTILINE)
        unit = found[1] if found else None
    except OSError:
        pass
    how = f"stop its service with `systemctl stop {unit}`" if unit else "stop the service that runs it (`systemctl stop prefetchd@NAME`)"
    return f"the daemon (pid {pid}) runs as {user}; {how}, or run this command as that user or root"


def _exited(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _mib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def describe_status(buffer: Path) -> dict[str, Any]:
    """What `prefetchd status` shows; ``status`` is the typed document (``status_json`` makes it JSON)."""
    owner = owning_buffer(buffer)
    if owner != buffer and not buffer.exists():  # the status read would be the parent's, of other ranks
        return {"buffer": str(buffer), "running": False, "pid": None, "heartbeat_age_s": None, "stale": False,
                "status": None, "manifest": None, "no_rank": True,
                "problems": [f"no such rank: the daemon on {owner} writes no {buffer.name}; "
                             f"`prefetchd status --buffer {owner}` shows the ranks it serves"]}
    pid = daemon_pid(buffer)
    status = manifest = None
    problems = []
    try:
        status = read_status(buffer)
    except ProtocolError as exc:
        problems.append(str(exc))
    rank = None
    if owner != buffer:  # one rank's stream directory: show that rank, not every rank of its daemon
        rank = int(buffer.name.removeprefix(STREAM_PREFIX))
        status, problem = _one_rank(status, rank, owner)
        problems += [problem] if problem else []
    # With several ranks the manifests live in the stream directories; they share everything shown.
    for directory in [buffer, *sorted(buffer.glob(f"{STREAM_PREFIX}*"))]:
        try:
            manifest = Manifest.read(directory).to_doc()
            break
        except FileNotFoundError:
            continue
        except ProtocolError as exc:
            problems.append(str(exc))
            break
    age = time.time() - status.heartbeat if status is not None else None
    free = _free_bytes(owner)
    if pid is not None and free is not None and free < FULL_FILESYSTEM_BYTES:
        # status.json cannot be rewritten (its mtime still beats, SPEC rule 8): what shows is the last that fitted.
        problems.append(f"the buffer's filesystem is full ({free / 2**20:.1f} MiB free): the daemon can build no "
                        "batch and cannot rewrite its status, so the figures above are from the last one written; "
                        f"free space on {filesystem_of(owner).point} (what else fills it?)")
    return {
        "buffer": str(buffer),
        "owner": str(owner),
        "rank": rank,
        "running": pid is not None,
        "pid": pid,
        "heartbeat_age_s": round(age, 1) if age is not None else None,
        "stale": pid is not None and age is not None and age > STALE_HEARTBEAT_SECONDS,
        "status": status,
        "manifest": manifest,
        "problems": problems,
    }


def _free_bytes(path: Path) -> int | None:
    try:
        fs = os.statvfs(path)
    except OSError:
        return None
    return fs.f_bavail * fs.f_frsize


def _one_rank(status: Status | None, rank: int, owner: Path) -> tuple[Status | None, str]:
    """``status`` narrowed to rank ``rank``'s stream: its trainer, position and fill (the rates, memory
    and errors stay the daemon's); with a problem line when the daemon serves no such rank now."""
    pr = status.production if status is not None else None
    if status is None or pr is None:
        return status, ""
    stream = next((s for s in pr.streams if s.rank == rank), None)
    if stream is None:
        served = rank_ranges([s.rank for s in pr.streams]) or "none"
        return status, (f"the daemon on {owner} does not serve rank {rank} now (it serves {served}); "
                        f"`prefetchd status --buffer {owner}` shows them")
    share = len(pr.streams)
    narrowed = dataclasses.replace(pr, streams=(stream,), progress=stream.progress, trainer=stream.trainer,
                                   waiting=stream.waiting, building=stream.building,
                                   high_water=pr.high_water // share, low_water=pr.low_water // share)
    return dataclasses.replace(status, production=narrowed), ""


def status_json(info: dict[str, Any], indent: int | None = 1) -> str:
    """``describe_status`` as `prefetchd status --json` prints it: the status as status.json holds it.
    ``indent=None``: on one line, as --watch --json prints one document per line."""
    status: Status | None = info["status"]
    return json.dumps({**info, "status": status.to_doc() if status is not None else None}, indent=indent, sort_keys=True)


def format_status(info: dict[str, Any]) -> str:
    """The text of `prefetchd status`; read_status has checked every field it shows."""
    buffer, mf = info["buffer"], info["manifest"]
    st: Status | None = info["status"]
    if info.get("no_rank"):  # a rank directory no daemon writes: its buffer's daemon may well run
        return "\n".join([f"prefetchd on {buffer}: no such rank", *info["problems"]])
    if not info["running"]:
        line = f"prefetchd on {buffer}: not running" + ("" if Path(buffer).exists() else f" ({buffer} does not exist)")
        if st:
            line += f" (last state: {st.state}{': ' + st.message if st.message else ''})"
        # What went wrong in the job it last produced (the bad files to mend) is not gone with it.
        e = st.production.errors if st is not None and st.production is not None else None
        told = [_errors_line(e), *_bad_file_lines(e)] if e is not None and (
            e.replaced_samples or e.undecodable_files or e.worker_restarts or e.write_failures) else []
        return "\n".join([line, *told, *info["problems"]])
    state = st.state if st else "starting"
    meaning = " (every batch of the job's epochs is built; trainers may still be reading)" if state == State.DONE else ""
    lines = [f"prefetchd on {buffer}: running (pid {info['pid']}), state {state}{meaning}"]
    if info.get("rank") is not None:
        lines.append(f"  stream    rank {info['rank']} of the daemon on {info['owner']}: its trainer and fill; "
                     "the rates, memory and errors are the whole daemon's")
    if info["stale"]:
        lines.append(f"  WARNING  no heartbeat for {info['heartbeat_age_s']:.0f} s: the daemon may be stuck")
    if st and st.message:
        lines.append(f"  note      {st.message}")
    if mf and state != State.WAITING_FOR_JOB:  # a finished job's manifest stays until the next job replaces it
        lines.append(
            f"  dataset   {mf['dataset_root']} ({counted(mf['num_samples'], 'sample')}, {counted(len(mf['classes']), 'class')}), "
            f"split {mf['split']}, batch {mf['batch_size']} x {mf['image_size']}px, {mf['steps_per_epoch']} steps/epoch"
            + (" (short last batch left out)" if mf.get("drop_last") else "")
        )
    pr = st.production if st else None
    world = mf.get("world_size", 1) if mf else 1
    if world > 1:  # one stream directory per rank: say which of the world's ranks are here
        served = rank_ranges([s.rank for s in pr.streams]) if pr is not None and pr.streams else "some"
        lines.append(f"  ranks     {served} of world size {world}, each in {owning_buffer(Path(buffer))}/{STREAM_PREFIX}NNNNN")
    if pr is not None:  # None while the daemon waits for a job or starts one
        p, r, e = pr.progress, pr.rates, pr.errors
        share = p.trainer_wait_share
        fed = f", waiting for data {share:.1%} of its time" if share is not None else ""
        lines += [
            f"  progress  {_lead_name(pr)} at epoch {p.epoch} step {p.step}{fed}{_trainer_note(pr.trainer, _all_left(pr))}",
            f"  fill      {fill_bar(pr.waiting, pr.high_water)} {pr.waiting}/{pr.high_water} batches waiting"
            + (", " if state == State.DONE else f" (builds again at {pr.low_water} waiting), ") + f"{pr.building} building",
            *_cap_line(pr),
            f"  memory    {_mib(pr.buffer_bytes)} in the buffer, {_mib(pr.free_bytes)} free on its filesystem",
            f"  rates     produce {r.samples_per_s:.0f} img/s with {counted(pr.workers, 'worker')} "
            f"({pr.workers_cpu_percent:.0f}% CPU), consume {r.consumed_batches_per_s:.2f} batches/s",
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
                lines.append(f"  rank {s.rank:<5} {fill_bar(s.waiting, per_rank, 12)} {s.waiting}/{per_rank} "
                             f"waiting, trainer at epoch {sp.epoch} step {sp.step}{waits}")
        for s in streams:
            # Several trainers share the buffer (or one named consumer reads it): one line each.
            if _consumer_lines_shown(s):
                rank = f" of rank {s.rank}" if len(streams) > 1 else ""
                lines += [_consumer_line(c, rank) for c in s.consumers]
    job = st.job_result if st else None
    if job:
        # A job accepted that then failed while producing carries its own verb.
        verdict = job.reason if job.reason.startswith(FAILED_WHILE_PRODUCING) else \
            f"{'accepted' if job.accepted else 'refused'}: {job.reason}"
        lines.append(f"  last job  {job.job_id or '(unreadable)'} {verdict}")
    lines += info["problems"]
    return "\n".join(lines)


def _cap_line(pr: Production) -> list[str]:
    """A line when --max-buffer-bytes, not the high-water mark, bounds the buffer: a consumer's window
    is narrower than the high-water mark only then (consumers.plan_windows), also where the job's end
    leaves fewer batches to build."""
    per_rank = pr.high_water // max(1, len(pr.streams))
    capped = [c.window for s in pr.streams for c in s.consumers if c.holding and c.window < per_rank]
    if not capped:
        return []
    return [f"  capped    --max-buffer-bytes, not the high-water mark, limits the buffer: it keeps {min(capped)} of "
            f"{per_rank} batches ({_mib(pr.batch_bytes)} each) for {counted(len(capped), 'consumer')}; raise it for a "
            "deeper buffer"]


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
                f"{counted(rm.cluster_cpus, 'CPU')}; {built}")
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
    return (f"  consumer  {name}{rank} at epoch {p.epoch} step {p.step}{share}; pid {c.trainer.pid} {alive}{wrote}; "
            f"{held}")


def _errors_line(e: Errors) -> str:
    return (f"  errors    {counted(e.replaced_samples, 'replaced sample')}, "
            f"{counted(e.undecodable_files, 'undecodable file')}, {counted(e.worker_restarts, 'worker restart')}, "
            f"{counted(e.write_failures, 'failed build')}")


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
    return "slowest consumer" if any(_consumer_lines_shown(s) for s in pr.streams) else "trainer"


def _all_left(pr: Production) -> bool:
    """Every consumer closed its loader: the trainers finished (or stopped) rather than went away."""
    consumers = [c for s in pr.streams for c in s.consumers]
    return bool(consumers) and all(c.closed for c in consumers)


def _trainer_note(trainer: TrainerStatus, left: bool = False) -> str:
    """", trainer pid 123 alive, progress moved 4 s ago" from status.json's ``trainer``; "" when unknown."""
    if trainer.pid is None:
        return ""
    state = trainer.alive
    # Gone, it still holds its window (SPEC rule 8): the buffer may still be filling, not yet full.
    keeps = "the daemon fills the buffer to the high-water mark and keeps it for when one comes back"
    gone = f"left (closed its loader; {keeps})" if left else f"GONE ({keeps})"
    alive = "alive" if state is True else gone if state is False else "?"
    age = trainer.progress_age_s
    moved = f", progress moved {age:.0f} s ago" if age is not None else ""
    return f"; trainer pid {trainer.pid} {alive}{moved}"


def fill_bar(waiting: int, high: int, width: int = 24) -> str:
    # Clamped both ways: status.json is a file others may write, and "." * -10**10 is a MemoryError.
    filled = round(width * max(0, min(waiting, high)) / max(high, 1)) if high > 0 else 0
    return "[" + "#" * filled + "." * (width - filled) + "]"


@click.command()
@click.option("--buffer", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (with --watch: one document per line).")
@click.option("--watch", is_flag=True, help="Redraw every --interval seconds until Ctrl-C.")
@click.option("--interval", type=FiniteFloat(0.1), default=1.0, show_default=True)
def status(buffer: Path, as_json: bool, watch: bool, interval: float) -> None:
    """Show buffer fill, rates and errors.  Exit code 3 when no daemon runs on BUFFER."""
    if not watch:
        info = describe_status(buffer)
        click.echo(status_json(info) if as_json else format_status(info))
        if not info["running"]:
            sys.exit(EXIT_NOT_RUNNING)
        return
    note = f"(every {interval:g} s, Ctrl-C to leave)"
    if as_json:  # stdout stays pure JSON Lines, for `| jq` or a script
        click.echo(note, err=True)
    try:
        while True:
            info = describe_status(buffer)
            if as_json:
                click.echo(status_json(info, indent=None))
            else:
                click.clear()
                click.echo(f"{format_status(info)}\n\n{note}")
            time.sleep(interval)
    except KeyboardInterrupt:
        return


@click.command()
@click.option("--buffer", type=click.Path(path_type=Path, file_okay=False, exists=True), required=True)
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=Path("batch.png"), show_default=True)
@click.option("--max-images", type=click.IntRange(1), default=64, show_default=True)
def show(buffer: Path, out: Path, max_images: int) -> None:
    """Render the next waiting batch as a labelled image grid, to check augmentations by eye."""
    from prefetchd.daemon.show import render_next_batch

    try:
        batch = render_next_batch(buffer, out, max_images)
    except (ProtocolError, DaemonError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {out}: epoch {batch.meta.epoch} step {batch.meta.step}, "
               f"{min(batch.meta.size, max_images)} of {batch.meta.size} images")


def shard_size_option(ctx: click.Context, param: click.Parameter, value: str) -> int:
    """A --shard-size option's callback: ``parse_size``, its refusal as click's (also tools/bench_sources.py's)."""
    from prefetchd.daemon.sources.shards import parse_size

    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _pack_out(ctx: click.Context, param: click.Parameter, value: str) -> Path:
    # Checked as typed: Path("s3://bkt/packed") is the local folder "s3:/bkt/packed", which pack would create.
    if is_url(value):
        raise click.BadParameter(
            f"{value} is a URL, but pack writes shards to a local folder; pack into one (e.g. /data/packed), "
            f"upload the folder to {value} with your storage's tools (aws s3 sync, gcloud storage rsync), then "
            f"`prefetchd start --data {value}`")
    return Path(value)


@click.command()
@click.argument("src")
@click.argument("out", callback=_pack_out)
@click.option("--shard-size", default="1GB", show_default=True, callback=shard_size_option,
              help="Start a new shard past this size: 1GB (10^9 bytes), 500MB, 1GiB (2^30 bytes).")
@click.option("--shuffle", is_flag=True, help="Pack the samples in a seeded random order (the index records each one's source).")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=None, help="Seed of --shuffle [default: 0].")
@click.option("--force", is_flag=True, help="Replace the shards and index already in OUT.")
@click_options(DaemonConfig, ("index_cache", "refresh_index"))  # start's: SRC is indexed as --data is
def pack(src: str, out: Path, shard_size: int, shuffle: bool, seed: int | None, force: bool,
         index_cache: Path | None, refresh_index: bool) -> None:
    """Pack the dataset at SRC (class folders or a file list) into tar shards in OUT.

    The shards follow WebDataset's naming (<key>.jpg + <key>.cls), so any tar
    reader can read them; OUT/prefetchd-index.npz holds every sample's byte
    offset, so `prefetchd start --data OUT` reads each with one positioned read.
    """
    from prefetchd.daemon.sources import open_dataset
    from prefetchd.daemon.sources.index_cache import default_cache_dir
    from prefetchd.daemon.sources.shards import check_pack_target
    from prefetchd.daemon.sources.shards import pack as pack_shards

    if seed is not None and not shuffle:
        raise click.UsageError("--seed orders the samples of --shuffle; add --shuffle, or leave --seed out")
    setup_logging("info")
    try:
        check_pack_target(src, out, force)  # before the source is indexed, which can take long
        index = open_dataset(src, index_cache=index_cache or default_cache_dir(), refresh_index=refresh_index)
        with click.progressbar(length=len(index), label=f"packing {len(index)} samples", file=sys.stderr) as bar:
            def progress(items: Iterator[int]) -> Iterator[int]:
                # click draws the bar only on a terminal; elsewhere (a job's log) a line every 10 s
                last = time.monotonic()
                for i in items:
                    yield i
                    bar.update(1)
                    if not sys.stderr.isatty() and time.monotonic() - last >= 10:
                        log.info("packed %d of %d samples", i + 1, len(index))
                        last = time.monotonic()

            summary = pack_shards(index, out, shard_size, (seed or 0) if shuffle else None, force, progress)
    except DaemonError as exc:
        raise click.ClickException(str(exc)) from None
    unreadable = counted(summary["unreadable"], "unreadable file")
    bad = f"; {unreadable} packed empty (the daemon replaces them)" if summary["unreadable"] else ""
    click.echo(f"packed {counted(summary['samples'], 'sample')} of {src} into {counted(summary['shards'], 'shard')} "
               f"({_mib(summary['bytes'])}) in {out}{bad}")


# The umbrella command (prefetchd/cli.py) adds these to bench and demo; the daemon knows neither.
COMMANDS: tuple[click.Command, ...] = (start, config_command, submit, stop, status, show, pack)

__all__ = ["COMMANDS", "FIELDS", "setup_logging", "shard_size_option"]
