"""Mapped batch -> device memory with no extra host copy, one batch ahead of the consumer.

``BufferLoader(device="cuda", pin=...)`` picks how a mapped batch file reaches the GPU:

``staging`` (the default on CUDA)
    copy the mapped uint8 payload into one of a small ring of pinned (page-locked)
    host buffers, then DMA it to the device on a side stream.  One host memcpy
    (tmpfs page cache -> pinned buffer), which is what lets the copy engine run
    asynchronously: it only reads page-locked memory without the driver's help.
``register``
    page-lock the mapped payload itself (``cudaHostRegister``) and DMA straight
    from the tmpfs pages: no host copy at all, but pinning ~37 MB
    (256 x 224 x 224 x 3) and unpinning it costs a driver call per batch, and
    ``cudaHostUnregister`` may wait for the device.  ``tools/h2d_bench.py``
    measures both against the plain pageable copy (``pin="none"``).

Why the registration is read-only: ``map_batch`` maps a batch file MAP_PRIVATE
(copy-on-write).  A default ``cudaHostRegister`` pins pages for writing, and
pinning a private mapping for writing breaks copy-on-write: the kernel first
copies every page of the payload into anonymous memory (the very host copy this
mode exists to avoid, charged to the trainer's memory cgroup) and the DMA then
reads the copies.  ``cudaHostRegisterReadOnly`` pins the page-cache pages
themselves.  Where the driver or device cannot do that the loader raises,
naming ``pin="staging"``, instead of silently paying for the copy.

The order of work for batch k (side stream S, the consumer's stream C)::

    host: [map k][memcpy k -> pinned slot][issue]     hand k to the consumer, then start k+1
    S:                                    [H2D k] copied_k [u8 -> f32, normalise] ready_k
    C:                                          ... wait(ready_k) [step k]

The loader starts batch k+1 right after handing k over, so the copy of k+1
overlaps step k.  A staging slot, a registration and the mapping are released,
and the loader moves progress.json past the batch, only once ``copied_k`` has
completed.  The device tensors are allocated on S and marked as used on C
(``record_stream``), so the caching allocator does not hand their memory to S
again while C still reads it.

All device operations go through a :class:`Backend`, so the bookkeeping runs
under CPU tests with a fake one; :class:`CudaBackend` is the real thing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import torch

from prefetchd.buffer_protocol import MappedBatch
from prefetchd.trainer.config import PIN_MODES, PinMode
from prefetchd.trainer.errors import LoaderError

logger = logging.getLogger(__name__)


# cudaHostRegisterReadOnly (CUDA >= 11.1): the device only reads the pages, so
# they are pinned without asking for write access (see the module docstring).
HOST_REGISTER_READ_ONLY = 0x08


class CopyEvent(Protocol):
    """A point in the side stream's work (``torch.cuda.Event`` on CUDA)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Backend(Protocol):
    """The device operations a :class:`DeviceFeeder` needs."""

    @property
    def device(self) -> torch.device: ...

    def side_stream(self) -> AbstractContextManager[object]:
        """Work issued inside runs on the side stream."""
        ...

    def record(self) -> CopyEvent:
        """An event that completes when all work issued so far on the side stream has."""
        ...

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """An asynchronous copy of a page-locked host tensor, same strides."""
        ...

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat page-locked host buffer."""
        ...

    def hand_over(self, ready: CopyEvent, tensors: Sequence[torch.Tensor]) -> None:
        """Make the consumer's current stream wait for ``ready`` and own ``tensors``."""
        ...

    def register(self, address: int, nbytes: int) -> str | None:
        """Page-lock host memory for reading; None on success, else what went wrong."""
        ...

    def unregister(self, address: int) -> None: ...


