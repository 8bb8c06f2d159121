"""The device path's bookkeeping (staging ring, registration, prefetch, progress after the copy),
run on the CPU with a fake CUDA backend whose copies complete only when the test says so.

The same behaviour on a real GPU is in test_gpu.py (skipped without one)."""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from prefetchd.buffer_protocol import Progress
from prefetchd.trainer import BufferLoader, DaemonGone, LoaderError
from prefetchd.trainer import gpu
from prefetchd.trainer.device_path import DevicePath
from prefetchd.trainer.gpu import PIN_MODES, CopyEvent

if TYPE_CHECKING:
    from conftest import FakeJob, MakeJob


class FakeEvent:
    def __init__(self, name: str) -> None:
        self.name = name
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


class FakeBackend:
    """CPU stand-in for CudaBackend: "device" copies are clones, events complete on demand."""

    def __init__(self, register_error: str | None = None) -> None:
        self.events: list[FakeEvent] = []
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.register_error = register_error
        self.handed: list[CopyEvent] = []
        self.on_side = False
        self.copies_off_side = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @contextlib.contextmanager
    def _side(self):  # type: ignore[no-untyped-def]
        self.on_side = True
        try:
            yield None
        finally:
            self.on_side = False

    def side_stream(self) -> AbstractContextManager[object]:
        return self._side()

    def record(self) -> FakeEvent:
        event = FakeEvent("copied" if len(self.events) % 2 == 0 else "ready")
        self.events.append(event)
        return event

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        if not self.on_side:
            self.copies_off_side += 1
        return host.clone()

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def hand_over(self, ready: CopyEvent, tensors: Sequence[torch.Tensor]) -> None:
        self.handed.append(ready)

    def register(self, address: int, nbytes: int) -> str | None:
        if self.register_error is not None:
            return self.register_error
        assert address not in self.registered, "registered twice"
        self.registered[address] = nbytes
        return None

    def unregister(self, address: int) -> None:
        self.registered.pop(address)
        self.unregistered.append(address)

    def complete(self) -> None:
        for event in self.events:
            event.done = True


def in_flight(loader: BufferLoader) -> DevicePath:
    """The loader's device path (its copies ahead and handed out); the loader must have one."""
    assert loader._device_path is not None, "no device path: a CPU loader"
    return loader._device_path


def progress(buffer: Path) -> tuple[int, int] | None:
    p = Progress.read(buffer)
    return None if p is None else (p.epoch, p.step)


def device_loader(job: FakeJob, mode: str = "staging", prefetch: int = 1, **kwargs: object) -> tuple[BufferLoader, FakeBackend]:
    loader = BufferLoader(job.buffer, timeout=5, daemon_grace=0, **kwargs)  # type: ignore[arg-type]
    backend = FakeBackend()
    loader._attach_feeder(backend, mode, prefetch)  # type: ignore[arg-type]
    return loader, backend


@pytest.mark.parametrize("mode", ["staging", "register"])
@pytest.mark.parametrize("normalize", [True, False])
def test_values_equal_the_cpu_path(make_job: MakeJob, mode: str, normalize: bool) -> None:
    job = make_job(write=2)
    reference = BufferLoader(job.buffer, timeout=5, normalize=normalize, daemon_grace=0)
    cpu = [(b.images, b.labels, b.indices, b.epoch, b.step) for _ in range(2) for b in reference]
    # A fresh buffer copy: the CPU loader above has moved progress to the end.
    loader, backend = device_loader(make_job(job.buffer / "again", write=2), mode, normalize=normalize)
    got = []
    for _ in range(2):
        for b in loader:
            got.append((b.images, b.labels, b.indices, b.epoch, b.step))
            backend.complete()  # the consumer's step ends after the copy
    assert len(got) == len(cpu) == 6
    for (gi, gl, gx, ge, gs), (ci, cl, cx, ce, cs) in zip(got, cpu):
        assert (ge, gs) == (ce, cs)
        assert gi.dtype == ci.dtype == (torch.float32 if normalize else torch.uint8)
        assert gi.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(gi, ci) and torch.equal(gl, cl) and torch.equal(gx, cx)
    assert backend.copies_off_side == 0, "every copy is issued on the side stream"
    assert len(backend.handed) == 6, "the consumer waits for every batch it is handed"


