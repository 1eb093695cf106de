"""The ``fp8`` page format: K and V as float8 codes with a float16 scale per token and kv-head.

K and V are float8 codes (e4m3 or e5m2) ``[num_pages, page_size, head_dim]`` with one float16
scale per token and kv-head (absmax / the format's largest value). Every token is self-contained,
so token moves are exact. Used by the ``fp8`` method (engine/methods/fp8.py).
"""

from __future__ import annotations

import torch

from engine.cache.format_base import FormatError, KVFormat

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

    @property
    def moved_token_bytes(self) -> int:
        return 2 * self.head_dim + 2 * 2  # codes and scales, as stored

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


__all__ = ["FP8Format"]
