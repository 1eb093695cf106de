"""The fidelity measures of benchmarks/agent_fidelity.py: a configuration against dense on one transcript.

``run_dense``      dense on the chain, greedy and free-running: its replies complete each transcript
                   (``Reference``: every turn's input tokens and dense's reply tokens)
``run_forced``     one session per reference under a method, teacher-forced on the decode path: each
                   turn's input is sent as dense's was, and after every decode step the sampled token
                   is replaced by dense's (as benchmarks/quant_quality.py does), so the session's
                   history is dense's token for token while the method compresses and recalls as in
                   serving. The recall tier acts once a turn's input is in, so only decoded replies can
                   show it. Per reply position: the configuration's own argmax (its raw logits; no
                   grammar or penalty touches them) against dense's token. At the first decode step of
                   each question turn (the input prefilled, compressed and recalled): the positions
                   each (layer, kv-head) holds on the device, and those it can recall from the cold tier.
``dense_attention`` the dense attention of each question turn's reply queries, from a dense re-prefill
                   of the reference history through the engine's own model (its weights and RoPE)
``attention_recall`` the share of that attention, over the context before the reply, that lands on
                   positions a head holds; averaged over queries, query heads and layers.

Exact match of a question turn: the configuration's free-running greedy reply equals dense's up to
the first position where its argmax differs, then continues with that argmax; the answer counts as
found when it appears in that known prefix (a lower bound where the configuration disagrees early).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from benchmarks.agent_transcripts import Transcript, is_correct
from engine.method_spec import MethodSpec
from engine.llm import LLMEngine
from engine.sampling import SamplingParams

_ids = itertools.count()


@dataclass
class Reference:
    transcript: Transcript
    inputs: list[list[int]]
    replies: list[list[int]]

    @property
    def history(self) -> list[int]:
        return [t for a, b in zip(self.inputs, self.replies) for t in a + b]

    def reply_start(self, turn: int) -> int:
        return sum(len(a) + len(b) for a, b in zip(self.inputs[:turn], self.replies[:turn])) + len(self.inputs[turn])


@dataclass
class Held:
    """What a session holds at a question turn's first decode step, as masks ``[L, H, reply_start]``."""

    device: torch.Tensor
    cold: torch.Tensor


@dataclass
class SessionMeasure:
    agree: list[list[bool]] = field(default_factory=list)
    """Per turn, per reply position: the configuration's argmax equals dense's token."""
    argmax: list[list[int]] = field(default_factory=list)
    held: dict[int, Held] = field(default_factory=dict)
    """By question turn index."""
    kv_fraction: float | None = None
    """KV entries kept at the end on the device / the history's (all layers and kv-heads)."""
    cold_fraction: float = 0.0
    """KV entries in the cold tier at the end / the history's."""


def _drain(engine: LLMEngine, ids: set, on_step=None) -> None:
    done = set()
    while len(done) < len(ids):
        outs = engine.step()
        if on_step is not None:
            on_step()
        for o in outs:
            if o.finished and o.request_id in ids:
                if o.error:
                    raise RuntimeError(f"session {o.request_id!r} failed: {o.error}")
                done.add(o.request_id)


def _input(engine: LLMEngine, text: str, previous_reply: list[int] | None) -> list[int]:
    """A turn's input tokens; after a reply that did not end its message, ``<|im_end|>`` first."""
    if previous_reply is not None and (not previous_reply or previous_reply[-1] not in engine.eos_token_ids):
        text = "<|im_end|>\n" + text
    return engine.encode(text)


def run_dense(engine: LLMEngine, transcripts: list[Transcript]) -> list[Reference]:
    """Dense on the chain, greedy: each transcript's turns with dense's replies (concurrent sessions)."""
    refs = [Reference(t, [], []) for t in transcripts]
    sids = [f"fd{next(_ids)}" for _ in transcripts]
    seqs = {}
    for t in range(max(len(x.turns) for x in transcripts)):
        ids = set()
        for ref, sid in zip(refs, sids):
            if t < len(ref.transcript.turns):
                turn = ref.transcript.turns[t]
                ref.inputs.append(_input(engine, turn.text, ref.replies[-1] if ref.replies else None))
                engine.add_turn(
                    sid,
                    ref.inputs[-1],
                    SamplingParams(max_tokens=turn.reply_tokens),
                    method=MethodSpec("dense") if t == 0 else None,
                )
                seqs[sid] = engine._seqs[sid]
                ids.add(sid)
        _drain(engine, ids)
        for ref, sid in zip(refs, sids):
            if t < len(ref.transcript.turns):
                ref.replies.append(list(seqs[sid].output_ids))
    for sid in sids:
        engine.end_session(sid)
    return refs


def _held(engine: LLMEngine, sid, reply_start: int) -> Held:
    L, H = engine.shape.num_layers, engine.shape.num_kv_heads
    device = torch.zeros(L, H, reply_start, dtype=torch.bool)
    pos = engine.manager.positions(sid).long().cpu()
    ok = (pos >= 0) & (pos < reply_start)
    li, hi, ti = ok.nonzero(as_tuple=True)
    device[li, hi, pos[li, hi, ti]] = True
    cold = torch.zeros_like(device)
    for layer, heads in enumerate(engine.controller.recall.cold_positions(sid)):
        for h, p in enumerate(heads):
            p = p.long().cpu()
            cold[layer, h, p[(p >= 0) & (p < reply_start)]] = True
    return Held(device, cold)


