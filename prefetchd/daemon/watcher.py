"""Wake the daemon when a trainer rewrites its progress file or submits a job.

watchdog (inotify on Linux) gives a wake-up within a millisecond of the
trainer's rename; the controller also re-reads the file on a short timer, so a
missing or broken watch (inotify limits, network filesystems) only costs latency.
"""

from __future__ import annotations

import errno
import logging
import os

from watchdog.events import FileMovedEvent, FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from prefetchd.buffer_protocol.layout import JOB_NAME, consumer_of

log = logging.getLogger(__name__)

_ERRNO_HINTS = {
    errno.ENOSPC: "inotify watch limit reached (raise fs.inotify.max_user_watches)",
    errno.EMFILE: "inotify instance limit reached (raise fs.inotify.max_user_instances)",
    errno.ENOENT: "the buffer directory vanished",
}


class _StoppingEmitterFilter(logging.Filter):
    """Drops watchdog's "queue_events() called when the thread is inactive" ERROR.

    watchdog 7 logs it when an event is still being read while ``Observer.stop()`` runs: its
    emitter drops the inotify handle without a lock the reading thread holds.  The daemon
    writes status.json (a rename, so an event) right before it stops the watcher, so nearly
    every exit hit that race.  Nothing is wrong then: the event is dropped as it should be.
    The handle is None only after the stop began, so the message means nothing else.
    """

    MESSAGE = "InotifyEmitter.queue_events() called when the thread is inactive"

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.MESSAGE


_STOPPING_EMITTER_FILTER = _StoppingEmitterFilter()


class _Handler(FileSystemEventHandler):
    def __init__(self, wake_fd: int) -> None:
        self._wake_fd = wake_fd

    def on_any_event(self, event: FileSystemEvent) -> None:
        # The trainer publishes by rename, which arrives as a move whose destination is the file.
        for path in (event.src_path, getattr(event, "dest_path", "")):
            name = os.path.basename(os.fsdecode(path))
            if name == JOB_NAME or consumer_of(name) is not None:  # job.json or any consumer's progress
                try:
                    os.write(self._wake_fd, b"p")
                except BlockingIOError:  # the pipe is full: a wake-up is already pending
                    pass
                return


class BufferWatcher:
    def __init__(self, buffer: os.PathLike[str] | str, wake_fd: int) -> None:
        # The same filter object every time: addFilter keeps one copy.
        logging.getLogger("watchdog.observers.inotify").addFilter(_STOPPING_EMITTER_FILTER)
        self._observer: Observer | None = None  # type: ignore[valid-type]
        try:
            # In the try: watchdog's inotify observer takes its inotify instance as it is made, and a user out of
            # them (fs.inotify.max_user_instances) ended the daemon's start in a traceback (a walk under limits).
            self._observer = Observer()
            # Only renames: without the filter inotify reports every worker write into a
            # batch being built, and watchdog's threads spent ~0.15 core on them.
            # Recursive, for the progress files in per-rank stream directories.
            self._observer.schedule(_Handler(wake_fd), os.fspath(buffer), recursive=True,
                                    event_filter=[FileMovedEvent])
            self._observer.daemon = True
            self._observer.start()
        except OSError as exc:
            hint = _ERRNO_HINTS.get(exc.errno or 0, exc.strerror)
            log.warning("cannot watch %s for progress (%s); polling it instead", buffer, hint)
            self._observer = None

    @property
    def watching(self) -> bool:
        return self._observer is not None

    def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
            self._observer = None
