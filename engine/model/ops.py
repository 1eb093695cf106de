"""The decoder's elementwise ops: plain torch on the CPU, fused Triton kernels on a GPU.

A decode step of a 32-layer model launches over a thousand kernels if every RMSNorm, RoPE and
SwiGLU is a chain of small torch ops; at batch 1 their launch gaps cost as much as reading the
weights. On CUDA these three become one kernel each (the residual add folded into the norm).
The torch versions are the HF numerics (and the CPU path the parity tests check).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton is there on GPU machines; the CPU build of torch runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def _fused(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


# --- RMSNorm (with the residual add) -------------------------------------------------------------


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (or ``x``), then ``rms_norm(residual) * weight``: (normed, residual)."""
    if _fused(x) and x.shape[-1] <= 16384:
        return _add_rms_norm_triton(x, residual, weight, eps)
    if residual is not None:
        x = x + residual
    return rms_norm(x, weight, eps), x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalise in float32, cast back, scale."""
    if _fused(x) and x.shape[-1] <= 16384:
        return _add_rms_norm_triton(x, None, weight, eps)[0]
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


# --- RoPE -----------------------------------------------------------------------------------------


def rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q ``[N, Hq, D]`` and k ``[N, H, D]`` at ``positions`` (tables float32
    ``[max_len, D]``). On the GPU it rotates in place (q and k may be views into the QKV output)."""
    if _fused(q):
        _rope_triton(q, k, positions, cos, sin)
        return q, k
    c = cos[positions].to(q.dtype)[:, None, :]
    s = sin[positions].to(q.dtype)[:, None, :]
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# --- SwiGLU ---------------------------------------------------------------------------------------


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dim."""
    if _fused(gate_up):
        return _silu_mul_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- Triton kernels ------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(
        X, R, W, Out, Rout, stride_x, stride_r, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
            tl.store(Rout + row * n_cols + cols, x, mask=mask)
        h = x.to(tl.float32)
        var = tl.sum(h * h, 0) / n_cols
        h = (h * tl.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(W + cols, mask=mask, other=0.0)
        tl.store(Out + row * n_cols + cols, (w.to(tl.float32) * h.to(tl.float32)).to(x.dtype), mask=mask)

    @triton.jit
    def _rope_kernel(
        Q,
        K,
        Pos,
        Cos,
        Sin,
        stride_qn,
        stride_qh,
        stride_kn,
        stride_kh,
        HQ: tl.constexpr,
        HK: tl.constexpr,
        D: tl.constexpr,
        HB: tl.constexpr,
    ):
        n = tl.program_id(0).to(tl.int64)
        half = D // 2
        i = tl.arange(0, D // 2)
        pos = tl.load(Pos + n).to(tl.int64)
        c1 = tl.load(Cos + pos * D + i)
        s1 = tl.load(Sin + pos * D + i)
        c2 = tl.load(Cos + pos * D + half + i)
        s2 = tl.load(Sin + pos * D + half + i)
        h = tl.arange(0, HB)
        for which in tl.static_range(2):
            if which == 0:
                base = Q + n * stride_qn
                stride_h = stride_qh
                nh = HQ
            else:
                base = K + n * stride_kn
                stride_h = stride_kh
                nh = HK
            hm = (h < nh)[:, None]
            p1 = base + h[:, None] * stride_h + i[None, :]
            x1 = tl.load(p1, mask=hm, other=0.0)
            x2 = tl.load(p1 + half, mask=hm, other=0.0)
            a, b = x1.to(tl.float32), x2.to(tl.float32)
            tl.store(p1, (a * c1[None, :] - b * s1[None, :]).to(x1.dtype), mask=hm)
            tl.store(p1 + half, (b * c2[None, :] + a * s2[None, :]).to(x1.dtype), mask=hm)

    @triton.jit
    def _silu_mul_kernel(X, Out, n_cols, stride_x, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(X + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Out + row * n_cols + cols, (g / (1 + tl.exp(-g)) * u).to(Out.dtype.element_ty), mask=mask)


def _add_rms_norm_triton(x, residual, weight, eps):
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, n = x2.shape
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, n)
        rout = torch.empty_like(out)
    else:
        r2, rout = x2, out
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            rout,
            x2.stride(0),
            r2.stride(0),
            n,
            eps,
            HAS_RES=residual is not None,
            BLOCK=triton.next_power_of_2(n),
            num_warps=4 if n <= 4096 else 8,
        )
    return out.view(shape), (rout.view(shape) if residual is not None else x)


def _rope_triton(q, k, positions, cos, sin):
    N, HQ, D = q.shape
    HK = k.shape[1]
    if N == 0:
        return
    assert q.stride(-1) == 1 and k.stride(-1) == 1
    _rope_kernel[(N,)](
        q,
        k,
        positions,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        HQ=HQ,
        HK=HK,
        D=D,
        HB=triton.next_power_of_2(max(HQ, HK)),
    )


def _silu_mul_triton(x):
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows, n2 = x2.shape
    n = n2 // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    BLOCK = 1024
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, BLOCK))](x2, out, n, x2.stride(0), BLOCK=BLOCK)
    return out.view(*shape[:-1], n)
