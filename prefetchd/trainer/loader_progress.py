"""How a loader tells the daemon what it consumed: its progress file, written as it reads.

Progress (``progress.json``, read by the daemon, which deletes every batch
before it; written by ``prefetchd.trainer.progress_file``) is the trainer's side
of flow control:

- it is written when iteration starts and by ``load_state_dict``, so a trainer
  restarted at an older position makes the daemon regenerate from there;
- the job's end (every epoch of a job with ``epochs`` consumed) is written only by
  a loader that read the job's last batch, or that continues (``load_state_dict``)
  one whose progress file says it did: the daemon takes that position for the job
  done and ends it, which a loader put there by a state saved at the end (a finished
  run's checkpoint, loaded to validate or to train more epochs) has no say in.  It
  reads nothing and leaves the progress file as it was;
- a loader that may not write it is refused when it is made (``NoAccess``), and one
  whose writes fail later goes on for a while and then stops, saying why (``AccessLost``
  for a permission lost; ``prefetchd.trainer.progress_file``);
- after a batch is handed over, progress moves past it only when the consumer
  asks for the next batch, when the epoch's iterator is exhausted or when the
  loader is closed, so the file the consumer may still be reading is not
  deleted under it.

On a CUDA device's copy path (``prefetchd.trainer.device_path``) a batch counts as consumed only
once the consumer has come back for the next one *and* its copy has completed,
so progress.json may trail the position by a batch the copy engine still reads.

While it waits for a batch a loader rewrites its progress file every ``PROGRESS_REFRESH_SECONDS``, so that
the daemon sees a named consumer is there.

A part of :class:`~prefetchd.trainer.loader.BufferLoader`, which sets what is declared here in its
``__init__``; the file itself is ``progress_file.py``'s, and what a loader writes as it leaves ``leaving.py``'s.
"""

from __future__ import annotations

from prefetchd.buffer_protocol import Manifest
from prefetchd.trainer.batch import WaitMeter
from prefetchd.trainer.device_path import DevicePath
from prefetchd.trainer.job_watch import JobWatch
from prefetchd.trainer.leaving import Where, unread_end
from prefetchd.trainer.progress_file import ProgressFile


class LoaderProgress:
    """What a :class:`~prefetchd.trainer.loader.BufferLoader` writes in its progress file, and when."""

    # Set by BufferLoader.__init__.
    _manifest: Manifest
    _job: JobWatch
    _at: Where
    _progress: ProgressFile
    _waits: WaitMeter
    _device_path: DevicePath | None

    def _consumed_until(self) -> tuple[int, int]:
        """The position progress.json may name: handed-out batches still being copied are not consumed."""
        position = (self._at.epoch, self._at.step)
        return position if self._device_path is None else self._device_path.consumed_until(position)

    def _publish(self, force: bool = False, closed: bool = False) -> None:
        position = self._consumed_until()
        if self._unread_end(position):
            # Not this loader's to announce (the module docstring): only leaving is said, where it was written.
            if not closed or self._progress.published is None:
                return
            position = self._progress.published
        # Counted, not taken from the position: a jump (load_state_dict, set_epoch) reads nothing.
        read = self._at.handed_out - (len(self._device_path.handed) if self._device_path is not None else 0)
        self._progress.publish(position, self._waits.share(), force=force, closed=closed, read_batches=read)

    def _unread_end(self, position: tuple[int, int]) -> bool:
        """Whether ``position`` is the job's end and this loader got there without reading its last batch."""
        return unread_end(position, self._at, self._manifest.epochs)

    def _check_progress(self) -> None:
        """While waiting: write the progress file again where it does not name this loader's position,
        or is due for a refresh (``ProgressFile.stale``)."""
        self._job.check()  # a position written back into a job that replaced ours would mislead its daemon
        if self._progress.stale():
            self._publish(force=True)


__all__ = ["LoaderProgress"]
