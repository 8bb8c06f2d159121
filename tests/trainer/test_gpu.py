"""The device path on a real CUDA device: skipped without one.

test_device_path.py runs the same bookkeeping on the CPU with a fake backend."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from prefetchd.buffer_protocol import Progress
from prefetchd.trainer import BufferLoader
from prefetchd.trainer.gpu import CudaBackend, _clear_last_cuda_error
from tests.trainer.test_device_path import in_flight

if TYPE_CHECKING:
    from conftest import MakeJob

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE_MODES = ["staging", "register", "none"]
# torch.cuda._sleep spins the GPU for this many cycles (~1 s at 2 GHz): long enough that the
# host's next few calls certainly happen while the side stream is still blocked.
BLOCK_CYCLES = 2_000_000_000


def progress(buffer: Path) -> tuple[int, int] | None:
    p = Progress.read(buffer)
    return None if p is None else (p.epoch, p.step)


def block_side_stream(loader: BufferLoader, cycles: int = BLOCK_CYCLES) -> None:
    """Hold up everything issued on the loader's copy stream from now on."""
    backend = in_flight(loader).feeder.backend
    assert isinstance(backend, CudaBackend)
    with torch.cuda.stream(backend.stream):
        torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("pin", DEVICE_MODES)
@pytest.mark.parametrize("normalize", [True, False])
def test_values_equal_the_cpu_path(make_job: MakeJob, pin: str, normalize: bool) -> None:
    job = make_job(write=2, image_size=32)
    reference = BufferLoader(job.buffer, timeout=5, normalize=normalize, daemon_grace=0)
    cpu = [b for _ in range(2) for b in reference]
    gpu_job = make_job(job.buffer / "gpu", write=2, image_size=32)
    loader = BufferLoader(gpu_job.buffer, device="cuda", pin=pin, normalize=normalize, timeout=5, daemon_grace=0)  # type: ignore[arg-type]
    assert loader.pin == pin
    got = [b for _ in range(2) for b in loader]
    assert [(b.epoch, b.step) for b in got] == [(b.epoch, b.step) for b in cpu]
    for g, c in zip(got, cpu):
        assert g.images.is_cuda and g.labels.is_cuda and not g.indices.is_cuda
        assert g.images.is_contiguous(memory_format=torch.channels_last)
        assert g.images.dtype == c.images.dtype
        # Same float32 operations in the same order: equal up to the last bit, allow one ulp.
        torch.testing.assert_close(g.images.cpu(), c.images, rtol=0, atol=1e-6)
        assert torch.equal(g.labels.cpu(), c.labels) and torch.equal(g.indices, c.indices)
    loader.close()


def warm_host_allocator(make_job: MakeJob, buffer: Path, pin: str) -> None:
    """Run a loader of the same shapes to the end. The first page-locked allocation in a process
    (cudaHostAlloc) waits for the whole device, a blocked stream included; later ones reuse its
    cached blocks. Without this the first staged batch waited out the block when the test ran
    first in its process (gpu_check's three test processes, H200, 2026-11-26)."""
    warm = make_job(buffer, write=1, image_size=32)
    loader = BufferLoader(warm.buffer, device="cuda", pin=pin, prefetch=0, timeout=5, daemon_grace=0)  # type: ignore[arg-type]
    list(loader)
    loader.close()  # its pinned blocks go back to torch's cache, where the test's loader finds them


@pytest.mark.parametrize("pin", ["staging", "register"])
def test_progress_moves_only_after_the_copy_completed(make_job: MakeJob, pin: str) -> None:
    job = make_job(write=1, image_size=32)
    warm_host_allocator(make_job, job.buffer / "warm", pin)
    loader = BufferLoader(job.buffer, device="cuda", pin=pin, prefetch=0, timeout=5, daemon_grace=0)  # type: ignore[arg-type]
    it = iter(loader)
    block_side_stream(loader)
    first = next(it)  # issued behind the sleep: its copy cannot have completed
    assert in_flight(loader).handed and not in_flight(loader).handed[0].copied.query()
    assert next(it).step == 1
    assert progress(job.buffer) == (0, 0), "batch 0 is still being copied, so it is not consumed"
    torch.cuda.synchronize()
    assert next(it).step == 2
    assert progress(job.buffer) == (0, 2)
    assert first.images.shape == (4, 3, 32, 32)
    loader.close()
    assert progress(job.buffer) == (1, 0)


@pytest.mark.parametrize("pin", ["staging", "register"])
def test_two_batches_in_flight_while_the_consumer_works(make_job: MakeJob, pin: str) -> None:
    job = make_job(write=1, image_size=32)
    loader = BufferLoader(job.buffer, device="cuda", pin=pin, prefetch=2, normalize=False, timeout=5, daemon_grace=0)  # type: ignore[arg-type]
    it = iter(loader)
    block_side_stream(loader)
    assert next(it).step == 0
    ahead = list(in_flight(loader).ahead)
    assert [t.key for t in ahead] == [(0, 1), (0, 2)]
    assert not any(t.copied.query() for t in ahead), "both copies are queued behind the blocked stream"
    # Started means the host side is done with the files (staging) or holds them pinned (register):
    # they can go, and the batches still arrive intact.
    job.path(0, 1).unlink()
    job.path(0, 2).unlink()
    for batch in it:
        raw, _, _ = job.arrays(0, batch.step)
        assert np.array_equal(batch.images.permute(0, 2, 3, 1).cpu().numpy(), raw)
    loader.close()


def test_consumer_on_its_own_stream_sees_complete_batches(make_job: MakeJob) -> None:
    job = make_job(write=1, image_size=32, samples=40)
    loader = BufferLoader(job.buffer, device="cuda", normalize=False, timeout=5, daemon_grace=0)
    consumer = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    sums = []
    with torch.cuda.stream(consumer):
        for batch in loader:
            block_side_stream(loader, BLOCK_CYCLES // 50)  # the next copy lags; the consumer must still wait for its own
            sums.append(batch.images.to(torch.int64).sum())
    torch.cuda.synchronize()
    want = [int(job.arrays(0, step)[0].astype(np.int64).sum()) for step in range(len(loader))]
    assert [int(s) for s in sums] == want
    loader.close()


def test_register_leaves_no_pinned_mapping_behind(make_job: MakeJob, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every address the real backend registered is noted (the registration itself still happens).
    registered: list[int] = []
    real_register = CudaBackend.register

    def noting(self: CudaBackend, address: int, nbytes: int) -> str | None:
        error = real_register(self, address, nbytes)
        if error is None:
            registered.append(address)
        return error

    monkeypatch.setattr(CudaBackend, "register", noting)
    job = make_job(write=2, image_size=32)
    loader = BufferLoader(job.buffer, device="cuda", pin="register", timeout=5, daemon_grace=0)
    for _ in range(2):
        list(loader)
    feeder = in_flight(loader).feeder
    loader.close()
    assert feeder.in_flight == 0
    assert loader._device_path is None, "close() lets the feeder (and its pinned memory) go"
    assert len(registered) == 2 * len(loader)
    # A registration still in place would let cudaHostUnregister succeed (and undo the leak); a new
    # mapping of the same file gets another address, so registering the files again would not tell.
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    leaked = [hex(a) for a in registered if int(cudart.cudaHostUnregister(a)) == 0]
    _clear_last_cuda_error()  # the expected "not registered" errors must not be blamed on a later kernel
    assert not leaked, f"still registered after close(): {leaked}"
