"""Holding the opens of one file until the test has acted: a race between an open and a later check, made exact.

fanotify's permission events (Linux, CAP_SYS_ADMIN) stop every open of a marked file after the kernel has
looked its path up and before the open returns, until the listener answers: a test can rename folders in that
window, where a racing process would hit it only now and then.  ctypes, since no maintained library wraps
fanotify's permission events.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
import threading
from collections.abc import Callable
from types import TracebackType

FAN_CLOEXEC = 0x01
FAN_CLASS_CONTENT = 0x04  # the class permission events need
FAN_MARK_ADD = 0x01
FAN_OPEN_PERM = 0x00010000
FAN_ALLOW = 0x01
AT_FDCWD = -100
EVENT = struct.Struct("=IBBHQii")  # fanotify_event_metadata: event_len, vers, reserved, metadata_len, mask, fd, pid
RESPONSE = struct.Struct("=iI")  # fanotify_response: fd, response

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]


def _init() -> int:
    fd = int(_libc.fanotify_init(FAN_CLASS_CONTENT | FAN_CLOEXEC, os.O_RDONLY))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fanotify_init: {os.strerror(err)}")
    return fd


def unavailable() -> str | None:
    """Why this process cannot hold opens (no CAP_SYS_ADMIN, a kernel without permission events); None if it can."""
    try:
        os.close(_init())
    except OSError as exc:
        return str(exc)
    return None


class OpenGate:
    """While open (a ``with`` block), every open of the file at ``path`` waits until ``on_open`` has run, once,
    at the first of them; ``opened`` counts them."""

    def __init__(self, path: str | os.PathLike[str], on_open: Callable[[], None]) -> None:
        self.opened = 0
        self._on_open = on_open
        self._failed: BaseException | None = None
        self._fd = _init()
        if _libc.fanotify_mark(self._fd, FAN_MARK_ADD, FAN_OPEN_PERM, AT_FDCWD, os.fsencode(path)) != 0:
            err = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(err, f"fanotify_mark {path}: {os.strerror(err)}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="open-gate", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not select.select([self._fd], [], [], 0.05)[0]:
                continue
            data = os.read(self._fd, 4096)
            at = 0
            while at + EVENT.size <= len(data):
                length, _, _, _, _, fd, _ = EVENT.unpack_from(data, at)
                at += length
                try:
                    if not self.opened:
                        self._on_open()
                except BaseException as exc:  # said by close(), in the test's thread
                    self._failed = exc
                finally:
                    self.opened += 1
                    os.write(self._fd, RESPONSE.pack(fd, FAN_ALLOW))
                    os.close(fd)

    def close(self) -> None:
        """Stop holding opens (closing the group lets any still held go on) and raise what ``on_open`` raised."""
        self._stop.set()
        self._thread.join(5)
        os.close(self._fd)
        if self._failed is not None:
            raise self._failed

    def __enter__(self) -> OpenGate:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


__all__ = ["OpenGate", "unavailable"]
