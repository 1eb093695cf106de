"""Sequence: one request's tokens, progress through the cache, sampling state and output."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Hashable

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.method_spec import MethodSpec
from engine.sampling import SamplingParams
from engine.turn_timing import TurnTiming


PENDING = -1
"""A token id whose value is still on the GPU (a decode step launched ahead; see LLMEngine.step)."""


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SeqCounters:
    prefilled_tokens: int = 0
    """Tokens this request pushed through prefill (recomputation after preemption included)."""
    reused_tokens: int = 0
    """Tokens whose KV was already cached when the request arrived (chain / prefix reuse)."""
    decoded_tokens: int = 0
    preemptions: int = 0


class Sequence:
    def __init__(
        self,
        seq_id: Hashable,
        token_ids: list[int],
        params: SamplingParams,
        spec: MethodSpec,
        tokenizer: Any,
        generator: torch.Generator | None,
        num_cached: int = 0,
    ):
        self.seq_id = seq_id
        self.token_ids = list(token_ids)
        """The whole logical history: everything fed so far plus everything sampled."""
        self.prompt_len = len(token_ids)
        self.num_cached = num_cached
        """Leading tokens of ``token_ids`` whose KV is in the cache."""
        self.params = params
        self.spec = spec
        self.generator = generator
        self.matcher = None
        """Structured output: this turn's grammar matcher (engine/constrained.py), or None."""
        self.status = SeqStatus.WAITING
        self.in_decode = False
        """The prompt is in and the last token was sampled: feed it through the decode path."""
        self.output_ids: list[int] = []
        self.detok = IncrementalDetokenizer(tokenizer, params.stop)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.counters = SeqCounters(reused_tokens=num_cached)
        self.turn_serial = 0
        """Bumped every turn, so a token launched for an earlier turn is recognised as stale."""
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.timing = TurnTiming(arrival=self.arrival_time)
        """Where this request's (turn's) time goes (engine/turn_timing.py)."""
        self.priority = 0
        """Admission order: higher first (a session's agent hint)."""
        self.bypassed = 0
        """Times later-queued sequences were admitted ahead of this one while it waited (``max_bypass``)."""
        self.pending_text = ""
        """Text produced since the last RequestOutput."""
        self.pending_ids: list[int] = []
        # sessions (engine/chain.py)
        self.turn_start = 0
        """History length when the current turn began (its first new token)."""
        self.source_tier = None
        self.protected_len = 0
        """Leading tokens shared with other sessions (a prefix holder): never evicted."""
        self.prefix_boundary = 0
        """While > num_cached: prefill chunks stop here, so a prefix holder can be made at it."""
        self.prompt_logits: list[torch.Tensor] = []  # per chunk, when params.prompt_logits
        self.step_logits: list[torch.Tensor] = []  # per sampled token, when params.return_logits
        self.penalty_state = None
        """engine/penalties.py: this turn's token counts, while its params use a penalty."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_to_feed(self) -> int:
        """Tokens not yet in the cache (for a decode step, the one just sampled)."""
        return len(self.token_ids) - self.num_cached

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def reset_turn(self, tokenizer: Any) -> None:
        """Per-turn state for a session's next turn (the history and cache stay)."""
        self.status = SeqStatus.WAITING
        self.in_decode = False
        self.turn_serial += 1
        self.output_ids = []
        self.detok = IncrementalDetokenizer(tokenizer, self.params.stop)
        self.finish_reason = None
        self.error = None
        self.counters = SeqCounters(reused_tokens=self.num_cached)
        self.arrival_time = time.monotonic()
        self.first_token_time = None
        self.timing = TurnTiming(arrival=self.arrival_time)
        self.bypassed = 0
        self.pending_text, self.pending_ids = "", []
        self.prompt_logits, self.step_logits = [], []

    def finish_idle(self) -> None:
        """A session's sequence between turns: nothing to run."""
        self.status = SeqStatus.FINISHED
        self.in_decode = False

    def reset_for_recompute(self) -> None:
        """Preempted: the cache is gone; everything is prefilled again on readmission."""
        self.num_cached = 0
        self.in_decode = False
        self.status = SeqStatus.WAITING
        self.counters.preemptions += 1


@dataclass
class RequestOutput:
    request_id: Hashable
    prompt_token_ids: list[int]
    """The prompt (for a session turn: the whole history before the reply); in the final output only
    (copying a long history into every streamed output would cost O(history) per token)."""
    token_ids: list[int]
    """Every token generated so far (while the request runs, the engine's live list: copy it to keep
    a snapshot; a finished request's list no longer changes)."""
    text: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    """``stop`` (EOS, a stop token or a stop string), ``length``, ``abort`` or ``error``."""
    error: str | None = None
    counters: SeqCounters = field(default_factory=SeqCounters)
    source_tier: str | None = None
    """Sessions: where the turn found its session (new, gpu, host, store, recompute)."""
    turn_start: int = 0
    """Sessions: history length before this turn."""
    time_to_first_token: float | None = None
    timing: TurnTiming | None = None
    """In the final output: where the request's time went (engine/turn_timing.py)."""
    prompt_logits: torch.Tensor | None = None
    """``[prompt_len, V]`` when SamplingParams.prompt_logits (set by LLMEngine.generate)."""
    step_logits: torch.Tensor | None = None
    """``[generated, V]`` when SamplingParams.return_logits (set by LLMEngine.generate)."""
