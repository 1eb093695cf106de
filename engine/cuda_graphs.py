"""Decode under CUDA graphs, one graph per batch-size bucket.

A pure decode step whose methods need no per-layer hooks this step (dense, or an eviction method
between its compressions) runs as one graph replay: embeddings, every layer's GEMMs, RoPE, the
Triton KV store and paged decode kernels, the LM head. A batch whose rows all use one method with
a graph-capturable selection (``SparseMethod.graph_decode``, e.g. quest) replays a graph captured
with that method's ``graph_decode_view`` in every layer: one graph per (batch bucket, method).
The kernels read the CacheManager's global
device tables through a static row index (``tables[:, layer]``), so nothing is gathered per step;
the host only copies token ids, positions, rows and the slot mapping into static buffers. Rows
past the real batch read an empty cache slot and write to a scratch page; their logits are
never looked at.
"""

from __future__ import annotations

import bisect

import torch

from engine.attention.triton_paged import num_splits, paged_decode, store_kv
from engine.cache.manager import CacheManager
from engine.model.llama import LlamaForCausalLM

PAD_SLOT = ("__cuda_graph_pad__",)


def default_buckets(max_batch: int) -> list[int]:
    out, b = [], 1
    for b in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 1024):
        if b >= max_batch:
            break
        out.append(b)
    return out + [max_batch]


class GraphDecodeAttention:
    """``attend`` for decode-only steps: static buffers in, no Python per token or per sequence."""

    def __init__(
        self,
        manager: CacheManager,
        rows: torch.Tensor,
        slot_mapping: torch.Tensor,
        scale: float,
        splits: int,
        method=None,
    ):
        self.manager = manager
        self.rows = rows  # [B] int32: cache slot of each batch row
        self.slot_mapping = slot_mapping  # [L, B, H] int64
        self.scale = scale
        self.splits = splits
        self.method = method  # a SparseMethod whose graph_decode_view picks the pages, or None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pool, mgr = self.manager.pool, self.manager
        store_kv(pool.k, pool.v, self.slot_mapping[layer], k, v)
        tables, lengths = mgr.tables_dev[:, layer], mgr.lengths_dev[:, layer]
        selected = count = None
        if self.method is not None:
            rows = self.rows.long()
            selected = self.method.graph_decode_view(layer, mgr, q, tables[rows], lengths[rows])
            if selected is not None:
                count = (selected >= 0).sum(-1, dtype=torch.int32)
                selected = selected.to(torch.int32)
        out, _ = paged_decode(
            q,
            pool.k,
            pool.v,
            tables,
            lengths,
            self.rows,
            self.scale,
            splits=self.splits,
            selected=selected,
            selected_count=count,
        )
        return out


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, manager: CacheManager, max_batch: int, num_sms: int):
        self.model = model
        self.manager = manager
        self.device = manager.device
        self.buckets = default_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        L, H = manager.num_layers, manager.num_kv_heads
        dev = self.device
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.rows = torch.zeros(self.max_batch, dtype=torch.int32, device=dev)
        self.slot_mapping = torch.zeros(L, self.max_batch, H, dtype=torch.long, device=dev)
        self.scale = model.cfg.head_dim**-0.5
        self.num_sms = num_sms
        # an empty cache slot for padding rows, and one scratch page their K/V lands in
        manager.open(PAD_SLOT)
        self.pad_row = manager.slot(PAD_SLOT)
        self.scratch = int(manager.pool.alloc(1)[0])
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        """(bucket, id of the selecting method or None) -> (graph, its logits buffer)."""
        self._pool = None
        self.replays = 0

    def bucket(self, batch: int) -> int | None:
        i = bisect.bisect_left(self.buckets, batch)
        return self.buckets[i] if i < len(self.buckets) else None

    def _capture(self, B: int, method=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        H = self.manager.num_kv_heads
        P = self.manager.page_size
        splits = num_splits(B * H, self.manager.max_pages * P, self.num_sms, max(P, 64))
        attend = GraphDecodeAttention(self.manager, self.rows[:B], self.slot_mapping[:, :B], self.scale, splits, method)
        self._fill_padding(0, B)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                self.model(self.input_ids[:B], self.positions[:B], attend)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool), torch.inference_mode():
            logits = self.model(self.input_ids[:B], self.positions[:B], attend)
        self._pool = graph.pool()
        return graph, logits

    def _fill_padding(self, start: int, end: int) -> None:
        if end <= start:
            return
        self.rows[start:end] = self.pad_row
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[:, start:end] = self.scratch * self.manager.page_size

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        slot_mapping: torch.Tensor,
        method=None,
    ) -> torch.Tensor:
        """Logits ``[B, V]`` of one decode step (``slot_mapping`` ``[L, B, H]`` from CacheManager.append);
        ``method``: every row's method, whose selection the graph runs (None: dense attention)."""
        B = input_ids.shape[0]
        bucket = self.bucket(B)
        key = (bucket, None if method is None else id(method))
        if key not in self._graphs:
            self._graphs[key] = self._capture(bucket, method)
        graph, logits = self._graphs[key]
        self.input_ids[:B].copy_(input_ids, non_blocking=True)
        self.positions[:B].copy_(positions, non_blocking=True)
        self.rows[:B].copy_(rows, non_blocking=True)
        self.slot_mapping[:, :B].copy_(slot_mapping, non_blocking=True)
        self._fill_padding(B, bucket)
        graph.replay()
        self.replays += 1
        return logits[:B]
