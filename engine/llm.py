"""LLMEngine: the engine's front door — submit requests, step the batch, or generate to completion.

    engine = LLMEngine(EngineConfig(method="streaming_llm", budget=256))
    out = engine.generate(["Hello"], SamplingParams(max_tokens=32))

``add_request`` / ``step`` / ``abort`` is the step-wise interface a server drives; ``generate``
loops over it. Requests may name their own sparse method (a ``MethodSpec``); the rest use the
config's.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Hashable, Iterable

import torch

from engine.attention.reference import ReferenceAttention
from engine.chain import ChainCache, SessionError, Tier
from engine.cache.formats import make_format
from engine.cache.manager import CacheManager
from engine.cache.pages import PagePool
from engine.config import ConfigError, EngineConfig
from engine.controller import SparseController
from engine.lifecycle import MethodSpec, ModelShape, SeqInfo
from engine.distributed.layers import TensorParallelLlama
from engine.distributed.sharding import shard_layout
from engine.distributed.snapshots import for_rank as snapshot_for_rank
from engine.methods import get_method_class
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import (ModelConfig, load_hf_config, load_tokenizer, parse_hf_config, read_safetensors,
                                 resolve_model_dir)
from engine.runner import ModelRunner
from engine.sampling import SamplingParams, sample
from engine.scheduler import Scheduler
from engine.sequence import PENDING, RequestOutput, Sequence, SeqStatus

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RequestError(ValueError):
    """A request cannot be served as given (too long, bad parameters, unknown id)."""


class CapacityError(RequestError):
    """The KV pool can never hold this request (it needs more pages than the pool has)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was asked for, but torch sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, random_weights: bool = False, **overrides: Any):
        """Load the model and size the KV pool. ``random_weights`` keeps the real shapes but
        initialises weights randomly (throughput benchmarks); the checkpoint's config is still read."""
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = EngineConfig.from_dict({**config.to_dict(), **overrides})
        self.config = config
        self.default_spec = MethodSpec(config.method, config.budget, config.budget_ratio, dict(config.method_args))
        get_method_class(config.method)  # an unknown method fails before the model loads
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_dir = resolve_model_dir(config.model, need_weights=not random_weights)
        self.hf_config = load_hf_config(self.model_dir)
        self.model_config: ModelConfig = parse_hf_config(self.hf_config)
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if mc.sliding_window and self.max_model_len > mc.sliding_window:
            log.warning("%s uses a sliding window of %d; max_model_len capped to it", mc.architecture, mc.sliding_window)
            self.max_model_len = mc.sliding_window
        self.tokenizer = load_tokenizer(self.model_dir)

        self.shard = shard_layout(config, mc)
        """This rank's part of the model at tensor_parallel_size > 1 (engine/distributed); None: all of it."""
        if self.shard is None:
            self.model = LlamaForCausalLM.create(mc, self.hf_config, self.max_model_len, self.dtype, self.device)
        else:
            self.model = TensorParallelLlama.create_shard(mc, self.shard, self.hf_config, self.max_model_len,
                                                          self.dtype, self.device)
        num_heads, num_kv_heads = (mc.num_heads, mc.num_kv_heads) if self.shard is None else \
            (self.shard.num_heads, self.shard.num_kv_heads)  # a rank caches only its own kv-heads
        if random_weights:
            self.model.init_random(seed=config.seed)
        else:
            self.model.load_weights(read_safetensors(self.model_dir))
        self.model.eval()

        self.shape = ModelShape(num_layers=mc.num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                head_dim=mc.head_dim, page_size=config.page_size,
                                rope_cos=self.model.rope_cos, rope_sin=self.model.rope_sin, device=self.device)
        slots = config.max_cached_seqs or 4 * config.max_num_seqs
        # the pool stores pages in the layout the configured method declares (plain, fp8, kivi, ...)
        layout = get_method_class(config.method)(self.default_spec, self.shape).kv_layout()
        fmt = make_format(layout.format, layout.args, config.page_size, mc.head_dim, self.dtype)
        # formats with full-precision pages (kivi: the open page and the residual window) get
        # ``staging_per_head`` staging pages per cached head
        max_open = slots * mc.num_layers * num_kv_heads * fmt.staging_per_head + 1 if fmt.staging_per_head else 0
        self.pool = PagePool(self._num_pages(fmt, max_open), config.page_size, mc.head_dim, self.dtype, self.device,
                             format=fmt, max_open_pages=max_open)
        self.manager = CacheManager(self.pool, mc.num_layers, num_kv_heads, slots, self.max_model_len)
        self.controller = SparseController(self.shape, self.manager)
        self.controller.method_for(self.default_spec)  # a bad method setting fails here, not on the first request
        self.scheduler = Scheduler(config, self.manager, self.controller)
        self.backend = self._backend()
        graphs = None
        graphs_ok = config.cuda_graphs and self.shard is None  # TP ranks decode eagerly
        if self.device.type == "cuda" and graphs_ok and self.backend.name == "triton" and fmt.plain:
            from engine.cuda_graphs import DecodeGraphs

            graphs = DecodeGraphs(self.model, self.manager, config.max_num_seqs, self.backend.num_sms)
        self.runner = ModelRunner(self.model, self.manager, self.controller, self.backend, graphs)
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._seqs: dict[Hashable, Sequence] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.chains = ChainCache(self)
        self.scheduler.chains = self.chains
        self._inflight = None  # a launched decode step whose tokens are not read yet (see step)
        self.totals = {"decoded_tokens": 0, "finished_stop": 0, "finished_length": 0, "finished_abort": 0,
                       "finished_error": 0}
        """Engine-wide counters since start (stats() reports them)."""

    # --- setup ---------------------------------------------------------------------------------
    def _num_pages(self, fmt, max_open: int) -> int:
        cfg, mc = self.config, self.model_config
        page_bytes = fmt.bytes_per_page + cfg.page_size * 4  # K/V storage + positions
        staging = max_open * fmt.open_page_bytes  # full-precision open and window pages (kivi)
        if cfg.num_pages is not None:
            return cfg.num_pages
        if cfg.kv_cache_gb is not None or self.device.type != "cuda":
            return max(1, int(((cfg.kv_cache_gb or 2.0) * 2**30 - staging) // page_bytes))
        free, total = torch.cuda.mem_get_info(self.device)
        # keep room for activations: the largest prefill chunk's attention and the logits
        reserve = max(2 * 2**30, int(0.04 * total))
        budget = int(total * cfg.gpu_memory_utilization) - (total - free) - reserve - staging
        if budget < page_bytes * mc.num_layers * mc.num_kv_heads:
            raise ConfigError(f"too little GPU memory left for the KV pool ({budget / 2**30:.1f} GiB)")
        return budget // page_bytes

    def _backend(self):
        name = self.config.attention_backend
        if name == "triton" or (name == "auto" and self.device.type == "cuda"):
            try:
                from engine.attention.triton_paged import TritonPagedAttention
            except ImportError:
                if name == "triton":
                    raise ConfigError("attention_backend triton needs Triton and a CUDA device") from None
            else:
                return TritonPagedAttention(self.device)
        return ReferenceAttention()

    # --- text --------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self._need_tokenizer().encode(text, add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        out = self._need_tokenizer().apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                          tokenize=True, return_dict=False, **kwargs)
        return list(out)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise RequestError(f"{self.model_dir} has no tokenizer; give token ids instead of text")
        return self.tokenizer

    # --- requests -----------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: Hashable | None = None, method: MethodSpec | None = None) -> Hashable:
        """A one-shot request: its cache is freed when it finishes (see ``add_turn`` for sessions)."""
        params = params or SamplingParams()
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = next(self._ids) if request_id is None else request_id
        if request_id in self._seqs or request_id in self.chains.chains:
            raise RequestError(f"request id {request_id!r} is already in use")
        seq = self.new_sequence(request_id, token_ids, params, method or self.default_spec)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def new_sequence(self, seq_id: Hashable, token_ids: list[int], params: SamplingParams, spec: MethodSpec) -> Sequence:
        """A validated Sequence (not yet queued)."""
        self._check_tokens(token_ids, 0, params, spec)
        return Sequence(seq_id, token_ids, params, spec, self.tokenizer, self._generator(params))

    def restart_sequence(self, seq: Sequence, new_tokens: list[int], params: SamplingParams) -> None:
        """Start a session's next turn on its (persistent) Sequence."""
        self._check_tokens(new_tokens, seq.num_tokens, params, seq.spec)
        seq.turn_start = seq.num_tokens
        seq.token_ids.extend(new_tokens)
        seq.prompt_len = seq.num_tokens
        seq.params = params
        seq.generator = self._generator(params)
        seq.reset_turn(self.tokenizer)

    def _check_tokens(self, token_ids: list[int], before: int, params: SamplingParams, spec: MethodSpec) -> None:
        if not token_ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in token_ids):
            raise RequestError(f"token ids must be integers in [0, {vocab})")
        n = before + len(token_ids)
        if n >= self.max_model_len:
            raise RequestError(f"the prompt has {n} tokens; max_model_len is {self.max_model_len}")
        m = self.controller.method_for(spec)  # raises MethodError for a bad spec
        total = min(n + params.max_tokens, self.max_model_len)
        peak = min(total, m.kept_tokens(total) + self.config.prefill_chunk_size + 1)
        need = self.scheduler.fresh_pages(peak)
        if need > self.pool.num_pages:
            raise CapacityError(f"this request needs up to {need} KV pages; the pool has {self.pool.num_pages}")

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        seed = params.seed if params.seed is not None else self.config.seed + next(self._arrivals)
        return torch.Generator().manual_seed(seed)

    def fingerprint(self) -> str:
        """What KV computed here depends on: a snapshot from another fingerprint is recomputed."""
        mc, cfg = self.model_config, self.config
        return f"{self.model_dir.name}|{mc.architecture}|{mc.num_layers}x{mc.num_kv_heads}x{mc.head_dim}|{self.dtype}|p{cfg.page_size}"

    # --- sessions (the Chain Cache) ----------------------------------------------------------------
    def add_turn(self, session_id: Hashable, tokens: list[int], params: SamplingParams | None = None, *,
                 role: str = "user", spans: list[tuple[int, int, str]] | None = None, method: MethodSpec | None = None,
                 expected_turn_index: int | None = None, history: list[int] | None = None,
                 shared_prefix: int = 0) -> Hashable:
        """Run one turn of a session: ``tokens`` are appended to its history and only they are
        prefilled, attending to the session's cached (possibly compressed) KV. Creates the session
        on its first turn. ``history`` instead of ``tokens`` gives the whole history, which must
        extend the session's. ``shared_prefix``: how many leading tokens of a first turn are a
        prompt other sessions share (stored once). Outputs carry the request id ``session_id``."""
        params = params or SamplingParams()
        if session_id in self._seqs and session_id not in self.chains.chains:
            raise RequestError(f"id {session_id!r} is in use by a one-shot request")
        try:
            seq = self.chains.start_turn(session_id, list(tokens), params, role=role, spans=spans, method=method,
                                         expected_turn_index=expected_turn_index, history=history,
                                         shared_prefix=shared_prefix)
        except CapacityError:
            raise
        except RequestError as e:
            raise SessionError(str(e)) from None
        self._seqs[session_id] = seq
        self.scheduler.add(seq)
        return session_id

    def end_session(self, session_id: Hashable) -> None:
        self.chains.end(session_id)

    def fork_session(self, session_id: Hashable, child_id: Hashable) -> None:
        self.chains.fork(session_id, child_id)

    def session_info(self, session_id: Hashable) -> dict:
        return self.chains.info(session_id)

    def prune_history(self, session_id: Hashable, start: int, end: int, **policy) -> int:
        return self.chains.prune(session_id, start, end, **policy)

    def snapshot_session(self, session_id: Hashable, with_kv: bool = True):
        return self.chains.snapshot(session_id, with_kv)

    def load_session(self, snapshot, source: Tier = Tier.STORE) -> None:
        """Make a session from a snapshot (one made at any tensor_parallel_size: re-sharded here)."""
        rank = 0 if self.shard is None else self.shard.rank
        self.chains.load(snapshot_for_rank(snapshot, self.config.tensor_parallel_size, rank), source)

    def add_prefilled_request(self, num_tokens: int, kv_tokens: int | torch.Tensor, params: SamplingParams,
                              method: MethodSpec | None = None, seed: int = 0) -> Hashable:
        """Benchmarks: a request already past a ``num_tokens`` prefill whose cache holds
        ``kv_tokens`` per (layer, kv-head) (an int, or ``[L, H]`` for per-head budgets) of
        synthetic KV (whatever the pool's pages hold). It decodes from the next step on."""
        gen = torch.Generator().manual_seed(seed)
        history = torch.randint(0, self.model_config.vocab_size, (num_tokens,), generator=gen).tolist()
        rid = next(self._ids)
        seq = self.new_sequence(rid, history, params, method or self.default_spec)
        kv = torch.as_tensor(kv_tokens).expand(self.shape.num_layers, self.shape.num_kv_heads)
        most = int(kv.max())
        if most > num_tokens - 1:
            raise RequestError("kv_tokens cannot exceed the tokens already prefilled")
        need = self.scheduler.fresh_pages(most)
        if need > self.pool.num_free or self.manager.num_free_slots == 0:
            raise RequestError(f"no room for another prefilled request ({need} pages, {self.pool.num_free} free)")
        self.manager.open(rid)
        self.manager.append([rid], [most], torch.arange(num_tokens - 1 - most, num_tokens - 1))
        if int(kv.min()) < most:  # per-head budgets: trim each head to its own count
            for layer in range(self.shape.num_layers):
                self.manager.evict(rid, layer, [torch.arange(int(n)) for n in kv[layer]])
        self.controller.admit(SeqInfo(rid, num_tokens - 1), seq.spec)
        seq.num_cached = num_tokens - 1
        seq.in_decode = True
        seq.status = SeqStatus.RUNNING
        self.scheduler.running.append(seq)
        self._seqs[rid] = seq
        return rid

    def abort(self, request_id: Hashable) -> RequestOutput | None:
        seq = self._seqs.get(request_id)
        if seq is None or seq.finished:
            return None
        self._finish(seq, "abort")
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self._inflight is not None

    # --- stepping -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward pass; outputs for every request that produced tokens or finished.

        In steady greedy decoding on the GPU the engine runs one step ahead: it launches step t,
        then reads and processes the tokens of step t-1 while the GPU works (their outputs arrive
        one call later). Any other step first completes the step in flight."""
        touched: list[Sequence] = []
        overlap = self._overlap_ok()
        if not overlap and self._inflight is not None:
            touched += self._complete(self._inflight)
            self._inflight = None
        batch = self.scheduler.schedule()
        for seq, reason in batch.failed:
            seq.error = reason
            self._finish(seq, "error")
            touched.append(seq)
        if overlap and not batch.empty and self.runner.graph_ok(batch, None):
            launched = self.runner.launch_decode(batch, self._inflight)
            for seq in batch.decode:
                seq.token_ids.append(PENDING)  # its value arrives when this step completes
            previous, self._inflight = self._inflight, launched
            if previous is not None:
                touched += self._complete(previous)
            return [self._output(s) for s in touched]
        if self._inflight is not None:  # the batch needs the tokens still in flight
            touched += self._complete(self._inflight)
            self._inflight = None
            batch.decode = [s for s in batch.decode if not s.finished]
        if not batch.empty:
            windows = {s.seq_id: c.queries for s in _seqs_of(batch) if (c := self.chains.chains.get(s.seq_id)) and c.queries}
            result = self.runner.execute(batch, windows)
            for seq in _seqs_of(batch):
                if seq.prefix_boundary:
                    self.chains.after_step(seq)
            for seq, _ in batch.prefill:  # after the prefix holders: they keep the whole prefix
                if seq.num_cached == seq.num_tokens:  # the turn's input is in: a method may score it
                    self.runner.scoring_pass(seq, self.tokenizer, self.config.prefill_chunk_size)
            for sid, rows in result.prompt_logits.items():
                self._seqs[sid].prompt_logits.append(rows.cpu())
            tokens = sample(result.logits, [s.params for s in result.sampling], [s.generator for s in result.sampling])
            now = time.monotonic()
            for seq, tok, row in zip(result.sampling, tokens, result.logits):
                if seq.params.return_logits:
                    seq.step_logits.append(row.cpu())
                self._append_token(seq, tok, now)
                touched.append(seq)
        return [self._output(s) for s in touched]

    def _overlap_ok(self) -> bool:
        """Can the next step run ahead of its predecessor's tokens? Steady greedy decoding only."""
        if self.runner.graphs is None or not self.config.async_decode:
            return False
        s = self.scheduler
        if s.waiting or not s.running:
            return False
        chains = self.chains.chains
        return all(q.in_decode and q.params.greedy and not q.params.return_logits
                   and not (q.seq_id in chains and chains[q.seq_id].queries is not None) for q in s.running)

    def _complete(self, inflight) -> list[Sequence]:
        """Wait for a launched step's tokens and take them in (stop checks, text, outputs)."""
        tokens = inflight.read()  # waits for that step only, not for the one launched after it
        now = time.monotonic()
        done = []
        for seq, serial, at, tok in zip(inflight.seqs, inflight.serials, inflight.slots, tokens):
            if seq.finished or seq.turn_serial != serial or at >= len(seq.token_ids) or seq.token_ids[at] != PENDING:
                continue  # it finished (or was restarted) meanwhile: this token is past its end
            self._append_token(seq, tok, now, at=at)
            done.append(seq)
        return done

    def _append_token(self, seq: Sequence, token: int, now: float, at: int | None = None) -> None:
        if seq.first_token_time is None:
            seq.first_token_time = now
        if at is None:
            seq.token_ids.append(token)
        else:
            seq.token_ids[at] = token
        seq.output_ids.append(token)
        seq.pending_ids.append(token)
        seq.in_decode = True
        seq.counters.decoded_tokens += 1
        self.totals["decoded_tokens"] += 1
        p = seq.params
        is_stop = token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        if not is_stop:
            seq.pending_text += seq.detok.push(token)
        if is_stop or seq.detok.stopped_on is not None:
            self._finish(seq, "stop")
        elif len(seq.output_ids) >= p.max_tokens or len(seq.output_ids) + seq.prompt_len >= self.max_model_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        while seq.token_ids and seq.token_ids[-1] == PENDING:  # a step launched past the end
            seq.token_ids.pop()
        seq.num_cached = min(seq.num_cached, len(seq.token_ids))
        seq.pending_text += seq.detok.flush()
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.totals[f"finished_{reason}"] += 1
        self.scheduler.remove(seq)
        if seq.seq_id in self.chains.chains:  # a session keeps its chain
            if reason == "abort":
                self.chains.abort_turn(seq)
            elif reason == "error":
                self.chains.fail_turn(seq)
            else:
                self.chains.finish_turn(seq)
            return
        if self.manager.has(seq.seq_id):
            self.manager.release(seq.seq_id)
        self.controller.release(seq.seq_id)

    def _output(self, seq: Sequence) -> RequestOutput:
        out = RequestOutput(
            request_id=seq.seq_id,
            prompt_token_ids=seq.token_ids[: seq.prompt_len] if seq.finished else [],
            token_ids=seq.output_ids,
            text=seq.detok.text,
            new_token_ids=seq.pending_ids,
            new_text=seq.pending_text,
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            error=seq.error,
            counters=seq.counters,
            source_tier=None if seq.source_tier is None else seq.source_tier.value,
            turn_start=seq.turn_start,
            time_to_first_token=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
        )
        seq.pending_ids, seq.pending_text = [], ""
        if seq.finished:
            self._seqs.pop(seq.seq_id, None)
        return out

    def logits_of(self, request_id: Hashable) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(prompt logits ``[prompt_len, V]``, step logits ``[generated, V]``) kept for a live request."""
        seq = self._seqs[request_id]
        return (torch.cat(seq.prompt_logits) if seq.prompt_logits else None,
                torch.stack(seq.step_logits) if seq.step_logits else None)

    def generate(self, prompts: Iterable[str | list[int]] | str | list[int], params: SamplingParams | list[SamplingParams] | None = None,
                 method: MethodSpec | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order (each with its logits if asked for)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp, method=method) for p, sp in zip(prompts, plist)]
        seqs = {i: self._seqs[i] for i in ids}
        done: dict[Hashable, RequestOutput] = {}
        while len(done) < len(ids):
            if not self.has_unfinished():
                raise RuntimeError("the engine stopped with requests unfinished")
            for out in self.step():
                if out.finished:
                    seq = seqs[out.request_id]
                    out.prompt_logits = torch.cat(seq.prompt_logits) if seq.prompt_logits else None
                    out.step_logits = torch.stack(seq.step_logits) if seq.step_logits else None
                    done[out.request_id] = out
        return [done[i] for i in ids]

    # --- stats ------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return {
            "pages_total": self.pool.num_pages,
            "pages_free": self.pool.num_free,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": self.scheduler.preemptions,
            "forward_passes": self.runner.forward_passes,
            "graph_steps": self.runner.graph_steps,
            "evicted_pages": self.controller.evicted_pages,
            "evicted_tokens": self.controller.evicted_tokens,
            "sessions": len(self.chains.chains),
            "demotions": self.chains.demotions,
            "swaps": self.scheduler.swaps,
            "prefix_holders": self.chains.prefixes.num_holders,
            **self.totals,
        }


def _seqs_of(batch) -> list[Sequence]:
    return list(batch.decode) + [s for s, _ in batch.prefill]
