"""The Lifecycle Contract: the hooks through which a sparse method controls its sequences' KV.

A method subclasses :class:`SparseMethod`. It owns its rule and its per-sequence state; it never
touches pages. Hooks return *decisions* (which physical tokens each kv-head keeps, which pages
attention may read) and the SparseController hands them to the CacheManager, which really frees
what is evicted. Hooks a method does not override cost nothing: the controller skips them. A method
is built from a :class:`~engine.method_spec.MethodSpec` (its name, budget and ``method_args``,
declared in engine/method_spec.py) and the :class:`ModelShape` it serves.

Hooks, in the order the engine calls them (docs/architecture.md):

=========================================  =====================================================
``on_admit(seq)``                          a sequence (or resumed session) enters the engine
``prefill_probs_window(chunk)``            how many of the chunk's last queries' attention
                                           probabilities ``after_prefill_chunk`` needs (0: none)
``prefill_view(layer, chunk)``             which cached KV a prefill chunk attends (None: all)
``after_prefill_chunk(layer, chunk)``      keep-indices per kv-head after a chunk's attention
``after_prefill_pass()``                   the forward pass is queued: keep decisions the method
                                           deferred from its chunks, every layer at once
``decode_view(layer, batch)``              pages / tokens each head reads this decode step
``graph_decode()`` / ``prepare_graph_decode``  optional: the decode selection can run inside the
``graph_decode_view(layer, ...)``           decode CUDA graph (device-only, static shapes; Quest)
``after_decode(layer, batch)``             keep-indices after a decode step (scores in batch)
``after_decode_step(seqs, lengths)``       keep-indices per layer decided from the heads' lengths
                                           alone, after the step (which may replay a CUDA graph)
``scoring_pass(seq, token_ids, tokenizer)``  a turn's input is in: ask for an extra forward pass
                                           over token ids whose attention the method reads
``observe_scoring(layer, chunk)``          a chunk of that pass, with all its queries' probabilities
``after_scoring(seq)``                     the pass is over (its KV is gone): keep-indices per layer
``on_turn_end(seq, spans)``                a turn finished: compress what it appended
``state_dict(seq)`` / ``load_state_dict``  snapshot / resume of the method's state
``fork_state(seq, child)``                 ForkSession: copy state to the child
``release(seq)``                           the sequence ends: drop state
=========================================  =====================================================

Attention scores: a method that reads attention probabilities says so, and the attention backend
computes them only then — ``prefill_probs_window(chunk) > 0`` asks for the probabilities of the
chunk's last queries (an observation window), ``needs_decode_probs`` for those of decode steps.
(The design calls this ``needs_scores``; these two are its spelling here.) Methods that score from
K/V alone (KeyDiff, Expected Attention) read the cache through :class:`KVReader` instead.

Scoring passes (KVzip's context reconstruction): once the last prefill chunk of a turn has run,
a method may return a :class:`ScoringPass` from ``scoring_pass``. The engine runs each of its
segments as extra prefill of the same sequence (positions continuing the history, attending the
whole cache and the segment itself, causally), hands every chunk of it to ``observe_scoring``
with the probabilities of all its queries, and removes the segment's KV again before the next
segment, so the pass leaves the cache and the pool as they were. Then ``after_scoring`` returns
the method's keep decisions, applied like any other.

CUDA graphs: a decode step whose methods need no hooks replays a captured graph. A method whose
``decode_view`` is pure device work with shapes fixed by the cache (no host reads) says so with
``graph_decode()``; when every row of a batch uses it, the graph is captured with its
``graph_decode_view`` in every layer (reading the cache's full-width page tables), and
``prepare_graph_decode`` runs the method's host-side checks before each replay.

Physical indices: within one (sequence, layer, kv-head), tokens sit in arrival order and eviction
keeps that order, so index ``i`` is the i-th oldest token the head still holds. Their original
positions are available from :class:`KVReader` for methods that need them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Hashable, Mapping, Protocol, Sequence

import torch

from engine.cache.compaction import Keep  # noqa: F401  (the keep decisions hooks return)
from engine.method_spec import MethodError, MethodSpec, build_params

SeqId = Hashable


@dataclass(frozen=True)
class ModelShape:
    """What a method may know about the model and the cache layout."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    rope_cos: torch.Tensor | None = field(default=None, compare=False, repr=False)
    """``[max_len, head_dim]`` float32 RoPE tables of the model (rotate-half convention), for
    methods that reason about positions (Expected Attention); None for models without them."""
    rope_sin: torch.Tensor | None = field(default=None, compare=False, repr=False)
    device: torch.device = field(default=torch.device("cpu"), compare=False)
    """Where the cache lives (decisions a method builds itself go there)."""

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class KVLayout:
    """How a method wants its KV pages stored: a page format of the cache layer
    (engine/cache/formats.py) and its parameters. ``plain`` is the model dtype, unquantized."""

    format: str = "plain"
    args: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self.args)
        return f"{self.format}({inner})" if inner else self.format


