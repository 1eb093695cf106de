"""ModelRunner: turns a scheduled batch into one forward pass and returns the logits to sample from.

Token layout of the pass: the decode tokens (one per decoding sequence) first, then each
prefill chunk. The runner reserves cache room for every token (CacheManager.append), binds the
batch to a PagedAttention, runs the model and returns one logits row per sequence that samples
(each decode, and each chunk that ends its sequence's input), plus every chunk position for
sequences that asked for prompt logits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention.paged import PagedAttention, PrefillSegment
from engine.cache.manager import CacheManager, to_device
from engine.controller import SparseController
from engine.model.llama import LlamaForCausalLM
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    sampling: list[Sequence]
    """Sequences that sample a token this step, in the order of ``logits``' rows."""
    logits: torch.Tensor
    """``[len(sampling), V]`` float32."""
    prompt_logits: dict
    """seq_id -> ``[n, V]`` logits of every token of this step's chunk (when asked for)."""


@dataclass
class InFlight:
    """A decode step launched ahead: row i is ``seqs[i]``, whose token lands at ``token_ids[slots[i]]``."""

    seqs: list[Sequence]
    serials: list[int]
    slots: list[int]
    tokens: torch.Tensor  # [B] on the device (the next step's inputs)
    host_tokens: torch.Tensor  # [B] pinned host copy, valid once ``done`` has completed
    done: "torch.cuda.Event | None"  # None on the CPU: the copy is complete when launched

    def read(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host_tokens.tolist()


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, manager: CacheManager, controller: SparseController, backend, graphs=None
    ):
        self.model = model
        self.manager = manager
        self.controller = controller
        self.backend = backend
        self.graphs = graphs
        """DecodeGraphs (GPU): decode steps that need no method hooks replay a CUDA graph."""
        self.device = manager.device
        self.scale = model.cfg.head_dim**-0.5
        self.forward_passes = 0
        self.graph_steps = 0
        self._graph_method = None  # set by graph_ok: the method whose decode selection the graph runs

    def graph_ok(self, batch: ScheduledBatch, query_windows) -> bool:
        """Can ``batch`` run as a graph replay? Remembers which method's selection goes inside."""
        self._graph_method = None
        if self.graphs is None or batch.prefill or not batch.decode or len(batch.decode) > self.graphs.max_batch:
            return False
        ids = [s.seq_id for s in batch.decode]
        if query_windows and any(i in query_windows for i in ids):
            return False
        slots = torch.tensor([self.manager.slot(i) for i in ids])
        ok, self._graph_method = self.controller.graph_decode_method(ids, self.manager.lengths[slots] + 1)
        return ok

    @torch.inference_mode()
    def _execute_graph(self, batch: ScheduledBatch, previous: InFlight | None = None) -> StepResult:
        seqs = batch.decode
        ids = [s.seq_id for s in seqs]
        positions = torch.tensor([s.num_cached for s in seqs], dtype=torch.long)
        slot_mapping = self.manager.append(ids, [1] * len(seqs), positions)
        rows = torch.tensor([self.manager.slot(i) for i in ids], dtype=torch.int32)
        dev = self.device
        tokens = to_device(torch.tensor([s.token_ids[s.num_cached] for s in seqs], dtype=torch.long), dev)
        if previous is not None:  # tokens still on the GPU come straight from the step before
            row_of = {id(s): i for i, s in enumerate(previous.seqs)}
            src = to_device(torch.tensor([row_of.get(id(s), 0) for s in seqs], dtype=torch.long), dev)
            tokens = torch.where(tokens >= 0, tokens, previous.tokens[src])
        method = self._graph_method
        if method is not None:
            method.prepare_graph_decode(self.manager, ids)
        logits = self.graphs.run(tokens, to_device(positions, dev), to_device(rows, dev), slot_mapping, method=method)
        for s in seqs:
            s.num_cached += 1
        self.forward_passes += 1
        self.graph_steps += 1
        self.controller.after_decode_step(ids, [s.num_cached for s in seqs])
        return StepResult(sampling=list(seqs), logits=logits, prompt_logits={})

    def launch_decode(self, batch: ScheduledBatch, previous: InFlight | None) -> InFlight:
        """A greedy decode step launched without waiting: its tokens stay on the GPU until read."""
        seqs = list(batch.decode)
        result = self._execute_graph(batch, previous)
        tokens = result.logits.argmax(-1)
        gpu = tokens.is_cuda
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=gpu)
        host.copy_(tokens, non_blocking=gpu)  # queued now, so reading it waits for this step only
        done = None
        if gpu:
            done = torch.cuda.Event()
            done.record()
        return InFlight(
            seqs=seqs,
            serials=[s.turn_serial for s in seqs],
            slots=[len(s.token_ids) for s in seqs],
            tokens=tokens,
            host_tokens=host,
            done=done,
        )

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, query_windows: dict | None = None) -> StepResult:
        if self.graph_ok(batch, query_windows):
            return self._execute_graph(batch)
        ids: list[int] = []
        positions: list[int] = []
        seq_ids, counts = [], []
        for seq in batch.decode:
            ids.append(seq.token_ids[seq.num_cached])
            positions.append(seq.num_cached)
            seq_ids.append(seq.seq_id)
            counts.append(1)
        segments = []
        for seq, n in batch.prefill:
            start = seq.num_cached
            segments.append(
                PrefillSegment(
                    seq_id=seq.seq_id,
                    slot=self.manager.slot(seq.seq_id),
                    offset=len(ids),
                    length=n,
                    start=start,
                    is_last=start + n == seq.num_tokens,
                )
            )
            ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            seq_ids.append(seq.seq_id)
            counts.append(n)

        pos_t = torch.tensor(positions, dtype=torch.long)
        slot_mapping = self.manager.append(seq_ids, counts, pos_t)
        pos_dev = to_device(pos_t, self.device)
        attend = PagedAttention(
            self.manager,
            self.controller,
            self.backend,
            self.scale,
            decode_ids=[s.seq_id for s in batch.decode],
            decode_num_tokens=[s.num_cached + 1 for s in batch.decode],
            segments=segments,
            slot_mapping=slot_mapping,
            positions=pos_dev,
            query_windows=query_windows,
        )

        sampling = list(batch.decode)
        rows = list(range(len(batch.decode)))  # flattened tokens whose logits we compute
        sample_rows = list(range(len(batch.decode)))  # indices into rows, one per sampling sequence
        prompt_rows: dict = {}
        for (seq, n), seg in zip(batch.prefill, segments):
            if seq.params.prompt_logits:
                prompt_rows[seq.seq_id] = (len(rows), len(rows) + n)
                rows.extend(range(seg.offset, seg.offset + n))
            elif seg.is_last:
                rows.append(seg.offset + n - 1)
            if seg.is_last:
                sample_rows.append(len(rows) - 1)
                sampling.append(seq)

        input_ids = to_device(torch.tensor(ids, dtype=torch.long), self.device)
        try:
            logits = self.model(
                input_ids, pos_dev, attend, to_device(torch.tensor(rows, dtype=torch.long), self.device)
            )
        except BaseException:
            self.controller.drop_pending_evictions()
            raise
        self.controller.apply_pending_evictions()  # the prefill chunks' keep decisions, all layers at once
        self.forward_passes += 1

        for seq, n in batch.prefill:
            seq.num_cached += n
            seq.counters.prefilled_tokens += n
        for seq in batch.decode:
            seq.num_cached += 1
        if batch.decode:
            self.controller.after_decode_step(seq_ids[: len(batch.decode)], [s.num_cached for s in batch.decode])

        prompt_logits = {sid: logits[a:b] for sid, (a, b) in prompt_rows.items()}
        return StepResult(sampling=sampling, logits=logits[sample_rows], prompt_logits=prompt_logits)

    @torch.inference_mode()
    def scoring_pass(self, seq: Sequence, tokenizer, max_chunk: int) -> bool:
        """Run the extra pass ``seq``'s method asks for once its turn's input is in the cache (see
        engine/lifecycle.py), then apply the method's keep decisions. Each segment runs as prefill
        chunks of at most ``max_chunk`` tokens after the history and is truncated away again, so
        the cache and the pool's free pages end as they were before the pass. Returns whether a
        pass ran (False: the method asked for none, or the pool could not hold a segment)."""
        sid = seq.seq_id
        if not self.controller.wants_scoring_pass(sid):
            return False
        request = self.controller.scoring_pass(sid, seq.num_cached, seq.token_ids[: seq.num_cached], tokenizer)
        if request is None:
            return False
        context = self.manager.lengths[self.manager.slot(sid)].clone()  # [L, H]
        longest = max((len(t) for t in request.segments), default=0)
        if self.manager.pages_for_append([sid], [longest]) > self.manager.pool.num_free:
            log.warning("scoring pass of %r skipped: the pool cannot hold %d more tokens", sid, longest)
            self.controller.after_scoring(sid, seq.num_cached)  # the method saw nothing: it keeps all
            return False
        slot = self.manager.slot(sid)
        for tokens in request.segments:
            try:
                for s in range(0, len(tokens), max_chunk):
                    ids = tokens[s : s + max_chunk]
                    start = seq.num_cached + s
                    pos = torch.arange(start, start + len(ids))
                    slot_mapping = self.manager.append([sid], [len(ids)], pos)
                    seg = PrefillSegment(
                        seq_id=sid,
                        slot=slot,
                        offset=0,
                        length=len(ids),
                        start=start,
                        is_last=False,
                        context_lengths=context,
                    )
                    pos_dev = to_device(pos, self.device)
                    attend = PagedAttention(
                        self.manager,
                        self.controller,
                        self.backend,
                        self.scale,
                        decode_ids=[],
                        decode_num_tokens=[],
                        segments=[seg],
                        slot_mapping=slot_mapping,
                        positions=pos_dev,
                    )
                    input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
                    self.model(input_ids, pos_dev, attend, torch.tensor([len(ids) - 1], device=self.device))
                    self.forward_passes += 1
            finally:  # the segment's own tokens go: each head back to its history
                self.manager.truncate(sid, context)
        self.controller.after_scoring(sid, seq.num_cached)
        return True
