"""The `prefetchd bench` command (also `python tools/bench.py`)."""

from __future__ import annotations

import logging
import math
import shutil
import sys
import tempfile
from pathlib import Path

import click
from click.core import ParameterSource

from prefetchd.bench.measure import MIN_BATCHES
from prefetchd.bench.results import ALL_CONTENDERS, CONTENDERS
from prefetchd.bench.run import buffers_in, run_benchmark, worker_counts
from prefetchd.daemon.config import usable_cpus
from prefetchd.launch import stops_cleanly
from prefetchd.locations import probe_folder
from prefetchd.options import FiniteFloat, LocalPath, ReadableFolder

DEFAULT_GENERATE = 1500


def _parse_workers(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        counts = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        raise click.BadParameter(f"{value!r}: give worker counts separated by commas, e.g. 1,2,4") from None
    if not counts or counts[0] < 1:
        raise click.BadParameter(f"{value!r}: worker counts must be 1 or more")
    return counts


def _parse_contenders(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[str] | None:
    if value is None:
        return None
    names = list(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    unknown = [name for name in names if name not in ALL_CONTENDERS]
    if not names or unknown:
        raise click.BadParameter(f"{', '.join(unknown) or repr(value)}: name contenders from {', '.join(ALL_CONTENDERS)}, "
                                 "separated by commas")
    return names


@click.command("bench", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--data", type=ReadableFolder(),
              help="Class-folder dataset to read. Without it an ImageNet-like set is generated in a temp dir.")
@click.option("--generate", "generate", type=click.IntRange(min=1), default=DEFAULT_GENERATE, show_default=True,
              help="Images to generate when --data is not given.")
@click.option("--source", type=ReadableFolder(),
              help="Folder of real photos to cut the generated images from (instead of synthetic pictures).")
@click.option("--keep-data", is_flag=True, help="Keep the generated dataset (its path is printed).")
@click.option("--workers", "workers", callback=_parse_workers, metavar="K1,K2,...",
              help="Worker counts to measure  [default: 1..usable cores]")
@click.option("--batch-size", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--image-size", type=click.IntRange(min=8), default=224, show_default=True)
@click.option("--seconds", type=FiniteFloat(min=0, min_open=True), default=8.0, show_default=True,
              help="Length of each measurement after its first batch and warm-up.")
@click.option("--batches", type=click.IntRange(min=MIN_BATCHES),
              help=f"Measure this many batches instead of --seconds (at least {MIN_BATCHES}).")
@click.option("--rounds", type=click.IntRange(min=1), default=1, show_default=True,
              help="Measure every contender this many times, taking turns, and report the medians: for a machine "
                   "whose speed drifts (a shared VM).")
@click.option("--high-water", type=click.IntRange(min=2), default=None,
              help="The daemon's --high-water in batches  [default: max(16, 6 x max workers)]")
@click.option("--buffer-root", type=LocalPath(file_okay=False),
              help="The folder the daemons' buffers go in, to measure where yours will live (a tmpfs mounted with "
                   "huge=within_size, say)  [default: /dev/shm]")
@click.option("--out", "out_dir", type=LocalPath(file_okay=False), default=Path("bench-out"),
              show_default=True, help="Where bench.json, bench.txt, bench.png and logs/ go.")
@click.option("--contenders", callback=_parse_contenders, metavar="NAME,...",
              help=f"Measure only these, in this order  [default: all of {', '.join(CONTENDERS)}]. Without "
                   "prefetchd there is no floor; without dataloader, no 'vs dataloader'.")
@click.option("--ray", "with_ray", is_flag=True,
              help="Also measure prefetchd-ray: the daemon with no local workers and a private Ray cluster on the same "
                   "cores (needs prefetchd[ray]; on a shared machine run the bench under `unshare -n` with loopback up).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="warning",
              show_default=True, help="Log level of the benchmark's own diagnostics.")
@stops_cleanly
def bench_command(
    data: Path | None,
    generate: int,
    source: Path | None,
    keep_data: bool,
    workers: list[int] | None,
    batch_size: int,
    image_size: int,
    seconds: float,
    batches: int | None,
    rounds: int,
    high_water: int | None,
    buffer_root: Path | None,
    out_dir: Path,
    contenders: list[str] | None,
    with_ray: bool,
    log_level: str,
) -> None:
    """Measure images/s of prefetchd against ImageFolder + DataLoader (and SPDL and DALI, if installed).

    Every contender runs on the same dataset with 1..cores workers, pinned to as
    many cores as it has workers. Prints a table, with the floor (the daemon's
    augment() alone on one core) and prefetchd's share of k times it, and writes
    bench.json, bench.txt and bench.png into --out.
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(level=getattr(logging, log_level.upper()),
                            format="%(asctime)s %(levelname)-7s %(name)s: %(message)s", stream=sys.stderr)

    def say(msg: str) -> None:
        click.echo(msg, err=True)

    generated: Path | None = None
    try:
        workers = worker_counts(workers)  # before a dataset that takes a minute to generate
        buffers_in(buffer_root)  # likewise
        _check_out(out_dir)  # likewise, and before the minutes of measuring that it would hold
        if data is not None and click.get_current_context().get_parameter_source("generate") in GIVEN:
            raise click.UsageError("--generate sizes the dataset generated without --data; drop one of them")
        if data is None:
            generated = Path(tempfile.mkdtemp(prefix="prefetchd-bench-data-"))
            data = generated / "train"
            data_classes = min(10, generate)
            per_class = math.ceil(generate / data_classes)
            say(f"generating {data_classes * per_class} ImageNet-like JPEGs in {data}")
            from prefetchd.synthetic import make_imagenet_like

            with click.progressbar(length=data_classes * per_class, label="images", file=sys.stderr) as bar:
                summary = make_imagenet_like(
                    data, classes=data_classes, per_class=per_class, seed=0, source=source,
                    workers=usable_cpus(), progress=lambda done, _total: bar.update(done - bar.pos),
                )
            say(summary.line())
        elif source is not None:
            raise click.UsageError("--source only applies when generating; drop it or drop --data")
        results = run_benchmark(
            data, workers_list=workers, batch_size=batch_size, image_size=image_size,
            seconds=seconds, batches=batches, rounds=rounds, out_dir=out_dir, high_water=high_water,
            contenders=_chosen(contenders, with_ray), report=say, buffer_root=buffer_root,
        )
    except (ValueError, FileExistsError) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        if generated is not None:
            if keep_data:
                say(f"kept the generated dataset in {generated}")
            else:
                shutil.rmtree(generated, ignore_errors=True)
    click.echo(results.table())
    click.echo(f"\nwrote {', '.join(results.files[k] for k in ('table', 'json', 'plot') if k in results.files)}")


GIVEN = (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)


def _check_out(out_dir: Path) -> None:
    """Refuse an ``--out`` this user cannot write in (a read-only place was a traceback once the run began):
    the folder, or the nearest one above it that exists, where the run makes it.  Nothing is made here."""
    there = out_dir.absolute()
    while not there.exists() and not there.is_symlink() and there != there.parent:
        there = there.parent
    try:
        probe_folder(there, "bench.json")
    except OSError as exc:
        raise click.BadParameter(f"{out_dir}: cannot write in {'it' if there == out_dir.absolute() else there} "
                                 f"({exc.strerror or exc}); pass a folder you can write", param_hint="--out") from None


def _chosen(contenders: list[str] | None, with_ray: bool) -> tuple[str, ...]:
    """``--contenders`` (default: every one but those measured on request), and prefetchd-ray with ``--ray``."""
    chosen = list(contenders) if contenders is not None else list(CONTENDERS)
    if with_ray and "prefetchd-ray" not in chosen:
        chosen.append("prefetchd-ray")
    return tuple(chosen)
