"""Request intake: the checks every request passes and the Sequence it becomes.

``RequestFactory`` turns a prompt (token ids), SamplingParams and a MethodSpec into a validated
``Sequence``, or restarts a session's Sequence for its next turn. It checks what the engine can
check before anything runs: token ids in the vocabulary, the length against ``max_model_len``,
the method spec (through the controller) and whether the KV pool could ever hold the request.
"""

from __future__ import annotations

import itertools
from typing import Any, Hashable

import torch

from engine.cache.manager import CacheManager
from engine.controller import SparseController
from engine.method_spec import MethodSpec
from engine.sampling import SamplingParams
from engine.sequence import Sequence


class RequestError(ValueError):
    """A request cannot be served as given (too long, bad parameters, unknown id)."""


class CapacityError(RequestError):
    """The KV pool can never hold this request (it needs more pages than the pool has)."""


class RequestFactory:
    """Validated Sequences for one engine (its vocabulary, length limit, methods and pool)."""

    def __init__(
        self,
        *,
        vocab_size: int,
        max_model_len: int,
        prefill_chunk_size: int,
        seed: int,
        manager: CacheManager,
        controller: SparseController,
        tokenizer: Any,
    ):
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.prefill_chunk_size = prefill_chunk_size
        self.seed = seed
        self.manager = manager
        self.controller = controller
        self.tokenizer = tokenizer
        self._arrivals = itertools.count()
        self.matchers = None
        """Structured output: ``SamplingParams -> Matcher`` (set by the engine; engine/constrained.py)."""

    def new_sequence(
        self, seq_id: Hashable, token_ids: list[int], params: SamplingParams, spec: MethodSpec
    ) -> Sequence:
        """A validated Sequence (not yet queued)."""
        self.check_tokens(token_ids, 0, params, spec)
        matcher = self.matcher(params)
        seq = Sequence(seq_id, token_ids, params, spec, self.tokenizer, self.generator(params))
        seq.matcher = matcher
        return seq

    def restart_sequence(self, seq: Sequence, new_tokens: list[int], params: SamplingParams) -> None:
        """Start a session's next turn on its (persistent) Sequence."""
        self.check_tokens(new_tokens, seq.num_tokens, params, seq.spec)
        seq.matcher = self.matcher(params)
        seq.turn_start = seq.num_tokens
        seq.token_ids.extend(new_tokens)
        seq.prompt_len = seq.num_tokens
        seq.params = params
        seq.generator = self.generator(params)
        seq.reset_turn(self.tokenizer)

    def matcher(self, params: SamplingParams):
        """The turn's grammar matcher (structured output), or None (raises ConstraintError)."""
        if params.constraint is None or self.matchers is None:
            return None
        return self.matchers(params)

    def check_tokens(self, token_ids: list[int], before: int, params: SamplingParams, spec: MethodSpec) -> None:
        """``token_ids`` appended to ``before`` cached tokens: valid ids, within the length limit, a
        valid method spec, and a peak KV the pool can hold (raises RequestError / CapacityError /
        MethodError)."""
        if not token_ids:
            raise RequestError("the prompt is empty")
        vocab = self.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in token_ids):
            raise RequestError(f"token ids must be integers in [0, {vocab})")
        n = before + len(token_ids)
        if n >= self.max_model_len:
            raise RequestError(f"the prompt has {n} tokens; max_model_len is {self.max_model_len}")
        m = self.controller.method_for(spec)  # raises MethodError for a bad spec
        total = min(n + params.max_tokens, self.max_model_len)
        peak = min(total, m.kept_tokens(total) + self.prefill_chunk_size + 1)
        need = self.manager.pages_for_new(peak)
        if need > self.manager.pool.num_pages:
            raise CapacityError(f"this request needs up to {need} KV pages; the pool has {self.manager.pool.num_pages}")

    def generator(self, params: SamplingParams) -> torch.Generator | None:
        """The request's random generator (None for greedy): its seed, or the engine's seed plus
        the request's arrival number."""
        if params.greedy:
            return None
        seed = params.seed if params.seed is not None else self.seed + next(self._arrivals)
        return torch.Generator().manual_seed(seed)
