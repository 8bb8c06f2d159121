"""Settings declared once: a frozen dataclass's field metadata yields its click options and its value checks.

Both commands build their flags here, ``prefetchd start`` from ``DaemonConfig``
and ``prefetchd-train`` from ``TrainConfig``, so a flag's name, type, range,
default and help text live beside the field and nowhere else.  This module
knows neither role: each passes its own dataclass and its own error class.

A field's metadata (see :func:`setting`):

- ``help``, ``kind`` (``bool``, ``int``, ``float``, ``str`` or ``Path``; a float is always finite);
- ``choices``; ``minimum`` / ``maximum`` (inclusive unless ``min_open`` /
  ``max_open``);
- ``location``: a local path or an object-storage URL;
- ``path``: ``"dir"`` or ``"file"`` when only one of them makes sense (a ``location``: ``"dir"`` only);
- ``buffer``: a buffer folder's path, held to what a daemon can keep one at (``unfit_buffer_path``);
- ``readable``: False where what uses the path checks it and says more than click's "is not readable"
  (a buffer, the daemon's or the trainer's: whose it is, and what to do);
- ``metavar``; ``short``, a one-letter alias such as ``-q``; ``unit``, what a number counts, said where a
  value of another type is refused (``max_buffer_bytes = '2GB'``);
- ``multiple``: a list of ``kind`` (a TOML array, a repeated flag), held as a tuple.

The two commands differ in one respect, kept from before they shared this
code: the daemon layers a TOML file under its flags, so its options default
to None (``layered``) and check ranges after merging, in ``check_value``,
where a file's value and a flag's fail with the same message; the trainer
has no file, so its options carry the defaults and click checks the ranges.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, NoReturn

import click

from prefetchd.access import EXIT_NO_ACCESS, cannot_read
from prefetchd.buffer_protocol.batch import VERSION
from prefetchd.buffer_protocol.errors import MAX_INT, shown
from prefetchd.buffer_protocol.layout import unfit_buffer_path
from prefetchd.locations import is_url, normalize
from prefetchd.words import one_line

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def setting(default: Any, help: str | None, kind: type, **extra: Any) -> Any:
    """A dataclass field with its CLI metadata; ``dataclasses.MISSING`` makes it (and its flag) required."""
    return dataclasses.field(default=default, metadata={"help": help, "kind": kind, **extra})


def check_value(f: dataclasses.Field[Any], value: Any, error: type[Exception] = ValueError) -> None:
    """Refuse a value of the wrong type or range for field ``f``, naming the key and what is allowed."""
    meta, name = f.metadata, f.name
    if value is None:
        return
    if meta.get("multiple"):
        if not isinstance(value, (list, tuple)):
            raise error(f"{name} = {shown(value)}: expected a list of {meta['kind'].__name__}")
        for item in value:
            _check_one(name, item, meta, error)
        return
    _check_one(name, value, meta, error)


def _check_one(name: str, value: Any, meta: Any, error: type[Exception]) -> None:
    """Check one setting.  Its value may come from a job.json any member of a --group-access buffer's group
    wrote: every way it can be wrong is ``error``, never another exception (10**400 for a float overflowed,
    a NUL in a path stopped the daemon), and the message quotes it cut short (``shown``)."""
    kind = meta["kind"]
    # Before the type: a file's buffer = "" is no Path, but what it is said (unfit_buffer_path) is more use.
    if meta.get("buffer") and isinstance(value, (str, os.PathLike)) and (unfit := unfit_buffer_path(value)) is not None:
        raise error(f"{name} = {shown(value)}: {unfit}")
    if (kind is Path or meta.get("location")) and value == "":
        raise error(f"{name} = '': {EMPTY_PATH}")
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if meta.get("location") and isinstance(value, os.PathLike):
        ok = True  # a local path given as a Path; the config makes it what it keeps
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        unit = f" ({meta['unit']})" if "unit" in meta else ""  # '2GB' for bytes: say what the number counts
        raise error(f"{name} = {shown(value)}: expected {kind.__name__}{unit}")
    if kind is float and not abs(value) <= sys.float_info.max:  # nan and inf too (nan passes every comparison below)
        raise error(f"{name} = {shown(value)}: expected a finite number")
    if kind is int and not -MAX_INT <= value <= MAX_INT:
        raise error(f"{name} = {shown(value)}: expected a number below 2**63")
    if isinstance(value, (str, os.PathLike)) and "\x00" in os.fspath(value):
        raise error(f"{name} = {shown(value)}: contains a NUL character, which no path or name may hold")
    if "choices" in meta and value not in meta["choices"]:
        raise error(f"{name} = {shown(value)}: allowed values are {', '.join(meta['choices'])}")
    if "minimum" in meta and (value <= meta["minimum"] if meta.get("min_open") else value < meta["minimum"]):
        bound = "above" if meta.get("min_open") else "at least"
        raise error(f"{name} = {shown(value)}: must be {bound} {_bound(meta['minimum'])}")
    if "maximum" in meta and (value >= meta["maximum"] if meta.get("max_open") else value > meta["maximum"]):
        bound = "below" if meta.get("max_open") else "at most"
        raise error(f"{name} = {shown(value)}: must be {bound} {_bound(meta['maximum'])}")


def _bound(value: float) -> str:
    """A bound as typed: 4, not 4.0, for a float bound derived from another constant."""
    return f"{value:g}" if isinstance(value, float) else str(value)


class FiniteFloat(click.FloatRange):
    """A float within optional bounds, refusing nan and ±inf: click's range checks let nan through
    (every comparison with it is false), and no setting means "infinitely many seconds"."""

    def __init__(self, min: float | None = None, max: float | None = None, **kw: Any) -> None:
        super().__init__(min, max, **kw)
        self.name = "float" if min is None and max is None else "float range"  # the metavar click shows

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number

    def _describe_range(self) -> str:
        return "" if self.min is None and self.max is None else super()._describe_range()


# Said of "" given for a path (an unset variable: --metrics-textfile "$PROM"), which was the working folder: a
# daemon's internal error for a textfile, the cache or the dataset there, a demo's files among the user's (a walk).
EMPTY_PATH = "an empty path (an unset variable?); give the path, or leave it out"


def home_expanded(value: Any) -> Any:
    """A path typed with a leading ``~`` as the shell would have expanded it (it leaves ``'~/x'`` and
    ``--opt=~/x``); any other value as it is."""
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


class LocalPath(click.Path):
    """A local path, ``~`` expanded as the shell would have (a quoted ``'~/x'``, ``--opt=~/x``, which bash leaves:
    it made a folder named ``~`` in the working one, where BufferLoader took the home's; a walk); with ``buffer``, one
    a daemon can keep a buffer at (``unfit_buffer_path``: an empty one was the working folder).  A file's path that
    ends in '/' is refused: `show --out grid.png/` wrote a file grid.png."""

    def __init__(self, buffer: bool = False, **kw: Any) -> None:
        super().__init__(path_type=Path, **kw)
        self.buffer = buffer

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        value = home_expanded(value)
        if not self.dir_okay and isinstance(value, str) and value.endswith("/"):  # Path drops the slash
            self.fail(f"{shown(value)} ends in '/', which names a folder; name a file", param, ctx)
        if self.buffer and isinstance(value, (str, os.PathLike)) and (unfit := unfit_buffer_path(value)) is not None:
            self.fail(f"{shown(os.fspath(value))}: {unfit}", param, ctx)
        if value == "":
            self.fail(f"'': {EMPTY_PATH}", param, ctx)
        return super().convert(value, param, ctx)


class LocationParam(click.ParamType):  # type: ignore[type-arg]
    """A local path (a Path) or an object-storage URL (kept as a string: Path would fold its '//'); with
    ``dir_only``, a local one must not be a file."""

    def __init__(self, dir_only: bool = False) -> None:
        self.name = "DIR|URL" if dir_only else "PATH|URL"
        self._local = click.Path(file_okay=not dir_only, path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path | str:
        if isinstance(value, (str, os.PathLike)) and is_url(os.fspath(value)):
            return normalize(value)
        if value == "":
            self.fail(f"'': {EMPTY_PATH}", param, ctx)
        value = home_expanded(value)  # as LocalPath does: `pack '~/ds' ...` made a folder named ~ (a walk)
        path: Path = self._local.convert(value, param, ctx)
        return path


class OutputChecked:
    """A click command (or group) whose ``main`` says so where its output cannot be written (stdout on a full disk,
    /dev/full): click pacifies a closed pipe only, and anything else was a traceback from deep in click.echo.  Only
    an OSError raised by click.echo writing to stdout is said so; any other keeps its traceback, as a bug should,
    but a PermissionError naming a path: a path of the user's under a folder it may not enter (/root, a home of mode
    0700) was a traceback in pack, show --out, demo --workdir, bench --out and --checkpoint-dir (a walk as a
    non-root user), where each command's own checks did not foresee it.  It is said in one line naming the
    folder that stops it (``access.cannot_read``), exit code 4 (``EXIT_NO_ACCESS``), as the buffer's are."""

    program = "prefetchd"  # the name the one line begins with

    def main(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().main(*args, **kwargs)  # type: ignore[misc]
        except OSError as exc:
            if not raised_writing_stdout(exc):
                raise
            # Pointed at /dev/null, so that the interpreter's flush at exit does not fail on it again.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            click.echo(f"{self.program}: cannot write to standard output: {exc.strerror or exc}", err=True)
            sys.exit(1)

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)  # type: ignore[misc,no-any-return]
        except click.ClickException as exc:  # a bad value's message quotes it: a path's control characters too
            exc.message = one_line(exc.message)  # type: ignore[misc]
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)  # type: ignore[misc]
        except click.ClickException as exc:  # the commands' own refusals (UsageError) quote paths as given
            exc.message = one_line(exc.message)  # type: ignore[misc]
            raise
        except PermissionError as exc:
            if not exc.filename:
                raise
            path = Path(os.fsdecode(exc.filename))
            refuse_unusable(cannot_read(path) or f"{path}: {exc.strerror or 'permission denied'}", self.program)


