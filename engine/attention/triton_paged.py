"""Triton kernels over head-granular pages: split-K paged decode, KV store, token moves.

Decode: one program per (sequence, kv-head, split). It loads the GQA group's queries once
(padded to 16 rows for the tensor cores), walks its share of the head's page list (or of a
per-head list of selected pages: Quest, offload) ``BLOCK_T`` tokens at a time with an online
softmax, and writes an unnormalised partial result; a second kernel merges the splits. Page
tables and lengths are read through a row index, so the same kernel serves a gathered
AttentionView and, inside a CUDA graph, the CacheManager's global tables (``tables[:, layer]``).
When asked it also writes the raw scores, from which probabilities follow with the merged
log-sum-exp (h2o, tova and decode-time snapkv need them).

Prefill of a chunk against the cache gathers each head's pages into contiguous K/V and runs torch
SDPA (flash or memory-efficient, never cuDNN: see _VARIABLE_SHAPE_BACKENDS) with a lower-right causal
mask when every head holds the same tokens, a position-causal mask otherwise;
attention probabilities of an observation window are computed beside it only when a method asks.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import triton
import triton.language as tl

from engine.attention.reference import ReferenceAttention, gather_view, overlay_chunk
from engine.cache.pages import PagePool
from engine.cache.view import AttentionView

# Prefill shapes change with every chunk (its length, the history's): cuDNN's SDPA builds a new graph
# for each new shape, milliseconds of host time per call (measured: 6.6 ms per layer and chunk on the
# H200 against 0.4 ms for flash), so prefill uses flash / memory-efficient attention only.
_VARIABLE_SHAPE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@triton.jit
def _decode_partial_kernel(
    Q,
    stride_qb,
    stride_qh,
    K,
    V,
    Tables,
    stride_tr,
    stride_th,
    Lengths,
    stride_lr,
    stride_lh,
    Rows,
    Sel,
    stride_sb,
    stride_sh,
    SelCount,
    Acc,
    Mx,
    Sm,
    Scores,
    stride_scb,
    stride_sch,
    scale,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    P: tl.constexpr,
    SPLITS,  # a runtime value: the split count follows the batch, and a new value must not compile a kernel
    BLOCK_T: tl.constexpr,
    HAS_SEL: tl.constexpr,
    WRITE_SCORES: tl.constexpr,
    PREC: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    row = tl.load(Rows + b).to(tl.int64)
    length = tl.load(Lengths + row * stride_lr + h * stride_lh)
    if HAS_SEL:
        n_list = tl.load(SelCount + b * H + h)
    else:
        n_list = tl.cdiv(length, P)
    n_tok = n_list * P
    per_split = tl.cdiv(tl.cdiv(n_tok, BLOCK_T), SPLITS) * BLOCK_T
    start = split * per_split
    end = tl.minimum(start + per_split, n_tok)

    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    gmask = g < G
    q = tl.load(Q + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    tbl = Tables + row * stride_tr + h * stride_th
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        in_list = t < end
        li = t // P
        if HAS_SEL:
            page_idx = tl.load(Sel + b * stride_sb + h * stride_sh + li, mask=in_list, other=0)
        else:
            page_idx = li
        page = tl.load(tbl + page_idx, mask=in_list, other=0).to(tl.int64)
        tok = page_idx * P + t % P
        valid = in_list & (tok < length)
        off = page[:, None] * (P * D) + (t % P)[:, None] * D + d[None, :]
        k = tl.load(K + off, mask=valid[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        qk = tl.where(valid[None, :], qk, float("-inf"))
        if WRITE_SCORES:
            sp = Scores + b * stride_scb + (h * G + g)[:, None] * stride_sch + tok[None, :]
            tl.store(sp, qk, mask=gmask[:, None] & valid[None, :])
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(qk - m_safe[:, None])
        v = tl.load(V + off, mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    hq = h * G + g
    base = (b * (H * G) + hq) * SPLITS + split
    tl.store(Acc + base[:, None] * D + d[None, :], acc, mask=gmask[:, None])
    tl.store(Mx + base, m_i, mask=gmask)
    tl.store(Sm + base, l_i, mask=gmask)


@triton.jit
def _decode_reduce_kernel(Acc, Mx, Sm, Out, Lse, SPLITS, SP: tl.constexpr, D: tl.constexpr):
    r = tl.program_id(0)  # b * Hq + hq
    s = tl.arange(0, SP)
    d = tl.arange(0, D)
    smask = s < SPLITS
    m = tl.load(Mx + r * SPLITS + s, mask=smask, other=float("-inf"))
    l = tl.load(Sm + r * SPLITS + s, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_safe)
    total = tl.sum(w * l, 0)
    acc = tl.load(Acc + (r * SPLITS + s)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    # a row with nothing to read (a CUDA graph's padding row, an empty selection) gives zeros, not
    # 0/0: its K/V in the next layer is written to the pool and must stay finite
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + r * D + d, out.to(Out.dtype.element_ty))
    tl.store(Lse + r, m_safe + tl.log(total))


@triton.jit
def _store_kv_kernel(
    Knew,
    Vnew,
    Slots,
    K,
    V,
    n_rows,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # r = token * H + head
    rmask = r < n_rows
    d = tl.arange(0, D)
    slot = tl.load(Slots + r, mask=rmask, other=0).to(tl.int64)
    n = (r // H).to(tl.int64)
    h = (r % H).to(tl.int64)
    dst = slot[:, None] * D + d[None, :]
    k = tl.load(Knew + n[:, None] * stride_kn + h[:, None] * stride_kh + d[None, :], mask=rmask[:, None])
    v = tl.load(Vnew + n[:, None] * stride_vn + h[:, None] * stride_vh + d[None, :], mask=rmask[:, None])
    tl.store(K + dst, k, mask=rmask[:, None])
    tl.store(V + dst, v, mask=rmask[:, None])


@triton.jit
def _gather_tokens_kernel(K, V, Pos, Src, Kout, Vout, Pout, n, D: tl.constexpr, BLOCK_R: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n
    d = tl.arange(0, D)
    src = tl.load(Src + r, mask=rmask, other=0).to(tl.int64)
    o = r.to(tl.int64)[:, None] * D + d[None, :]
    tl.store(Kout + o, tl.load(K + src[:, None] * D + d[None, :], mask=rmask[:, None]), mask=rmask[:, None])
    tl.store(Vout + o, tl.load(V + src[:, None] * D + d[None, :], mask=rmask[:, None]), mask=rmask[:, None])
    tl.store(Pout + r, tl.load(Pos + src, mask=rmask), mask=rmask)


@triton.jit
def _scatter_tokens_kernel(K, V, Pos, Dst, Kin, Vin, Pin, n, D: tl.constexpr, BLOCK_R: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n
    d = tl.arange(0, D)
    dst = tl.load(Dst + r, mask=rmask, other=0).to(tl.int64)
    i = r.to(tl.int64)[:, None] * D + d[None, :]
    tl.store(K + dst[:, None] * D + d[None, :], tl.load(Kin + i, mask=rmask[:, None]), mask=rmask[:, None])
    tl.store(V + dst[:, None] * D + d[None, :], tl.load(Vin + i, mask=rmask[:, None]), mask=rmask[:, None])
    tl.store(Pos + dst, tl.load(Pin + r, mask=rmask), mask=rmask)


def num_splits(batch_heads: int, max_tokens: int, num_sms: int, block_t: int) -> int:
    """Enough programs to keep every SM's memory pipes busy (about eight per SM), never more
    splits than blocks of tokens."""
    want = triton.cdiv(8 * num_sms, max(1, batch_heads))
    return int(max(1, min(want, triton.cdiv(max(max_tokens, 1), block_t), 256)))


def paged_decode(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    *,
    splits: int,
    selected: torch.Tensor | None = None,
    selected_count: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    workspace: tuple | None = None,
    block_t: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention for ``q`` ``[B, Hq, D]``; ``tables`` ``[R, H, *]`` and ``lengths`` ``[R, H]``
    are read at row ``rows[b]`` (any strides). Returns out ``[B, Hq, D]`` and lse ``[B, Hq]``; fills
    ``scores`` ``[B, Hq, T]`` (pre-filled with -inf) with raw logits when given."""
    B, Hq, D = q.shape
    H = tables.shape[1]
    G = Hq // H
    P = k_pool.shape[1]
    BT = block_t or max(P, 64)
    dev = q.device
    if workspace is None:
        acc = torch.empty(B, Hq, splits, D, dtype=torch.float32, device=dev)
        mx = torch.empty(B, Hq, splits, dtype=torch.float32, device=dev)
        sm = torch.empty(B, Hq, splits, dtype=torch.float32, device=dev)
    else:
        acc, mx, sm = workspace
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(B, Hq, dtype=torch.float32, device=dev)
    has_sel = selected is not None
    sel = selected if has_sel else rows
    sel_count = selected_count if has_sel else rows
    sc = scores if scores is not None else acc
    _decode_partial_kernel[(B * H, splits)](
        q,
        q.stride(0),
        q.stride(1),
        k_pool,
        v_pool,
        tables,
        tables.stride(0),
        tables.stride(1),
        lengths,
        lengths.stride(0),
        lengths.stride(1),
        rows,
        sel,
        sel.stride(0) if has_sel else 0,
        sel.stride(1) if has_sel else 0,
        sel_count,
        acc,
        mx,
        sm,
        sc,
        sc.stride(0) if scores is not None else 0,
        sc.stride(1) if scores is not None else 0,
        scale,
        H=H,
        G=G,
        GP=max(16, triton.next_power_of_2(G)),
        D=D,
        P=P,
        SPLITS=splits,
        BLOCK_T=BT,
        HAS_SEL=has_sel,
        WRITE_SCORES=scores is not None,
        PREC="ieee" if k_pool.dtype == torch.float32 else "tf32",  # float32 pools (parity tests) stay exact
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _decode_reduce_kernel[(B * Hq,)](
        acc, mx, sm, out, lse, SPLITS=splits, SP=max(2, triton.next_power_of_2(splits)), D=D
    )
    return out, lse


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write ``k``, ``v`` ``[N, H, D]`` (any token/head strides, e.g. views into the QKV output)
    at flat token slots ``[N, H]`` of the pools."""
    N, H, D = k.shape
    n = N * H
    if n == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and slots.is_contiguous()
    BLOCK_R = 16
    _store_kv_kernel[(triton.cdiv(n, BLOCK_R),)](
        k, v, slots, k_pool, v_pool, n, k.stride(0), k.stride(1), v.stride(0), v.stride(1), H=H, D=D, BLOCK_R=BLOCK_R
    )


class TritonPagedAttention:
    """The GPU backend: same interface as ReferenceAttention."""

    name = "triton"

    def __init__(self, device: torch.device | None = None):
        device = device or torch.device("cuda")
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8

    def store_kv(self, pool: PagePool, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if not pool.format.plain:  # quantized pages: the format quantizes (torch)
            pool.write_tokens(slots, k, v)
            return
        store_kv(pool.k, pool.v, slots.contiguous(), k.to(pool.dtype), v.to(pool.dtype))

    def decode(
        self, pool: PagePool, view: AttentionView, q: torch.Tensor, scale: float, want_probs: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, Hq, D = q.shape
        H, NP = view.tables.shape[1], view.tables.shape[2]
        P = pool.page_size
        rows = torch.arange(B, dtype=torch.int32, device=q.device)
        selected = count = None
        if view.token_mask is not None or not pool.format.plain:
            # token-level selections, and quantized pages (dequantize, then attend), go through
            # the reference path
            return ReferenceAttention().decode(pool, view, q, scale, want_probs)
        if view.selected_pages is not None:
            sp = view.selected_pages
            valid = (sp >= 0) & (sp < NP)
            count = valid.sum(-1).to(torch.int32)
            # compact valid entries to the front of each list
            order = torch.sort((~valid).to(torch.int8), dim=-1, stable=True).indices
            selected = torch.gather(torch.where(valid, sp, 0), -1, order).to(torch.int32).contiguous()
        splits = num_splits(B * H, NP * P, self.num_sms, max(P, 64))
        scores = None
        if want_probs:
            scores = torch.full((B, Hq, NP * P), float("-inf"), dtype=torch.float32, device=q.device)
        out, lse = paged_decode(
            q.contiguous(),
            pool.k,
            pool.v,
            view.tables,
            view.lengths,
            rows,
            scale,
            splits=splits,
            selected=selected,
            selected_count=count,
            scores=scores,
        )
        probs = None
        if want_probs:
            probs = torch.exp(scores - lse[..., None])
        return out, probs

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
        n, Hq, D = q.shape
        H, NP = view.tables.shape[1], view.tables.shape[2]
        G = Hq // H
        qh = q.permute(1, 0, 2).reshape(H, G, n, D)
        if uniform_length is not None and chunk_kv is None:
            # every head holds the same T tokens, the chunk's n last: query i reads keys 0..T-n+i, a
            # lower-right causal mask that flash attention applies itself (no mask tensor, no positions)
            T = uniform_length
            pages = view.tables[0, :, : triton.cdiv(T, pool.page_size)].long()
            k, v = pool.read_pages(pages)
            k, v = k.reshape(H, -1, D)[:, :T], v.reshape(H, -1, D)[:, :T]
            with sdpa_kernel(_VARIABLE_SHAPE_BACKENDS):
                out = F.scaled_dot_product_attention(
                    qh,
                    k[:, None].expand(H, G, T, D),
                    v[:, None].expand(H, G, T, D),
                    attn_mask=causal_lower_right(n, T),
                    scale=scale,
                )
            window_mask = None
            if probs_window > 0:
                w = min(probs_window, n)
                rows = torch.arange(T - w, T, device=q.device)[:, None]
                window_mask = torch.arange(T, device=q.device)[None, :] <= rows  # [w, T]
        else:
            T = NP * pool.page_size
            k, v, kpos, readable = (x[0] for x in gather_view(pool, view))  # [H, T, D], [H, T]; hidden slots zeroed
            if chunk_kv is not None:  # the chunk's own K/V in full precision (quantized formats)
                overlay_chunk(k, v, view.lengths[0], chunk_kv)
            mask = readable[:, None, :] & (kpos[:, None, :] <= q_pos[None, :, None])  # [H, n, T]
            with sdpa_kernel(_VARIABLE_SHAPE_BACKENDS):
                out = F.scaled_dot_product_attention(
                    qh,
                    k[:, None].expand(H, G, T, D),
                    v[:, None].expand(H, G, T, D),
                    attn_mask=mask[:, None],
                    scale=scale,
                )
            window_mask = mask[:, None, n - min(probs_window, n) :] if probs_window > 0 else None
        out = out.reshape(Hq, n, D).permute(1, 0, 2).contiguous()
        window = None
        if probs_window > 0:
            w = min(probs_window, n)
            s = torch.einsum("hgwd,htd->hgwt", qh[:, :, n - w :].float(), k.float()) * scale
            s = s.masked_fill(~window_mask, float("-inf"))
            window = torch.softmax(s, dim=-1).reshape(Hq, w, T)
        return out, window


def gather_tokens(pool: PagePool, src: torch.Tensor):
    n = src.numel()
    D = pool.head_dim
    kout = torch.empty(n, D, dtype=pool.dtype, device=pool.device)
    vout = torch.empty_like(kout)
    pout = torch.empty(n, dtype=torch.int32, device=pool.device)
    if n:
        _gather_tokens_kernel[(triton.cdiv(n, 32),)](
            pool.k, pool.v, pool.pos, src, kout, vout, pout, n, D=D, BLOCK_R=32
        )
    return kout, vout, pout


def scatter_tokens(pool: PagePool, dst: torch.Tensor, data) -> None:
    kin, vin, pin = data
    n = dst.numel()
    if n:
        _scatter_tokens_kernel[(triton.cdiv(n, 32),)](
            pool.k, pool.v, pool.pos, dst, kin, vin, pin, n, D=pool.head_dim, BLOCK_R=32
        )


__all__ = ["TritonPagedAttention", "paged_decode", "store_kv", "gather_tokens", "scatter_tokens", "num_splits"]
