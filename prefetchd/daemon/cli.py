"""The daemon's commands of `prefetchd` (start, stop, status, submit, show, pack, config);
prefetchd/cli.py assembles them with bench and demo.  `start` options are generated from
DaemonConfig, so flags, config keys and their help text come from one place; what `status` finds
and prints is status_view.py's."""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import re
import signal
import stat
import sys
import time
from pathlib import Path
from collections.abc import Callable, Collection, Iterator
from typing import Any

import click
import psutil
import tomli_w

from prefetchd.buffer_protocol import (BufferBusy, JobRequest, ProtocolError, daemon_owner, lock_holders, read_status,
                                      readable_status)
from prefetchd.buffer_protocol.errors import user_name
from prefetchd.buffer_protocol.layout import LOCK_NAME, STREAM_RE, owning_buffer
from prefetchd.buffer_protocol.manifest import exact_number
from prefetchd.buffer_protocol.ownership import service_unit
from prefetchd.daemon.config import (FIELDS, DaemonConfig, check_buffer_outside, check_job_setting, fill_defaults,
                                     held_bytes, load_toml)
from prefetchd.access import cannot_read, no_access
from prefetchd.daemon.buffer_dir import check_capacity, check_not_shared, private_dir_problem
from prefetchd.daemon.job_inbox import JOB_FIELDS
from prefetchd.daemon.logs import setup_logging
from prefetchd.daemon.errors import (EXIT_BUFFER_BUSY, EXIT_FAILURE, EXIT_NO_ACCESS, EXIT_NOT_RUNNING, EXIT_USAGE, ConfigError,
                                     DaemonError, out_of_processes)
from prefetchd.daemon.status_view import (describe_status, exiting, foreign_lock, format_status, not_the_holder,
                                          status_json)
from prefetchd.locations import is_url, normalize
from prefetchd.options import BufferOptionCommand, FiniteFloat, LocalPath, LocationParam, click_options
from prefetchd.words import binary_size, counted, one_line

log = logging.getLogger("prefetchd")

def config_options(only: Collection[str] | None = None,
                   defaults_from: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Click options for DaemonConfig's fields (or the ``only`` ones), in declaration order; layered over --config."""
    return click_options(DaemonConfig, only, layered=True, defaults_from=defaults_from)


# A job leaves unset what the daemon's own flags and config file decide (JobInbox.config): `prefetchd start`'s
# defaults in submit's help ("[default: 128]") told a user of a service configured for batch 256 the wrong value.
SUBMIT_DEFAULTS = "the daemon's own setting"


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
    ("--val-fraction -0.1: must be at least 0"), an item of a repeated flag as that flag given it
    ("--allowed-transforms nocolon: expected ..."), and an error that starts with a key of the
    config file under the file's name ("prefetchd.toml: workers = 0 leaves ...")."""
    for key, value in flags.items():
        for one in value if isinstance(value, tuple) else (value,):
            forms = {repr(one), str(one)} | ({repr(os.fspath(one))} if isinstance(one, os.PathLike) else set())
            typed = f"--{key.replace('_', '-')} {shown(one)}"
            for written in sorted(forms, key=len, reverse=True):
                message = re.sub(rf"(?<![\w-]){key} = {re.escape(written)}(?![\w.])", lambda _: typed, message)
    if config_file is not None and message.partition(" = ")[0] in from_file:
        return f"{config_file}: {message}"
    return message


def shown(value: Any) -> str:
    """A flag's value as it is typed: click makes ``--consumer-timeout 0`` the float 0.0, shown as 0."""
    return exact_number(value) if isinstance(value, float) else str(value)


# Not readable=True (click's default): a user outside a --group-access buffer's group got only click's "Directory
# ... is not readable" (exit 2, which `stop` documents for a rank's directory); the commands say whose it is (no_access,
# as prefetchd-train does).
BUFFER = LocalPath(buffer=True, file_okay=False, readable=False)


def say(message: str, err: bool = False) -> None:
    """One line of a command's answer, a path's newline and terminal escapes in it written out as the log and
    status write them (``one_line``): `stop` and `config` printed them raw, which split a line and reached the
    terminal (an escape in a folder's name turned it red: a walk)."""
    click.echo(one_line(message), err=err)


CONFIG_FILE_OPTION = click.option(
    "--config", "config_file", type=LocalPath(dir_okay=False),
    help="TOML file with the same keys as these flags; flags override it.",
)


# start's; `config` takes it too, so that a start command line checks as it is (it was "No such option", a walk).
LOG_LEVEL_OPTION = click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
                                show_default=True, help="How much the daemon logs (debug: prefetchd's own lines).")


