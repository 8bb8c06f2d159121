"""Loader positions in checkpoints that rank 0 alone writes (Lightning, Accelerate's ``save_state``).

Each rank reads its own stream, so each has its own loader state (the stream's
identity names its rank); a checkpoint written by rank 0 must hold all of them.
``gather_states`` collects them when the checkpoint is taken (every rank takes
part, as both frameworks call ``state_dict`` on every rank), and ``own_state``
gives each rank its own back on resume::

    accelerator.register_for_checkpointing(EveryRank(train_loader))

With one process nothing is gathered and the state holds one position.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import torch.distributed as dist

from prefetchd.trainer.errors import StateMismatch
from prefetchd.trainer.ranks import Ranks

STATE_FORMAT = "prefetchd.rank_states"
STATE_VERSION = 1


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def gather_states(own: dict[str, Any]) -> dict[str, Any]:
    """Every rank's ``own`` state, in rank order (a collective: every rank must call it)."""
    states: list[Any] = [own]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        states = [None] * dist.get_world_size()
        dist.all_gather_object(states, own)
    return {"format": STATE_FORMAT, "version": STATE_VERSION, "ranks": states}


def a_mapping(state: object, what: str, writer: str) -> Mapping[str, Any]:
    """``state`` if it is a mapping; StateMismatch naming ``writer``, whose state_dict() makes one, if not (None,
    a list: they failed as TypeError or AttributeError from inside the check)."""
    if not isinstance(state, Mapping):
        raise StateMismatch(f"{what} {state!r:.60}: expected the dict {writer}.state_dict() returns")
    return state


def check_format(state: Mapping[str, Any], fmt: str, version: int, what: str, writer: str) -> None:
    """StateMismatch unless ``state`` says it is version ``version`` of ``fmt``: one of a later prefetchd is said
    so, not read as if it were this one's."""
    got, got_version = state.get("format"), state.get("version")
    if got == fmt and got_version == version and not isinstance(got_version, bool):  # True == 1
        return
    if got is None:  # a hand-made dict, or a part of one
        raise StateMismatch(f"{what} {dict(state)!r:.80} has no format: expected the dict {writer.split()[0]}"
                            ".state_dict() returns, saved whole")
    if got == fmt and isinstance(got_version, int) and not isinstance(got_version, bool) and got_version > version:
        raise StateMismatch(f"{what} is version {got_version} of {fmt!r}, which a later prefetchd wrote; this one "
                            f"reads version {version}: resume with the prefetchd that saved it, or a later one")
    raise StateMismatch(f"{what} has format {got!r} version {got_version!r}; this prefetchd reads {fmt!r} version "
                        f"{version}: it was not written by prefetchd's {writer}")


def own_state(state: object, ranks: Ranks) -> dict[str, Any]:
    """This rank's part of a :func:`gather_states` state."""
    what = "the checkpoint's loader state"
    state = a_mapping(state, what, "EveryRank")
    if "fingerprint" in state and "ranks" not in state:  # was "not written by prefetchd's EveryRank" (a user's walk)
        raise StateMismatch(
            "the checkpoint's loader state is one loader's position (BufferLoader.state_dict), not every rank's: "
            "load it with loader.load_state_dict, as register_for_checkpointing(loader) does where the run that "
            "saved it registered the loader itself")
    check_format(state, STATE_FORMAT, STATE_VERSION, what, "EveryRank or BufferDataModule")
    states = state.get("ranks")
    if not isinstance(states, list) or len(states) != ranks.world_size:
        count = len(states) if isinstance(states, list) else "no"
        raise StateMismatch(
            f"the checkpoint holds the loader positions of {count} ranks but this run has {ranks.world_size}; "
            "resume with as many processes as the checkpoint was taken with"
        )
    return dict(states[ranks.rank])


class EveryRank:
    """A loader whose ``state_dict`` holds every rank's position, for checkpoints rank 0 writes.

    ``ranks`` defaults to what torchrun's environment says (``accelerate launch`` sets it).
    """

    def __init__(self, loader: Stateful, ranks: Ranks | None = None) -> None:
        # Anything was taken, and failed only at the first checkpoint, inside Accelerate's save_state.
        if not all(callable(getattr(loader, name, None)) for name in ("state_dict", "load_state_dict")):
            raise TypeError(f"EveryRank({loader!r:.60}): pass the BufferLoader whose position to keep (anything "
                            "with state_dict and load_state_dict)")
        self.loader = loader
        self._ranks = ranks

    def state_dict(self) -> dict[str, Any]:
        """Every rank's loader position (a collective: every rank calls it, as Lightning and Accelerate do)."""
        return gather_states(self.loader.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put the loader at this rank's position of ``state`` (a :meth:`state_dict` of as many ranks)."""
        ranks = self._ranks if self._ranks is not None else Ranks.from_env()
        self.loader.load_state_dict(own_state(state, ranks))


__all__ = ["EveryRank", "a_mapping", "check_format", "gather_states", "own_state"]
