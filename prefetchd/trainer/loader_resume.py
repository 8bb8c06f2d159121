"""How a loader resumes: the state it saves, and the moves to a position (``load_state_dict``, ``set_epoch``).

A move ends the iterators handed out before and drains the copies in flight; ``load_state_dict`` tells the
daemon at once, ``set_epoch`` when the next iteration starts.  A state at the job's end is taken, but its end
is said to the daemon only where the progress file says the trainer it continues read the last batch
(``loader_progress.py``).

A part of :class:`~prefetchd.trainer.loader.BufferLoader`, which sets what is declared here in its
``__init__``; the state itself, and whether it fits the buffer's job, is ``resume.py``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefetchd.buffer_protocol import Manifest, Progress, ProtocolError
from prefetchd.trainer.device_path import DevicePath
from prefetchd.trainer.errors import StateMismatch
from prefetchd.trainer.leaving import Where
from prefetchd.trainer.progress_file import ProgressFile
from prefetchd.trainer.resume import as_count, loader_state, resume_position
from prefetchd.words import counted

logger = logging.getLogger("prefetchd.trainer.loader")  # the loader's messages, as before this module was split off


class LoaderResume:
    """Where a :class:`~prefetchd.trainer.loader.BufferLoader` resumes, and how it is moved there."""

    # Set by BufferLoader.__init__.
    _buffer: Path
    _consumer: str
    _manifest: Manifest
    _at: Where
    _device_path: DevicePath | None
    _generation: int
    _progress: ProgressFile

    if TYPE_CHECKING:  # the loader's (loader.py), its iteration's (loader_iteration.py) and its progress' (loader_progress.py)
        @property
        def position(self) -> tuple[int, int]: ...
        def _check_open(self) -> None: ...
        def _unread_end(self, position: tuple[int, int]) -> bool: ...
        def _publish(self, force: bool = False, closed: bool = False) -> None: ...

    # Where load_state_dict put the loader: (epoch, step, batches handed out then); None once set_epoch moved it.
    _loaded_at: tuple[int, int, int] | None = None
    _left_at: tuple[int, int] | None = None  # where the last trainer of this consumer left the job (mid-job)

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: the (epoch, step) of the next batch, and the job it belongs to."""
        return loader_state(self._manifest, self._at.epoch, self._at.step)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (a :meth:`state_dict`) and tell the daemon to produce from there.

        Raises StateMismatch when the state belongs to another dataset or job (a
        different seed, batch size, split ... would give different batches) or
        points past the job's end.  A state at the job's end (saved after its last
        epoch) is taken with a warning: there is nothing left to read, and the daemon
        is not told so (its job would end, for this trainer and any other that reads
        it: see ``prefetchd.trainer.loader_progress``); unless the progress file says the trainer it
        continues read the last batch (it died before asking for the next one), whose
        end this loader then says.
        """
        self._move(state)
        self._loaded_at = (self._at.epoch, self._at.step, self._at.handed_out)  # for set_epoch's warning
        self._resumed_at_end()
        self._publish()

    def _resumed_at_end(self) -> bool:
        """Whether a resumed loader (``load_state_dict``, or made with ``start=``) is at the job's end, not having
        read its last batch; there, take the end as read where the trainer it continues read the last batch (the
        next ``_publish`` tells the daemon), else warn that nothing is left.  Made with ``start=`` at the end, a
        loader did neither: the daemon of an --epochs job never finished."""
        if not self._unread_end(self.position):
            return False
        if self._last_batch_handed_before():  # the progress file read once, only at the end
            self._at.read_to_end = True  # the loader it continues read the job's last batch: the end is said
        else:
            logger.warning(
                "%s: the loader state is at the end of the job's %s: there is nothing left to read, and "
                "iterating yields no batch. To train more epochs, restart the daemon with a larger --epochs (the "
                "job is the same otherwise) and load the state again; to train again from epoch 0, do not load it",
                self._buffer, counted(self._manifest.epochs or 0, "epoch"))
        return True

    def _last_batch_handed_before(self) -> bool:
        """Whether this consumer's progress file says the job's last batch was handed out: it names the last
        step (its trainer died after reading that batch, before asking for the next one, with a state saved at
        the end) or the end.  Not a fresh run's file, which is elsewhere or absent."""
        found = self._found_progress()
        if found is None:
            return False
        epochs, steps = self._manifest.epochs or 0, self._manifest.steps_per_epoch
        return (found.epoch, found.step) >= (epochs - 1, steps - 1)

    def _found_progress(self) -> Progress | None:
        """This consumer's progress file as an earlier trainer of this job left it; None where there is none."""
        try:
            found = Progress.read(self._buffer, self._consumer)
        except (ProtocolError, OSError):
            return None
        return found if found is not None and found.job in (None, self._manifest.job_key) else None

    def _mid_job_left_at(self) -> tuple[int, int] | None:
        """Where the last trainer of this consumer left the job, if mid-job: past its first batch, before its
        end.  Looked at as the loader is made, for ``_say_if_starting_over``."""
        found = self._found_progress()
        if found is None:
            return None
        left, epochs = (found.epoch, found.step), self._manifest.epochs
        return left if (0, 0) < left and (epochs is None or left < (epochs, 0)) else None

    def _say_if_starting_over(self) -> None:
        """Warn, once, where the loader's first epoch starts the job over at (0, 0) unasked (no load_state_dict,
        set_epoch or start=) while the last trainer of this consumer left it mid-job.  Right for a new run; a
        resume that forgot to load its checkpoint's loader state (Accelerate without
        register_for_checkpointing, Lightning without ckpt_path) trained the first epochs again and skipped
        the rest of the one it stopped in, the daemon only saying the trainer joined at epoch 0 (a user's walk)."""
        left, self._left_at = self._left_at, None
        if left is None or self.position != (0, 0):
            return
        logger.warning(
            "%s: this loader starts the job over at epoch 0 step 0, where the last trainer reading it as %s left "
            "at epoch %d step %d. Right for a new run; a resume loads its checkpoint's loader state first "
            "(loader.load_state_dict(state); Accelerate: register_for_checkpointing before load_state; Lightning: "
            "ckpt_path=; prefetchd-train: --resume), or it trains those batches again",
            self._buffer, self._progress.who, *left)

    def _move(self, state: Mapping[str, Any]) -> None:
        """Go to ``state``'s position, ending the iterators handed out before; progress.json is left alone."""
        self._check_open()
        epoch, step = resume_position(state, self._manifest, self._buffer)
        if self._device_path is not None:
            self._device_path.drain()
        if (epoch, step) != (self._at.epoch, self._at.step):
            self._at.read_to_end = False
        self._at.epoch, self._at.step = epoch, step
        self._generation += 1
        self._left_at = None  # a position asked for: no word of where the last trainer left

    def set_epoch(self, epoch: int) -> None:
        """Go to the first batch of ``epoch``, as ``DistributedSampler.set_epoch`` does for a sampler.

        A script that resumes by epoch (``for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)``) gets that epoch's batches, bit-identical to an
        uninterrupted run's: progress.json moves there when the next iteration starts
        (not at once: a mid-epoch resume, below, would have the daemon read step 0
        first, take it for a rewind and delete the batches it kept for this trainer,
        SPEC rule 8), and the daemon regenerates from there if it has moved on.  Called at the top of every epoch of an
        uninterrupted run it changes nothing.  It always restarts the epoch, so a
        mid-epoch resume calls ``load_state_dict`` *after* ``set_epoch`` for the
        epoch it resumes into: ``set_epoch`` names the epoch, ``load_state_dict``
        the batch, and the later call wins.
        """
        counted_epoch = as_count(epoch)
        if counted_epoch is None:
            raise ValueError(f"set_epoch({epoch!r}): pass a non-negative integer epoch (counted from 0)")
        epoch = counted_epoch
        epochs = self._manifest.epochs
        if epochs is not None and epoch > epochs:  # said for this call, not as a checkpoint's state would be
            raise StateMismatch(
                f"set_epoch({epoch}) is past the end of the job of {self._buffer}: it has {counted(epochs, 'epoch')} "
                f"(counted from 0, so set_epoch({epochs}) is its end, an empty epoch); loop over range({epochs}), or "
                "restart the daemon with a larger --epochs")
        if self._loaded_at == (epoch, self._at.step, self._at.handed_out) and self._at.step > 0:
            # load_state_dict, then set_epoch for the same epoch at the top of the loop: the epoch's first steps
            # trained again, silently (a walk of the API).  Said, as the docstring's order is easy to miss.
            logger.warning(
                "%s: set_epoch(%d) right after load_state_dict moves the loader back from step %d to the epoch's "
                "first batch, so steps 0-%d are read again: call load_state_dict after set_epoch to resume "
                "mid-epoch", self._buffer, epoch, self._at.step, self._at.step - 1)
        self._loaded_at = None
        # The same checks and the same repositioning as a checkpoint taken at that epoch's start.
        self._move({**self.state_dict(), "epoch": epoch, "step": 0})


__all__ = ["LoaderResume"]
