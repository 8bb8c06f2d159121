"""One pass of ``prefetchd-train`` over a loader's epoch: the steps, their sums, and the time spent
waiting for batches (the *data-wait share*), carried over a daemon's restart.

A pass trains (with an optimizer) or evaluates (without); its sums stay on the
device so that no step waits for the GPU just to log, and a mid-epoch checkpoint
saves them (``PassState``) for a resumed pass to continue.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from prefetchd.buffer_protocol import ProtocolError
from prefetchd.trainer.errors import DaemonGone, DaemonStuck, LoaderError, StopRequested
from prefetchd.trainer.loader import Batch, BufferLoader
from prefetchd.trainer.report import ProgressLine

TOP_K = 5


@dataclass
class PassState:
    """The running sums of a pass: what a mid-epoch checkpoint saves and a resume continues from."""

    loss_sum: float = 0.0
    correct1: int = 0
    correctk: int = 0
    seen: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0


@dataclass
class PassStats:
    """One pass (train or val) over one epoch of a loader."""

    loss: float
    top1: float
    images: int
    seconds: float
    wait_seconds: float
    topk: float = math.nan
    k: int = 1
    stopped: bool = False  # ended early because ``after_step`` asked to
    state: PassState = field(default_factory=PassState)  # the sums behind the figures


Recover = Callable[[BufferLoader, LoaderError], bool]


def timed_batches(loader: BufferLoader, recover: Recover | None = None) -> Iterator[tuple[Batch, float]]:
    """The loader's batches, each with the seconds spent waiting inside ``next()``.

    When the loader gives up on its daemon (gone or stuck) and ``recover`` brings a
    new one up (True), the same iterator asks again for the same (epoch, step): the
    position moves only when a batch is handed over, so none is skipped or repeated.
    """
    it = iter(loader)
    start = time.perf_counter()
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except (DaemonGone, DaemonStuck) as exc:
            if recover is None or not recover(loader, exc):
                raise
            continue  # the time lost to the daemon, and to its restart, is this batch's wait too
        yield batch, time.perf_counter() - start
        start = time.perf_counter()


def run_pass(
    model: nn.Module,
    loader: BufferLoader,
    criterion: nn.Module,
    progress: ProgressLine,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    *,
    topk: int = TOP_K,
    amp: bool = False,
    start: PassState | None = None,
    after_step: Callable[[Callable[[], PassState]], bool] | None = None,
    between_steps: Callable[[Callable[[], PassState], Exception | None], None] | None = None,
    recover: Recover | None = None,
    before_step: Callable[[bool], bool] | None = None,
) -> PassStats:
    """Train (with an optimizer) or evaluate (without) over the rest of the loader's epoch.

    ``start`` continues the sums of a pass that a checkpoint interrupted.
    ``after_step`` is called after every optimizer step with a function that
    snapshots the sums; returning True ends the pass there.  When the loader
    gives no batch, between two steps, ``between_steps`` gets that function too
    (to save the last step's state) and the loader's error, before the pass ends
    with it; or None when the loader's ``stop_requested`` ended its wait, and the
    pass ends as ``stopped``.
    ``before_step`` (the ranks under torchrun) is asked before every step whether the
    pass stops there: with False once the batch is in hand, with True when a stop ended
    the wait for it.  True ends the pass as a stop during a wait does: the batch in hand
    is given back to the loader (the checkpoint and a resume start with it), and
    ``between_steps`` gets the snapshot.
    ``recover`` is asked to replace a dead or stuck daemon (see ``timed_batches``).
    """
    training = optimizer is not None
    model.train(training)
    device = loader.device
    k = max(1, min(topk, len(loader.classes)))
    begun = start or PassState()
    # Sums stay on the device so no step waits for the GPU just to log.
    loss_sum = torch.full((), begun.loss_sum, dtype=torch.float64, device=device)
    correct1 = torch.full((), begun.correct1, dtype=torch.int64, device=device)
    correctk = torch.full((), begun.correctk, dtype=torch.int64, device=device)
    seen = begun.seen
    wait = begun.wait_seconds
    t0 = time.perf_counter()

    def snapshot() -> PassState:
        return PassState(
            loss_sum=loss_sum.item(), correct1=int(correct1.item()), correctk=int(correctk.item()), seen=seen,
            seconds=begun.seconds + time.perf_counter() - t0, wait_seconds=wait,
        )

    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if amp else nullcontext()
    stopped = False
    between = False  # stopped before a step (in its wait, or as the ranks agreed): the sums are the last step's
    asked = time.perf_counter()  # when the pass last asked the loader for a batch
    with progress, torch.set_grad_enabled(training):
        # Counted from the epoch's start, so a resumed pass shows "10/15", not "1/15" of a pass it never ends.
        try:
            for done, (batch, waited) in enumerate(timed_batches(loader, recover), start=loader.position[1] + 1):
                wait += waited
                if before_step is not None and before_step(False):
                    loader.load_state_dict({**loader.state_dict(), "epoch": batch.epoch, "step": batch.step})
                    stopped = between = True
                    break
                images, labels = batch
                with autocast:
                    logits = model(images)
                    loss = criterion(logits, labels)
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    if scheduler is not None:
                        scheduler.step()
                n = labels.shape[0]
                loss_sum += loss.detach().double() * n
                correct1 += (logits.argmax(dim=1) == labels).sum()
                correctk += (logits.topk(k, dim=1).indices == labels[:, None]).any(dim=1).sum()
                seen += n
                progress.update(done, lambda: loss_sum.item() / max(seen, 1))
                if after_step is not None and after_step(snapshot):
                    stopped = True
                    break
                asked = time.perf_counter()
        except StopRequested:  # raised by a wait, between two steps: the sums are the last step's
            stopped = between = True
            wait += time.perf_counter() - asked  # that wait too: a stalled daemon's time is no compute
            if before_step is not None:
                before_step(True)  # the other ranks stop before this step too, rather than wait in it for this one
        except (LoaderError, ProtocolError) as exc:  # the daemon lost, a damaged batch: also before the step
            wait += time.perf_counter() - asked
            if between_steps is not None:
                between_steps(snapshot, exc)
            raise
        if between and between_steps is not None:
            between_steps(snapshot, None)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return pass_stats(snapshot(), k, stopped)


def pass_stats(state: PassState, k: int, stopped: bool = False) -> PassStats:
    n = state.seen
    return PassStats(
        loss=state.loss_sum / n if n else math.nan,
        top1=state.correct1 / n if n else math.nan,
        topk=state.correctk / n if n else math.nan,
        k=k,
        images=n,
        seconds=state.seconds,
        wait_seconds=state.wait_seconds,
        stopped=stopped,
        state=state,
    )


__all__ = ["TOP_K", "PassState", "PassStats", "Recover", "pass_stats", "run_pass", "timed_batches"]
