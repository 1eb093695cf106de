"""Shared prefixes and Prefix-Cache Pruning.

**Shared prefixes.** Many sessions start with the same system prompt and tool schema. The
``PrefixIndex`` maps chained SHA-256 hashes of full pages of tokens (salted by a fingerprint of
model, dtype, page size and method settings) to a *holder*: a read-only cache entry that owns
those pages. A new session whose first tokens match forks the holder's pages copy-on-write
(``CacheManager.fork(..., num_pages=k)``), so the prefix is stored once; its tokens are protected
from eviction in every session that shares them. The first session with a new prefix prefills it
and leaves a holder behind (no extra prefill). Sharing is partitioned by a *scope* (the sidecar
passes the tenant) salted into the hashes: a session only ever reuses a prefix of its own scope,
so how much it reuses (and how fast its first token comes) says nothing about other tenants'
prompts. The empty scope is the shared one (a prompt a caller published to every tenant).

**Prefix-Cache Pruning.** ``prune_span`` shrinks the physical KV of a span of the history (old
tool output, say) in every layer: ``drop`` removes it, ``keep_ratio`` keeps the span tokens that
recent queries attend most (ranked per layer across heads, ``global``, or per head). The logical
token history is untouched, so prefix matching and digests still work; only pages are freed.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.cache.manager import CacheManager
from engine.prune_rule import PruneRuleError


def block_hashes(tokens: list[int], page_size: int, salt: bytes) -> list[bytes]:
    """Chained SHA-256 of each full page of ``tokens``: hash_i covers every token up to page i."""
    out, prev = [], hashlib.sha256(salt).digest()
    for i in range(len(tokens) // page_size):
        block = np.asarray(tokens[i * page_size : (i + 1) * page_size], dtype="<u4").tobytes()
        prev = hashlib.sha256(prev + block).digest()
        out.append(prev)
    return out


def scope_salt(salt: bytes, scope: str) -> bytes:
    """The hash salt of one sharing scope (a tenant; "" for prefixes published to every caller)."""
    return salt if not scope else salt + b"\0scope\0" + scope.encode("utf-8", "surrogatepass")


@dataclass
class PrefixHolder:
    holder_id: tuple
    num_pages: int
    users: int = 0
    last_used: int = 0


class PrefixIndex:
    def __init__(self, manager: CacheManager, salt: bytes):
        self.manager = manager
        self.salt = salt
        self._by_hash: dict[bytes, tuple[PrefixHolder, int]] = {}  # block hash -> (holder, blocks it covers)
        self._holders: dict[tuple, PrefixHolder] = {}
        self._clock = 0

    def match(self, tokens: list[int], scope: str = "") -> tuple[PrefixHolder | None, int, list[bytes]]:
        """The holder sharing the most leading full pages with ``tokens`` within ``scope``:
        (holder, pages, hashes). Prefixes of different scopes never match each other."""
        hashes = block_hashes(tokens, self.manager.page_size, scope_salt(self.salt, scope))
        best, n = None, 0
        for i, h in enumerate(hashes):
            hit = self._by_hash.get(h)
            if hit is None:
                break
            best, n = hit[0], i + 1
        return best, n, hashes

    def attach(self, holder: PrefixHolder, seq_id, num_pages: int) -> None:
        """Give ``seq_id`` (no cache yet) the holder's first ``num_pages`` pages per head."""
        self.manager.fork(holder.holder_id, seq_id, num_pages=num_pages)
        self._clock += 1
        holder.users += 1
        holder.last_used = self._clock

    def detach(self, holder_id: tuple | None) -> None:
        holder = self._holders.get(holder_id) if holder_id is not None else None
        if holder is not None:
            holder.users = max(0, holder.users - 1)

    def register(self, seq_id, hashes: list[bytes]) -> PrefixHolder | None:
        """Make a holder from the first ``len(hashes)`` pages of ``seq_id`` (whose heads hold them)."""
        if not hashes or hashes[-1] in self._by_hash or self.manager.num_free_slots == 0:
            return None
        holder = PrefixHolder(("prefix", hashes[-1].hex()[:16]), len(hashes), users=1)
        self.manager.fork(seq_id, holder.holder_id, num_pages=len(hashes))
        self._holders[holder.holder_id] = holder
        for i, h in enumerate(hashes):
            if h not in self._by_hash or self._by_hash[h][1] < len(hashes):
                self._by_hash[h] = (holder, len(hashes))
        self._clock += 1
        holder.last_used = self._clock
        return holder

    def drop_idle(self) -> int:
        """Release the least recently used holder nobody uses; returns pages freed (0: none idle)."""
        idle = [h for h in self._holders.values() if h.users == 0]
        if not idle:
            return 0
        holder = min(idle, key=lambda h: h.last_used)
        del self._holders[holder.holder_id]
        self._by_hash = {k: v for k, v in self._by_hash.items() if v[0] is not holder}
        return self.manager.release(holder.holder_id)

    @property
    def num_holders(self) -> int:
        return len(self._holders)


