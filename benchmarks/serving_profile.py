"""Where the engine thread's time goes while the sidecar serves a trace (benchmarks/agent_trace.py --profile).

A ``ServingProfile`` wraps methods of a live engine (the scheduler, the runner, the controller, the
cache manager, the chain cache and the attention backend) with timers that nest: for every span
it counts calls, total seconds and *self* seconds (total minus the spans it called), on the engine
thread only. ``mode="sync"`` synchronizes the device at every span boundary, so the GPU work a span
queues is charged to it (the figures are then attribution, not the unprofiled speed);
``mode="host"`` takes host time only. ``count_syncs`` runs every engine step under torch's
sync-debug mode and counts the host<->device synchronizations by source line.

The engine's own counters (``LLMEngine.stats``: forward passes, graph steps, preemptions, demotions,
evicted pages) are reported as the difference over each configuration's replay.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
import warnings
from pathlib import Path
from typing import Any

# (object attribute path on the engine, method name, span name); a span's name says what it is in the
# serving path, so the report reads without the code beside it
SPANS = [
    (None, "step", "step"),
    ("scheduler", "schedule", "schedule"),
    ("scheduler", "_preempt", "schedule.preempt"),
    ("chains.tiers", "reclaim", "tiers.reclaim_pages"),
    ("chains.tiers", "reclaim_slot", "tiers.reclaim_slot"),
    ("chains.tiers", "demote", "tiers.demote_to_host"),
    ("chains.tiers", "restore", "tiers.restore_to_device"),
    ("chains.tiers", "prefetch", "tiers.prefetch_to_device"),
    ("runner", "execute", "forward.eager"),
    ("runner", "_execute_graph", "forward.graph"),
    ("runner", "launch_decode", "forward.graph_async"),
    ("runner", "scoring_pass", "method.scoring_pass"),
    ("controller", "after_prefill_chunk", "method.after_prefill_chunk"),
    ("controller", "apply_pending_evictions", "evict.apply_prefill_decisions"),
    ("controller", "decode_selections", "method.decode_view"),
    ("controller", "move_tiers", "tiers.offload_fetch"),
    ("controller", "after_decode", "method.after_decode"),
    ("controller", "on_turn_end", "method.on_turn_end"),
    ("controller", "after_scoring", "method.after_scoring"),
    ("manager", "compact", "evict.compact"),
    ("manager", "compact_mask", "evict.compact_mask"),
    ("manager", "compact_seq", "evict.compact_seq"),
    ("backend", "prefill", "attention.prefill"),
    ("backend", "decode", "attention.decode"),
    ("chains", "start_turn", "turn.start"),
    ("chains", "finish_turn", "turn.finish"),
    ("chains", "_auto_prune", "turn.auto_prune"),
    ("chains", "prune", "prune"),
    ("loop", "_complete", "step.read_tokens"),
    (None, "submit_turn", "cmd.add_turn"),
    (None, "session_info", "cmd.session_info"),
    (None, "end_session", "cmd.end_session"),
]
COUNTERS = (
    "forward_passes",
    "graph_steps",
    "preemptions",
    "swaps",
    "demotions",
    "prefetches",
    "prefetch_hits",
    "evicted_pages",
    "evicted_tokens",
    "decoded_tokens",
)


class ServingProfile:
    def __init__(
        self, engine: Any, mode: str = "sync", count_syncs: bool = False, torch_steps: int = 0, torch_from: int = 3
    ):
        import torch

        if mode not in ("sync", "host"):
            raise ValueError(f"profile mode must be sync or host, not {mode!r}")
        self.engine = engine
        self.mode = mode
        self.cuda = engine.device.type == "cuda"
        self._sync = torch.cuda.synchronize if (self.cuda and mode == "sync") else (lambda: None)
        self.count_syncs = count_syncs and self.cuda
        self.torch_steps = torch_steps
        """Trace this many eager steps with prefill per configuration with torch's profiler, ..."""
        self.torch_from = torch_from
        """... from this one on (the 3rd by default; later ones see sessions with long histories)."""
        self._local = threading.local()
        self._thread: int | None = None  # the engine thread (the first one to run a step)
        self.reset()
        for owner, attr, name in SPANS:
            obj = (
                engine
                if owner is None
                else functools.reduce(lambda o, a: getattr(o, a, None), owner.split("."), engine)
            )
            if obj is not None and hasattr(obj, attr):
                setattr(obj, attr, self._wrap(getattr(obj, attr), name))

    # --- per configuration --------------------------------------------------------------------
    def reset(self) -> None:
        self.spans: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])  # calls, total, self
        self.sync_sites: collections.Counter = collections.Counter()
        self.steps = 0
        self._traced = 0
        self._prefill_steps = 0
        self._prof = None
        self.torch_tables: dict[str, str] = {}
        self._counters0 = self._counters()
        self._t0 = time.perf_counter()

    def report(self) -> dict:
        wall = time.perf_counter() - self._t0
        now = self._counters()
        spans = {
            k: {"calls": int(c), "total_s": round(t, 4), "self_s": round(s, 4)}
            for k, (c, t, s) in sorted(self.spans.items(), key=lambda kv: -kv[1][2])
        }
        busy = self.spans["step"][1] + sum(v[1] for k, v in self.spans.items() if k.startswith("cmd."))
        return {
            "mode": self.mode,
            "wall_s": round(wall, 3),
            "engine_busy_s": round(busy, 3),
            "engine_steps": self.steps,
            "spans": spans,
            "counters": {k: now[k] - self._counters0.get(k, 0) for k in now},
            "host_syncs": dict(self.sync_sites.most_common(25)) if self.count_syncs else None,
            "torch_profile": self.torch_tables or None,
        }

    def _counters(self) -> dict[str, int]:
        stats = self.engine.stats()
        return {k: int(getattr(stats, k)) for k in COUNTERS}

    # --- spans -----------------------------------------------------------------------------------
    def _wrap(self, fn, name: str):
        profile = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if profile._thread is None and name == "step":
                profile._thread = threading.get_ident()
            if threading.get_ident() != profile._thread:
                return fn(*args, **kwargs)
            if name == "step" and profile.count_syncs:
                return profile._counting_syncs(lambda: profile._span(name, fn, args, kwargs))
            if name == "forward.eager" and profile.torch_steps and args and args[0].prefill:
                return profile._traced_step(lambda: profile._span(name, fn, args, kwargs))
            return profile._span(name, fn, args, kwargs)

        return timed

    def _span(self, name: str, fn, args, kwargs):
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        self._sync()
        stack.append(0.0)  # time spent in child spans
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._sync()
            dt = time.perf_counter() - t0
            children = stack.pop()
            if stack:
                stack[-1] += dt
            rec = self.spans[name]
            rec[0] += 1
            rec[1] += dt
            rec[2] += dt - children
            if name == "step":
                self.steps += 1

    def _traced_step(self, run):
        """Eager passes with prefill chunks: torch_steps of them from the torch_from-th under torch's profiler."""
        import torch

        self._prefill_steps += 1
        if self._traced >= self.torch_steps or self._prefill_steps < self.torch_from:
            return run()
        if self._prof is None:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.__enter__()
        try:
            return run()
        finally:
            self._traced += 1
            if self._traced >= self.torch_steps:
                if self.cuda:
                    torch.cuda.synchronize()
                self._prof.__exit__(None, None, None)
                ka = self._prof.key_averages()
                by = "cuda_time_total" if self.cuda else "cpu_time_total"
                self.torch_tables = {
                    "by_device_time": ka.table(sort_by=by, row_limit=25, max_name_column_width=70),
                    "by_host_self_time": ka.table(
                        sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70
                    ),
                }
                self._prof = None

    def _counting_syncs(self, run):
        import torch

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
                for w in caught:
                    if "synchroniz" in str(w.message):
                        self.sync_sites[f"{Path(w.filename).name}:{w.lineno}"] += 1


def print_report(config: str, rep: dict, rows: int = 14) -> None:
    busy = rep["engine_busy_s"] or 1e-9
    print(
        f"  profile of {config} ({rep['mode']}): engine busy {rep['engine_busy_s']:.2f} s of {rep['wall_s']:.2f} s wall, "
        f"{rep['engine_steps']} steps; " + ", ".join(f"{k} {v}" for k, v in rep["counters"].items() if v)
    )
    for name, s in list(rep["spans"].items())[:rows]:
        print(
            f"    {name:<32} self {s['self_s']:8.3f} s ({100 * s['self_s'] / busy:5.1f}%)  total {s['total_s']:8.3f} s  "
            f"calls {s['calls']}"
        )
    for title, table in (rep.get("torch_profile") or {}).items():
        print(f"    torch profiler, {rep['engine_steps']} steps' prefill passes, {title}:\n{table}")
    if rep["host_syncs"]:
        total = sum(rep["host_syncs"].values())
        print(
            f"    host syncs: {total} over {rep['engine_steps']} steps; top: "
            + ", ".join(f"{k} x{n}" for k, n in list(rep["host_syncs"].items())[:8])
        )
