"""The engine's own rates, measured on the engine a benchmark just ran (benchmarks/agent_trace.py):
what a lower bound on that run's makespan is computed from (benchmarks/makespan_bound.py).

* prefill: the time to prefill ``L`` tokens from nothing, ``F(L)``, at lengths spanning the trace's
  contexts (one-shot requests of random tokens, one output token); prefilling ``n`` tokens on top of
  ``c`` cached ones then costs ``F(c + n) - F(c)`` (interpolated), attention's growth included;
* decode: the time of one decode step at each batch size the run reaches (``b`` sequences of the
  trace's mean context, timed over ``DECODE_STEPS`` steps once all of them decode);
* host <-> device bandwidth: a ``BANDWIDTH_MB`` copy each way (pinned host memory on a GPU, timed
  with CUDA events; on the CPU a memory copy, timed by the clock).

Each is the best of ``REPEATS`` tries. The engine must be idle (its server stopped).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import asdict, dataclass, field

import torch

from engine.llm import LLMEngine
from engine.sampling import SamplingParams

REPEATS = 2
DECODE_STEPS = 8
BANDWIDTH_MB = 256


@dataclass
class EngineRates:
    prefill_points: list[tuple[int, float]] = field(default_factory=list)
    """(tokens L, seconds F(L)) to prefill L tokens from nothing; (0, 0) first."""
    decode_context: int = 0
    """The context (tokens) of the sequences the decode steps were timed at."""
    decode_step_s: dict[int, float] = field(default_factory=dict)
    """Batch size -> seconds per decode step."""
    h2d_gb_s: float = 0.0
    d2h_gb_s: float = 0.0

    def prefill_time(self, tokens: float) -> float:
        """F(tokens), linear between the measured points (and beyond the last, at its rate)."""
        xs = [x for x, _ in self.prefill_points]
        ys = [y for _, y in self.prefill_points]
        if tokens <= 0:
            return 0.0
        i = bisect.bisect_left(xs, tokens)
        if i >= len(xs):
            (x0, y0), (x1, y1) = self.prefill_points[-2], self.prefill_points[-1]
        else:
            x0, y0, x1, y1 = xs[i - 1], ys[i - 1], xs[i], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def prefill_cost(self, context: int, tokens: int) -> float:
        """Seconds to prefill ``tokens`` on top of ``context`` cached ones."""
        return max(0.0, self.prefill_time(context + tokens) - self.prefill_time(context))

    def decode_time(self, batch: int) -> float:
        """Seconds per decode step at ``batch`` (the nearest measured batch at or above it)."""
        sizes = sorted(self.decode_step_s)
        return self.decode_step_s[next((b for b in sizes if b >= batch), sizes[-1])]

    def as_dict(self) -> dict:
        d = asdict(self)
        d["prefill_tokens_per_s"] = {x: x / y for x, y in self.prefill_points if x}
        return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tokens(engine: LLMEngine, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, engine.model_config.vocab_size - 100, (n,), generator=g).tolist()


def measure_prefill(engine: LLMEngine, lengths: list[int]) -> list[tuple[int, float]]:
    """(L, F(L)) points, made non-decreasing (a longer prefill never costs less than a shorter one:
    a point below its predecessor is noise and takes the predecessor's time)."""
    engine.generate([_tokens(engine, min(lengths), -1)], SamplingParams(max_tokens=1, ignore_eos=True))  # warm-up
    points = [(0, 0.0)]
    for k, n in enumerate(sorted(set(lengths))):
        best = float("inf")
        for r in range(REPEATS):
            _sync(engine.device)
            t0 = time.perf_counter()
            engine.generate([_tokens(engine, n, 1000 * k + r)], SamplingParams(max_tokens=1, ignore_eos=True))
            _sync(engine.device)
            best = min(best, time.perf_counter() - t0)
        points.append((n, max(best, points[-1][1])))
    return points


def measure_decode(engine: LLMEngine, batch: int, context: int) -> float:
    best = float("inf")
    for r in range(REPEATS):
        params = SamplingParams(max_tokens=DECODE_STEPS + 2, ignore_eos=True)
        ids = [engine.add_request(_tokens(engine, context, 7919 * r + i), params) for i in range(batch)]
        while engine.scheduler.waiting or not all(s.in_decode for s in engine.scheduler.running):
            engine.step()
        _sync(engine.device)
        t0 = time.perf_counter()
        for _ in range(DECODE_STEPS):
            engine.step()
        _sync(engine.device)
        best = min(best, (time.perf_counter() - t0) / DECODE_STEPS)
        while engine.has_unfinished():
            engine.step()
        assert len(ids) == batch
    return best


def measure_bandwidth(device: torch.device) -> tuple[float, float]:
    n = BANDWIDTH_MB * 2**20
    if device.type == "cuda":
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        rates = []
        for src, dst in ((host, dev), (dev, host)):
            best = float("inf")
            for _ in range(REPEATS + 1):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3)
            rates.append(n / best / 1e9)
        return rates[0], rates[1]
    a, b = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    best = float("inf")
    for _ in range(REPEATS + 1):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return n / best / 1e9, n / best / 1e9


def measure(engine: LLMEngine, contexts: list[int], batches: list[int], decode_context: int) -> EngineRates:
    """Rates at the trace's context lengths (``contexts``: the longest one is measured, and a few
    below it) and at each of ``batches``."""
    top = max(16, max(contexts))
    limit = engine.max_model_len - 2
    lengths = sorted({min(limit, max(16, int(top * f))) for f in (0.125, 0.25, 0.5, 0.75, 1.0)})
    rates = EngineRates(prefill_points=measure_prefill(engine, lengths), decode_context=decode_context)
    for b in sorted(set(batches)):
        rates.decode_step_s[b] = measure_decode(engine, b, min(decode_context, limit - DECODE_STEPS - 2))
    rates.h2d_gb_s, rates.d2h_gb_s = measure_bandwidth(engine.device)
    return rates
