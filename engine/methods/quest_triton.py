"""Quest's page scores as one Triton kernel: read each page's key bounds through the page table
and score them against the query group, without materialising the gathered bounds.

The torch form (``quest.page_scores`` over ``PageBounds.gather``) copies the bounds of every page
of every row into ``[B, H, NP, D]`` tensors twice (gather, then float32) before two batched
matrix products; at batch 26 and 32K tokens that copy alone was a fifth of a decode step. Here one
program per (row, kv-head, block of pages) loads the block's page ids, their ``lo``/``hi`` rows
and the head's query group, and writes ``max_g (q+ . hi + q- . lo)`` for each page: the bounds are
read once, straight from the store. Entries past a head's end hold a score of page 0's bounds
(``select_pages`` masks them by length), as in the torch form.
"""

from __future__ import annotations

import torch

try:  # Triton is there on GPU machines; the CPU build of torch runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def fused(q: torch.Tensor) -> bool:
    """The kernel serves ``q`` on a CUDA device whose head_dim is a power of two of at least 16 (its
    matrix products need K >= 16); anything else takes the torch form."""
    D = q.shape[-1]
    return triton is not None and q.is_cuda and D >= 16 and D & (D - 1) == 0


def page_scores_fused(
    q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, tables: torch.Tensor, block_pages: int = 64
) -> torch.Tensor:
    """Quest's bound for queries ``q`` ``[B, Hq, D]`` against the pages ``tables`` ``[B, H, NP]``
    (physical ids, -1 past a head's end) of the bounds store ``lo``, ``hi`` ``[num_pages + 1, D]``:
    ``[B, H, NP]`` float32, equal to ``page_scores(q, lo[tables], hi[tables])`` up to summation order."""
    B, Hq, D = q.shape
    H, NP = tables.shape[1], tables.shape[2]
    G = Hq // H
    out = torch.empty(B, H, NP, dtype=torch.float32, device=q.device)
    if B == 0 or NP == 0:
        return out
    q = q.contiguous()
    lo, hi = lo.contiguous(), hi.contiguous()
    _page_scores_kernel[(B * H, triton.cdiv(NP, block_pages))](
        q,
        q.stride(0),
        q.stride(1),
        lo,
        hi,
        tables,
        tables.stride(0),
        tables.stride(1),
        tables.stride(2),
        out,
        NP,
        H=H,
        G=G,
        GP=max(16, triton.next_power_of_2(G)),
        D=D,
        BLOCK_P=block_pages,
        PREC="ieee" if lo.dtype == torch.float32 else "tf32",
    )
    return out


if triton is not None:

    @triton.jit
    def _page_scores_kernel(
        Q,
        stride_qb,
        stride_qh,
        Lo,
        Hi,
        Tables,
        stride_tb,
        stride_th,
        stride_tp,
        Out,
        NP,
        H: tl.constexpr,
        G: tl.constexpr,
        GP: tl.constexpr,
        D: tl.constexpr,
        BLOCK_P: tl.constexpr,
        PREC: tl.constexpr,
    ):
        bh = tl.program_id(0)
        b = bh // H
        h = bh % H
        p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        pmask = p < NP
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gmask = g < G
        q = tl.load(Q + b * stride_qb + (h * G + g)[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
        ids = tl.load(Tables + b * stride_tb + h * stride_th + p * stride_tp, mask=pmask, other=0)
        ids = tl.maximum(ids, 0).to(tl.int64)
        lo = tl.load(Lo + ids[:, None] * D + d[None, :], mask=pmask[:, None], other=0.0)
        hi = tl.load(Hi + ids[:, None] * D + d[None, :], mask=pmask[:, None], other=0.0)
        # sum_d max(q_d hi_d, q_d lo_d) = q+ . hi + q- . lo: two small matrix products
        qp = tl.maximum(q, 0.0).to(lo.dtype)
        qn = tl.minimum(q, 0.0).to(lo.dtype)
        s = tl.dot(qp, tl.trans(hi), input_precision=PREC) + tl.dot(qn, tl.trans(lo), input_precision=PREC)
        s = tl.where(gmask[:, None], s, float("-inf"))
        tl.store(Out + bh * NP + p, tl.max(s, 0), mask=pmask)


__all__ = ["fused", "page_scores_fused"]