# What has a running daemon write its threads' stacks into its log (and go on).
STACKS_SIGNAL = signal.SIGUSR1


@click.command(cls=BufferOptionCommand)
@config_options()
@CONFIG_FILE_OPTION
@LOG_LEVEL_OPTION
@click.pass_context
def start(ctx: click.Context, /, config_file: Path | None, log_level: str, **params: Any) -> None:
    """Run the daemon in the foreground until stopped (SIGTERM, SIGINT, SIGHUP or `prefetchd stop`).

    Without a dataset (--data or `data` in the config) it waits for jobs from
    `prefetchd submit` and serves them one after another.
    """
    setup_logging(log_level)
    if sys.__stderr__ is not None:  # where the log goes: a daemon that beats no more can be asked where it is
        # A crash in native code (a decoder) says where each thread was; `kill -USR1 PID` says it on demand, where
        # py-spy, which DaemonStuck names first, is not installed.
        faulthandler.enable(sys.__stderr__)
        faulthandler.register(STACKS_SIGNAL, file=sys.__stderr__, all_threads=True)
    try:
        os.getcwd()
    except FileNotFoundError:  # the worker server's start (multiprocessing) needs it: a traceback (a walk)
        log.error("the current folder was deleted; cd to one that exists and start the daemon again")
        sys.exit(EXIT_USAGE)
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
    except (RuntimeError, OSError) as exc:
        said = out_of_processes(exc)
        if said is None:
            raise
        log.error("%s", said)
        sys.exit(EXIT_FAILURE)
    sys.exit(code)


@click.command("config", cls=BufferOptionCommand)
@config_options()
@CONFIG_FILE_OPTION
@click.option("--show", is_flag=True, help="Print the effective configuration as TOML.")
@LOG_LEVEL_OPTION
@click.pass_context
def config_command(ctx: click.Context, /, config_file: Path | None, show: bool, log_level: str, **params: Any) -> None:
    """Check a configuration: defaults < --config file < flags, with machine-sized defaults filled in."""
    try:
        cfg = build_config(ctx, config_file, params)
        held = held_bytes(cfg)  # one listing of the buffer's batches for both
        filled, notes = fill_defaults(cfg, held)
        # What `start` refuses (exit 2, which the unit does not restart) or warns of.
        check_not_shared(Path(filled.buffer))
        unsafe = buffer_problem(Path(filled.buffer), filled.group_access)
        if unsafe is not None and unsafe[1]:
            raise ConfigError(unsafe[0])
        short = check_capacity(filled, held)
    except DaemonError as exc:
        raise click.UsageError(str(exc)) from None
    if short is not None:
        say(f"warning: {short}", err=True)
    # Values are checked; the dataset is opened only at start, so say now if a local one is not there.  Both are
    # said, not refused (exit 0): the values are valid, and the user who checks a service's config is not the one
    # it runs as (the unit's User=), who may well have the data and the buffer.
    caveats = []
    elsewhere = "(a service's daemon runs as its unit's User=)"
    if filled.data is not None and not is_url(filled.data):
        unread = cannot_read(Path(filled.data))
        if unread is not None:  # a folder on the way it may not enter made `exists()` a PermissionError
            caveats.append(f"this user may not read data {filled.data}, so `prefetchd start` run by this user would "
                           f"stop at it {elsewhere}: {unread}")
        elif not os.path.exists(filled.data):
            caveats.append(f"data {filled.data} does not exist (yet): `prefetchd start` would stop at it")
    if filled.metrics_textfile is not None:
        from prefetchd.daemon.metrics import unwritable_textfile

        unwritable = unwritable_textfile(Path(filled.metrics_textfile))
        if unwritable is not None:
            caveats.append(f"this user may not write metrics_textfile {filled.metrics_textfile}, so a daemon run by "
                           f"this user would warn once a minute that it cannot {elsewhere}: {unwritable}")
    if filled.transform is not None:
        # Imported as start does (its form was checked above): `config` said valid of a module that start could
        # not import, or of a name that is no callable (a user's walk). Said, not refused: the service's user
        # may have another PYTHONPATH.
        from prefetchd.daemon.hook import validate_hook_within

        try:
            validate_hook_within(filled.transform, filled.worker_start_timeout, lambda _: None)
        except ConfigError as exc:
            caveats.append(f"{exc}; so `prefetchd start` run by this user would refuse it {elsewhere}")
    # No access at all first: a trainer's user checking a service's config is to join its group, not to remove
    # the service's buffer; where this user may use it, what `start` by this user would refuse (another's).
    denied = no_access(filled.buffer, write=True) or (unsafe[0] if unsafe is not None else None)
    if denied is not None:
        caveats.append(f"this user may not use buffer {filled.buffer}, so `prefetchd start` run by this user would "
                       f"stop at it {elsewhere}: {denied}")
    if not show:
        say("configuration is valid" + (", but " + "; and ".join(caveats) if caveats else ""))
        return
    click.echo(format_toml(filled, dict(note.split(" = ", 1) for note in notes)))
    for caveat in caveats:
        say(f"# note: {caveat}", err=True)