class CudaBackend:
    """:class:`Backend` on one CUDA device with one side stream for the copies."""

    def __init__(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._device = torch.device("cuda", index)
        self.stream = torch.cuda.Stream(device=self._device)  # type: ignore[no-untyped-call]  # torch leaves it untyped
        # Whatever the consumer queued so far (the normalisation constants) precedes our copies.
        self.stream.wait_stream(torch.cuda.current_stream(self._device))

    @property
    def device(self) -> torch.device:
        return self._device

    def side_stream(self) -> AbstractContextManager[object]:
        return torch.cuda.stream(self.stream)

    def record(self) -> CopyEvent:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self._device, non_blocking=True)

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def hand_over(self, ready: CopyEvent, tensors: Sequence[torch.Tensor]) -> None:
        if not isinstance(ready, torch.cuda.Event):
            raise TypeError(f"expected a torch.cuda.Event, got {type(ready).__name__}")
        consumer = torch.cuda.current_stream(self._device)
        consumer.wait_event(ready)
        for tensor in tensors:
            tensor.record_stream(consumer)

    def register(self, address: int, nbytes: int) -> str | None:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = cudart.cudaHostRegister(address, nbytes, HOST_REGISTER_READ_ONLY)
        if int(err) == 0:
            return None
        text = f"cudaHostRegister(read-only, {nbytes} bytes): {cudart.cudaGetErrorString(err)} (error {int(err)})"
        if not _clear_last_cuda_error():
            text += "; the CUDA runtime's last-error state could not be reset, so restart the process"
        return text

    def unregister(self, address: int) -> None:
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        err = cudart.cudaHostUnregister(address)
        if int(err) != 0:
            _clear_last_cuda_error()
            logger.warning("cudaHostUnregister: %s (error %d)", cudart.cudaGetErrorString(err), int(err))