def test_staging_ring_reuse_never_corrupts_batches_in_use(make_job: MakeJob) -> None:
    job = make_job(samples=40, batch_size=4, write=1)  # 10 batches through a ring of 3 slots
    loader, backend = device_loader(job, "staging", prefetch=1, normalize=False)
    kept = [(b.step, b.images) for b in loader]
    for step, images in kept:
        raw, _, _ = job.arrays(0, step)
        assert np.array_equal(images.permute(0, 2, 3, 1).numpy(), raw)
    # The ring came round while copies were unconfirmed: the slot was waited for, not overwritten.
    assert any(e.waited for e in backend.events)


def test_progress_moves_past_a_batch_only_once_its_copy_completed(make_job: MakeJob) -> None:
    job = make_job(write=1)
    loader, backend = device_loader(job, prefetch=0)
    it = iter(loader)
    assert progress(job.buffer) == (0, 0)
    assert next(it).step == 0
    assert next(it).step == 1
    # The consumer came back, but batch 0's copy has not completed: it is not consumed yet.
    assert progress(job.buffer) == (0, 0)
    assert loader.position == (0, 2)
    assert loader.state_dict()["step"] == 2  # resume position is independent of the copy
    backend.complete()
    assert next(it).step == 2
    assert progress(job.buffer) == (0, 2)
    with pytest.raises(StopIteration):
        next(it)
    # Batch 2's copy is still unconfirmed at the end of the epoch ...
    assert progress(job.buffer) == (0, 2)
    loader.close()  # ... and close() waits for it
    assert progress(job.buffer) == (1, 0)


def test_next_batch_is_already_copying_while_the_consumer_works(make_job: MakeJob) -> None:
    job = make_job(write=1)
    loader, backend = device_loader(job, prefetch=2, normalize=False)
    it = iter(loader)
    first = next(it)
    assert first.step == 0
    assert [t.key for t in in_flight(loader).ahead] == [(0, 1), (0, 2)]  # two more batches in flight
    assert in_flight(loader).feeder.in_flight == 3
    assert not any(e.done for e in backend.events)
    # Their files may go now (a lost buffer; the daemon itself never deletes at or after
    # progress): what was started still arrives, intact, without waiting for a daemon.
    job.path(0, 1).unlink()
    job.path(0, 2).unlink()
    rest = list(it)
    assert [b.step for b in rest] == [1, 2]
    for b in rest:
        raw, _, _ = job.arrays(0, b.step)
        assert np.array_equal(b.images.permute(0, 2, 3, 1).numpy(), raw)


def test_without_prefetch_a_missing_file_is_waited_for(make_job: MakeJob) -> None:
    job = make_job(write=1)
    loader, _ = device_loader(job, prefetch=0)
    it = iter(loader)
    next(it)
    assert len(in_flight(loader).ahead) == 0
    job.path(0, 1).unlink()
    with pytest.raises(DaemonGone, match="e000000-s00000001.batch"):
        next(it)


def test_prefetch_crosses_epochs_but_not_the_jobs_end(make_job: MakeJob) -> None:
    job = make_job(write=2, epochs=2)
    loader, backend = device_loader(job, prefetch=2)
    it = iter(loader)
    next(it), next(it)
    assert [t.key for t in in_flight(loader).ahead] == [(0, 2), (1, 0)]
    assert [b.step for b in it] == [2]
    assert [(b.epoch, b.step) for b in loader] == [(1, 0), (1, 1), (1, 2)]
    assert list(in_flight(loader).ahead) == []  # nothing past epoch 2 of a 2-epoch job
    assert list(loader) == []


def test_rewind_drops_what_was_started_and_delivers_the_right_batches(make_job: MakeJob) -> None:
    job = make_job(write=1)
    loader, backend = device_loader(job, prefetch=2)
    start = loader.state_dict()
    it = iter(loader)
    next(it)
    started = list(in_flight(loader).ahead)
    loader.load_state_dict(start)
    assert all(t.released for t in started), "dropped transfers are waited for and released"
    assert progress(job.buffer) == (0, 0)
    assert [b.step for b in loader] == [0, 1, 2]


