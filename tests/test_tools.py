"""tools/inspect_buffer.py and tools/make_dataset.py, as functions and as scripts."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from click.testing import CliRunner

from prefetchd.buffer_protocol import (
    DaemonLock,
    Manifest,
    Progress,
    ProtocolError,
    Rates,
    batch_name,
    write_batch,
    write_status,
)
from prefetchd.buffer_protocol.batch import temp_name
from prefetchd.buffer_protocol.layout import MANIFEST_NAME
from prefetchd.daemon import jpeg_crop
from tests.status_examples import production
from tests.status_examples import status as status_example

REPO = Path(__file__).resolve().parents[1]
SPEC = (REPO / "prefetchd" / "buffer_protocol" / "SPEC.md").read_text()


def _load(name: str) -> ModuleType:
    # tools/ is a folder of scripts, not a package.
    spec = importlib.util.spec_from_file_location(f"tools_{name}", REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


inspect_buffer = _load("inspect_buffer")
make_dataset = _load("make_dataset")


def _write(path: Path, n: int = 2, labels: list[int] | None = None, **meta: object) -> Path:
    images = np.arange(n * 8 * 8 * 3, dtype=np.uint8).reshape(n, 8, 8, 3)
    labels_ = np.array(labels if labels is not None else list(range(n)), dtype=np.int64)
    fields = {"epoch": 0, "step": 0, "seed": 0, "producer": "test-daemon", **meta}
    write_batch(path, images, labels_, np.arange(n, dtype=np.int64) + 100, **fields)  # type: ignore[arg-type]
    return path


def test_describe_batch(tmp_path: Path) -> None:
    path = _write(tmp_path / batch_name(3, 5), n=5, labels=[2, 0, 2, 7, 2], epoch=3, step=5, seed=11,
                  producer="host-42", replaced=1)
    text = inspect_buffer.describe_batch(path)
    size = path.stat().st_size
    assert re.search(rf"^header: magic=PFDBATCH version=1 meta_len=\d+ header_len=4096 file_len={size}$", text, re.M)
    assert "meta: epoch=3 step=5 seed=11 producer='host-42' replaced=1" in text
    assert re.search(r"^images\s+uint8 \[5, 8, 8, 3\] offset=4096\s+length=960$", text, re.M)
    assert re.search(r"^labels\s+int64 \[5\]\s+offset=8192\s+length=40$", text, re.M)
    assert re.search(r"^indices\s+int64 \[5\]\s+offset=12288\s+length=40$", text, re.M)
    assert "labels histogram: 0:1 2:3 7:1" in text
    assert "indices: 100..104, 5 distinct of 5" in text


def test_describe_batch_matches_the_spec_example(tmp_path: Path) -> None:
    example = SPEC[SPEC.index("## Example"):]
    lines = [line.strip() for line in example.splitlines() if line.startswith("    ")]
    text = inspect_buffer.describe_batch(_write(tmp_path / batch_name(0, 0), n=2)).splitlines()
    header = next(line for line in text if line.startswith("header:"))
    assert re.fullmatch(re.sub(r"meta_len=~\d+", r"meta_len=\\d+", re.escape(lines[0]).replace(r"\~", "~")), header)
    tensor_lines = [line for line in text if re.match(r"(images|labels|indices) +(uint8|int64) ", line)]
    assert tensor_lines == lines[1:]


def test_describe_empty_batch(tmp_path: Path) -> None:
    text = inspect_buffer.describe_batch(_write(tmp_path / batch_name(0, 0), n=0))
    assert "images  uint8 [0, 8, 8, 3]" in text and "labels histogram: (empty batch)" in text


def test_describe_batch_refuses_a_damaged_file(tmp_path: Path) -> None:
    path = _write(tmp_path / batch_name(0, 0))
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(ProtocolError, match="header says the file is"):
        inspect_buffer.describe_batch(path)


def _manifest() -> Manifest:
    return Manifest(
        dataset_root="/data/shapes", fingerprint="f00d", classes=["circle", "square", "star"], num_samples=600,
        split="train", seed=4, batch_size=2, image_size=8, samples_per_epoch=600, steps_per_epoch=300,
        epochs=None, producer="host-1",
    )


def test_describe_buffer(tmp_path: Path) -> None:
    _manifest().write(tmp_path)
    Progress(0, 1).write(tmp_path)
    write_status(tmp_path, status_example(production=production(rates=Rates(samples_per_s=812.5, consumed_batches_per_s=0.0))))
    for step in (0, 1, 2):
        _write(tmp_path / batch_name(0, step), step=step)
    temp_name(tmp_path / batch_name(0, 3)).write_bytes(b"partial")
    lock = DaemonLock(tmp_path)
    lock.acquire()
    try:
        text = inspect_buffer.describe_buffer(tmp_path)
    finally:
        lock.release()
    assert f"daemon: pid {os.getpid()}" in text
    assert ("manifest: split=train seed=4 batch_size=2 image_size=8 channels=3 classes=3 samples/epoch=600 "
            "steps/epoch=300 epochs=unbounded rank=0/1 producer=host-1") in text
    assert "dataset: /data/shapes (600 samples, fingerprint f00d)" in text
    assert "progress: next needed epoch 0 step 1" in text
    assert '  state: "filling"' in text and '  rates: {"consumed_batches_per_s": 0.0, "samples_per_s": 812.5}' in text
    assert "  format:" not in text
    assert "batches: 3 files, 48.0 KiB" in text
    listed = [line.split() for line in text.splitlines() if line.startswith("  e000000-")]
    assert [row[0] for row in listed] == [batch_name(0, s) for s in (0, 1, 2)]
    assert all(row[1] == "16384" for row in listed)
    assert "consumed" in " ".join(listed[0]) and "consumed" not in " ".join(listed[1] + listed[2])
    assert "temp files: 1 (e000000-s00000003.tmp)" in text


def test_describe_an_empty_buffer(tmp_path: Path) -> None:
    text = inspect_buffer.describe_buffer(tmp_path)
    for expected in ("daemon: none running", "manifest: none", "progress: none", "status: none",
                     "batches: 0 files, 0 B", "temp files: 0"):
        assert expected in text


def test_describe_buffer_refuses_a_broken_document(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text('{"format": "prefetchd.manifest", "version": 99}')
    with pytest.raises(ProtocolError, match="version 99"):
        inspect_buffer.describe_buffer(tmp_path)


def test_inspect_cli(tmp_path: Path) -> None:
    runner = CliRunner()
    good = _write(tmp_path / batch_name(0, 0))
    result = runner.invoke(inspect_buffer.main, [str(good)])
    assert result.exit_code == 0 and "magic=PFDBATCH" in result.output
    result = runner.invoke(inspect_buffer.main, [str(tmp_path)])
    assert result.exit_code == 0 and "batches: 1 file," in result.output
    bad = tmp_path / "bad.batch"
    bad.write_bytes(b"PFDBATCH" + bytes(100))
    result = runner.invoke(inspect_buffer.main, [str(bad)])
    assert result.exit_code == 1
    assert result.output.startswith(f"error: {bad}:") and "Traceback" not in result.output
    doc = tmp_path / "manifest.json"
    doc.write_text("{}")
    result = runner.invoke(inspect_buffer.main, [str(doc)])  # a document is not a damaged batch to delete
    assert result.exit_code == 1 and "is a JSON document, not a batch file" in result.output
    assert "delete it" not in result.output


def test_inspect_script_runs(tmp_path: Path) -> None:
    path = _write(tmp_path / batch_name(0, 0))
    ok = subprocess.run([sys.executable, str(REPO / "tools" / "inspect_buffer.py"), str(path)],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "labels histogram: 0:1 1:1" in ok.stdout
    path.write_bytes(b"not a batch at all, just text. " * 4)
    bad = subprocess.run([sys.executable, str(REPO / "tools" / "inspect_buffer.py"), str(path)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "magic is" in bad.stderr and bad.stdout == ""


def test_make_dataset_cli(tmp_path: Path) -> None:
    runner = CliRunner()
    args = [str(tmp_path), "--classes", "3", "--train-per-class", "4", "--val-per-class", "2", "--seed", "1"]
    result = runner.invoke(make_dataset.main, args)
    assert result.exit_code == 0, result.output
    assert re.search(r"3 classes \(circle, square, triangle\); train 12, val 6; .* 18 images in [\d.]+ s", result.output)
    assert "18/18 images" in result.output  # progress (stderr is mixed into output here)
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) == 18
    again = runner.invoke(make_dataset.main, args)
    assert again.exit_code == 1 and "not empty" in again.output
    assert runner.invoke(make_dataset.main, [*args, "--overwrite", "-q"]).exit_code == 0
    assert runner.invoke(make_dataset.main, [str(tmp_path), "--classes", "9"]).exit_code == 2


def test_make_dataset_script_runs(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "make_dataset.py"), str(tmp_path / "ds"), "--classes", "2",
         "--train-per-class", "2", "--val-per-class", "1"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "train 4, val 2" in done.stdout and "6/6 images" in done.stderr


def test_make_imagenet_like_prints_progress_only_once_it_writes(tmp_path: Path) -> None:
    script = [sys.executable, str(REPO / "tools" / "make_imagenet_like.py"), str(tmp_path / "out"), "--classes", "1",
              "--per-class", "2", "--workers", "1"]
    done = subprocess.run(script, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "2/2 images" in done.stderr and "2 JPEGs" in done.stdout
    refused = subprocess.run(script, capture_output=True, text=True, timeout=120)
    # the refusal is the only line: no progress label printed before the folder was judged
    assert refused.returncode == 1 and refused.stderr.strip().splitlines() == [
        f"Error: {tmp_path / 'out'} is not empty; pass overwrite=True (--overwrite) or choose another directory"]


def test_decode_floor_times_each_kernel_and_names_a_folder_without_jpegs(tmp_path: Path) -> None:
    from prefetchd.synthetic import make_imagenet_like

    make_imagenet_like(tmp_path / "data", classes=2, per_class=2)
    script = [sys.executable, str(REPO / "tools" / "decode_floor.py")]
    done = subprocess.run([*script, str(tmp_path / "data"), "--images", "4", "--rounds", "1", "--size", "32"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rates = dict(re.findall(r"^  (.+?)\s+\d+\.\d+ ms\s+\(\s*(\d+) img/s per core\)$", done.stdout, re.M))
    assert {"header: Pillow's parser + orientation", "torchvision decode_jpeg", "Pillow open + convert RGB",
            "prefetchd augment() (train)"} <= set(rates)
    if jpeg_crop.available():  # the gain of the crop-aware decoder, measured against the whole-image path
        assert {"header: plain_header (markers only)", "crop-aware decode of the box", "prefetchd augment(), whole-image decode",
                "resize of the box (extension's kernel)", "resize of the box (torch's kernel)",
                "crop-aware decode, file known clean", "prefetchd augment(), files known clean"} <= set(rates)
    assert all(int(rate) > 0 for rate in rates.values())
    assert "4 JPEGs from" in done.stdout
    # docs/BENCHMARKS.md quotes what it prints now: the same rows, in the same format.
    doc = (REPO / "docs" / "BENCHMARKS.md").read_text()
    quoted = doc[doc.index("It prints more now"):].split("```")[1]
    row = r"^  (.+?)\s+\d+\.\d{4} ms\s+\(\s*\d+ img/s per core\)$"
    if jpeg_crop.available() and "simplejpeg not installed" in done.stdout:
        assert re.findall(row, quoted, re.M) == re.findall(row, done.stdout, re.M)

    (tmp_path / "empty" / "cls").mkdir(parents=True)
    refused = subprocess.run([*script, str(tmp_path / "empty")], capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "no .jpg/.jpeg files" in refused.stderr


@pytest.mark.parametrize(("tool", "args", "says"), [
    ("decode_floor", ["{missing}"], "does not exist"),
    ("decode_floor", ["{data}", "--images", "0"], "x>=1"),
    ("decode_floor", ["{data}", "--rounds", "0"], "x>=1"),
    ("decode_floor", ["{data}", "--size", "0"], "x>=8"),
    ("bench_consumers", ["--consumers", "0"], "x>=1"),
    ("bench_consumers", ["--epochs", "0"], "x>=1"),
    ("bench_consumers", ["--step-ms", "-5"], "x>=0"),
    ("bench_consumers", ["--workers", "0"], "x>=1"),
    ("bench_consumers", ["--batch-size", "0"], "x>=1"),
    ("bench_consumers", ["--high-water", "0"], "x>=1"),
    ("bench_consumers", ["--generate", "-5"], "x>=1"),
    ("bench_consumers", ["--data", "{missing}"], "does not exist"),
    ("bench_sources", ["--shard-size", "abc"], "'abc' is not a size"),
    ("bench_sources", ["--shard-size", "0"], "less than one byte"),
    ("bench_sources", ["--dir", "{missing}"], "does not exist"),
    ("bench_sources", ["--location", "again"], "expected NAME=LOCATION"),
    ("bench_index", ["--files", "5", "--classes", "10"], "5 files cannot fill 10 class folders"),
])
def test_tools_refuse_bad_arguments_in_one_line(tool: str, args: list[str], says: str, tmp_path: Path) -> None:
    (tmp_path / "data" / "cls").mkdir(parents=True)
    argv = [a.format(missing=tmp_path / "missing", data=tmp_path / "data") for a in args]
    result = CliRunner().invoke(_load(tool).main, argv)
    assert result.exit_code == 2 and says in " ".join(result.output.split()), result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_tools_say_why_a_daemon_or_a_dataset_was_refused(tmp_path: Path) -> None:
    empty = tmp_path / "no-classes"
    empty.mkdir()
    # The daemon's own error, not a traceback pointing at a log in a deleted temp folder.
    result = CliRunner().invoke(_load("bench_consumers").main, ["--data", str(empty), "--consumers", "1"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "exited with code 1 before serving it: dataset root" in result.output and "has no class folders" in result.output
    result = CliRunner().invoke(_load("bench_sources").main, ["--images", "10", "--seconds", "0.01", "--dir", str(tmp_path),
                                                              "--location", f"x={tmp_path / 'missing'}"])
    assert result.exit_code == 1 and "--location x=" in result.output and "does not exist" in result.output
    assert [p.name for p in tmp_path.iterdir()] == ["no-classes"]  # its generated data removed
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for tool, args in (("make_dataset", ["--train-per-class", "1", "--val-per-class", "0"]),
                       ("make_imagenet_like", ["--per-class", "1", "--workers", "1"])):
        result = CliRunner().invoke(_load(tool).main, [str(a_file / "out"), *args])  # OUT cannot be created
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
        assert f"cannot create {a_file / 'out'} (Not a directory)" in result.output


def test_bench_consumers_runs_both_scenarios_and_keeps_its_arguments_typed(tmp_path: Path) -> None:
    out = tmp_path / "consumers.json"
    result = CliRunner().invoke(_load("bench_consumers").main, [
        "--generate", "8", "--consumers", "1", "--epochs", "1", "--batch-size", "4", "--image-size", "32",
        "--step-ms", "0", "--high-water", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("1 consumer x 1 epoch, batch 4 at 32px, --workers 1 per daemon")
    assert [ln.split()[0] for ln in result.output.splitlines()[2:4]] == ["shared", "separate"]
    doc = json.loads(out.read_text())
    assert doc["args"] == {"data": None, "generate": 8, "consumers": 1, "epochs": 1, "batch_size": 4, "image_size": 32,
                           "workers": 1, "step_ms": 0.0, "high_water": 2, "cap_factor": 1.0, "out": str(out)}
    assert [r["images_consumed"] for r in doc["results"]] == [8, 8]


def test_idle_cpu_headline_counts_its_workers() -> None:
    idle_cpu = _load("idle_cpu")
    assert idle_cpu.headline("2/2", "full", 1, 3.0).endswith("no trainer, 1 worker, over 3.0 s:")
    assert "no trainer, 2 workers, over" in idle_cpu.headline("2/2", "full", 2, 3.0)


def test_soak_runs_a_daemon_through_batches_and_jobs_and_its_open_files_and_threads_hold(tmp_path: Path) -> None:
    """tools/soak.py: rows as it reads, and after each phase the last row against the first.  Over jobs one after
    another the daemon's open files and threads do not grow (each job's worker pool made a selector and a shared
    file that nothing closed once, found by a review: tests/integration/test_jobs.py)."""
    done = subprocess.run([sys.executable, str(REPO / "tools" / "soak.py"), "--minutes", "0.05", "--every", "1",
                           "--jobs", "3", "--workers", "1"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "prefetchd soak: " in out and ", batch 16 x 64px, 1 worker, python " in out, out
    assert "one job read as fast as it comes, 0.05 min:" in out and "3 jobs one after another:" in out, out
    read = [int(n) for n in re.findall(r"^ *(\d+) batches, (?:epoch \d+|the end) ", out, re.M)]
    assert len(read) >= 2 and read == sorted(read) and read[-1] > 0, out
    assert [m for m in re.findall(r"^ *(job \d+) ", out, re.M)] == ["job 1", "job 3"], out
    jobs = re.search(r"^from job 1 to job 3: controller RSS [\d.]+ -> [\d.]+ MiB \([+-][\d.]+\), USS [+-][\d.]+ MiB, "
                     r"open files (\d+) -> (\d+), threads (\d+) -> (\d+), the rest of the tree [+-][\d.]+ MiB$", out, re.M)
    assert jobs is not None, out
    files_first, files_last, threads_first, threads_last = map(int, jobs.groups())
    assert files_last <= files_first and threads_last <= threads_first, out


def test_cold_start_times_real_daemons_to_their_first_batch(tmp_path: Path) -> None:
    from prefetchd.synthetic import make_imagenet_like

    make_imagenet_like(tmp_path / "data", classes=2, per_class=4)
    done = subprocess.run([sys.executable, str(REPO / "tools" / "cold_start.py"), str(tmp_path / "data"), "--runs", "2",
                           "--workers", "1", "--batch-size", "4", "--image-size", "32"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = [float(s) for s in re.findall(r"^run \d: first batch (\d+\.\d\d) s after prefetchd start$", done.stdout, re.M)]
    assert len(runs) == 2 and all(0 < s < 240 for s in runs), done.stdout
    assert re.search(rf"^cold first batch: median \d+\.\d\d s over 2 runs .*data {re.escape(str(tmp_path / 'data'))}$",
                     done.stdout, re.M), done.stdout

    # A daemon that refuses the data: its own reason, at once (not the loader's timeout, 120 s).
    (tmp_path / "no-classes").mkdir()
    refused = subprocess.run([sys.executable, str(REPO / "tools" / "cold_start.py"), str(tmp_path / "no-classes"),
                              "--runs", "1"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "exited with code 1 before serving it: dataset root" in refused.stderr
    assert "has no class folders" in refused.stderr


def test_a_terminated_benchmark_stops_its_daemon_and_removes_its_files(tmp_path: Path) -> None:
    """SIGTERM (a scheduler, `timeout`) to a tool that started a daemon: the daemon and its workers
    are stopped and the tool's buffer and temp folders removed, as after Ctrl-C (prefetchd.launch's
    stops_cleanly; every tool that starts daemons uses it, idle_cpu.py is the cheapest to start)."""
    import psutil

    from prefetchd.buffer_protocol import daemon_pid
    from tests.waiting import wait_for

    err_path = tmp_path / "stderr.txt"
    work = tmp_path / "tmp"
    work.mkdir()
    tree: list[psutil.Process] = []
    buffer: Path | None = None
    with open(err_path, "w") as err_file:
        tool = subprocess.Popen([sys.executable, str(REPO / "tools" / "idle_cpu.py"), "--seconds", "300", "--workers",
                                 "1", "--high-water", "2"], stdout=subprocess.DEVNULL, stderr=err_file,
                                env={**os.environ, "TMPDIR": str(work)})
    try:
        def daemon() -> psutil.Process | None:
            return next((p for p in psutil.Process(tool.pid).children() if "start" in p.cmdline()), None)

        wait_for(lambda: daemon() is not None, 60, "idle_cpu.py to start its daemon", tool)
        started = daemon()
        assert started is not None
        argv = started.cmdline()
        buffer = Path(argv[argv.index("--buffer") + 1])
        wait_for(lambda: daemon_pid(buffer) == started.pid, 120, f"the daemon to serve {buffer}", tool)
        tree = [started, *started.children(recursive=True)]
        tool.send_signal(signal.SIGTERM)
        tool.wait(60)
        _, alive = psutil.wait_procs(tree, timeout=10)
    finally:
        tool.kill()
        for proc in tree:  # what the tool left behind, so that a failure leaks nothing either
            with contextlib.suppress(psutil.Error):
                proc.kill()
        if buffer is not None:
            shutil.rmtree(buffer.parent, ignore_errors=True)
    err = err_path.read_text()
    assert tool.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in err and "Traceback" not in err, err
    assert not alive, f"left running: {alive}"
    assert not buffer.parent.exists()
    # What a leftover holds, with owners and times, to tell whose it is: once (stop 40) an 8-letter folder of
    # Python's tempfile names, no prefix, was left here and no code of ours or of our dependencies makes one.
    left = [f"{p} ({p.stat().st_size} bytes, mtime {p.stat().st_mtime:.1f}, tool started {started.create_time():.1f})"
            for p in sorted(work.rglob("*"))]
    assert left == [], left


def test_fetch_sample_photos_takes_each_photo_out_of_its_wheel(tmp_path: Path) -> None:
    """The extraction, on wheels built here (the real ones come from the registry): every
    photo lands under its own name with its bytes; a wheel or photo that is not there is named."""
    import io
    import zipfile

    from PIL import Image

    fetch = _load("fetch_sample_photos")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    expected: dict[str, bytes] = {}
    for k, (spec, members) in enumerate(fetch.WHEELS.items()):
        name, _, version = spec.partition("==")
        with zipfile.ZipFile(wheels / f"{name.replace('-', '_')}-{version}-cp311-cp311-linux_x86_64.whl", "w") as whl:
            for j, member in enumerate(members):
                buf = io.BytesIO()
                Image.new("RGB", (8 + k, 8 + j), (40 * k, 30 * j, 7)).save(buf, "PNG" if member.endswith(".png")
                                                                             else "JPEG")
                expected[Path(member).name] = buf.getvalue()
                whl.writestr(member, buf.getvalue())
    written = fetch.extract_photos(wheels, tmp_path / "photos")
    assert {p.name: p.read_bytes() for p in written} == expected
    assert len(written) == 9

    result = CliRunner().invoke(fetch.main, [str(tmp_path / "again"), "--wheels", str(wheels)])
    assert result.exit_code == 0, result.output
    assert "astronaut.png  8x8 RGB" in result.output

    # A wheel without one of the photos, then no wheel at all.
    spec, members = next(iter(fetch.WHEELS.items()))
    first = fetch.wheel_of(wheels, spec)
    with zipfile.ZipFile(first) as whl:
        kept = {m: whl.read(m) for m in members[1:]}
    with zipfile.ZipFile(first, "w") as whl:
        for m, data in kept.items():
            whl.writestr(m, data)
    result = CliRunner().invoke(fetch.main, [str(tmp_path / "third"), "--wheels", str(wheels)])
    assert result.exit_code == 1 and f"{first.name} has no {members[0]}" in result.output
    first.unlink()
    result = CliRunner().invoke(fetch.main, [str(tmp_path / "fourth"), "--wheels", str(wheels)])
    assert result.exit_code == 1 and f"no wheel of {spec} in {wheels}" in result.output


@pytest.mark.parametrize("module", ["host_use", "gpu_report", "gpu_check_plan", "gpu_check_machine", "gpu_check_steps",
                                    "gpu_check_feeds", "gpu_check_training"])
def test_gpu_checks_modules_say_they_are_not_tools(module: str) -> None:
    done = subprocess.run([sys.executable, str(REPO / "tools" / f"{module}.py"), "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and not done.stdout
    assert done.stderr == f"{module}.py is a module of tools/gpu_check.py, not a tool: run python tools/gpu_check.py --help\n"


def test_fetch_gpu_wheels_covers_every_dependency_the_gpu_image_lacks() -> None:
    script = ["bash", str(REPO / "tools" / "fetch_gpu_wheels.sh"), "--check"]
    env = {**os.environ, "PYTHON": sys.executable}
    assert subprocess.run(script, env=env, capture_output=True, text=True, timeout=60).returncode == 0
    # Without tomli-w (as on the first H200 run) it refuses, naming what is missing, before any download.
    proc = subprocess.run(script, env={**env, "WHEELS": "watchdog==7.1.0"}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "needs tomli-w" in proc.stderr and "WHEELS" in proc.stderr
    assert not proc.stdout



@pytest.mark.parametrize("batches", ["0", "1"])
def test_h2d_bench_refuses_fewer_than_two_batches(batches: str) -> None:
    # The first batch of each pass is left out: 0 crashed in statistics.median, 1 printed "median of 0 batches".
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "h2d_bench.py"), "--batches", batches],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and f"--batches: {batches}: pass 2 or more" in proc.stderr, proc.stderr


@pytest.mark.parametrize(("args", "said"), [
    (["--step-ms", "abc"], "--step-ms: 'abc': pass step times in ms of 0 or more"),
    (["--batch-size", "0"], "--batch-size: 0: pass 1 or more"),
    (["--root", "/nonexistent"], "--root /nonexistent is not a folder"),
    (["--device", "cpu"], "--device cpu: this measures copies to a GPU"),
])
def test_h2d_bench_checks_its_flags_before_cuda(args: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad --step-ms was read after part 1 was measured (a ValueError then), --batch-size 0 was an IndexError
    that left its prefetchd-h2d-* folder behind, --root a FileNotFoundError (a review, reading it on a CPU box)."""
    h2d = _load("h2d_bench")
    with pytest.raises(SystemExit) as exit_:
        h2d.parse_args(args)
    assert exit_.value.code == 2 and said in capsys.readouterr().err