def refuse_unusable(why: str, program: str = "prefetchd") -> NoReturn:
    """End the command where this user may not use a path it named: ``why`` (``access``'s words, naming the
    folder that stops it) in one line, exit code 4 (``EXIT_NO_ACCESS``)."""
    click.echo(f"{program}: {why}; pass a path this user may use", err=True)
    sys.exit(EXIT_NO_ACCESS)


class ReadableFolder(LocalPath):
    """An existing folder this command reads (bench's --data and --source).  click's ``exists=True`` said "does not
    exist" of one under a folder this user may not enter (/root/ds, a walk as a non-root user): said instead as
    a path this user may not use (``refuse_unusable``), as the other commands say it."""

    def __init__(self) -> None:
        super().__init__(exists=True, file_okay=False)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        value = home_expanded(value)
        why = cannot_read(Path(os.fsdecode(value))) if value != "" else None
        if why is not None:
            refuse_unusable(why if param is None else f"{param.opts[0]} {os.fsdecode(value)}: {why}")
        return super().convert(value, param, ctx)


def raised_writing_stdout(exc: OSError) -> bool:
    """Whether ``exc`` came from click.echo writing to stdout (every command's output goes through it)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or tb.tb_frame.f_code is not click.utils.echo.__code__:
        return False
    try:
        return bool(tb.tb_frame.f_locals["file"].fileno() == sys.stdout.fileno())
    except (KeyError, AttributeError, OSError, ValueError):
        return False


class BufferOptionCommand(click.Command):
    """A command that takes its buffer as ``--buffer``.  Given as an argument instead (``prefetchd status
    /dev/shm/bf``, as ``stop``'s help, "the daemon that owns BUFFER", invites), click said "Missing option
    '--buffer'", or for ``start`` (whose buffer may come from its --config file) "Got unexpected extra argument";
    this says how to write it."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, list(args))  # (click's parser consumes the list it is given)
        except click.UsageError:
            # Parsed again, only where click refused the line, for the arguments left over.
            given, strays, _ = self.make_parser(ctx).parse_args(args=list(args))
            if strays and "buffer" not in given:
                raise click.UsageError(
                    f"Got unexpected extra argument{'s' if len(strays) > 1 else ''} ({' '.join(strays)}): the buffer "
                    f"is an option, not an argument: {ctx.command_path} --buffer {strays[0]} ...", ctx) from None
            raise


def click_options(cls: type, only: Collection[str] | None = None, *, layered: bool = False,
                  defaults_from: str | None = None) -> Decorator:
    """Click options for the fields of dataclass ``cls`` (or the ``only`` ones), in declaration order.

    ``layered``: every flag defaults to None, so the command can tell a given flag
    from an absent one and put it over a config file; the field's default is named
    in the help, booleans get a ``--no-`` form, and ranges are left to ``check_value``.
    ``defaults_from`` (layered only): where an absent flag's value comes from, when that is not
    the dataclass default (`prefetchd submit`: the daemon's own settings); the help names it
    instead of the field's default.
    """
    chosen = [f for f in dataclasses.fields(cls) if only is None or f.name in only]

    def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
        for f in reversed(chosen):
            func = _option(f, layered, defaults_from)(func)
        return func

    return decorate


# A default a field's help names itself ("Stop after this many epochs [default: run on].").
DEFAULT_NOTE = re.compile(r" ?\[default: [^\]]*\]")


def _option(f: dataclasses.Field[Any], layered: bool, defaults_from: str | None = None) -> Decorator:
    meta = f.metadata
    flag = "--" + f.name.replace("_", "-")
    names = [flag, meta["short"]] if "short" in meta else [flag]
    kind = meta["kind"]
    layered_help = meta["help"]
    if defaults_from is not None:
        layered_help = f"{DEFAULT_NOTE.sub('', layered_help)} [default: {defaults_from}]"
    elif kind is not bool and f.default is not None and not meta.get("multiple"):
        # default=None lets the command tell a given flag from an absent one; the
        # dataclass default is shown in the help instead (a list's help says its own).
        layered_help = f"{layered_help} [default: {f.default}]"
    if layered and (bounds := _range_text(meta)):
        # A layered flag's type is unranged (the value is checked once a config file's is merged in): the range in
        # the help, as click writes a ranged flag's (prefetchd-train's --batch-size), which start's lacked (a walk).
        notes = list(DEFAULT_NOTE.finditer(layered_help))
        if notes:
            end = notes[-1].end() - 1
            layered_help = f"{layered_help[:end]}; {bounds}{layered_help[end:]}"
        else:
            layered_help = f"{layered_help} [{bounds}]"
    if kind is bool:
        if layered:
            return click.option(f"{flag}/--no-{flag[2:]}", default=False, help=layered_help)
        return click.option(*names, is_flag=True, help=meta["help"])
    ptype = _param_type(meta, ranged=not layered)
    required = f.default is dataclasses.MISSING
    if layered:
        multiple = bool(meta.get("multiple"))
        return click.option(*names, type=ptype, default=None, multiple=multiple, help=layered_help,
                            metavar=meta.get("metavar"))
    if required:
        return click.option(*names, type=ptype, required=True, help=meta["help"], metavar=meta.get("metavar"))
    extra: dict[str, Any] = {"show_default": True} if f.default is not None else {}
    return click.option(*names, type=ptype, default=f.default, help=meta["help"], metavar=meta.get("metavar"), **extra)


def _range_text(meta: Any) -> str:
    """A setting's range as click's ranged types write it ("1<=x<=65536", "x>0"); "" for one without bounds."""
    low, high = meta.get("minimum"), meta.get("maximum")
    if high is not None and high >= 2**62:  # the seed's 2**63 - 1: a bound past any value typed, not worth a line
        high = None
    above = "<" if meta.get("min_open") else "<="
    below = "<" if meta.get("max_open") else "<="
    if low is not None and high is not None:
        return f"{_bound(low)}{above}x{below}{_bound(high)}"
    if low is not None:
        return f"x{above.replace('<', '>')}{_bound(low)}"
    return f"x{below}{_bound(high)}" if high is not None else ""


def _param_type(meta: Any, ranged: bool) -> Any:
    kind = meta["kind"]
    if "choices" in meta:
        return click.Choice(meta["choices"])
    if kind is Path:
        if meta.get("location"):
            return LocationParam(dir_only=meta.get("path") == "dir")
        where = meta.get("path")
        return LocalPath(buffer=meta.get("buffer", False), readable=meta.get("readable", True),
                         **({"file_okay": False} if where == "dir" else {"dir_okay": False} if where == "file" else {}))
    bounds = {"min": meta.get("minimum"), "max": meta.get("maximum")} if ranged else {}
    if kind is float:  # finite even where layered: a flag's nan fails as it is typed, a file's in check_value
        return FiniteFloat(**bounds, min_open=ranged and meta.get("min_open", False),
                           max_open=ranged and meta.get("max_open", False))
    if ranged and kind is int and ("minimum" in meta or "maximum" in meta):
        return click.IntRange(**bounds)
    return {int: int, str: str}[kind]



def version_option() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--version of `prefetchd` and `prefetchd-train`: the package's version and the buffer protocol's, which is
    what a trainer and a daemon must share (SPEC.md rule 2)."""
    return click.version_option(package_name="prefetchd",
                                message=f"%(prog)s, version %(version)s, buffer protocol {VERSION}")

__all__ = ["FiniteFloat", "LocalPath", "LocationParam", "ReadableFolder", "check_value", "click_options", "refuse_unusable", "setting", "version_option"]
