"""SamplingParams and the sampler: greedy, temperature, top-k, top-p, per-request seeds, and the
grammar masks of structured output (engine/constrained.py) applied to the logits before any of them.

Each sampling request owns a ``torch.Generator`` seeded from its ``seed`` (or the engine's seed
and the request's arrival order), so its tokens do not depend on which other requests share
the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.constrained import Constraint


class SamplingError(ValueError):
    """Sampling parameters out of range."""


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    """0 is greedy."""
    top_k: int = 0
    """0 keeps every token."""
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation ends when the text contains one (it is cut off there)."""
    ignore_eos: bool = False
    prompt_logits: bool = False
    """Keep the logits of every prompt position (teacher-forced scoring, parity tests)."""
    return_logits: bool = False
    """Keep the logits row each generated token was sampled from."""
    constraint: Constraint | None = None
    """Structured output: the reply must match this grammar (engine/constrained.py)."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be a positive integer, not {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, not {self.temperature}")
        if self.top_k < 0:
            raise SamplingError(f"top_k must be >= 0, not {self.top_k}")
        if not math.isfinite(self.top_p) or not (0 < self.top_p <= 1):
            raise SamplingError(f"top_p must be in (0, 1], not {self.top_p}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must not be empty")
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise SamplingError("constraint must be an engine.constrained.Constraint")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           constrain: Callable[[torch.Tensor], None] | None = None) -> list[int]:
    """One token per row of ``logits`` ``[M, V]`` (float32). ``constrain`` first masks, in place, the
    rows of constrained sequences (their grammars' token bitmasks; ``GrammarBackend.apply_masks``)."""
    if constrain is not None:
        constrain(logits)
    out = logits.argmax(-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            # drop a token when the tokens before it already reach top_p
            drop = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        gen = generators[i]
        if gen is not None and gen.device != probs.device:
            probs = probs.to(gen.device)
        out[i] = int(torch.multinomial(probs, 1, generator=gen))
    return out
