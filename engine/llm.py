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
import threading
from typing import Any, Hashable, Iterable

import torch

from engine.build import attention_backend, num_pages, resolve_device, resolve_dtype, staging_pages
from engine.cache.formats import make_format
from engine.cache.manager import CacheManager
from engine.cache.pages import PagePool
from engine.chain import ChainCache, ChainState, SessionError, SessionInfo, Tier, TurnSpec
from engine.config import EngineConfig
from engine.constrained import GrammarBackend
from engine.controller import SparseController
from engine.lifecycle import ModelShape, SeqInfo
from engine.method_spec import MethodSpec
from engine.distributed.layers import TensorParallelLlama
from engine.distributed.sharding import shard_layout
from engine.distributed.snapshots import for_rank as snapshot_for_rank
from engine.methods import get_method_class
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import (
    ModelConfig,
    load_hf_config,
    load_tokenizer,
    parse_hf_config,
    read_safetensors,
    resolve_model_dir,
)
from engine.reports import EngineStats, ModelInfo
from engine.requests import CapacityError, RequestError, RequestFactory
from engine.runner import ModelRunner
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import RequestOutput, Sequence, SeqStatus
from engine.stepping import StepLoop

__all__ = ["CapacityError", "LLMEngine", "RequestError", "resolve_device", "resolve_dtype"]

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, random_weights: bool = False, **overrides: Any):
        """Load the model and size the KV pool. ``random_weights`` keeps the real shapes but
        initialises weights randomly (throughput benchmarks); the checkpoint's config is still read."""
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = EngineConfig.from_dict({**config.to_dict(), **overrides})
        self.config = config
        self.default_spec = MethodSpec.from_config(config)
        get_method_class(config.method)  # an unknown method fails before the model loads
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_dir = resolve_model_dir(config.model, need_weights=not random_weights)
        self.hf_config = load_hf_config(self.model_dir)
        self.model_config: ModelConfig = parse_hf_config(self.hf_config)
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if mc.sliding_window and self.max_model_len > mc.sliding_window:
            log.warning(
                "%s uses a sliding window of %d; max_model_len capped to it", mc.architecture, mc.sliding_window
            )
            self.max_model_len = mc.sliding_window
        self.tokenizer = load_tokenizer(self.model_dir)

        self.shard = shard_layout(config, mc)
        """This rank's part of the model at tensor_parallel_size > 1 (engine/distributed); None: all of it."""
        if self.shard is None:
            self.model = LlamaForCausalLM.create(mc, self.hf_config, self.max_model_len, self.dtype, self.device)
        else:
            self.model = TensorParallelLlama.create_shard(
                mc, self.shard, self.hf_config, self.max_model_len, self.dtype, self.device
            )
        num_heads, num_kv_heads = (
            (mc.num_heads, mc.num_kv_heads) if self.shard is None else (self.shard.num_heads, self.shard.num_kv_heads)
        )  # a rank caches only its own kv-heads
        if random_weights:
            self.model.init_random(seed=config.seed)
        else:
            self.model.load_weights(read_safetensors(self.model_dir))
        self.model.eval()

        self.shape = ModelShape(
            num_layers=mc.num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=mc.head_dim,
            page_size=config.page_size,
            rope_cos=self.model.rope_cos,
            rope_sin=self.model.rope_sin,
            device=self.device,
        )
        slots = config.max_cached_seqs or 4 * config.max_num_seqs
        # the pool stores pages in the layout the configured method declares (plain, fp8, kivi, ...)
        layout = get_method_class(config.method)(self.default_spec, self.shape).kv_layout()
        fmt = make_format(layout.format, layout.args, config.page_size, mc.head_dim, self.dtype)
        max_open = staging_pages(fmt, slots, mc.num_layers, num_kv_heads)
        pages = num_pages(config, fmt, max_open, mc.num_layers, num_kv_heads, self.device)
        self.pool = PagePool(
            pages, config.page_size, mc.head_dim, self.dtype, self.device, format=fmt, max_open_pages=max_open
        )
        self.manager = CacheManager(self.pool, mc.num_layers, num_kv_heads, slots, self.max_model_len)
        self.controller = SparseController(self.shape, self.manager, int(config.recall_host_gb * 2**30))
        self.controller.method_for(self.default_spec)  # a bad method setting fails here, not on the first request
        self.requests = RequestFactory(
            vocab_size=mc.vocab_size,
            max_model_len=self.max_model_len,
            prefill_chunk_size=config.prefill_chunk_size,
            seed=config.seed,
            manager=self.manager,
            controller=self.controller,
            tokenizer=self.tokenizer,
        )
        self.chains = ChainCache(
            config, self.manager, self.controller, self.requests, self.default_spec, self.fingerprint()
        )
        self.scheduler = Scheduler(config, self.manager, self.controller, reclaimer=self.chains.tiers)
        self.backend = attention_backend(config.attention_backend, self.device)
        graphs = None
        graphs_ok = config.cuda_graphs and self.shard is None  # TP ranks decode eagerly
        if self.device.type == "cuda" and graphs_ok and self.backend.name == "triton" and fmt.plain:
            from engine.cuda_graphs import DecodeGraphs

            graphs = DecodeGraphs(self.model, self.manager, config.max_num_seqs, self.backend.num_sms)
        self.runner = ModelRunner(self.model, self.manager, self.controller, self.backend, graphs)
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.loop = StepLoop(
            config, self.scheduler, self.runner, self.chains, self.tokenizer, self.eos_token_ids, self.max_model_len
        )
        self._grammars: GrammarBackend | None = None
        self._grammars_lock = threading.Lock()
        self.requests.matchers = lambda params: self.grammars.matcher(params.constraint, params.stop_token_ids)
        self.loop.grammar_masks = lambda logits, matchers: self.grammars.apply_masks(logits, matchers)
        self._seqs: dict[Hashable, Sequence] = self.loop.seqs
        self._ids = itertools.count()

    @property
    def totals(self) -> dict[str, int]:
        """Engine-wide counters since start (stats() reports them)."""
        return self.loop.totals

    # --- text --------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self._need_tokenizer().encode(text, add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        out = self._need_tokenizer().apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **kwargs
        )
        return list(out)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise RequestError(f"{self.model_dir} has no tokenizer; give token ids instead of text")
        return self.tokenizer

    # --- requests -----------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: Hashable | None = None,
        method: MethodSpec | None = None,
    ) -> Hashable:
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

    def new_sequence(
        self, seq_id: Hashable, token_ids: list[int], params: SamplingParams, spec: MethodSpec
    ) -> Sequence:
        """A validated Sequence (not yet queued)."""
        return self.requests.new_sequence(seq_id, token_ids, params, spec)

    @property
    def grammars(self) -> GrammarBackend:
        """Structured output's grammar compiler (built on first use; thread-safe): servers call
        ``engine.grammars.compile(constraint)`` on a worker thread so the turn finds it compiled."""
        if self._grammars is None:
            with self._grammars_lock:
                if self._grammars is None:
                    if self.tokenizer is None:
                        raise RequestError(f"{self.model_dir} has no tokenizer; structured output needs one")
                    # its own tokenizer: the engine thread detokenizes with the shared one
                    tok = load_tokenizer(self.model_dir) or self.tokenizer
                    self._grammars = GrammarBackend(tok, self.model_config.vocab_size, self.eos_token_ids)
        return self._grammars

    def fingerprint(self) -> str:
        """What KV computed here depends on: a snapshot from another fingerprint is recomputed."""
        mc, cfg = self.model_config, self.config
        return f"{self.model_dir.name}|{mc.architecture}|{mc.num_layers}x{mc.num_kv_heads}x{mc.head_dim}|{self.dtype}|p{cfg.page_size}"

    # --- sessions (the Chain Cache) ----------------------------------------------------------------
    def add_turn(
        self, session_id: Hashable, tokens: list[int] = (), params: SamplingParams | None = None, **options: Any
    ) -> Hashable:
        """``submit_turn`` with the turn given as ``TurnSpec``'s fields: ``tokens``, ``params`` and
        any of its options by name (``role``, ``spans``, ``method``, ``history``, ``hints``, ...)."""
        return self.submit_turn(session_id, TurnSpec(list(tokens), params or SamplingParams(), **options))

    def submit_turn(self, session_id: Hashable, turn: TurnSpec) -> Hashable:
        """Run one turn of a session: ``turn.tokens`` are appended to its history and only they are
        prefilled, attending to the session's cached (possibly compressed) KV. Creates the session
        on its first turn (engine/chain/turn_spec.py says what a turn may ask for). Outputs carry
        the request id ``session_id``."""
        if session_id in self._seqs and session_id not in self.chains.chains:
            raise RequestError(f"id {session_id!r} is in use by a one-shot request")
        try:
            seq = self.chains.start_turn(session_id, turn)
        except CapacityError:
            raise
        except RequestError as e:
            raise SessionError(str(e)) from None
        self._seqs[session_id] = seq
        self.scheduler.add(seq)
        return session_id

    def end_session(self, session_id: Hashable) -> None:
        """Drop a session; a turn still running on it is aborted first."""
        chain = self.chains.chains.get(session_id)
        if chain is not None and chain.state is ChainState.ACTIVE:
            self.abort(session_id)
        self.chains.end(session_id)

    def fork_session(self, session_id: Hashable, child_id: Hashable) -> None:
        self.chains.fork(session_id, child_id)

    def session_info(self, session_id: Hashable) -> SessionInfo:
        return self.chains.info(session_id)

    def set_eviction_priority(self, session_id: Hashable, priority: int) -> None:
        """Idle sessions of a lower priority leave the GPU (and host RAM) first (``ChainTiers``)."""
        self.chains.tiers.set_priority(session_id, priority)

    def span_kv_tokens(self, session_id: Hashable) -> list[float] | None:
        return self.chains.tiers.span_kv_tokens(session_id)

    def prune_history(self, session_id: Hashable, start: int, end: int, **policy) -> int:
        return self.chains.prune(session_id, start, end, **policy)

    def snapshot_session(self, session_id: Hashable, with_kv: bool = True):
        return self.chains.snapshot(session_id, with_kv)

    def load_session(self, snapshot, source: Tier = Tier.STORE) -> None:
        """Make a session from a snapshot (one made at any tensor_parallel_size: re-sharded here)."""
        rank = 0 if self.shard is None else self.shard.rank
        self.chains.load(snapshot_for_rank(snapshot, self.config.tensor_parallel_size, rank), source)

    def add_prefilled_request(
        self,
        num_tokens: int,
        kv_tokens: int | torch.Tensor,
        params: SamplingParams,
        method: MethodSpec | None = None,
        seed: int = 0,
    ) -> Hashable:
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
        self.loop.finish(seq, "abort")
        return self.loop.output(seq)

    def has_unfinished(self) -> bool:
        return self.loop.has_unfinished()

    # --- stepping -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward pass; outputs for every request that produced tokens or finished
        (engine/stepping.py: on the GPU, steady greedy decoding runs one step ahead)."""
        return self.loop.step()

    def prefetch(self) -> int:
        """Between steps, with nothing to run: bring back onto the GPU the sessions in host memory
        whose agents are due back (the ``expected_return_s`` hint), as far as free pages allow
        (``step`` does one at a time while requests run). Returns the sessions prefetched."""
        return self.loop.prefetch(limit=None)

    def next_prefetch_in(self) -> float | None:
        """Seconds until a session in host memory falls due for a prefetch (None: none will); an
        idle server wakes then to call ``prefetch``."""
        return self.chains.tiers.next_prefetch_in()

    def logits_of(self, request_id: Hashable) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(prompt logits ``[prompt_len, V]``, step logits ``[generated, V]``) kept for a live request."""
        seq = self._seqs[request_id]
        return (
            torch.cat(seq.prompt_logits) if seq.prompt_logits else None,
            torch.stack(seq.step_logits) if seq.step_logits else None,
        )

    def generate(
        self,
        prompts: Iterable[str | list[int]] | str | list[int],
        params: SamplingParams | list[SamplingParams] | None = None,
        method: MethodSpec | None = None,
    ) -> list[RequestOutput]:
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

    # --- reports ------------------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        mc, cfg = self.model_config, self.config
        return ModelInfo(
            name=self.model_dir.name,
            architecture=mc.architecture,
            max_model_len=self.max_model_len,
            vocab_size=mc.vocab_size,
            method=cfg.method,
            fingerprint=self.fingerprint(),
            prune_roles=tuple(cfg.prune_roles),
            prune_lag=cfg.prune_lag,
        )

    def _recall_stats(self) -> dict[str, int]:
        """The recall tier's copies since the engine started (engine/recall.py)."""
        tier = self.controller.recall
        t = tier.traffic
        return {
            "recall_d2h_bytes": t.d2h_bytes,
            "recall_h2d_bytes": t.h2d_bytes,
            "recall_pages_fetched": t.pages_fetched,
            "recalled_tokens": t.recalled_tokens,
            "recalls": t.recalls,
            "recall_host_bytes": tier.host_bytes,
            "recall_staging_buffers": tier.staging_buffers,
        }

    def stats(self) -> EngineStats:
        by_state: dict[str, int] = {}
        for chain in self.chains.chains.values():
            by_state[chain.state.value] = by_state.get(chain.state.value, 0) + 1
        return EngineStats(
            pages_total=self.pool.num_pages,
            pages_free=self.pool.num_free,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            preemptions=self.scheduler.preemptions,
            forward_passes=self.runner.forward_passes,
            graph_steps=self.runner.graph_steps,
            evicted_pages=self.controller.evicted_pages,
            evicted_tokens=self.controller.evicted_tokens,
            sessions=len(self.chains.chains),
            demotions=self.chains.demotions,
            swaps=self.scheduler.swaps,
            prefetches=self.chains.tiers.prefetches,
            prefetch_hits=self.chains.tiers.prefetch_hits,
            prefix_holders=self.chains.prefixes.num_holders,
            sessions_by_state=by_state,
            **self._recall_stats(),
            **self.totals,
        )
