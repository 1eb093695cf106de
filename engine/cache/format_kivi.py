"""The ``kivi`` page format: KIVI 2/4-bit keys per channel and values per token, with a full-precision window.

Keys are quantized per channel over the tokens of one page (the page is the key quantization
group), values per token in groups of ``value_group`` channels, both asymmetric (scale and zero
point in float16) with ``bits`` = 2 or 4, codes packed ``8 // bits`` to a byte.

KIVI's residual: a page stays in a full-precision staging page (model dtype) while it is partly
filled (*open*) or any of its tokens is among the head's ``residual_length`` most recent ones; it
is quantized ("sealed") once it is full and has left that window. The CacheManager says when a
page leaves the window (``expire``, on append and restore); a full page that already left it is
sealed as its last token is written. So at least the last ``residual_length`` tokens of every head
(and at most ``residual_length + page_size - 1``) are attended in full precision; with
``residual_length = 0`` only the open page is. A page that left the window does not come back to
it: after a truncation (an aborted turn) it is quantized again as soon as it is refilled, and a
page shared by a fork is sealed when the first sharer leaves it behind (sealing is deterministic,
so only the timing changes). Staging pages are a fixed set sized by the engine:
``staging_per_head`` (1 + ceil(residual_length / page_size)) per cached (sequence, layer, kv-head).
Used by the ``kivi`` method (engine/methods/kivi.py).
"""

from __future__ import annotations

import torch

from engine.cache.errors import OutOfPages
from engine.cache.format_base import FormatError, KVFormat


