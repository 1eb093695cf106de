"""SamplingParams and the sampler: greedy, temperature, top-k, top-p, per-request seeds, and the
grammar masks of structured output (engine/constrained.py) applied to the logits before any of them.
The repetition penalties (presence, frequency, repetition; engine/penalties.py) are applied by the
step loop before the grammar masks.

Each sampling request owns a ``torch.Generator`` seeded from its ``seed`` (or the engine's seed
and the request's arrival order), so its tokens do not depend on which other requests share
the batch.

Every field is checked when the params are made (``SamplingError``): finite numbers in range,
bounded stop strings. A temperature below ``GREEDY_BELOW`` (1e-40, say) is greedy decoding: dividing
logits by it would overflow. The sampler works row by row and a row that fails (a non-finite
logits row, a bad distribution) is reported for that row alone (``sample`` returns its error), so one
request cannot stop the engine for the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.constrained import Constraint


class SamplingError(ValueError):
    """Sampling parameters out of range."""


GREEDY_BELOW = 1e-5
"""Temperatures in [0, GREEDY_BELOW) decode greedily."""
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 2**31 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
"""Longest stop string (characters): the detokenizer looks for every stop string after each token."""
MAX_STOP_TOKEN_IDS = 1024
MAX_OPENAI_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-MAX_OPENAI_PENALTY, MAX_OPENAI_PENALTY] (OpenAI's range)."""
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
"""repetition_penalty's range: it divides (or multiplies) logits, so 1e-300 would overflow them."""


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    """0 (or anything below GREEDY_BELOW) is greedy."""
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
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of every token the reply already contains (0 is off)."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted once per occurrence of the token in the reply so far (0 is off)."""
    repetition_penalty: float = 1.0
    """vLLM's / Hugging Face's: the logits of tokens in the prompt or the reply are divided by it
    when positive, multiplied when not (1 is off; engine/penalties.py)."""

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be a positive integer, not {self.max_tokens!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingError(
                f"temperature must be a finite number in [0, {MAX_TEMPERATURE:g}], not {self.temperature!r}"
            )
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise SamplingError(f"top_k must be an integer in [0, {MAX_TOP_K}], not {self.top_k!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingError(f"top_p must be a finite number in (0, 1], not {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise SamplingError(f"seed must be a 64-bit integer, not {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingError(f"{len(self.stop)} stop strings; at most {MAX_STOP_STRINGS}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingError("stop strings must be non-empty strings")
            if len(s) > MAX_STOP_CHARS:
                raise SamplingError(f"a stop string is {len(s)} characters long; at most {MAX_STOP_CHARS}")
        self.stop_token_ids = list(self.stop_token_ids)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS or any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise SamplingError(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -MAX_OPENAI_PENALTY <= v <= MAX_OPENAI_PENALTY:
                raise SamplingError(
                    f"{name} must be a finite number in [{-MAX_OPENAI_PENALTY:g}, {MAX_OPENAI_PENALTY:g}], not {v!r}"
                )
        rp = self.repetition_penalty
        if not _is_real(rp) or not MIN_REPETITION_PENALTY <= rp <= MAX_REPETITION_PENALTY:
            raise SamplingError(
                f"repetition_penalty must be a finite number in [{MIN_REPETITION_PENALTY:g}, "
                f"{MAX_REPETITION_PENALTY:g}] (1 is off), not {rp!r}"
            )
        self.presence_penalty = float(self.presence_penalty)
        self.frequency_penalty = float(self.frequency_penalty)
        self.repetition_penalty = float(rp)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise SamplingError("constraint must be an engine.constrained.Constraint")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class RowFailed(RuntimeError):
    """Sampling one row failed; only that row's request is affected."""


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    constrain: Callable[[torch.Tensor], None] | None = None,
) -> tuple[list[int | None], list[str | None]]:
    """One token per row of ``logits`` ``[M, V]`` (float32), and per row the error that stopped it
    (None when it sampled). A failed row's token is None. ``constrain`` first masks, in place, the
    rows of constrained sequences (their grammars' token bitmasks; ``GrammarBackend.apply_masks``)."""
    if constrain is not None:
        constrain(logits)
    out: list[int | None] = logits.argmax(-1).tolist()
    errors: list[str | None] = [None] * len(params)
    for i, p in enumerate(params):
        try:
            if p.greedy:
                continue
            out[i] = sample_row(logits[i], p, generators[i])
        except Exception as e:  # this row's failure is this request's, not the batch's
            out[i], errors[i] = None, f"sampling failed: {e}"
    return out, errors


def _check_row(row: torch.Tensor) -> None:
    if not bool(torch.isfinite(row).any()):
        raise RowFailed("the model produced no finite logit for this sequence")


def sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from one logits row ``[V]`` under ``p`` (not greedy)."""
    _check_row(row)
    row = row.float().nan_to_num(nan=float("-inf"), posinf=float("-inf"))
    row = (row - row.max()) / p.temperature  # <= 0 everywhere, the top token 0: no overflow
    if p.top_k and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # drop a token when the tokens before it already reach top_p
        drop = (sorted_p.cumsum(-1) - sorted_p) >= p.top_p
        drop[..., 0] = False  # the top token always stays (a top_p below float32's range compares as 0)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    if gen is not None and gen.device != probs.device:
        probs = probs.to(gen.device)
    return int(torch.multinomial(probs, 1, generator=gen))
