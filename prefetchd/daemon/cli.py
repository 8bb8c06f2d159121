"""The `prefetchd` command.  `start` options are generated from DaemonConfig, so
flags, config keys and their help text come from one place."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import click
import psutil

from prefetchd.buffer_protocol import Manifest, ProtocolError, daemon_pid, read_status
from prefetchd.daemon.config import FIELDS, DaemonConfig, load_toml
from prefetchd.daemon.errors import EXIT_FAILURE, EXIT_NOT_RUNNING, DaemonError

log = logging.getLogger("prefetchd")

STALE_HEARTBEAT_SECONDS = 10.0


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _config_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for f in reversed(dataclasses.fields(DaemonConfig)):
        meta = f.metadata
        flag = "--" + f.name.replace("_", "-")
        kind = meta["kind"]
        if kind is bool:
            func = click.option(f"{flag}/--no-{flag[2:]}", default=False, help=meta["help"])(func)
            continue
        ptype: Any = {Path: click.Path(path_type=Path), int: int, float: float, str: str}[kind]
        if "choices" in meta:
            ptype = click.Choice(meta["choices"])
        # default=None lets build_config tell a given flag from an absent one; the
        # dataclass default is shown in the help instead.
        shown = meta["help"] if f.default is None else f"{meta['help']} [default: {f.default}]"
        func = click.option(flag, type=ptype, default=None, help=shown)(func)
    return func


def build_config(ctx: click.Context, config_file: Path | None, params: dict[str, Any]) -> DaemonConfig:
    """Dataclass defaults, then the config file, then flags given on the command line."""
    values = load_toml(config_file) if config_file else {}
    for name, value in params.items():
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
            values[name] = value
    return DaemonConfig(**values)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="prefetchd")
def main() -> None:
    """Decode and augment images ahead of the trainer into a RAM-disk buffer."""


@main.command()
@_config_options
@click.option("--config", "config_file", type=click.Path(path_type=Path, dir_okay=False), help="TOML file with the same keys as these flags; flags override it.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
@click.pass_context
def start(ctx: click.Context, /, config_file: Path | None, log_level: str, **params: Any) -> None:
    """Run the daemon in the foreground until stopped (SIGTERM, SIGINT or `prefetchd stop`)."""
    setup_logging(log_level)
    try:
        from prefetchd.daemon.main import run_daemon

        cfg = build_config(ctx, config_file, params)
        code = run_daemon(cfg)
    except (DaemonError, ProtocolError) as exc:
        log.error("%s", exc)
        sys.exit(getattr(exc, "exit_code", EXIT_FAILURE))
    sys.exit(code)


@main.command()
@click.option("--buffer", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds to wait for the daemon to exit.")
def stop(buffer: Path, timeout: float) -> None:
    """Stop the daemon that owns BUFFER gracefully (SIGTERM) and wait until it has exited."""
    pid = daemon_pid(buffer)
    if pid is None:
        click.echo(f"no daemon is running on {buffer}")
        return
    os.kill(pid, signal.SIGTERM)
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


def _exited(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _mib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def describe_status(buffer: Path) -> dict[str, Any]:
    pid = daemon_pid(buffer)
    status = manifest = None
    problems = []
    try:
        status = read_status(buffer)
    except ProtocolError as exc:
        problems.append(str(exc))
    try:
        manifest = Manifest.read(buffer).to_doc()
    except FileNotFoundError:
        pass
    except ProtocolError as exc:
        problems.append(str(exc))
    age = time.time() - status["heartbeat"] if status and isinstance(status.get("heartbeat"), (int, float)) else None
    return {
        "buffer": str(buffer),
        "running": pid is not None,
        "pid": pid,
        "heartbeat_age_s": round(age, 1) if age is not None else None,
        "stale": pid is not None and age is not None and age > STALE_HEARTBEAT_SECONDS,
        "status": status,
        "manifest": manifest,
        "problems": problems,
    }


def format_status(info: dict[str, Any]) -> str:
    buffer, st, mf = info["buffer"], info["status"], info["manifest"]
    if not info["running"]:
        line = f"prefetchd on {buffer}: not running"
        if st:
            line += f" (last state: {st.get('state')}{': ' + st['message'] if st.get('message') else ''})"
        return "\n".join([line, *info["problems"]])
    lines = [f"prefetchd on {buffer}: running (pid {info['pid']}), state {st['state'] if st else 'starting'}"]
    if info["stale"]:
        lines.append(f"  WARNING  no heartbeat for {info['heartbeat_age_s']:.0f} s: the daemon may be stuck")
    if st and st.get("message"):
        lines.append(f"  note      {st['message']}")
    if mf:
        lines.append(
            f"  dataset   {mf['dataset_root']} ({mf['num_samples']} samples, {len(mf['classes'])} classes), "
            f"split {mf['split']}, batch {mf['batch_size']} x {mf['image_size']}px, {mf['steps_per_epoch']} steps/epoch"
        )
    if st:
        p, r, e = st["progress"], st["rates"], st["errors"]
        lines += [
            f"  progress  trainer at epoch {p['epoch']} step {p['step']}",
            f"  fill      {st['waiting']}/{st['high_water']} batches waiting (resume at {st['low_water']}), {st['building']} building",
            f"  memory    {_mib(st['buffer_bytes'])} in the buffer, {_mib(st['free_bytes'])} free on its filesystem",
            f"  rates     produce {r['samples_per_s']:.0f} img/s, consume {r['consumed_batches_per_s']:.2f} batches/s",
            f"  errors    {e['replaced_samples']} replaced samples, {e['undecodable_files']} undecodable files, "
            f"{e['worker_restarts']} worker restarts, {e['write_failures']} write failures",
        ]
        if e.get("progress_file"):
            lines.append(f"  progress file problem: {e['progress_file']}")
    lines += info["problems"]
    return "\n".join(lines)


@main.command()
@click.option("--buffer", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def status(buffer: Path, as_json: bool) -> None:
    """Show buffer fill, rates and errors.  Exit code 3 when no daemon runs on BUFFER."""
    info = describe_status(buffer)
    click.echo(json.dumps(info, indent=1, sort_keys=True) if as_json else format_status(info))
    if not info["running"]:
        sys.exit(EXIT_NOT_RUNNING)


@main.command()
@click.option("--workdir", type=click.Path(path_type=Path, file_okay=False), default=None, help="Where the generated dataset and logs go [default: a temp dir, removed after].")
@click.option("--epochs", type=click.IntRange(1), default=3, show_default=True)
@click.option("--image-size", type=click.IntRange(16), default=64, show_default=True)
@click.option("--batch-size", type=click.IntRange(1), default=32, show_default=True)
@click.option("--train-per-class", type=click.IntRange(1), default=150, show_default=True)
@click.option("--keep", is_flag=True, help="Keep the dataset and logs.")
def demo(workdir: Path | None, epochs: int, image_size: int, batch_size: int, train_per_class: int, keep: bool) -> None:
    """Generate a small dataset, start daemons for it and train ResNet-18 alongside them."""
    from prefetchd.demo import run_demo

    setup_logging("warning")
    sys.exit(run_demo(workdir=workdir, epochs=epochs, image_size=image_size, batch_size=batch_size,
                      train_per_class=train_per_class, keep=keep))


__all__ = ["main", "FIELDS"]
