"""Rank 0's engine front door and the other ranks' loop: every engine call runs on every rank.

:class:`TensorParallelEngine` wraps rank 0's LLMEngine and has its interface: each call that
changes the engine (a request, a turn, an abort, a step, a snapshot, ...) is first broadcast to
the other ranks, which run it on their own engines in :func:`follow`. All ranks hold the same
sequences, run the same scheduler (its plan checked every step, engine/distributed/capacity.py),
compute their shard of the same forward pass and sample the same tokens from the same gathered
logits; only rank 0's outputs leave the process. Reads (``session_info``, ``stats``, the tokenizer)
are answered by rank 0 alone.

After every call the ranks agree on its outcome: a call that fails on every rank (a bad request)
fails on rank 0 as usual and the followers carry on; a call that fails on some ranks only leaves
the ranks out of step, so every rank raises :class:`TensorParallelError` and the process group
goes down (the launcher then stops the server).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from engine.distributed import capacity, group, snapshots
from engine.distributed.group import TensorParallelError

log = logging.getLogger(__name__)

REPLICATED = (
    "add_request",
    "add_turn",
    "submit_turn",
    "abort",
    "end_session",
    "fork_session",
    "prune_history",
    "load_session",
    "snapshot_session",
    "add_prefilled_request",
    "step",
    "prefetch",
)
"""LLMEngine methods every rank runs (the rest only read rank 0's state)."""
_STOP = "__stop__"


def execute(engine, name: str, args: tuple, kwargs: dict, now: float | None = None) -> Any:
    """Run one replicated call on this rank's engine; collective calls collect here. ``now``: rank 0's
    clock when it sent the call, what every rank's pins (agent hints) expire by during it, so the
    ranks demote alike. Every rank
    learns whether the call was refused anywhere (a ValueError or KeyError, raised before any
    collective): refused on some ranks only is fatal. Any other error ends this rank's process."""
    result, error = None, None
    if now is not None:
        engine.chains.tiers.clock = lambda: now
    try:
        if name == "snapshot_session":
            result = engine.snapshot_session(*args, **kwargs)
        else:
            result = getattr(engine, name)(*args, **kwargs)
    except (ValueError, KeyError) as e:  # a bad request or session id: judged below, against the other ranks
        error = e
    failed = group.min_ints([0 if error is None else 1, 1 if error is None else 0])
    everywhere, nowhere = failed[0] == 1, failed[1] == 1
    if not everywhere and not nowhere:
        raise TensorParallelError(
            f"{name} failed on some ranks only (here: {error!r}); the ranks are out of step"
        ) from error
    if error is not None:
        raise error
    if name == "snapshot_session":
        parts = group.gather_objects(result)
        return snapshots.merge(parts) if group.rank() == 0 else None
    return result


class TensorParallelEngine:
    """Rank 0's LLMEngine, with every state-changing call replicated to the other ranks."""

    def __init__(self, engine):
        if group.rank() != 0:
            raise TensorParallelError("only rank 0 takes requests; the other ranks run follow()")
        self.engine = engine
        capacity.install(engine)
        self._stopped = False

    def _call(self, name: str, *args, **kwargs) -> Any:
        if self._stopped:
            raise TensorParallelError("the tensor-parallel group has been shut down")
        now = time.monotonic()
        group.broadcast_object((name, args, kwargs, now))
        return execute(self.engine, name, args, kwargs, now)

    def __getattr__(self, name: str) -> Any:
        if name in REPLICATED:
            return lambda *args, **kwargs: self._call(name, *args, **kwargs)
        return getattr(self.engine, name)

    def next_prefetch_in(self) -> float | None:
        """LLMEngine.next_prefetch_in on the wall clock: rank 0's pin clock holds the time of the last
        replicated call (``execute``), and this read is not one."""
        return self.engine.chains.tiers.next_prefetch_in(time.monotonic())

    def generate(self, prompts, params=None, method=None):
        """LLMEngine.generate, each of its calls replicated."""
        from engine.llm import LLMEngine

        return LLMEngine.generate(self, prompts, params, method)

    def shutdown(self) -> None:
        """Release the followers (their loops return)."""
        if not self._stopped:
            self._stopped = True
            group.broadcast_object((_STOP, (), {}, None))


def follow(engine) -> None:
    """A follower rank: run rank 0's calls until it shuts down. Errors that every rank saw (a bad
    request) are rank 0's to report; anything else ends this process."""
    capacity.install(engine)
    while True:
        name, args, kwargs, now = group.broadcast_object()
        if name == _STOP:
            return
        if name not in REPLICATED:
            raise TensorParallelError(f"rank 0 sent an unknown call {name!r}")
        try:
            execute(engine, name, args, kwargs, now)
        except TensorParallelError:
            raise
        except Exception as e:  # failed on every rank alike: rank 0 reports it to the client
            log.debug("rank %d: %s failed as on every rank: %s", group.rank(), name, e)