@functools.cache
def _libcudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded, or None (a CPU build, or a runtime linked statically).

    RTLD_NOLOAD asks the dynamic linker for the library already resident under the
    soname of torch's CUDA version (``libcudart.so.13`` for 13.x): torch's own
    copy, never a second one with a runtime state of its own (torchvision's private
    copy carries another soname).
    """
    version = torch.version.cuda
    if not version:
        return None
    try:
        return ctypes.CDLL(f"libcudart.so.{version.split('.')[0]}", mode=os.RTLD_NOLOAD)
    except OSError:
        return None


def _clear_last_cuda_error() -> bool:
    """Reset the runtime's last error after a failure we handled.

    torch checks ``cudaGetLastError()`` after every kernel launch, so an error
    left behind by a failed registration would be blamed on the next, unrelated
    kernel.  torch's ``cudart()`` module binds cudaHostRegister, cudaHostUnregister and
    cudaGetErrorString but not ``cudaGetLastError`` (torch 2.14), hence :func:`_libcudart`.
    """
    lib = _libcudart()
    if lib is None:
        return False
    lib.cudaGetLastError()
    return True


@dataclass(eq=False)
class _Slot:
    labels: torch.Tensor  # pinned int64 [batch_size]
    images: torch.Tensor | None  # pinned uint8 [batch_size * H * W * C]; staging only
    user: Transfer | None = None


@dataclass(eq=False)
class Transfer:
    """One batch on its way to the device (or there already)."""

    key: tuple[int, int]  # (epoch, step)
    images: torch.Tensor  # on the device, NCHW with channels_last strides
    labels: torch.Tensor
    indices: torch.Tensor  # on the CPU, a copy (the mapping is released after the copy)
    replaced: int
    copied: CopyEvent  # the host memory (mapping or staging slot) is no longer read
    ready: CopyEvent  # images converted and normalised
    slot: _Slot | None
    mapped: MappedBatch | None  # kept mapped until ``copied``
    registered: int | None = None  # address to unregister once ``copied``
    released: bool = False


class DeviceFeeder:
    """Starts transfers of mapped batches and releases their host memory once copied."""

    def __init__(
        self,
        backend: Backend,
        mode: Literal["staging", "register"],
        *,
        batch_size: int,
        image_shape: tuple[int, int, int],
        scale: torch.Tensor | None,
        shift: torch.Tensor | None,
        ring: int,
    ) -> None:
        if mode not in ("staging", "register"):
            raise ValueError(f"mode={mode!r}: expected 'staging' or 'register'")
        if ring < 1:
            raise ValueError(f"ring={ring!r}: need at least one staging slot")
        self.backend = backend
        self.mode = mode
        self._image_shape = image_shape
        self._scale, self._shift = scale, shift
        image_numel = batch_size * image_shape[0] * image_shape[1] * image_shape[2]
        self._slots = [
            _Slot(
                labels=backend.pinned(batch_size, torch.int64),
                images=backend.pinned(image_numel, torch.uint8) if mode == "staging" else None,
            )
            for _ in range(ring)
        ]
        self._turn = 0
        self._live: set[Transfer] = set()

    @property
    def device(self) -> torch.device:
        return self.backend.device

    @property
    def in_flight(self) -> int:
        """Transfers whose host memory is still held (copy not known to be complete)."""
        return len(self._live)

    def start(self, mapped: MappedBatch, key: tuple[int, int]) -> Transfer:
        """Issue the copy of a validated mapped batch; returns at once (the copy runs on the side stream)."""
        slot = self._slots[self._turn]
        self._turn = (self._turn + 1) % len(self._slots)
        if slot.user is not None:
            # The ring has gone round: the slot's last copy must be done before it is overwritten.
            self.finish(slot.user, wait=True)
        n = mapped.images.shape[0]
        host_labels = slot.labels[:n]
        host_labels.copy_(torch.from_numpy(mapped.labels))
        registered: int | None = None
        if self.mode == "register":
            registered = self._register(mapped.images)
            host_images = torch.from_numpy(mapped.images)
        else:
            assert slot.images is not None  # allocated for every slot in staging mode
            host_images = slot.images[: mapped.images.size].view(mapped.images.shape)
            host_images.copy_(torch.from_numpy(mapped.images))
        backend = self.backend
        with backend.side_stream():
            # HWC bytes seen as NCHW: a free permute whose strides are channels_last.
            images = backend.to_device(host_images).permute(0, 3, 1, 2)
            labels = backend.to_device(host_labels)
            copied = backend.record()
            if self._scale is not None and self._shift is not None:
                # Converted on the device: uint8 crosses the bus, a quarter of float32's bytes.
                images = images.to(torch.float32).mul_(self._scale).sub_(self._shift)
            ready = backend.record()
        transfer = Transfer(
            key=key,
            images=images,
            labels=labels,
            indices=torch.from_numpy(np.array(mapped.indices)),
            replaced=mapped.meta.replaced,
            copied=copied,
            ready=ready,
            slot=slot,
            mapped=mapped if registered is not None else None,
            registered=registered,
        )
        slot.user = transfer
        self._live.add(transfer)
        return transfer

    def hand_out(self, transfer: Transfer) -> tuple[torch.Tensor, torch.Tensor]:
        """The transfer's tensors, usable on the caller's current stream."""
        self.backend.hand_over(transfer.ready, (transfer.images, transfer.labels))
        return transfer.images, transfer.labels

    def finish(self, transfer: Transfer, *, wait: bool) -> bool:
        """Release the transfer's host memory if its copy is complete (or, with ``wait``, once it is)."""
        if transfer.released:
            return True
        if wait:
            transfer.copied.synchronize()
        elif not transfer.copied.query():
            return False
        if transfer.registered is not None:
            self.backend.unregister(transfer.registered)
            transfer.registered = None
        transfer.mapped = None
        if transfer.slot is not None and transfer.slot.user is transfer:
            transfer.slot.user = None
        transfer.slot = None
        transfer.released = True
        self._live.discard(transfer)
        return True

    def close(self) -> None:
        """Wait for every copy still in flight and release all host memory."""
        for transfer in list(self._live):
            self.finish(transfer, wait=True)

    def close_quietly(self) -> None:
        """:meth:`close` as the finaliser of a loader that was never closed: unpin before the mappings go."""
        try:
            self.close()
        except Exception as exc:  # at interpreter exit CUDA may be gone already
            logger.debug("releasing in-flight batches: %s", exc)

    def _register(self, images: np.ndarray) -> int:
        address = int(images.ctypes.data)
        error = self.backend.register(address, images.nbytes)
        if error is not None:
            raise LoaderError(
                f"pin='register' could not page-lock a mapped batch ({error}). This driver or device "
                "cannot register read-only host memory; use pin='staging' (the default on CUDA)"
            )
        return address


__all__ = [
    "Backend",
    "CopyEvent",
    "CudaBackend",
    "DeviceFeeder",
    "HOST_REGISTER_READ_ONLY",
    "PIN_MODES",
    "PinMode",
    "Transfer",
]