def run_forced(engine: LLMEngine, refs: list[Reference], spec: MethodSpec) -> list[SessionMeasure]:
    """One session per reference under ``spec``, teacher-forced to dense's replies (concurrent sessions)."""
    sids = [f"ff{next(_ids)}" for _ in refs]
    out = [SessionMeasure() for _ in refs]
    for t in range(max(len(r.inputs) for r in refs)):
        active = []
        for i, (ref, sid) in enumerate(zip(refs, sids)):
            if t < len(ref.inputs):
                params = SamplingParams(max_tokens=len(ref.replies[t]), ignore_eos=True, return_logits=True)
                engine.add_turn(sid, ref.inputs[t], params, method=spec if t == 0 else None)
                active.append((i, engine._seqs[sid]))
                out[i].agree.append([])
                out[i].argmax.append([])

        def force():
            for i, seq in active:
                m, forced = out[i], refs[i].replies[t]
                n = len(m.argmax[t])
                if len(seq.output_ids) > n:  # one new token this step: record its argmax, then force dense's
                    assert len(seq.output_ids) == n + 1, "teacher forcing fell behind a step"
                    top = int(seq.step_logits[-1].argmax())
                    seq.step_logits.clear()
                    m.argmax[t].append(top)
                    m.agree[t].append(top == forced[n])
                    seq.token_ids[-1] = forced[n]
                    if n == 0 and refs[i].transcript.turns[t].answer is not None:
                        m.held[t] = _held(engine, sids[i], refs[i].reply_start(t))

        _drain(engine, {sids[i] for i, _ in active}, force)
    L, H = engine.shape.num_layers, engine.shape.num_kv_heads
    for i, sid in enumerate(sids):
        seq = engine.chains.chains[sid].seq
        if seq.token_ids != refs[i].history:
            raise RuntimeError(f"teacher forcing failed: session {sid!r}'s history is not dense's")
        info = engine.session_info(sid)
        out[i].kv_fraction = info.kv_tokens / (L * H * max(1, info.cached_tokens))
        out[i].cold_fraction = engine.controller.recall.cold_tokens(sid) / (L * H * max(1, info.cached_tokens))
        engine.end_session(sid)
    return out


@torch.inference_mode()
def dense_attention(engine: LLMEngine, ref: Reference) -> dict[int, torch.Tensor]:
    """Per question turn: ``[L, H, reply_start]`` float32, the dense attention of the turn's reply
    queries (the last input token and every reply token but the last: the positions that predict the
    reply) over the context before the reply, renormalized there, averaged over queries and each
    kv-head's query heads. Each row sums to 1."""
    model, cfg = engine.runner.model, engine.runner.model.cfg
    H, G, scale = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, engine.runner.scale
    history = ref.history
    spans = {}
    for t in ref.transcript.questions:
        rs = ref.reply_start(t)
        spans[t] = (rs - 1, rs - 1 + len(ref.replies[t]), rs)  # query positions [a, b), context [0, rs)
    out = {t: torch.zeros(cfg.num_layers, H, rs) for t, (_, _, rs) in spans.items()}

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qh = q.transpose(0, 1)  # [Hq, n, D]
        kh = k.transpose(0, 1).repeat_interleave(G, 0)
        vh = v.transpose(0, 1).repeat_interleave(G, 0)
        o = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], is_causal=True, scale=scale)[0]
        for t, (a, b, rs) in spans.items():
            s = torch.einsum("hmd,htd->hmt", qh[:, a:b].float(), kh[:, :rs].float()) * scale
            p = torch.softmax(s, dim=-1)  # every query is at or after the context: no causal mask
            out[t][layer] = p.view(H, G, b - a, rs).mean((1, 2)).cpu()
        return o.transpose(0, 1)

    ids = torch.tensor(history, device=engine.device)
    pos = torch.arange(len(history), device=engine.device)
    model(ids, pos, attend, torch.tensor([len(history) - 1], device=engine.device))
    return out


def attention_recall(mass: torch.Tensor, held: torch.Tensor) -> float:
    """The share of ``mass`` ``[L, H, T]`` (rows summing to 1) on ``held`` positions, averaged over rows."""
    return float((mass * held).sum(-1).mean())


def exact_match(engine: LLMEngine, ref: Reference, turn: int, argmax: list[int] | None = None) -> bool:
    """Whether the free-running reply (dense's; or a configuration's, known up to its first
    disagreement with dense) contains the turn's answer."""
    reply = ref.replies[turn]
    if argmax is not None:
        d = next((j for j, (a, b) in enumerate(zip(argmax, reply)) if a != b), len(reply))
        reply = reply[:d] + argmax[d : d + 1]
    text = engine.tokenizer.decode(reply, skip_special_tokens=True)
    return is_correct(text, ref.transcript.turns[turn].answer)
