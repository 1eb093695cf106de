"""Plain torch attention over head-granular pages: the CPU backend and the test oracle.

It gathers each head's pages into a padded ``[B, H, T, D]`` tensor, computes softmax(q k^T / sqrt(d))
in float32 with GQA groups, and masks what the AttentionView does not let it read. For prefill,
a query attends a key when the key's recorded position is not after the query's (causal by
position, so it stays right after eviction has compacted a head). When asked, it returns the
attention probabilities that score-based sparse methods need.
"""

from __future__ import annotations

import torch

from engine.cache.pages import PagePool
from engine.cache.view import AttentionView


def overlay_chunk(k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, chunk_kv: tuple) -> None:
    """Write a prefill chunk's full-precision K/V ``[n, H, D]`` over the last ``n`` physical tokens
    of each head in gathered ``k``, ``v`` ``[H, T, D]`` (the chunk was appended last)."""
    kc, vc = chunk_kv
    n, H, D = kc.shape
    idx = (lengths.long()[:, None] - n + torch.arange(n, device=k.device)[None, :])[..., None].expand(H, n, D)
    k.scatter_(1, idx, kc.permute(1, 0, 2).to(k.dtype))
    v.scatter_(1, idx, vc.permute(1, 0, 2).to(v.dtype))


def gather_view(pool: PagePool, view: AttentionView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What ``view`` lets attention read, gathered: k, v ``[B, H, T, D]`` (model dtype), key positions
    and the readable mask ``[B, H, T]``. Slots the view does not let attention read are zeroed, not
    only masked: a probability of 0 times a non-finite value there (a slot past a head's end, a page
    the table does not name) is NaN, and SDPA adds its mask as a bias. Both backends gather with it."""
    B, H, NP = view.tables.shape
    pages = view.tables.long().clamp(min=0)
    T = NP * pool.page_size
    k, v = pool.read_pages(pages)  # dequantized for quantized page formats
    k = k.reshape(B, H, T, pool.head_dim)
    v = v.reshape(B, H, T, pool.head_dim)
    pos = pool.pos[pages].reshape(B, H, T)
    readable = view.readable()
    hidden = ~readable[..., None]
    return k.masked_fill(hidden, 0), v.masked_fill(hidden, 0), pos, readable


class ReferenceAttention:
    name = "reference"

    def store_kv(self, pool: PagePool, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V (``[N, H, D]``) at flat pool indices ``slots`` (``[N, H]``)."""
        pool.write_tokens(slots, k, v)

    def decode(
        self, pool: PagePool, view: AttentionView, q: torch.Tensor, scale: float, want_probs: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One query per sequence: q ``[B, Hq, D]`` -> out ``[B, Hq, D]``, probs ``[B, Hq, T]``."""
        B, Hq, D = q.shape
        H = view.tables.shape[1]
        G = Hq // H
        k, v, _, mask = gather_view(pool, view)
        scores = torch.einsum("bhgd,bhtd->bhgt", q.view(B, H, G, D).float(), k.float()) * scale
        scores = scores.masked_fill(~mask[:, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgt,bhtd->bhgd", probs, v.float()).reshape(B, Hq, D).to(q.dtype)
        return out, (probs.reshape(B, Hq, -1) if want_probs else None)

    def prefill(
        self,
        pool: PagePool,
        view: AttentionView,
        q: torch.Tensor,
        q_pos: torch.Tensor,
        scale: float,
        probs_window: int = 0,
        chunk_kv: tuple | None = None,
        uniform_length: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A chunk of one sequence (view of batch 1): q ``[n, Hq, D]`` at positions ``q_pos`` ``[n]``.
        ``chunk_kv``: the chunk's own K/V ``[n, H, D]`` in full precision, read instead of their
        stored (quantized) copies, as KIVI prefills. ``uniform_length``: every head holds this many
        tokens and the view hides none (a backend may then skip the per-head mask; this oracle
        always builds it).

        Returns out ``[n, Hq, D]`` and, if ``probs_window`` > 0, the probabilities of the chunk's
        last ``probs_window`` queries, ``[Hq, w, T]`` over the head's physical tokens.
        """
        n, Hq, D = q.shape
        H = view.tables.shape[1]
        G = Hq // H
        k, v, kpos, readable = gather_view(pool, view)
        k, v, kpos = k[0], v[0], kpos[0]  # [H, T, D], [H, T]
        if chunk_kv is not None:
            overlay_chunk(k, v, view.lengths[0], chunk_kv)
        mask = readable[0][:, None, :] & (kpos[:, None, :] <= q_pos.to(kpos.device)[None, :, None])  # [H, n, T]
        qh = q.view(n, H, G, D).permute(1, 2, 0, 3).float()  # [H, G, n, D]
        scores = torch.einsum("hgnd,htd->hgnt", qh, k.float()) * scale
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("hgnt,htd->hgnd", probs, v.float())  # [H, G, n, D]
        out = out.permute(2, 0, 1, 3).reshape(n, Hq, D).to(q.dtype)
        window = None
        if probs_window > 0:
            w = min(probs_window, n)
            window = probs[:, :, n - w :, :].reshape(Hq, w, -1)
        return out, window
