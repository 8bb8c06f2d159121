"""Fake buffers for trainer tests: a manifest and batch files written with the protocol's own writer."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from prefetchd.buffer_protocol import Manifest, batch_name, write_batch
from tests.owners import owned


def _tmpfs_root() -> str | None:
    # The real buffer lives on tmpfs; fall back to the default temp dir where there is none.
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.fixture
def buffer() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="pfd-trainer-test-", dir=_tmpfs_root()))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class FakeJob:
    """A job whose batch (epoch, step) is a pure function of (seed, epoch, step), like the daemon's."""

    buffer: Path
    manifest: Manifest
    # The lock ``claim`` holds, let go when the test ends.
    owner: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, compare=False, repr=False)

    def arrays(self, epoch: int, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        m = self.manifest
        start = step * m.batch_size
        n = min(m.batch_size, m.samples_per_epoch - start)
        order = np.random.default_rng([m.seed, epoch]).permutation(m.num_samples)[: m.samples_per_epoch]
        indices = order[start : start + n].astype(np.int64)
        labels = indices % len(m.classes)
        rng = np.random.default_rng([m.seed, epoch, step])
        images = rng.integers(0, 256, (n, m.image_size, m.image_size, m.channels), dtype=np.uint8)
        return images, labels, indices

    def path(self, epoch: int, step: int) -> Path:
        return self.buffer / batch_name(epoch, step)

    def write(self, epoch: int, step: int) -> None:
        images, labels, indices = self.arrays(epoch, step)
        write_batch(
            self.path(epoch, step), images, labels, indices,
            epoch=epoch, step=step, seed=self.manifest.seed, producer=self.manifest.producer,
        )

    def write_epochs(self, epochs: int) -> None:
        for epoch in range(epochs):
            for step in range(self.manifest.steps_per_epoch):
                self.write(epoch, step)

    def claim(self, buffer: Path | None = None) -> None:
        """This test process plays the daemon owning the job's buffer, or ``buffer`` (of which the job's is a
        rank's stream): its daemon.lock names this process and is held until the test ends (``owned``).  A dead
        daemon's lock is its pid, held by nobody."""
        self.owner.enter_context(owned(self.buffer if buffer is None else buffer))


MakeJob = Callable[..., FakeJob]


@pytest.fixture
def make_job(buffer: Path) -> Iterator[MakeJob]:
    made: list[FakeJob] = []

    def make(
        path: Path | None = None,
        *,
        classes: int = 3,
        samples: int = 10,
        batch_size: int = 4,
        image_size: int = 8,
        channels: int = 3,
        epochs: int | None = 2,
        seed: int = 7,
        fingerprint: str | None = None,
        write: int = 0,
        manifest: bool = True,
        split: str = "train",
    ) -> FakeJob:
        target = path if path is not None else buffer
        target.mkdir(parents=True, exist_ok=True)
        m = Manifest(
            dataset_root="/data/fake",
            # A val job's data is a folder of its own by default, as a real one's (the held-out check).
            fingerprint=fingerprint if fingerprint is not None else f"fp-{split}",
            classes=[f"class{i}" for i in range(classes)],
            num_samples=samples,
            split=split,
            seed=seed,
            batch_size=batch_size,
            image_size=image_size,
            samples_per_epoch=samples,
            steps_per_epoch=-(-samples // batch_size),
            epochs=epochs,
            producer="test-producer",
            channels=channels,
        )
        if manifest:
            m.write(target)
        job = FakeJob(target, m)
        job.write_epochs(write)
        made.append(job)
        return job

    yield make
    for job in made:
        job.owner.close()


@pytest.fixture(scope="session")
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
