"""ColdStore: one sequence's evicted KV, kept recallable in host memory (the recall tier's storage).

A method's eviction frees device pages as always; with recall on (``<method>+recall``,
engine/recall.py) the tokens it drops land here instead of being destroyed.

Layout, per row (one layer and kv-head of the sequence), cold tokens in the order they arrived:

* host: ``k``, ``v`` ``[L, H, C, D]`` and positions ``pos`` ``[L, H, C]``; the format is ``plain``
  (the pool's dtype) or ``fp8`` (float8 e4m3 with one float32 scale per token and row: half the
  bytes of bf16);
* device: ``lo``, ``hi`` ``[L, H, NB, D]``, the element-wise min and max of the keys of each *block*
  of ``block`` consecutive cold tokens (Quest's page bounds), so a query scores every cold block
  without touching the host: ``q+ . hi + q- . lo`` bounds ``q . k`` for every key in the block.

Recall takes whole blocks. A taken block is marked dead (its bounds can never be chosen again) and
its host memory is reclaimed by ``compact`` once dead blocks pass half the capacity; appends go
after the last block, so only a row's last block can be partly filled.

Copies run off the engine thread's path (engine/cache/cold_copy.py). ``append`` updates the
bookkeeping (counts, blocks' turns, the device bounds) at once and queues the values' copy to the
host; once the copy has run, ``poll`` (each step) has the copier's writer thread put the values in
the host arrays, or the engine thread does when it reads them first (``flush``: ``fetch`` of a
block the copy writes, ``compact``, ``state``, a growth).
``fetch`` gathers the blocks into pinned memory and queues their copy to the device; the tokens
are decoded there once the compute stream waits for the copy (``ColdFetch.wait``). Without CUDA
every copy completes at once (the same path, synchronous).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cache.cold_copy import ColdCopier, DeviceCopy, nbytes
from engine.cache.cold_pending import PendingWrite, PendingWrites

COLD_FORMATS = ("plain", "fp8")
FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0


@dataclass
class ColdTokens:
    """Tokens taken out of the store, on the device: ``k``/``v`` ``[L, H, n, D]`` (model dtype) and
    ``pos`` ``[L, H, n]`` (-1 where a row has fewer than ``n``)."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor


@dataclass
class ColdFetch:
    """Blocks on their way to the device (``ColdStore.fetch``): ``wait`` gives their ColdTokens."""

    copy: DeviceCopy
    fp8: bool
    """The copy carries fp8 values and each token's scales (decoded on the device)."""
    dtype: torch.dtype
    nbytes: int
    """Bytes the copy moves from the host to the device."""

    def wait(self) -> ColdTokens:
        parts = self.copy.wait()
        k, v, pos = parts[:3]
        if self.fp8:
            k = (k.float() * parts[3][..., None]).to(self.dtype)
            v = (v.float() * parts[4][..., None]).to(self.dtype)
        return ColdTokens(k=k, v=v, pos=pos)