class KIVIFormat(KVFormat):
    """KIVI pages: per-channel keys and per-token values in ``bits`` bits; open pages and the pages
    of the recent full-precision window in staging."""

    name = "kivi"

    def __init__(self, page_size, head_dim, dtype, bits: int = 2, value_group: int = 32, residual_length: int = 128):
        super().__init__(page_size, head_dim, dtype)
        if bits not in (2, 4):
            raise FormatError(f"kivi supports 2 or 4 bits, not {bits}")
        if value_group < 1 or head_dim % value_group:
            raise FormatError(f"kivi value_group ({value_group}) must divide head_dim ({head_dim})")
        if page_size < 2:
            raise FormatError("kivi quantizes keys over the tokens of a page: page_size must be at least 2")
        if residual_length < 0:
            raise FormatError(f"kivi residual_length must be >= 0, not {residual_length}")
        self.args = {"bits": bits, "value_group": value_group, "residual_length": residual_length}
        self.bits = bits
        self.per_byte = 8 // bits
        self.levels = 2**bits - 1
        self.value_group = value_group
        self.residual_length = residual_length
        self.staging_per_head = 1 + -(-residual_length // page_size)
        self._shifts = None

    def allocate(self, num_pages, device, max_open_pages=0):
        P, D, dev = self.page_size, self.head_dim, device
        W = D // self.per_byte
        self.kq = torch.zeros(num_pages, P, W, dtype=torch.uint8, device=dev)
        self.vq = torch.zeros(num_pages, P, W, dtype=torch.uint8, device=dev)
        self.kstat = torch.zeros(num_pages, 2, D, dtype=torch.float16, device=dev)  # scale, zero per channel
        self.vstat = torch.zeros(num_pages, P, 2, D // self.value_group, dtype=torch.float16, device=dev)
        n_open = max(1, max_open_pages)
        self.staging = torch.empty(n_open, 2, P, D, dtype=self.dtype, device=dev)  # [., K|V, P, D]; written before read
        self.stage_of = torch.full((num_pages,), -1, dtype=torch.int64)  # host: page -> staging page
        self.stage_of_dev = self.stage_of.to(dev)
        self.expired = torch.zeros(num_pages, dtype=torch.bool)  # host: the page left its head's window
        self._free_stage = list(range(n_open - 1, -1, -1))
        self._shifts = (torch.arange(self.per_byte, device=dev) * self.bits).to(torch.uint8)
        self.device = torch.device(dev)

    @property
    def bytes_per_page(self) -> int:
        P, D = self.page_size, self.head_dim
        codes = 2 * P * (D // self.per_byte)
        return codes + 2 * D * 2 + P * 2 * (D // self.value_group) * 2

    @property
    def open_page_bytes(self) -> int:
        return 2 * self.page_size * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def _tensors(self):
        return [self.kq, self.vq, self.kstat, self.vstat, self.staging, self.stage_of_dev]

    def num_open(self, pages):
        pages = pages.reshape(-1).long().cpu()
        return int((self.stage_of[pages] >= 0).sum()) if pages.numel() else 0

    @property
    def num_staging_free(self) -> int:
        return len(self._free_stage)

    # --- quantization ----------------------------------------------------------------------------
    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        c = codes.reshape(*codes.shape[:-1], -1, self.per_byte)
        return _or_reduce(c << self._shifts)

    def _unpack(self, packed: torch.Tensor) -> torch.Tensor:
        c = (packed[..., None] >> self._shifts) & self.levels
        return c.reshape(*packed.shape[:-1], -1)

    def _quant(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Asymmetric quantization of ``x`` with min/max taken along ``dim``: codes, scale, zero
        (scale and zero rounded to float16 first, so the codes match what is stored)."""
        lo = x.amin(dim, keepdim=True)
        hi = x.amax(dim, keepdim=True)
        scale = ((hi - lo) / self.levels).clamp(min=1e-5).half()
        zero = lo.half()
        codes = torch.round((x - zero.float()) / scale.float()).clamp(0, self.levels).to(torch.uint8)
        return codes, scale, zero

    def _seal(self, pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize full pages: ``k``, ``v`` ``[n, P, D]`` (float32) into ``pages`` (device)."""
        n, P, D = k.shape
        codes, scale, zero = self._quant(k, dim=1)  # per channel, over the page's tokens
        self.kq[pages] = self._pack(codes)
        self.kstat[pages] = torch.cat([scale, zero], dim=1)
        g = self.value_group
        vg = v.reshape(n, P, D // g, g)
        codes, scale, zero = self._quant(vg, dim=-1)  # per token, per group of channels
        self.vq[pages] = self._pack(codes.reshape(n, P, D))
        self.vstat[pages] = torch.stack([scale[..., 0], zero[..., 0]], dim=2)

    def read_pages(self, pages):
        shape = pages.shape
        flat = pages.reshape(-1)
        P, D, g = self.page_size, self.head_dim, self.value_group
        n = flat.numel()
        kstat = self.kstat[flat].float()
        k = self._unpack(self.kq[flat]).float() * kstat[:, None, 0] + kstat[:, None, 1]
        vstat = self.vstat[flat].float()  # [n, P, 2, D/g]
        v = (
            self._unpack(self.vq[flat]).float().reshape(n, P, D // g, g) * vstat[:, :, 0, :, None]
            + vstat[:, :, 1, :, None]
        ).reshape(n, P, D)
        so = self.stage_of_dev[flat]
        opened = (so >= 0)[:, None, None]
        st = self.staging[so.clamp(min=0)]
        k = torch.where(opened, st[:, 0].float(), k).to(self.dtype)
        v = torch.where(opened, st[:, 1].float(), v).to(self.dtype)
        return k.reshape(*shape, P, D), v.reshape(*shape, P, D)

    def write(self, slots, k, v):
        P, D = self.page_size, self.head_dim
        slots = slots.reshape(-1)
        if slots.numel() == 0:
            return
        slots_h = slots.cpu()
        pages_h, inv_h = torch.unique(slots_h // P, return_inverse=True)
        dev = self.device
        pages = pages_h.to(dev)
        inv = inv_h.to(dev)
        off = slots % P
        bk, bv = self.read_pages(pages)  # current content of the touched pages (fresh copies)
        bk, bv = bk.float(), bv.float()
        bk[inv, off] = k.reshape(-1, D).float()
        bv[inv, off] = v.reshape(-1, D).float()
        last = torch.zeros(pages_h.numel(), dtype=torch.bool)
        last[inv_h[slots_h % P == P - 1]] = True  # tokens arrive in order: the last one fills a page
        seal = last & self.expired[pages_h]  # full and out of the window: quantize now
        if bool(seal.any()):
            sd = seal.to(dev)
            self._seal(pages[sd], bk[sd], bv[sd])
            self._unstage(pages_h[seal])
        staged = ~seal
        if bool(staged.any()):
            idx = self._stage(pages_h[staged])
            sd = staged.to(dev)
            self.staging[idx.to(dev)] = torch.stack([bk[sd], bv[sd]], dim=1).to(self.dtype)

    def expire(self, pages, filled):
        pages = pages.reshape(-1).long().cpu()
        if pages.numel() == 0:
            return
        self.expired[pages] = True
        ready = pages[filled.reshape(-1).cpu() & (self.stage_of[pages] >= 0)]  # full pages still in staging
        if ready.numel():
            dev = self.device
            st = self.staging[self.stage_of[ready].to(dev)].float()
            self._seal(ready.to(dev), st[:, 0], st[:, 1])
            self._unstage(ready)

    def _stage(self, pages: torch.Tensor) -> torch.Tensor:
        """Staging pages of ``pages`` (host), taking free ones for pages that have none yet."""
        cur = self.stage_of[pages]
        new = (cur < 0).nonzero().flatten()
        if new.numel():
            if new.numel() > len(self._free_stage):
                raise OutOfPages(
                    f"kivi: {new.numel()} open pages need staging, {len(self._free_stage)} staging pages free"
                )
            got = torch.tensor([self._free_stage.pop() for _ in range(new.numel())], dtype=torch.int64)
            cur[new] = got
            self.stage_of[pages[new]] = got
            self.stage_of_dev[pages[new].to(self.device)] = got.to(self.device)
        return cur

    def _unstage(self, pages: torch.Tensor) -> None:
        """Give the staging pages of ``pages`` (host) back."""
        so = self.stage_of[pages]
        held = so >= 0
        if bool(held.any()):
            self._free_stage.extend(so[held].tolist())
            self.stage_of[pages[held]] = -1
            self.stage_of_dev[pages[held].to(self.device)] = -1

    def release(self, pages):
        pages = pages.reshape(-1).long().cpu()
        if pages.numel() == 0:
            return
        self._unstage(pages)
        self.expired[pages] = False

    def copy_pages(self, src, dst):
        for t in (self.kq, self.vq, self.kstat, self.vstat):
            t[dst] = t[src]
        src_h, dst_h = src.reshape(-1).long().cpu(), dst.reshape(-1).long().cpu()
        self.expired[dst_h] = self.expired[src_h]
        so = self.stage_of[src_h]
        opened = so >= 0
        if bool(opened.any()):
            idx = self._stage(dst_h[opened])
            self.staging[idx.to(self.device)] = self.staging[so[opened].to(self.device)]


def _or_reduce(c: torch.Tensor) -> torch.Tensor:
    out = c[..., 0].clone()
    for i in range(1, c.shape[-1]):
        out |= c[..., i]
    return out


__all__ = ["KIVIFormat"]
