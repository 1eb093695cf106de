"""How the agent-quality harness runs its sessions through the engine (the chain API, in process).

Three ways to run the same samples (benchmarks/agent_tasks.py):

``run_reprefill``  the reference: every turn is a one-shot request holding the whole transcript so
                   far (its own earlier replies included), dense, nothing cached between turns.
``run_chain``      one session per sample (``LLMEngine.add_turn``): each turn sends only its new
                   tokens, tagged by role (tool output as ``tool`` spans, which pruning acts on); the
                   session's method compresses the chain at the end of every turn's prefill.
``run_once``       kvpress-style: for each question, a fresh session whose first turn is the whole
                   reference transcript before the question (compressed once, at its end), then the
                   question turn. Against ``run_chain`` it isolates what compressing every turn costs.

The samples of one call run as concurrent sessions (continuous batching), turn by turn.
Every function returns, per sample, one dict per question: answer text, correct, distance.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

from benchmarks.agent_tasks import Sample, is_correct
from engine.method_spec import MethodSpec
from engine.llm import LLMEngine
from engine.sampling import SamplingParams

ANSWER_TOKENS = 6
"""Tokens a question may generate (a 4-digit value is up to 5 tokens; then "." or <|im_end|>)."""

_ids = itertools.count()


@dataclass
class EncodedTurn:
    tokens: list[int]
    spans: list[tuple[int, int, str]]
    question: str | None
    distance: int


def encode_sample(engine: LLMEngine, sample: Sample) -> list[EncodedTurn]:
    """Each turn's token ids (its pieces encoded one by one) and role spans."""
    out = []
    for turn in sample.turns:
        tokens: list[int] = []
        spans = []
        for piece in turn.pieces:
            ids = engine.encode(piece.text)
            if ids:
                spans.append((len(tokens), len(tokens) + len(ids), piece.role))
                tokens += ids
        out.append(EncodedTurn(tokens, spans, turn.question, turn.distance))
    return out


def _params(turn: EncodedTurn) -> SamplingParams:
    return SamplingParams(max_tokens=ANSWER_TOKENS if turn.question is not None else 1)


def _drain(engine: LLMEngine, ids: set) -> dict:
    """Step until every id in ``ids`` finished; their outputs by id."""
    done = {}
    while len(done) < len(ids):
        for o in engine.step():
            if o.finished and o.request_id in ids:
                if o.error:
                    raise RuntimeError(f"request {o.request_id!r} failed: {o.error}")
                done[o.request_id] = o
    return done


def _score(engine: LLMEngine, turn: EncodedTurn, output_ids: list[int]) -> dict:
    text = engine.tokenizer.decode(output_ids, skip_special_tokens=True)
    return {
        "answer": text,
        "expected": turn.question,
        "correct": is_correct(text, turn.question),
        "distance": turn.distance,
    }


def run_reprefill(
    engine: LLMEngine, encoded: list[list[EncodedTurn]]
) -> tuple[list[list[dict]], list[list[int]], list[list[int]]]:
    """Dense, the whole transcript re-prefilled every turn. Returns the scores, each sample's final
    history, and where each turn of it starts (for ``run_once`` and the budgets)."""
    histories: list[list[int]] = [[] for _ in encoded]
    starts: list[list[int]] = [[] for _ in encoded]
    scores: list[list[dict]] = [[] for _ in encoded]
    dense = MethodSpec("dense")
    for t in range(max(len(e) for e in encoded)):
        ids = {}
        for i, turns in enumerate(encoded):
            if t < len(turns):
                starts[i].append(len(histories[i]))
                histories[i] += turns[t].tokens
                ids[
                    engine.add_request(
                        list(histories[i]), _params(turns[t]), request_id=f"re{next(_ids)}", method=dense
                    )
                ] = i
        for rid, o in _drain(engine, set(ids)).items():
            i = ids[rid]
            if encoded[i][t].question is not None:
                scores[i].append(_score(engine, encoded[i][t], o.token_ids))
            histories[i] += list(o.token_ids)
    return scores, histories, starts


def run_chain(
    engine: LLMEngine, encoded: list[list[EncodedTurn]], spec_of: Callable[[int], MethodSpec]
) -> tuple[list[list[dict]], list[dict]]:
    """One session per sample (``spec_of(i)`` its method); returns the scores and each session's
    final KV footprint (kv tokens summed over layers and kv-heads, pruned tokens)."""
    sids = [f"aq{next(_ids)}" for _ in encoded]
    scores: list[list[dict]] = [[] for _ in encoded]
    for t in range(max(len(e) for e in encoded)):
        ids = {}
        for i, turns in enumerate(encoded):
            if t < len(turns):
                turn = turns[t]
                engine.add_turn(
                    sids[i], turn.tokens, _params(turn), spans=turn.spans, method=spec_of(i) if t == 0 else None
                )
                ids[sids[i]] = i
        for sid, o in _drain(engine, set(ids)).items():
            i = ids[sid]
            if encoded[i][t].question is not None:
                scores[i].append(_score(engine, encoded[i][t], o.token_ids))
    footprint = []
    for sid in sids:
        info = engine.session_info(sid)
        footprint.append(
            {
                "kv_tokens": info.kv_tokens,
                "history_tokens": info.num_tokens,
                "cached_tokens": info.cached_tokens,
                "pruned_tokens": info.pruned_tokens,
            }
        )
        engine.end_session(sid)
    return scores, footprint


def run_once(
    engine: LLMEngine,
    encoded: list[list[EncodedTurn]],
    histories: list[list[int]],
    starts: list[list[int]],
    spec_of: Callable[[int], MethodSpec],
) -> list[list[dict]]:
    """Per question: a session whose first turn is the reference transcript before it (less the
    token the previous turn generated, which this turn generates again), then the question."""
    jobs = []  # (sample, turn index)
    for i, turns in enumerate(encoded):
        jobs += [(i, t) for t, turn in enumerate(turns) if turn.question is not None and t > 0]
    sids = {f"once{next(_ids)}": job for job in jobs}
    for sid, (i, t) in sids.items():
        engine.add_turn(sid, histories[i][: starts[i][t] - 1], SamplingParams(max_tokens=1), method=spec_of(i))
    _drain(engine, set(sids))
    for sid, (i, t) in sids.items():
        turn = encoded[i][t]
        engine.add_turn(sid, turn.tokens, _params(turn), spans=turn.spans)
    outs = _drain(engine, set(sids))
    scores: list[list[dict]] = [[] for _ in encoded]
    for sid, (i, t) in sids.items():  # jobs are in (sample, turn) order
        scores[i].append(_score(engine, encoded[i][t], outs[sid].token_ids))
        engine.end_session(sid)
    return scores
