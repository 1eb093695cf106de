"""Page formats: how a PagePool stores the K/V of its pages (plain, FP8, KIVI 2/4-bit).

A sparse method declares the layout it wants (``SparseMethod.kv_layout()``, a ``KVLayout``); the
engine builds the matching format here and hands it to the PagePool, which delegates every read
and write of K/V to it. Nothing outside this file knows how a quantized page is laid out: the
attention backends read pages through ``read_pages`` (dequantize-then-attend) and write new
tokens through ``write``; the CacheManager moves tokens (eviction compaction), copies pages
(copy-on-write) and snapshots tokens through the same calls.

Formats:

``plain``  K and V ``[num_pages, page_size, head_dim]`` in the model dtype. The Triton kernels and
           CUDA graphs read these tensors directly (``plain = True``).
``fp8``    K and V as float8 codes (e4m3 or e5m2) ``[num_pages, page_size, head_dim]`` with one
           float16 scale per token and kv-head (absmax / the format's largest value). Every
           token is self-contained, so token moves are exact.
``kivi``   KIVI: keys quantized per channel over the tokens of one page (the page is the key
           quantization group), values per token in groups of ``value_group`` channels, both
           asymmetric (scale and zero point in float16) with ``bits`` = 2 or 4, codes packed
           ``8 // bits`` to a byte. KIVI's residual: a page stays in a full-precision staging page
           (model dtype) while it is partly filled (*open*) or any of its tokens is among the head's
           ``residual_length`` most recent ones; it is quantized ("sealed") once it is full and has
           left that window. The CacheManager says when a page leaves the window (``expire``, on
           append and restore); a full page that already left it is sealed as its last token is
           written. So at least the last ``residual_length`` tokens of every head (and at most
           ``residual_length + page_size - 1``) are attended in full precision; with
           ``residual_length = 0`` only the open page is. A page that left the window does not
           come back to it: after a truncation (an aborted turn) it is quantized again as soon as it
           is refilled, and a page shared by a fork is sealed when the first sharer leaves it
           behind (sealing is deterministic, so only the timing changes). Staging pages are a fixed set sized by the
           engine: ``staging_per_head`` (1 + ceil(residual_length / page_size)) per cached
           (sequence, layer, kv-head).

Accounting. ``bytes_per_page`` is what a page's own storage costs (codes, scales, zero points);
``open_page_bytes`` is what a staged (open or in-window) page costs on top (its staging page); ``storage_bytes`` is
every byte the format allocated. ``PagePool.bytes_of(pages)`` adds them up for a set of pages, so
a sequence's cost counts its full-precision window where it really has one.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.cache.errors import OutOfPages


class FormatError(ValueError):
    """A page format with parameters it cannot support."""


class KVFormat:
    """Base class: the interface the PagePool delegates to."""

    name = ""
    plain = False
    """True only for the plain layout: kernels may read ``k`` / ``v`` directly."""

    def __init__(self, page_size: int, head_dim: int, dtype: torch.dtype):
        self.page_size = page_size
        self.head_dim = head_dim
        self.dtype = dtype
        self.args: dict[str, Any] = {}

    # --- layout ---------------------------------------------------------------------------------
    def allocate(self, num_pages: int, device: torch.device, max_open_pages: int = 0) -> None:
        raise NotImplementedError

    @property
    def key(self) -> tuple:
        """Identity of the layout (name and parameters): sessions of one pool must agree on it."""
        return (self.name, tuple(sorted(self.args.items())))

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in sorted(self.args.items()))
        return f"{self.name}({args})" if args else self.name

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page's K/V storage (codes, scales and zero points; positions not included)."""
        raise NotImplementedError

    open_page_bytes = 0
    """Extra bytes a staged (open or in the full-precision window, not yet quantized) page holds."""

    staging_per_head = 0
    """Staging pages one (sequence, layer, kv-head) can hold at once (0: the format stages nothing)."""

    residual_length = 0
    """Most recent tokens of a head kept in full precision (the CacheManager ``expire``s pages past them)."""

    def _tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    @property
    def storage_bytes(self) -> int:
        """Every byte this format allocated (pages and staging)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def num_open(self, pages: torch.Tensor) -> int:
        """How many of ``pages`` hold a staging page (open or in the full-precision window)."""
        return 0

    def expire(self, pages: torch.Tensor, filled: torch.Tensor) -> None:
        """``pages`` (host int64) left their head's full-precision window. Those with ``filled``
        (host bool) are full already; the others get their last token in the coming write. Each is
        quantized once full."""

    # --- data -----------------------------------------------------------------------------------
    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store tokens: ``k``, ``v`` ``[M, D]`` at flat token slots ``[M]`` (page * page_size + offset)."""
        raise NotImplementedError

    def read_pages(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of ``pages`` (any shape S, int64 on the device) as ``[*S, page_size, D]`` in the model dtype."""
        raise NotImplementedError

    def read_tokens(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[M, D]`` (model dtype) of flat token slots ``[M]``."""
        P = self.page_size
        if slots.numel() == 0:
            empty = torch.empty(0, self.head_dim, dtype=self.dtype, device=slots.device)
            return empty, empty.clone()
        pages, inv = torch.unique(slots // P, return_inverse=True)
        k, v = self.read_pages(pages)
        off = slots % P
        return k[inv, off], v[inv, off]

    def take_tokens(self, slots: torch.Tensor) -> Any:
        """The stored form of tokens, for ``put_tokens`` (eviction compaction moves tokens)."""
        return self.read_tokens(slots)

    def put_tokens(self, slots: torch.Tensor, data: Any) -> None:
        self.write(slots, *data)

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy whole pages (copy-on-write); ``dst`` are freshly allocated pages."""
        raise NotImplementedError

    def release(self, pages: torch.Tensor) -> None:
        """``pages`` went back to the free list (host int64)."""


class PlainFormat(KVFormat):
    name = "plain"
    plain = True

    def allocate(self, num_pages, device, max_open_pages=0):
        shape = (num_pages, self.page_size, self.head_dim)
        self.k = torch.zeros(shape, dtype=self.dtype, device=device)
        self.v = torch.zeros(shape, dtype=self.dtype, device=device)

    @property
    def bytes_per_page(self) -> int:
        return 2 * self.page_size * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def _tensors(self):
        return [self.k, self.v]

    def write(self, slots, k, v):
        D = self.head_dim
        idx = slots.reshape(-1)
        self.k.view(-1, D).index_copy_(0, idx, k.reshape(-1, D).to(self.dtype))
        self.v.view(-1, D).index_copy_(0, idx, v.reshape(-1, D).to(self.dtype))

    def read_pages(self, pages):
        return self.k[pages], self.v[pages]

    def read_tokens(self, slots):
        D = self.head_dim
        return self.k.view(-1, D)[slots], self.v.view(-1, D)[slots]

    def take_tokens(self, slots):
        return self.read_tokens(slots)

    def put_tokens(self, slots, data):
        D = self.head_dim
        self.k.view(-1, D)[slots] = data[0]
        self.v.view(-1, D)[slots] = data[1]

    def copy_pages(self, src, dst):
        self.k[dst] = self.k[src]
        self.v[dst] = self.v[src]


_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class FP8Format(KVFormat):
    """Float8 codes, stored as uint8 (indexing float8 tensors is not implemented everywhere)
    and viewed as float8 to convert, with a float16 absmax scale per token and kv-head (the codes are
    computed with the rounded scale, so what is stored is what is read)."""

    name = "fp8"

    def __init__(self, page_size, head_dim, dtype, fp8: str = "e4m3"):
        super().__init__(page_size, head_dim, dtype)
        if fp8 not in _FP8:
            raise FormatError(f"fp8 format must be e4m3 or e5m2, not {fp8!r}")
        self.args = {"fp8": fp8}
        self.code_dtype = _FP8[fp8]
        self.max_code = float(torch.finfo(self.code_dtype).max)

    def allocate(self, num_pages, device, max_open_pages=0):
        P, D = self.page_size, self.head_dim
        self.kq = torch.zeros(num_pages, P, D, dtype=torch.uint8, device=device)
        self.vq = torch.zeros(num_pages, P, D, dtype=torch.uint8, device=device)
        self.ks = torch.zeros(num_pages, P, dtype=torch.float16, device=device)
        self.vs = torch.zeros(num_pages, P, dtype=torch.float16, device=device)

    @property
    def bytes_per_page(self) -> int:
        return 2 * self.page_size * self.head_dim + 2 * self.page_size * 2

    def _tensors(self):
        return [self.kq, self.vq, self.ks, self.vs]

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.float()
        scale = (x.abs().amax(-1) / self.max_code).clamp(min=2**-24).half()  # the smallest float16 > 0
        codes = (
            (x / scale.float()[..., None]).clamp(-self.max_code, self.max_code).to(self.code_dtype).view(torch.uint8)
        )
        return codes, scale

    def _dequantize(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (codes.view(self.code_dtype).float() * scale.float()[..., None]).to(self.dtype)

    def write(self, slots, k, v):
        D = self.head_dim
        idx = slots.reshape(-1)
        for x, q, s in ((k, self.kq, self.ks), (v, self.vq, self.vs)):
            codes, scale = self._quantize(x.reshape(-1, D))
            q.view(-1, D)[idx] = codes
            s.view(-1)[idx] = scale

    def read_pages(self, pages):
        return self._dequantize(self.kq[pages], self.ks[pages]), self._dequantize(self.vq[pages], self.vs[pages])

    def read_tokens(self, slots):
        D = self.head_dim
        return (
            self._dequantize(self.kq.view(-1, D)[slots], self.ks.view(-1)[slots]),
            self._dequantize(self.vq.view(-1, D)[slots], self.vs.view(-1)[slots]),
        )

    def take_tokens(self, slots):
        D = self.head_dim
        return (
            self.kq.view(-1, D)[slots],
            self.ks.view(-1)[slots],
            self.vq.view(-1, D)[slots],
            self.vs.view(-1)[slots],
        )

    def put_tokens(self, slots, data):
        D = self.head_dim
        kq, ks, vq, vs = data
        self.kq.view(-1, D)[slots] = kq
        self.ks.view(-1)[slots] = ks
        self.vq.view(-1, D)[slots] = vq
        self.vs.view(-1)[slots] = vs

    def copy_pages(self, src, dst):
        for t in self._tensors():
            t[dst] = t[src]


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


FORMATS: dict[str, type[KVFormat]] = {cls.name: cls for cls in (PlainFormat, FP8Format, KIVIFormat)}


def make_format(name: str, args: dict[str, Any] | tuple, page_size: int, head_dim: int, dtype: torch.dtype) -> KVFormat:
    """The page format a method's ``KVLayout`` names, for this model's page size, head_dim and dtype."""
    try:
        cls = FORMATS[name]
    except KeyError:
        raise FormatError(f"unknown KV page format {name!r}; known: {', '.join(sorted(FORMATS))}") from None
    try:
        return cls(page_size, head_dim, dtype, **dict(args))
    except TypeError as e:
        raise FormatError(f"KV page format {name!r}: {e}") from None


__all__ = ["FORMATS", "FP8Format", "FormatError", "KIVIFormat", "KVFormat", "PlainFormat", "make_format"]