def buffer_problem(buffer: Path, group_access: bool) -> tuple[str, bool] | None:
    """Why `prefetchd start` run by this user would refuse ``buffer`` as it stands (``private_dir_problem``), and
    whether it would for any user: a link, a file, a folder every user may write; not another user's folder (the
    service's user may own it), nor a group-writable one (the unit passes --group-access on its command line,
    not in its config file).  None where it would take it, or where it is not there yet."""
    try:
        st = os.lstat(buffer)
    except OSError:
        return None
    problem = private_dir_problem(buffer, st, group_access)
    if problem is None:
        return None
    return problem, stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or bool(st.st_mode & stat.S_IWOTH)


def _nearest_owner(path: Path) -> tuple[Path, int]:
    """``path``, or the nearest folder above it that this user may stat, and its owner's uid."""
    for folder in (path, *path.parents):
        try:
            return folder, os.stat(folder).st_uid
        except OSError:
            continue
    return Path("/"), 0


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
        # A note reads "VALUE (why)": the comment is the why (a VALUE may hold spaces: a path under /home/Jo Doe).
        why = sized[f.name].removeprefix(f"{value} ").removeprefix("(").removesuffix(")") if f.name in sized else ""
        note = f"  # default: {why}" if why else ""
        lines.append(f"{pair}{note}")
    return "\n".join(lines)