class ColdStore:
    @torch.inference_mode(False)  # its state is updated in and out of inference mode
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block: int,
        dtype: torch.dtype,
        device: torch.device,
        cold_format: str = "plain",
        copier: ColdCopier | None = None,
    ):
        if cold_format not in COLD_FORMATS:
            raise ValueError(f"cold_format must be one of {', '.join(COLD_FORMATS)}, not {cold_format!r}")
        if cold_format == "fp8" and FP8 is None:
            raise ValueError("cold_format fp8 needs a torch build with float8_e4m3fn")
        self.L, self.H, self.D, self.P = num_layers, num_kv_heads, head_dim, block
        self.dtype, self.device, self.format = dtype, device, cold_format
        self.copier = copier or ColdCopier.for_device(device)
        self.pending = PendingWrites(self.copier, self._write)
        """Copies to the host not yet written into the arrays."""
        self.capacity = 0
        self.count = torch.zeros(num_layers, num_kv_heads, dtype=torch.int64)
        """Token slots used per row (dead blocks and the padding after a dead last block included)."""
        self.dead = torch.zeros(num_layers, num_kv_heads, 0, dtype=torch.bool)
        self.epoch = torch.zeros(num_layers, num_kv_heads, 0, dtype=torch.int64)
        """The turn (``turn``'s value) in which each block got its first token."""
        self.turn = 0
        """Counts the sequence's finished turns (``next_turn``): blocks of the turn in progress can be
        left out of a recall (``block_scores(before=...)``)."""
        self.k = self.v = self.scale_k = self.scale_v = self.pos = None
        self.lo = self.hi = None
        self._grow(block)

    # --- storage ------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.capacity // self.P

    @property
    def nbytes(self) -> int:
        """Host bytes the store holds (its capacity, used or not)."""
        tensors = (self.k, self.v, self.pos, self.scale_k, self.scale_v)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def live_tokens(self) -> int:
        """Cold tokens that can still be recalled."""
        fill = self._fill()
        return int((fill * ~self.dead).sum())

    def live_slots(self) -> torch.Tensor:
        """``[L, H, C]`` bool: the token slots that hold a recallable token (used, in a live block)."""
        alive = ~self.dead.repeat_interleave(self.P, dim=-1)[..., : self.capacity]
        return alive & (torch.arange(self.capacity)[None, None, :] < self.count[..., None])

    def _fill(self) -> torch.Tensor:
        """Tokens in each block ``[L, H, NB]``."""
        start = torch.arange(self.num_blocks) * self.P
        return (self.count[..., None] - start).clamp(0, self.P)

    @staticmethod
    def _host(*shape, dtype) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype)  # pageable: pinning GBs that grow by doubling costs more

    @torch.inference_mode(False)
    def _grow(self, capacity: int) -> None:
        self.flush()  # pending slots are numbered by the capacity they were queued at
        capacity = -(-capacity // self.P) * self.P
        L, H, D, old = self.L, self.H, self.D, self.capacity
        kv_dtype = FP8 if self.format == "fp8" else self.dtype
        k, v = self._host(L, H, capacity, D, dtype=kv_dtype), self._host(L, H, capacity, D, dtype=kv_dtype)
        pos = self._host(L, H, capacity, dtype=torch.int32)
        nb = capacity // self.P
        lo = torch.full((L, H, nb, D), float("inf"), dtype=self.dtype, device=self.device)
        hi = torch.full((L, H, nb, D), float("-inf"), dtype=self.dtype, device=self.device)
        dead = torch.zeros(L, H, nb, dtype=torch.bool)
        epoch = torch.zeros(L, H, nb, dtype=torch.int64)
        if self.format == "fp8":
            sk, sv = (
                self._host(L, H, capacity, dtype=torch.float32),
                self._host(L, H, capacity, dtype=torch.float32),
            )
        if old:
            k[:, :, :old], v[:, :, :old], pos[:, :, :old] = self.k, self.v, self.pos
            ob = old // self.P
            lo[:, :, :ob], hi[:, :, :ob], dead[:, :, :ob] = self.lo, self.hi, self.dead
            epoch[:, :, :ob] = self.epoch
            if self.format == "fp8":
                sk[:, :, :old], sv[:, :, :old] = self.scale_k, self.scale_v
        self.k, self.v, self.pos, self.lo, self.hi, self.dead, self.epoch = k, v, pos, lo, hi, dead, epoch
        if self.format == "fp8":
            self.scale_k, self.scale_v = sk, sv
        self.capacity = capacity

    def growth_bytes(self, rows: torch.Tensor) -> int:
        """Host bytes ``append`` of tokens in ``rows`` (host ``[n]``, layer * H + head) would add."""
        need = int((self.count.reshape(-1) + torch.bincount(rows, minlength=self.L * self.H)).max())
        if need <= self.capacity:
            return 0
        return self.nbytes * (max(2 * self.capacity, need) - self.capacity) // max(1, self.capacity)

    # --- in ------------------------------------------------------------------------------------
    @torch.inference_mode(False)
    def append(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> int:
        """Add tokens: ``rows`` (host int64 ``[n]``, layer * H + head, ascending), ``k``/``v`` ``[n, D]``
        and ``pos`` ``[n]`` on the device, each row's tokens in arrival order. The values reach the
        host arrays when their copy has run (``poll``/``flush``). Returns the bytes copied to the host."""
        n = rows.numel()
        if n == 0:
            return 0
        R = self.L * self.H
        per = torch.bincount(rows, minlength=R)
        need = int((self.count.reshape(-1) + per).max())
        if need > self.capacity:
            self._grow(max(2 * self.capacity, need))
        start = torch.cumsum(per, 0) - per
        dest = self.count.reshape(-1)[rows] + torch.arange(n) - start[rows]
        layer, head = rows // self.H, rows % self.H
        opens = dest % self.P == 0  # a token that starts a block dates it
        self.epoch[layer[opens], head[opens], dest[opens] // self.P] = self.turn
        k_store, k_scale, k_seen = self._encode(k)
        v_store, v_scale, _ = self._encode(v)
        parts = [k_store, v_store, pos.to(torch.int32)]
        if k_scale is not None:
            parts += [k_scale, v_scale]
        block_ids = rows * self.num_blocks + dest // self.P
        copy = self.copier.to_host(parts)
        self.pending.add(copy, rows * self.capacity + dest, torch.unique(block_ids))
        block = block_ids.to(self.device)
        D = self.D
        self.lo.view(-1, D).scatter_reduce_(0, block[:, None].expand(-1, D), k_seen, "amin")
        self.hi.view(-1, D).scatter_reduce_(0, block[:, None].expand(-1, D), k_seen, "amax")
        self.count.view(-1).add_(per)
        self.poll()
        return nbytes(parts)

    # --- copies in flight ----------------------------------------------------------------------
    @property
    def staging_buffers(self) -> int:
        """Pinned buffers held by copies to the host not yet written (0 without CUDA)."""
        return self.pending.buffers

    def poll(self) -> None:
        """Have the copies to the host that have run written (never waits)."""
        self.pending.poll()

    def flush(self, blocks: torch.Tensor | None = None) -> None:
        """Wait for the copies to the host and write them into the arrays (only those into
        ``blocks``, host ``[n]`` row * num_blocks + block, if given)."""
        self.pending.flush(blocks)

    @torch.inference_mode(False)
    def _write(self, p: PendingWrite) -> None:
        k, v, pos, *scales = p.copy.wait()
        # one multi-threaded index_copy_ per buffer (flat (row, slot) indices), not a copy per row
        _raw(self.k).view(-1, self.D).index_copy_(0, p.flat, _raw(k))
        _raw(self.v).view(-1, self.D).index_copy_(0, p.flat, _raw(v))
        self.pos.view(-1).index_copy_(0, p.flat, pos)
        if scales:
            self.scale_k.view(-1).index_copy_(0, p.flat, scales[0])
            self.scale_v.view(-1).index_copy_(0, p.flat, scales[1])
        p.copy.discard()

    def discard(self) -> None:
        """The store is dropped: its copies in flight (and writes) are waited for and their buffers let go."""
        self.pending.discard()

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``x`` ``[n, D]`` (device) as the host stores it (values, fp8's scales or None), still on the
        device, and as it will read back (the bounds are taken of that, so they hold for a recall)."""
        if self.format == "plain":
            x = x.to(self.dtype)
            return x, None, x
        s = (x.float().abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
        xq = (x.float() / s[:, None]).to(FP8)
        return xq, s, (xq.float() * s[:, None]).to(self.dtype)

    def _decode(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        if self.format == "plain":
            return x
        return (x.float() * scale[..., None]).to(self.dtype)

    # --- scoring and out -----------------------------------------------------------------------
    @torch.inference_mode(False)
    def next_turn(self) -> None:
        """The sequence finished a turn: blocks started from now on belong to the next one."""
        self.turn += 1

    def block_scores(self, q: torch.Tensor, before: int | None = None) -> torch.Tensor:
        """Upper bounds of ``q . k`` over each block, ``[L, H, NB]`` float32 (-inf for dead or empty
        blocks, and for blocks of turn ``before`` or later), from queries ``q`` ``[L, H, n, D]`` (a
        row's query group and window flattened)."""
        qf = q.float()
        pos_part, neg_part = qf.clamp(min=0), qf.clamp(max=0)
        bound = pos_part @ self.hi.float().transpose(-1, -2) + neg_part @ self.lo.float().transpose(-1, -2)
        best = bound.amax(-2)  # [L, H, NB]
        live = (self._fill() > 0) & ~self.dead
        if before is not None:
            live &= self.epoch < before
        return best.masked_fill(~live.to(best.device), float("-inf"))

    def take(self, blocks: torch.Tensor) -> ColdTokens:
        """``fetch``, waited for."""
        return self.fetch(blocks).wait()

    @torch.inference_mode(False)
    def fetch(self, blocks: torch.Tensor) -> ColdFetch:
        """Remove blocks ``[L, H, K]`` (host int64 block indices, -1 = none; each live) and start
        copying their tokens to the device, ``K * block`` per row."""
        L, H, K = blocks.shape
        P = self.P
        ok = blocks >= 0
        b = blocks.clamp(min=0)
        li = torch.arange(L)[:, None, None]
        hi = torch.arange(H)[None, :, None]
        NB, D = self.num_blocks, self.D
        flat_blocks = ((li * H + hi) * NB + b).reshape(-1)
        self.flush(flat_blocks[ok.reshape(-1)])  # the copies that write these blocks land first
        fill = self._fill()
        valid = (ok[..., None] & (torch.arange(P) < fill.gather(2, b)[..., None])).reshape(L, H, K * P)

        def blocks_of(t: torch.Tensor | None, *tail: int) -> torch.Tensor | None:  # whole blocks, contiguous
            if t is None:
                return None
            raw = _raw(t).view(L * H * NB, P, *tail)
            out = self.copier.host_buffer((L * H * K, P, *tail), raw.dtype)
            torch.index_select(raw, 0, flat_blocks, out=out)
            return out.view(t.dtype).reshape(L, H, K * P, *tail)

        parts = [blocks_of(self.k, D), blocks_of(self.v, D), blocks_of(self.pos)]
        parts[2].masked_fill_(~valid, -1)
        if self.format == "fp8":
            parts += [blocks_of(self.scale_k), blocks_of(self.scale_v)]
        # mark the blocks dead; a dead last block is closed so later appends start a fresh one
        lr, hr, kr = ok.nonzero(as_tuple=True)
        self.dead[lr, hr, blocks[lr, hr, kr]] = True
        last = (self.count - 1).clamp(min=0) // P
        closed = (self.count > 0) & self.dead.gather(2, last[..., None]).squeeze(-1)
        self.count = torch.where(closed, -(-self.count // P) * P, self.count)
        if int(self.dead.sum()) * 2 > self.num_blocks * L * H:
            self.compact()
        return ColdFetch(self.copier.to_device(parts), self.format == "fp8", self.dtype, nbytes(parts))

    @torch.inference_mode(False)
    def compact(self) -> None:
        """Drop dead blocks: each row's live blocks move to its front, in order."""
        self.flush()
        L, H, NB, P = self.L, self.H, self.num_blocks, self.P
        fill = self._fill()
        live = (fill > 0) & ~self.dead
        b = torch.arange(NB)
        order = torch.argsort(torch.where(live, b, NB + b), dim=-1, stable=True)  # live blocks first
        tok = (order[..., None] * P + torch.arange(P)).reshape(L, H, NB * P)
        li, hi_ = torch.arange(L)[:, None, None], torch.arange(H)[None, :, None]
        self.k, self.v, self.pos = self.k[li, hi_, tok], self.v[li, hi_, tok], self.pos[li, hi_, tok]
        if self.scale_k is not None:
            self.scale_k, self.scale_v = self.scale_k[li, hi_, tok], self.scale_v[li, hi_, tok]
        self.epoch = self.epoch.gather(2, order)
        od = order.to(self.device)
        self.lo = self.lo.gather(2, od[..., None].expand(-1, -1, -1, self.D))
        self.hi = self.hi.gather(2, od[..., None].expand(-1, -1, -1, self.D))
        n_live = live.sum(-1)
        last_fill = torch.where(
            n_live > 0, fill.gather(2, order.gather(2, (n_live - 1).clamp(min=0)[..., None])).squeeze(-1), 0
        )
        self.count = torch.where(n_live > 0, (n_live - 1) * P + last_fill, 0)
        self.dead = torch.zeros_like(self.dead)
        empty = torch.arange(NB)[None, None, :] >= n_live[..., None]
        self.lo.masked_fill_(empty.to(self.device)[..., None], float("inf"))
        self.hi.masked_fill_(empty.to(self.device)[..., None], float("-inf"))

    # --- snapshot ------------------------------------------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        """Host tensors that rebuild the store (``from_state``): live tokens only."""
        self.compact()
        used = max(1, int(self.count.max()))
        nb = -(-used // self.P)
        out = {"count": self.count.clone(), "pos": self.pos[:, :, :used].clone()}
        out["epoch"], out["turn"] = self.epoch[:, :, :nb].clone(), torch.tensor([self.turn])
        out["k"], out["v"] = self.k[:, :, :used].clone(), self.v[:, :, :used].clone()
        if self.scale_k is not None:
            out["scale_k"], out["scale_v"] = self.scale_k[:, :, :used].clone(), self.scale_v[:, :, :used].clone()
        return out

    @torch.inference_mode(False)
    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Refill an empty store from ``state`` (bounds recomputed on the device)."""
        count = state["count"].long().cpu()
        if tuple(count.shape) != (self.L, self.H):
            raise ValueError(f"cold tier state is for {tuple(count.shape)} (layers, kv-heads), not {(self.L, self.H)}")
        k, v, pos = state["k"].cpu(), state["v"].cpu(), state["pos"].cpu()
        if k.shape[-1] != self.D or k.shape[:2] != (self.L, self.H) or int(count.max()) > k.shape[2]:
            raise ValueError("cold tier state does not match this model or its own counts")
        fp8 = self.format == "fp8"
        if fp8 != ("scale_k" in state):
            raise ValueError("cold tier state was saved in another cold_format")
        self._grow(max(self.P, k.shape[2]))
        used = k.shape[2]
        self.k[:, :, :used], self.v[:, :, :used], self.pos[:, :, :used] = k, v, pos
        if fp8:
            self.scale_k[:, :, :used], self.scale_v[:, :, :used] = state["scale_k"].cpu(), state["scale_v"].cpu()
        self.count = count.clone()
        if "epoch" in state:
            epoch = state["epoch"].long().cpu()
            self.epoch[:, :, : epoch.shape[2]] = epoch
            self.turn = int(state["turn"].reshape(-1)[0])
        keys = self._decode(self.k, self.scale_k).to(self.device, self.dtype)  # [L, H, C, D]
        valid = (torch.arange(self.capacity)[None, None, :] < count[..., None]).to(self.device)[..., None]
        shape = (self.L, self.H, self.num_blocks, self.P, self.D)
        self.lo = torch.where(valid, keys, float("inf")).reshape(shape).amin(3)
        self.hi = torch.where(valid, keys, float("-inf")).reshape(shape).amax(3)

    def clone(self) -> "ColdStore":
        other = ColdStore(self.L, self.H, self.D, self.P, self.dtype, self.device, self.format, self.copier)
        other.load(self.state())
        return other


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 buffers as bytes (CPU index_copy_ / index_select have no float8 kernels; the bytes move the same)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t