class KVReader(Protocol):
    """Read access to the cache for scoring (implemented by the CacheManager)."""

    def gather(self, seq_id: SeqId, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """k, v ``[H, T, D]``, positions ``[H, T]`` (-1 past each head's end), lengths ``[H]``."""

    def seq_lengths(self, seq_id: SeqId) -> torch.Tensor:
        """Physical tokens per (layer, kv-head), ``[L, H]`` (host)."""

    def page_table(self, seq_id: SeqId, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's page ids ``[H, num_pages]`` (device, -1 = none) and lengths ``[H]`` (device)."""

    def layout_versions(self, seq_ids: Sequence[SeqId], layer: int) -> list[int]:
        """Numbers that change whenever a (sequence, layer)'s pages are rewritten other than by
        appending: per-page state derived from the pool stays valid while they stay the same."""


@dataclass
class SeqInfo:
    seq_id: SeqId
    num_tokens: int
    """Logical tokens in the sequence so far (the whole history, prompt included)."""
    protected_len: int = 0
    """Leading tokens (a shared prefix) the controller never lets a method evict."""


@dataclass
class ChunkInfo:
    """A prefill chunk of one sequence, before its attention."""

    seq_id: SeqId
    layer: int
    start: int
    """Logical position of the chunk's first token."""
    length: int
    is_last: bool
    """The chunk ends the input of this turn (the next token will be sampled)."""

    @property
    def num_tokens(self) -> int:
        """Logical length of the sequence once the chunk is in."""
        return self.start + self.length


@dataclass
class PrefillChunk(ChunkInfo):
    """A prefill chunk after its attention: its q/k/v and, if asked for, attention probabilities."""

    q: torch.Tensor = None  # [n, Hq, D], after RoPE
    k: torch.Tensor = None  # [n, H, D], after RoPE
    v: torch.Tensor = None  # [n, H, D]
    probs: torch.Tensor | None = None
    """``[Hq, w, T]``: softmax of the chunk's last w queries over the head's physical tokens."""
    lengths: torch.Tensor = None
    """``[H]`` (host): physical tokens per kv-head, the chunk included."""
    cache: KVReader = None
    context_lengths: torch.Tensor | None = None
    """``[H]`` (host), scoring-pass chunks only: physical tokens per kv-head before the pass (the
    cached history the pass scores; the pass's own tokens follow them)."""
    protected: int = 0
    """Leading tokens every head keeps whatever the method decides (a prefix whose pages other
    sequences share). A method that keeps its best ``budget`` tokens spends the budget on the
    others (ranks these last), so every head ends with the same count: heads of one length attend
    and score in one batch."""


@dataclass
class ScoringPass:
    """An extra forward pass a method asks for at the end of a turn's prefill (see the module
    docstring). Each segment runs on its own after the cached history and is removed afterwards."""

    segments: list[list[int]]


@dataclass
class DecodeBatch:
    """One decode step of one layer for the sequences of one method (row ``i`` is ``seq_ids[i]``)."""

    layer: int
    seq_ids: list[SeqId]
    num_tokens: list[int]
    """Logical length of each sequence, the token being decoded included."""
    q: torch.Tensor  # [B, Hq, D]
    lengths: torch.Tensor
    """``[B, H]`` (host): physical tokens per kv-head, the new token included."""
    cache: KVReader
    probs: torch.Tensor | None = None
    """``[B, Hq, T]`` attention probabilities of this step (when ``needs_decode_probs_at(layer)``)."""
    k: torch.Tensor | None = None
    """``[B, H, D]`` the step's new keys (after RoPE), already in the cache at index ``lengths - 1``."""
    tables: torch.Tensor | None = None
    """``[B, H, NP]`` (device, int32) each head's page ids (-1 past its end), as attention reads them."""
    device_lengths: torch.Tensor | None = None
    """``[B, H]`` (device, int32): ``lengths`` without a host-to-device copy."""


@dataclass
class Selection:
    """What attention may read this step, for the rows of a DecodeBatch (or one prefill chunk)."""

    selected_pages: torch.Tensor | None = None
    """``[B, H, K]`` indices into each head's page list (-1 = unused)."""
    token_mask: torch.Tensor | None = None
    """``[B, H, T]`` bool over physical tokens."""
    to_host: torch.Tensor | None = None
    """``[B, H, M]`` indices into each head's page list to move to the host tier before attention
    (-1 = none). Offload methods set it; pages in ``selected_pages`` that sit on the host are
    fetched back to the device before attention reads them."""


@dataclass
class KeepMask:
    """Keep decisions of several sequences in every layer at once: ``mask`` ``[B, L, H, T]`` bool
    over each head's physical tokens (``T`` at least the longest head; past a head's end ignored)."""

    seq_ids: list[SeqId]
    mask: torch.Tensor


@dataclass
class Span:
    """A span of the logical history, tagged by role (for on_turn_end and pruning)."""

    start: int
    end: int
    role: str


class SparseMethod:
    """Base class: a pass-through method. Subclasses override the hooks they need."""

    name: ClassVar[str] = ""
    Params: ClassVar[type] = None  # a dataclass of the method's own parameters
    needs_budget: ClassVar[bool] = False
    holds_budget: ClassVar[bool] = False
    """The method's cache holds about its budget per head once compressed (eviction methods);
    False: a budget, if any, limits what attention reads, not what is held (selection methods)."""
    needs_decode_probs: ClassVar[bool] = False
    """The backend returns decode attention probabilities only for methods that set this."""

    def __init__(self, spec: MethodSpec, shape: ModelShape):
        self.spec = spec
        self.shape = shape
        self.params = build_params(type(self), spec.method_args)
        if self.needs_budget and spec.budget is None and spec.budget_ratio is None:
            raise MethodError(f"method {self.name!r} needs budget (tokens per head) or budget_ratio")

    def needs_decode_probs_at(self, layer: int) -> bool:
        """Decode probabilities for one layer only (a method that scores a few layers overrides it)."""
        return self.needs_decode_probs

    # --- budget -------------------------------------------------------------------------------
    def budget_for(self, num_tokens: int) -> int | None:
        """Tokens to keep per (layer, kv-head) for a context of ``num_tokens`` (None: no limit)."""
        if self.spec.budget is not None:
            return self.spec.budget
        if self.spec.budget_ratio is not None:
            return max(1, math.ceil(self.spec.budget_ratio * num_tokens))
        return None

    def device_budget(self, num_tokens: int) -> int | None:
        """Tokens per head the device may hold for a context of ``num_tokens`` (None: no limit): the
        budget of a method that ``holds_budget`` (a recall variant's includes its recall reserve)."""
        return self.budget_for(num_tokens) if self.holds_budget else None

    def kept_tokens(self, num_tokens: int) -> int:
        """Tokens per head this method holds, at most, once a context of ``num_tokens`` is compressed:
        the device budget plus ``kept_slack()`` for a method that ``holds_budget``, else every token.
        (Per-layer or per-head budgets, pyramidkv and adakv, average to the budget.)"""
        budget = self.device_budget(num_tokens)
        return num_tokens if budget is None else min(num_tokens, budget + self.kept_slack())

    def kept_slack(self) -> int:
        """Tokens past its budget a head may grow to between two compressions (0: none)."""
        return 0

    def recall_settings(self) -> Any:
        """The recall tier's settings (``RecallParams``) of a ``<method>+recall`` variant, else None:
        what this method evicts is then kept recallable in host memory (engine/recall.py)."""
        return None

    def kv_layout(self) -> KVLayout:
        """The page format this method's KV is stored in. The engine builds its page pool in the
        layout of its configured method; a session whose method wants another layout is refused."""
        return KVLayout()

    # --- lifecycle hooks (all optional) --------------------------------------------------------
    def on_admit(self, seq: SeqInfo) -> None:
        pass

    def prefill_probs_window(self, chunk: ChunkInfo) -> int:
        return 0

    def prefill_view(self, layer: int, chunk: ChunkInfo) -> Selection | None:
        return None

    def after_prefill_chunk(self, layer: int, chunk: PrefillChunk) -> Keep | None:
        return None

    def after_prefill_pass(self) -> KeepMask | None:
        """Once a forward pass is queued: the keep decisions of the prefill chunks this method
        recorded in ``after_prefill_chunk`` instead of deciding there (scoring every layer of a
        prompt in one batch of kernels rather than one per layer). Also called, its answer
        dropped, when the pass fails: forget what was recorded."""
        return None

    def decode_view(self, layer: int, batch: DecodeBatch) -> Selection | None:
        return None

    def after_decode(self, layer: int, batch: DecodeBatch) -> Mapping[SeqId, Keep] | None:
        return None

    def after_decode_step(self, seqs: Sequence[SeqInfo], lengths: torch.Tensor) -> KeepMask | None:
        """After every decode step, graph replays included: keep decisions that need nothing but the
        heads' lengths (``lengths`` ``[B, L, H]``, host, the step's token included), for any of the
        rows in every layer. Overriding this instead of ``after_decode`` keeps the step itself a
        CUDA graph; the controller carries out the decisions in one compaction."""
        return None

    def decode_hooks_due(self, seq_ids: Sequence[SeqId], lengths: torch.Tensor) -> bool:
        """Must this decode step call ``decode_view`` / ``after_decode``? ``lengths`` ``[B, L, H]``
        (host) are the physical tokens per head once the step's token is in. A method that acts on
        decode only now and then answers False in between, so the step can run as a CUDA graph."""
        return True

    # --- decode selection inside a CUDA graph (optional) ---------------------------------------
    def graph_decode(self) -> bool:
        """Can this instance's ``decode_view`` run inside a CUDA graph? Then it implements
        ``prepare_graph_decode`` (host work before each replay) and ``graph_decode_view`` (pure
        device work with shapes fixed by its arguments: no host reads), and overrides no other
        decode hook. Default: no."""
        return False

    def prepare_graph_decode(self, cache: Any, seq_ids: Sequence[SeqId]) -> None:
        """Host-side work before a graph replay of a decode step over ``seq_ids``."""

    def graph_decode_view(
        self, layer: int, cache: Any, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor | None:
        """Inside the graph: page lists ``[B, H, K]`` (-1 after the valid entries, which come first)
        that each head reads this step, from ``q`` ``[B, Hq, D]``, the batch's page tables ``[B, H, NP]``
        (``NP`` = the cache's widest table) and lengths ``[B, H]`` (device, the step's token
        included); None: the layer reads every page."""
        return None

    def scoring_pass(self, seq: SeqInfo, token_ids: Sequence[int], tokenizer: Any) -> ScoringPass | None:
        """The turn's input is in the cache (``token_ids``: the whole logical history, ``tokenizer``
        the engine's or None): an extra pass to run over the cache, or None for none."""
        return None

    def observe_scoring(self, layer: int, chunk: PrefillChunk) -> None:
        """A chunk of the scoring pass after its attention; ``chunk.probs`` ``[Hq, n, T]`` holds
        every query of the chunk, ``chunk.context_lengths`` the history's physical tokens per head."""

    def after_scoring(self, seq: SeqInfo) -> Mapping[int, Keep] | None:
        """The scoring pass is over and its KV removed: keep decisions per layer (None: nothing)."""
        return None

    def on_turn_end(self, seq: SeqInfo, spans: Sequence[Span]) -> Mapping[int, Keep] | None:
        """Keep decisions per layer for one sequence at the end of a turn (None: nothing)."""
        return None

    def state_dict(self, seq_id: SeqId) -> dict[str, Any]:
        return {}

    def load_state_dict(self, seq_id: SeqId, state: Mapping[str, Any]) -> None:
        pass

    def fork_state(self, seq_id: SeqId, child_id: SeqId) -> None:
        pass

    def release(self, seq_id: SeqId) -> None:
        pass