@click.command(cls=BufferOptionCommand)
@config_options(only=JOB_FIELDS, defaults_from=SUBMIT_DEFAULTS)
@click.option("--buffer", type=BUFFER, required=True, help="The daemon's buffer directory.")
@CONFIG_FILE_OPTION
@click.option("--replace", is_flag=True, help="Replace the running job even while a trainer consumes it.")
@click.option("--timeout", type=FiniteFloat(0), default=60.0, show_default=True, help="Seconds to wait for the daemon's answer.")
@click.pass_context
def submit(ctx: click.Context, /, buffer: Path, config_file: Path | None, replace: bool, timeout: float, **params: Any) -> None:
    """Ask the daemon on BUFFER to produce a job (it validates it and answers in its status).  A setting left
    out is the daemon's own (its flags and --config), not `prefetchd start`'s default.  Exit code 0:
    accepted; 1: refused, or no answer within --timeout; 2: a bad setting, or a BUFFER no daemon takes jobs in (a
    link, a file, a folder every user may write, a rank's stream directory; nothing written); 3: no daemon owns
    BUFFER (the job waits in job.json for one to start); 4: this user may not write BUFFER, or not create it
    (nothing written)."""
    flags = {k: v for k, v in params.items() if ctx.get_parameter_source(k) is click.core.ParameterSource.COMMANDLINE}
    settings: dict[str, Any] = {}
    from_file: set[str] = set()
    try:
        if config_file:
            settings.update({k: v for k, v in load_toml(config_file).items() if k in JOB_FIELDS})
        from_file = set(settings) - set(flags)
        settings.update(flags)
        for key, value in settings.items():  # now, not after the daemon has read the job
            check_job_setting(key, value)
    except ConfigError as exc:
        raise click.UsageError(where_it_came_from(str(exc), flags, config_file, from_file)) from None
    settings = {k: str(Path(v).resolve()) if isinstance(v, Path) else normalize(v) if FIELDS[k].metadata.get("location")
                and isinstance(v, str) else v for k, v in settings.items()}  # the daemon's cwd is not ours
    real = Path(os.path.realpath(buffer))  # b4/nx/../rank-00001 too, nx missing: made, and job.json written (a walk)
    top = owning_buffer(real)
    if top != real:  # its job.json no daemon reads: submit waited out --timeout, 60 s, then exit 1 (a walk)
        raise click.UsageError(f"{buffer} is a rank's stream directory of the daemon on {top}, which takes jobs for "
                               f"all its ranks in {top}: run `prefetchd submit --buffer {top} ...` (nothing written)")
    try:
        check_not_shared(buffer)  # a job.json in /dev/shm itself
        unsafe = buffer_problem(buffer, group_access=True)  # the daemon's flag is not known here
        if unsafe is not None and unsafe[1]:  # a folder no daemon takes: the job would wait there for ever
            raise ConfigError(f"{unsafe[0]} (nothing written)")
        check_buffer_outside(buffer, settings.get("data"))  # normalized above, as the daemon will read it
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    denied = no_access(buffer, write=True)
    if denied is not None:
        say(f"cannot submit a job to {buffer} (nothing written): {denied}", err=True)
        sys.exit(EXIT_NO_ACCESS)
    created = not buffer.exists()
    try:
        buffer.mkdir(mode=0o700, parents=True, exist_ok=True)  # as the daemon would create it
    except OSError as exc:  # what no_access cannot foresee: a read-only filesystem, a file in the path
        say(f"cannot submit a job to {buffer} (nothing written): cannot create it: {exc.filename}: "
            f"{exc.strerror}", err=True)
        sys.exit(EXIT_NO_ACCESS)
    request = JobRequest(settings, replace)
    request.write(buffer)
    if daemon_owner(buffer) is None:
        # Exit 3, not 0: nothing has accepted the job, and a mistyped --buffer looks just like this. job.json
        # stays, since a daemon started on the buffer later adopts it (README, "Jobs").
        made = (f" (this created {buffer}: if you meant a running daemon's buffer, check the path; a service's "
                "daemon refuses a buffer another user made)") if created else ""
        say(f"submitted job {request.job_id}; no daemon owns {buffer} yet, the job waits in job.json until "
            f"one starts{made}")
        sys.exit(EXIT_NOT_RUNNING)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            answer = read_status(buffer)
        except ProtocolError:  # a damaged status: the daemon rewrites it within a second
            answer = None
        result = answer.job_result if answer is not None else None
        if result is not None and result.job_id == request.job_id:
            verdict = "accepted" if result.accepted else "refused"
            say(f"job {request.job_id} {verdict}: {result.reason}")
            sys.exit(0 if result.accepted else EXIT_FAILURE)
        time.sleep(0.1)
    if daemon_owner(buffer) is None:  # it stopped while we waited
        say(f"the daemon on {buffer} stopped before it answered job {request.job_id}; the job waits in "
            "job.json until one starts", err=True)
        sys.exit(EXIT_NOT_RUNNING)
    say(f"the daemon on {buffer} did not answer job {request.job_id} within {timeout:.0f} s; "
        f"see `prefetchd status --buffer {buffer}`", err=True)
    sys.exit(EXIT_FAILURE)


