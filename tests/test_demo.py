"""`prefetchd demo`: what its first step prints to a pipe and to a terminal, and what it says when the kernel kills
its trainer."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cgroups import cgroup_v1, in_cgroup

GENERATE = "import sys; from pathlib import Path; from prefetchd.demo import generate_data; generate_data(Path(sys.argv[1]), 2)"
TOTAL = 4 * (2 + 40)  # CLASSES * (train_per_class + VAL_PER_CLASS)


def test_the_image_count_is_printed_when_output_is_not_a_terminal(tmp_path: Path) -> None:
    """click prints a progress bar's label alone there: a bare '      images' line, no count."""
    out = subprocess.run([sys.executable, "-c", GENERATE, str(tmp_path / "data")], capture_output=True, text=True,
                         timeout=120, check=True)
    lines = out.stdout.splitlines()
    assert f"      {TOTAL} images" in lines, out.stdout
    assert "(train 8, val 160)" in out.stdout, out.stdout


def test_the_image_count_is_in_the_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    main, child = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", GENERATE, str(tmp_path / "data")], stdout=child, stderr=child)
    os.close(child)
    said = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        said += chunk
    os.close(main)
    assert proc.wait(timeout=120) == 0, said
    if b"[" not in said:
        pytest.skip("click drew no bar on this pseudo-terminal")
    assert f"{TOTAL} images".encode() in said and b"100%" in said, said


def test_a_trainer_the_oom_killer_kills_is_said_so_with_the_memory_it_had(tmp_path: Path) -> None:
    """In a 600 MiB cgroup the kernel kills the trainer (ResNet-18 and torch, the largest process), and the demo
    said only "the trainer exited with code -9" (and exited 247)."""
    with cgroup_v1("memory", {"memory.limit_in_bytes": str(600 << 20)}) as group:
        run = subprocess.run(in_cgroup(group, [sys.executable, "-m", "prefetchd", "demo", "--workdir",
                                               str(tmp_path / "work")]),
                             capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert ("demo failed: the trainer was killed by the kernel's out-of-memory killer (the demo's memory cgroup is "
            "limited to 600.0 MiB; it needs about 0.9 GiB); logs are in") in run.stderr, run.stdout + run.stderr


def test_a_second_demo_in_a_workdir_uses_its_dataset_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It was a traceback, "... is not empty; pass overwrite=True (--overwrite)", an option the demo has not (a walk
    of the demo).  The same settings use the dataset again; others make it again; files of anything else are
    refused in one line."""
    import click

    from prefetchd.demo import generate_data

    data = tmp_path / "data"
    assert generate_data(data, 2) is not None
    assert generate_data(data, 2) is None
    assert f"[1/3] using the dataset an earlier demo generated in {data}" in capsys.readouterr().out
    again = generate_data(data, 3)  # another size: made again, no file of the first left in it
    assert again is not None and again.counts["train"] == 12 and len(list((data / "train").rglob("*.*"))) == 12
    foreign = tmp_path / "mine"
    (foreign / "photos").mkdir(parents=True)
    (foreign / "photos" / "a.jpg").write_bytes(b"x")
    with pytest.raises(click.UsageError, match=f"{foreign} holds files the demo did not generate; pick another"):
        generate_data(foreign, 2)
    assert (foreign / "photos" / "a.jpg").read_bytes() == b"x"


def test_a_daemon_that_refuses_its_settings_is_said_at_once_in_its_words(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A refused daemon's demo ran the trainer, which waited 120 s for a manifest and advised `prefetchd start` (a walk
    of the demo: --image-size 20000, which its range then let through).  Real daemons, refusing a low water mark
    that is not below the high one."""
    import time

    import prefetchd.demo as demo

    start = demo._start_daemon
    monkeypatch.setattr(demo, "_start_daemon", lambda buffer, data, split, common, log:
                        start(buffer, data, split, {**common, "high_water": 4, "low_water": 4}, log))
    began = time.monotonic()
    code = demo.run_demo(workdir=tmp_path / "work", epochs=1, image_size=16, batch_size=8, train_per_class=2, keep=False)
    said = capsys.readouterr().err
    assert code == 1 and time.monotonic() - began < 100, said
    assert "demo failed: the daemon started for " in said and "exited with code 2 before serving it" in said, said
    assert "before serving it: --low-water 4 must be below --high-water 4" in said and "after waiting" not in said, said