def test_register_pins_the_mapping_and_unpins_after_the_copy(make_job: MakeJob) -> None:
    job = make_job(write=1, image_size=32)
    loader, backend = device_loader(job, "register", prefetch=0)
    it = iter(loader)
    next(it)
    assert list(backend.registered.values()) == [4 * 32 * 32 * 3]  # the images payload, in place
    next(it)
    assert backend.unregistered == [], "a mapping is unpinned only once its copy has completed"
    backend.complete()
    next(it)
    assert len(backend.unregistered) == 2
    loader.close()
    assert backend.registered == {}


def test_register_failure_names_the_fallback(make_job: MakeJob) -> None:
    job = make_job(write=1)
    loader = BufferLoader(job.buffer, timeout=5)
    loader._attach_feeder(FakeBackend(register_error="cudaHostRegister: operation not supported"), "register", 1)
    with pytest.raises(LoaderError, match="operation not supported.*pin='staging'"):
        next(iter(loader))


def test_pin_and_prefetch_arguments(make_job: MakeJob) -> None:
    job = make_job(write=1)
    assert PIN_MODES == ("auto", "staging", "register", "none")
    assert BufferLoader(job.buffer, timeout=5).pin == "none"
    with pytest.raises(ValueError, match="pin='bogus'"):
        BufferLoader(job.buffer, timeout=5, pin="bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a CUDA device"):
        BufferLoader(job.buffer, timeout=5, pin="staging")
    with pytest.raises(ValueError, match="prefetch"):
        BufferLoader(job.buffer, timeout=5, prefetch=-1)
    loader, _ = device_loader(job, "staging")
    assert loader.pin == "staging" and "pin='staging'" in repr(loader)


def test_the_cpu_path_is_untouched(make_job: MakeJob) -> None:
    job = make_job(write=1)
    loader = BufferLoader(job.buffer, timeout=5, normalize=False)
    batch = next(iter(loader))
    assert loader._device_path is None
    # Zero-copy on the CPU: the indices still view the mapped file.
    assert not batch.indices.numpy().flags.owndata


def test_a_loader_dropped_without_close_still_unpins(make_job: MakeJob) -> None:
    import gc

    job = make_job(write=1)
    loader, backend = device_loader(job, "register", prefetch=1)
    next(iter(loader))
    assert len(backend.registered) == 2  # the batch handed out and the one ahead
    del loader
    gc.collect()
    assert backend.registered == {} and len(backend.unregistered) == 2


@pytest.mark.skipif(not torch.version.cuda, reason="a CPU build of torch has no CUDA runtime")
def test_the_runtime_whose_last_error_is_cleared_is_torchs_own() -> None:
    """After a failed cudaHostRegister the loader resets the runtime's last error; that must be the
    libcudart torch loaded, not a second copy with its own state (works without a GPU)."""

    def mapped_runtimes() -> set[str]:
        with open("/proc/self/maps") as fh:
            return {line.split(None, 5)[5].strip() for line in fh if "libcudart" in line and line.count(" ") >= 5}

    before = mapped_runtimes()
    lib = gpu._libcudart()
    assert lib is not None and lib._name == f"libcudart.so.{str(torch.version.cuda).split('.')[0]}"
    assert mapped_runtimes() == before  # nothing new loaded
    info = _DlInfo()
    assert ctypes.CDLL(None).dladdr(ctypes.cast(lib.cudaGetLastError, ctypes.c_void_p), ctypes.byref(info))
    # The function lives in the copy torch loaded (through its RPATH), already there before the call.
    assert os.path.realpath(info.dli_fname.decode()) in {os.path.realpath(p) for p in before}


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def test_close_releases_the_pinned_staging_ring(make_job: MakeJob) -> None:
    """It stayed page-locked (prefetch + 2 batches) for as long as the closed loader was referenced (review)."""
    import weakref

    pinned: list[weakref.ref[torch.Tensor]] = []

    class Recording(FakeBackend):
        def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
            tensor = super().pinned(numel, dtype)
            pinned.append(weakref.ref(tensor))
            return tensor

    loader = BufferLoader(make_job(write=1).buffer, timeout=5, daemon_grace=0)
    backend = Recording()
    loader._attach_feeder(backend, "staging", 2)
    next(iter(loader))
    backend.complete()
    assert pinned and any(ref() is not None for ref in pinned)
    loader.close()
    assert all(ref() is None for ref in pinned), "a closed loader still holds its staging buffers"