@click.command(cls=BufferOptionCommand)
@click.option("--buffer", type=BUFFER, required=True)
@click.option("--timeout", type=FiniteFloat(0), default=30.0, show_default=True, help="Seconds to wait for the daemon to exit.")
def stop(buffer: Path, timeout: float) -> None:
    """Stop the daemon that owns BUFFER gracefully (SIGTERM, and SIGCONT where it is stopped) and wait until it has
    exited.  One of another pid namespace (another container, or the host) is not signalled: stop it where it runs.
    Exit code 0: stopped, or no daemon runs on BUFFER; 1: it could not be stopped (this user may not signal it, or
    not read BUFFER); 2: BUFFER is a rank's stream directory (stop its buffer's daemon), or a file; 3: BUFFER does
    not exist."""
    denied = no_access(buffer)
    if denied is not None:  # daemon.lock cannot be read: "no daemon is running" would be a guess
        # Not "join its group": a member may read the buffer but not signal its daemon (a review).
        closed, uid = _nearest_owner(buffer)  # a rank's stream directory is reached through its buffer
        who = "root" if uid == 0 else f"its daemon's user (most likely {user_name(uid)}) or root"
        # The buffer to stop: a rank's stream directory's own (the folder that stops this user), else BUFFER itself,
        # not a folder above it that this user may not enter (it said `--buffer /root`, a walk as a non-root user).
        target = closed if STREAM_RE.fullmatch(buffer.name) and buffer.absolute().parent == closed.absolute() else buffer
        say(f"cannot stop the daemon on {buffer}, if one runs: this user may not read {closed}, which belongs "
            f"to {user_name(uid)}; only {who} may stop it (`sudo prefetchd stop --buffer {target}`); a "
            "service's daemon stops with `systemctl stop` of its unit", err=True)
        sys.exit(EXIT_FAILURE)
    owner = daemon_owner(buffer)
    if owner is None:
        if not buffer.exists():  # most likely a typo: `stop --buffer X && ...` must not go on as if it stopped one
            # A start launched a moment ago has not made it yet (a race walk: `start & stop`).
            say(f"{buffer} does not exist, so no daemon runs on it; check the path (a daemon started a moment ago "
                "makes it as it takes the buffer: stop it once `prefetchd status` says it runs)", err=True)
            sys.exit(EXIT_NOT_RUNNING)
        # Stopping what is stopped is done (as `systemctl stop` of a stopped unit): exit 0.
        say(f"no daemon is running on {buffer}")
        held = foreign_lock(owning_buffer(buffer) / LOCK_NAME)
        if held is not None:
            say(f"note: {held}", err=True)
        return
    if not owner.here:  # its pid names no process here, or another one: never signalled
        say(f"cannot stop the daemon on {buffer} ({owner}) from here, and signalled nothing: stop it with "
            f"{owner.how_to_stop(buffer)}", err=True)
        sys.exit(EXIT_FAILURE)
    pid = owner.pid
    top = owning_buffer(buffer)
    lock = top / LOCK_NAME
    holders = lock_holders(lock)
    if holders is not None and pid not in holders:  # without /proc, the pid is trusted as it always was
        if exiting(readable_status(top), pid) and _within(timeout, lambda: daemon_owner(buffer) is None):
            # another stop was first: its lock goes with its last process
            say(f"stopped the daemon on {buffer} (pid {pid}), which was stopping already")
            return
        say(f"cannot stop the daemon on {buffer}, and signalled nothing: {not_the_holder(lock, pid, holders)}",
                   err=True)
        sys.exit(EXIT_FAILURE)
    if top != buffer:  # stopping it would stop every rank's stream, not just this one
        say(f"{buffer} is a rank's stream directory of the daemon on {top} (pid {pid}), which serves all "
            f"its ranks; to stop it, run `prefetchd stop --buffer {top}`", err=True)
        sys.exit(EXIT_USAGE)
    try:
        os.kill(pid, signal.SIGTERM)
        # A stopped daemon (Ctrl-Z, SIGSTOP) takes its SIGTERM only once continued, as systemd's stop does it.
        os.kill(pid, signal.SIGCONT)
    except PermissionError:
        say(f"cannot stop the daemon on {buffer}: {not_ours_to_signal(pid)}", err=True)
        sys.exit(EXIT_FAILURE)
    except ProcessLookupError:  # it exited between the look and the signal
        pass
    # The lock goes before the interpreter exits: "stopped" means the process is gone
    # (a zombie is gone too: its parent, not us, has to reap it).
    if _within(timeout, lambda: _exited(pid)):
        say(f"stopped the daemon on {buffer} (pid {pid})")
        return
    say(f"the daemon on {buffer} (pid {pid}) did not exit within {timeout:.0f} s; `kill -9 {pid}` ends it", err=True)
    sys.exit(EXIT_FAILURE)