# --- pruning --------------------------------------------------------------------------------------


@dataclass
class QueryWindow:
    """The last ``size`` queries of a sequence in every layer (they score keep_ratio pruning and the
    recall tier's recalls)."""

    size: int
    num_layers: int
    q: torch.Tensor | None = None  # [L, size, Hq, D]
    count: list[int] = field(default_factory=list)
    decode: bool = True
    """Record decode steps' queries too (False: prefill's only, so decode steps stay CUDA graphs)."""

    def push(self, layer: int, q: torch.Tensor) -> None:
        if self.q is None:
            self.q = torch.zeros(self.num_layers, self.size, *q.shape[1:], dtype=q.dtype, device=q.device)
            self.count = [0] * self.num_layers
        q = q[-self.size :]
        n = q.shape[0]
        c = self.count[layer]
        idx = (torch.arange(n, device=q.device) + c) % self.size
        self.q[layer, idx] = q
        self.count[layer] = c + n

    def get(self, layer: int) -> torch.Tensor | None:
        if self.q is None or self.count[layer] == 0:
            return None
        return self.q[layer, : min(self.count[layer], self.size)]


def prune_span(
    manager: CacheManager,
    seq_id,
    start: int,
    end: int,
    policy: str,
    keep_ratio: float,
    scope: str,
    queries: QueryWindow | None,
    protected: int,
) -> int:
    """Shrink the KV of logical positions [start, end) in every layer, in one compaction; returns
    the tokens removed (summed over layers and kv-heads)."""
    pos = manager.positions(seq_id)  # [L, H, T]
    in_span = (pos >= start) & (pos < end) & (pos >= protected)
    keep = (pos >= 0) & ~in_span
    if policy == "keep_ratio":
        if queries is None:
            raise PruneRuleError(
                "keep_ratio pruning ranks tokens by recent queries, which the engine records only "
                "when it runs with prune_policy keep_ratio"
            )
        for layer in range(manager.num_layers):
            q = queries.get(layer)
            if q is None:
                raise PruneRuleError("keep_ratio pruning needs recent queries; none were recorded for this session")
            k, _, _, lengths = manager.gather(seq_id, layer)
            T = k.shape[1]
            scores = _attention_scores(q, k, lengths)  # [H, T]
            keep[layer, :, :T] |= _top_in_span(scores, pos[layer, :, :T], in_span[layer, :, :T], keep_ratio, scope)
    return manager.compact_seq(seq_id, keep, protect=protected).tokens_removed


def _attention_scores(q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Mean softmax attention each physical token gets from the window's queries, ``[H, T]``."""
    w, Hq, D = q.shape
    H, T, _ = k.shape
    G = Hq // H
    s = torch.einsum("whgd,htd->hgwt", q.view(w, H, G, D).float(), k.float()) / math.sqrt(D)
    valid = torch.arange(T, device=k.device)[None, :] < lengths[:, None].to(k.device)
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1).mean(dim=(1, 2))


def _top_in_span(
    scores: torch.Tensor, pos: torch.Tensor, in_span: torch.Tensor, ratio: float, scope: str
) -> torch.Tensor:
    """``[H, T]`` bool: the span tokens to keep, the ``ratio`` best by score."""
    H, T = scores.shape
    out = torch.zeros_like(in_span)
    if scope == "per_head":
        s = scores.masked_fill(~in_span, float("-inf"))
        for h in range(H):
            k = math.ceil(ratio * int(in_span[h].sum()))
            if k:
                out[h, torch.topk(s[h], k).indices] = True
        return out & in_span
    # global: one ranking of span positions per layer, by the mean score over the heads holding each
    p = pos[in_span].long()
    base = int(p.min())
    total = torch.zeros(int(p.max()) - base + 1, device=scores.device).index_add_(0, p - base, scores[in_span].float())
    count = torch.zeros_like(total).index_add_(0, p - base, torch.ones_like(p, dtype=total.dtype))
    held = count > 0
    k = math.ceil(ratio * int(held.sum()))
    mean = torch.where(held, total / count.clamp(min=1), torch.tensor(float("-inf"), device=total.device))
    chosen = torch.zeros_like(held)
    chosen[torch.topk(mean, k).indices] = True
    rel = (pos.long() - base).clamp(0, chosen.numel() - 1)
    return in_span & chosen[rel]