def not_ours_to_signal(pid: int) -> str:
    """Why `prefetchd stop` may not SIGTERM ``pid`` (another user's process), and who can: its
    systemd unit when it runs as one, read from /proc/PID/cgroup, or its user or root.  A daemon in no unit
    (started by hand) is not sent to systemctl (a walk as a non-root user); one whose cgroups cannot be read
    may be either."""
    try:
        user = f"user {psutil.Process(pid).username()}"
    except (psutil.Error, KeyError):  # hidden by hidepid, or gone
        user = "another user"
    try:
        unit = service_unit(pid)
        how = f"stop its service with `systemctl stop {unit}`, or " if unit is not None else ""
    except OSError:
        how = "stop the service that runs it, if one does (`systemctl stop prefetchd@NAME`), or "
    return f"the daemon (pid {pid}) runs as {user}; {how}run this command as that user or root"


def _within(timeout: float, done: Callable[[], bool]) -> bool:
    """Whether ``done()`` comes true within ``timeout`` seconds, asked every 50 ms (stop's waits for a daemon)."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _exited(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


@click.command(cls=BufferOptionCommand)
@click.option("--buffer", type=BUFFER, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON (with --watch: one document per line).")
@click.option("--watch", is_flag=True, help="Redraw every --interval seconds until Ctrl-C.")
@click.option("--interval", type=FiniteFloat(0.1), default=1.0, show_default=True, help="Seconds between redraws of --watch.")
@click.pass_context
def status(ctx: click.Context, /, buffer: Path, as_json: bool, watch: bool, interval: float) -> None:
    """Show buffer fill, rates and errors.  Exit code 2 for a BUFFER that is a file; 3 when no daemon runs on BUFFER
    (or it is a rank's stream directory its daemon does not write now); 4 when this user may not read BUFFER, so
    whether one runs is unknown."""
    if not watch and ctx.get_parameter_source("interval") is click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError(f"--interval {interval:g} sets how often --watch redraws; add --watch, or leave "
                               "--interval out")
    if not watch:
        report = describe_status(buffer)
        click.echo(status_json(report) if as_json else format_status(report))
        if not report.readable:
            sys.exit(EXIT_NO_ACCESS)
        if not report.running or not report.served:
            sys.exit(EXIT_NOT_RUNNING)
        return
    note = f"(every {interval:g} s, Ctrl-C to leave)"
    if as_json:  # stdout stays pure JSON Lines, for `| jq` or a script
        say(note, err=True)
    try:
        while True:
            report = describe_status(buffer)
            if as_json:
                click.echo(status_json(report, indent=None))
            else:
                click.clear()
                click.echo(f"{format_status(report)}\n\n{note}")
            time.sleep(interval)
    except KeyboardInterrupt:
        return


@click.command(cls=BufferOptionCommand)
@click.option("--buffer", type=BUFFER, required=True)
@click.option("--out", type=LocalPath(dir_okay=False, writable=True), default=Path("batch.png"),
              show_default=True)
@click.option("--max-images", type=click.IntRange(1), default=64, show_default=True)
def show(buffer: Path, out: Path, max_images: int) -> None:
    """Render the next waiting batch as a labelled image grid, to check augmentations by eye.  Exit code 1: no
    batch to show (or BUFFER holds one stream per rank: pass one), or the write failed; 2: a bad --out, or no
    BUFFER (or a file); 4: this user may not read BUFFER, or enter a folder above --out."""
    from prefetchd.daemon.show import render_next_batch, unwritable_out

    denied = no_access(buffer)
    if denied is not None:
        say(f"cannot show a batch of {buffer}: {denied}", err=True)
        sys.exit(EXIT_NO_ACCESS)
    if not buffer.exists():  # click's exists=True would say so of a buffer in a folder this user may not enter
        raise click.BadParameter(f"{buffer} does not exist; pass the daemon's --buffer", param_hint="'--buffer'")
    if (problem := unwritable_out(out)) is not None:  # a bad value, as click's own are: exit 2
        raise click.UsageError(problem)
    try:
        batch = render_next_batch(buffer, out, max_images)
    except (ProtocolError, DaemonError) as exc:
        raise click.ClickException(str(exc)) from None
    say(f"wrote {out}: epoch {batch.meta.epoch} step {batch.meta.step}, "
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
    # ~ expanded, "" refused, as --data's; a file is check_pack_target's to refuse, with the exit code help says (1).
    path: Path = LocalPath().convert(value, param, ctx)
    return path


@click.command()
@click.argument("src", type=LocationParam())
@click.argument("out", callback=_pack_out)
@click.option("--shard-size", default="1GB", show_default=True, callback=shard_size_option,
              help="Start a new shard past this size: 1GB (10^9 bytes), 500MB, 1GiB (2^30 bytes).")
@click.option("--shuffle", is_flag=True, help="Pack the samples in a seeded random order (the index records each one's source).")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=None, help="Seed of --shuffle [default: 0].")
@click.option("--force", is_flag=True, help="Replace the shards and index already in OUT.")
@click_options(DaemonConfig, ("index_cache", "refresh_index"))  # start's: SRC is indexed as --data is
def pack(src: Path | str, out: Path, shard_size: int, shuffle: bool, seed: int | None, force: bool,
         index_cache: Path | None, refresh_index: bool) -> None:
    """Pack the dataset at SRC (class folders or a file list) into tar shards in OUT.

    The shards follow WebDataset's naming (<key>.jpg + <key>.cls), so any tar
    reader can read them; OUT/prefetchd-index.npz holds every sample's byte
    offset, so `prefetchd start --data OUT` reads each with one positioned read.

    Exit code 1: SRC cannot be read, or OUT refused (a file, a folder not empty without --force, one inside SRC,
    one this user may not write in, one another pack is writing into); 2: a bad option (OUT a URL too); 4: SRC
    under a folder this user may not enter; 130: interrupted (Ctrl-C), its shards removed.
    """
    from prefetchd.daemon.dataset import PROGRESS_LOG_SECONDS, logged_progress
    from prefetchd.daemon.sources import open_dataset
    from prefetchd.daemon.sources.index_cache import default_cache_dir
    from prefetchd.daemon.sources.shards import check_pack_target
    from prefetchd.daemon.sources.shards import pack as pack_shards

    if seed is not None and not shuffle:
        raise click.UsageError("--seed orders the samples of --shuffle; add --shuffle, or leave --seed out")
    setup_logging("info")
    try:
        check_pack_target(src, out, force)  # before the source is indexed, which can take long
        index = open_dataset(src, tick=logged_progress(f"indexing {src}"), index_cache=index_cache or default_cache_dir(),
                             refresh_index=refresh_index)
        with click.progressbar(length=len(index), label=f"packing {len(index)} samples", file=sys.stderr) as bar:
            def progress(items: Iterator[int]) -> Iterator[int]:
                # click draws the bar only on a terminal; elsewhere (a job's log) a line every 10 s
                last = time.monotonic()
                for i in items:
                    yield i
                    bar.update(1)
                    if not sys.stderr.isatty() and time.monotonic() - last >= PROGRESS_LOG_SECONDS:
                        log.info("packed %d of %d samples", i + 1, len(index))
                        last = time.monotonic()

            summary = pack_shards(index, out, shard_size, (seed or 0) if shuffle else None, force, progress)
    except KeyboardInterrupt:  # click's "Aborted!" and exit 1 read as a refusal (a walk): as a shell says Ctrl-C
        say(f"interrupted: the shards this pack wrote in {out} are removed", err=True)
        sys.exit(130)
    except DaemonError as exc:
        raise click.ClickException(str(exc)) from None
    unreadable = counted(summary["unreadable"], "unreadable file")
    bad = f"; {unreadable} packed empty (the daemon replaces them)" if summary["unreadable"] else ""
    say(f"packed {counted(summary['samples'], 'sample')} of {src} into {counted(summary['shards'], 'shard')} "
        f"({binary_size(summary['bytes'])}) in {out}{bad}")


# The umbrella command (prefetchd/cli.py) adds these to bench and demo; the daemon knows neither.
COMMANDS: tuple[click.Command, ...] = (start, config_command, submit, stop, status, show, pack)

__all__ = ["COMMANDS", "FIELDS", "setup_logging", "shard_size_option"]
