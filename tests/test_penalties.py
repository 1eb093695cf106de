"""presence_penalty, frequency_penalty and repetition_penalty (engine/penalties.py).

Fast: the penalty math on tiny tensors against the formulas, written out per element; the per-sequence
counts kept across steps and turns; rows without a penalty untouched; hostile values refused; a tiny
random model batched with and without penalties. Slow (SmolLM2): greedy with repetition_penalty equals
Hugging Face's ``generate(repetition_penalty=...)`` token for token, and frequency_penalty breaks a
greedy loop.
"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.penalties import apply_penalties, penalize
from engine.sampling import SamplingError, SamplingParams
from engine.sequence import Sequence

from tests.conftest import chat, make_engine, run_turn


def _seq(prompt: list[int], output: list[int], **penalties) -> Sequence:
    s = Sequence("s", prompt + output, SamplingParams(**penalties), spec=None, tokenizer=None, generator=None)
    s.output_ids = list(output)
    return s


def _expected(row: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    """The formulas, one logit at a time (vLLM's order: repetition, then frequency and presence)."""
    out = []
    for t, x in enumerate(row):
        if t in prompt or t in output:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        c = output.count(t)
        out.append(x - c * p.frequency_penalty - (1.0 if c else 0.0) * p.presence_penalty)
    return out


ROW = [2.0, -1.0, 0.0, 3.0, -4.0, 0.5]
CASES = [
    # prompt, output, penalties
    ([0], [3, 3, 1], {"frequency_penalty": 0.5}),
    ([0], [3, 3, 1], {"presence_penalty": 1.5}),
    ([0], [3, 3, 1], {"presence_penalty": -2.0, "frequency_penalty": -0.25}),
    ([0, 4], [3, 3, 1], {"repetition_penalty": 1.3}),
    ([0, 4], [3, 3, 1], {"repetition_penalty": 0.5}),
    ([0, 4], [3, 3, 1], {"repetition_penalty": 2.0, "frequency_penalty": 1.0, "presence_penalty": 0.5}),
    ([5], [], {"repetition_penalty": 2.0, "frequency_penalty": 1.0}),  # the first token: the prompt only
    ([2], [2, 2, 2, 2], {"frequency_penalty": 2.0, "repetition_penalty": 3.0}),  # a zero logit stays 0
]


@pytest.mark.parametrize("prompt,output,penalties", CASES)
def test_penalties_match_the_formulas(prompt, output, penalties):
    seq = _seq(prompt, output, **penalties)
    logits = torch.tensor([ROW])
    apply_penalties(logits, [seq])
    assert logits[0].tolist() == pytest.approx(_expected(ROW, prompt, output, seq.params), abs=1e-6)


def test_a_batch_penalizes_only_its_penalized_rows():
    seqs = [_seq(*case[:2], **case[2]) for case in CASES] + [_seq([0, 1], [3, 3])]  # the last: no penalty
    logits = torch.randn(len(seqs), len(ROW))
    before = logits.clone()
    apply_penalties(logits, seqs)
    for i, (seq, (prompt, output, _)) in enumerate(zip(seqs, CASES)):
        assert logits[i].tolist() == pytest.approx(_expected(before[i].tolist(), prompt, output, seq.params), abs=1e-5)
    assert torch.equal(logits[-1], before[-1]) and seqs[-1].penalty_state is None


def test_a_batch_without_penalties_is_not_touched():
    seqs = [_seq([0, 1], [3, 3]), _seq([2], [])]
    logits = torch.randn(2, 6)
    view = logits.clone()
    apply_penalties(logits, seqs)
    assert torch.equal(logits, view) and all(s.penalty_state is None for s in seqs)


def test_counts_follow_the_sequence_across_steps_and_turns():
    seq = _seq([0, 4], [], frequency_penalty=1.0, repetition_penalty=2.0)
    history = []
    for tok in [3, 3, 1, 5, 3]:  # one step at a time, like the step loop
        logits = torch.tensor([ROW])
        apply_penalties(logits, [seq])
        assert logits[0].tolist() == pytest.approx(_expected(ROW, [0, 4], history, seq.params), abs=1e-6)
        seq.token_ids.append(tok)
        seq.output_ids.append(tok)
        history.append(tok)
    assert seq.penalty_state.counts.tolist() == [0, 1, 0, 2, 0, 1]  # the last token is counted next step
    seq.reset_turn(None)  # a session's next turn: its prompt is the whole history, its output starts again
    logits = torch.tensor([ROW])
    apply_penalties(logits, [seq])
    assert logits[0].tolist() == pytest.approx(_expected(ROW, [0, 4] + history, [], seq.params), abs=1e-6)


def test_placeholders_and_out_of_vocab_prompt_tokens_are_ignored():
    seq = _seq([-1, 0, 10**9], [], repetition_penalty=2.0)  # -1: a token still in flight (PENDING)
    logits = torch.tensor([ROW])
    apply_penalties(logits, [seq])
    assert logits[0].tolist() == pytest.approx(_expected(ROW, [0], [], seq.params), abs=1e-6)


def test_penalize_keeps_masked_and_non_finite_logits_out():
    x = torch.tensor([[float("-inf"), 1.0, -1.0]])
    seen = torch.tensor([[True, True, True]])
    counts = torch.tensor([[3.0, 1.0, 0.0]])
    one = torch.tensor([1.0])
    out = penalize(x, -2 * one, -2 * one, 100 * one, counts, seen)
    assert out[0, 0] == float("-inf") and out[0].tolist()[1:] == pytest.approx([0.01 + 4, -100.0])


HOSTILE = [float("nan"), float("inf"), -float("inf"), 1e300, -1e300, True, "1", None, [1.0]]


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [*HOSTILE, 2.0000001, -2.5])
def test_hostile_openai_penalties_are_refused(name, value):
    with pytest.raises(SamplingError, match=name):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("value", [*HOSTILE, 0.0, -1.0, 1e-300, 5e-324, 0.0099, 100.5])
def test_hostile_repetition_penalties_are_refused(value):
    with pytest.raises(SamplingError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=value)


_ANY = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**70), 2**70), st.booleans())


@settings(max_examples=300, deadline=None)
@given(presence=_ANY, frequency=_ANY, repetition=_ANY, big=st.sampled_from([1.0, 1e4, 3e38]))
def test_penalties_are_refused_or_keep_the_logits_usable(presence, frequency, repetition, big):
    try:
        p = SamplingParams(presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition)
    except SamplingError:
        return
    assert -2 <= p.presence_penalty <= 2 and -2 <= p.frequency_penalty <= 2 and 0.01 <= p.repetition_penalty <= 100
    seq = _seq([0, 1, 2], [3, 3, 4])
    seq.params = p
    logits = torch.randn(1, 8) * big
    apply_penalties(logits, [seq])
    assert not torch.isnan(logits).any() and torch.isfinite(logits).any()


# --- the gRPC Turn and the adapters' requests ---------------------------------------------------------


def _turn(**options):
    from agent_adapters.client import build_turn_request

    return build_turn_request("s", [{"role": "user", "content": "hi"}], **options)


def _parsed(req, limits):
    """The sidecar's checks of a gRPC TurnRequest (its Turn converts it to the typed request first)."""
    from sidecar.turns.protocol import parse_turn
    from sidecar.turns.request import from_proto

    return parse_turn(from_proto(req), limits)


def test_turn_request_penalties_reach_sampling_params():
    from sidecar.turns.protocol import Limits

    args = _parsed(_turn(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.3), Limits())
    assert (args.params.presence_penalty, args.params.frequency_penalty, args.params.repetition_penalty) == (
        0.5,
        -1.0,
        1.3,
    )
    unset = _parsed(_turn(), Limits()).params
    assert (unset.presence_penalty, unset.frequency_penalty, unset.repetition_penalty) == (0.0, 0.0, 1.0)


@pytest.mark.parametrize(
    "name,value",
    [(n, v) for n in ("presence_penalty", "frequency_penalty") for v in (float("nan"), float("inf"), 2.5, -1e300)]
    + [("repetition_penalty", v) for v in (float("nan"), -float("inf"), 0.0, -1.0, 1e-300, 1e300)],
)
def test_hostile_turn_request_penalties_are_invalid_requests(name, value):
    from sidecar.turns.protocol import InvalidRequest, Limits

    with pytest.raises(InvalidRequest, match=name):
        _parsed(_turn(**{name: value}), Limits())


def test_adapters_send_the_penalties():
    from agent_adapters.langchain import ChatChainKV
    from agent_adapters.llamaindex import ChainKVLLM

    fields = {"presence_penalty": 0.5, "frequency_penalty": 1.0, "repetition_penalty": 1.1}
    _, _, _, lc = ChatChainKV(target="127.0.0.1:1", **fields)._call_args([], None, {}, None)
    _, _, _, li = ChainKVLLM(target="127.0.0.1:1", **fields)._args([], {})
    for options in (lc, li):
        options = {k: v for k, v in options.items() if k != "timeout_s"}
        req = _turn(**options)
        assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty) == (0.5, 1.0, 1.1)
    assert not _turn().HasField("repetition_penalty")


# --- engine ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_engine(tiny_models):
    folder, _ = tiny_models("llama")
    return make_engine(folder, num_pages=800, prefill_chunk_size=32, page_size=16)


def test_tiny_model_penalties_are_batch_invariant_and_change_the_reply(tiny_engine):
    prompt = list(range(5, 25))
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    strong = SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=2.0, frequency_penalty=2.0)
    rep = SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=100.0)
    alone = [tiny_engine.generate([prompt], p)[0].token_ids for p in (plain, strong, rep)]
    together = [o.token_ids for o in tiny_engine.generate([prompt] * 3, [plain, strong, rep])]
    assert together == alone
    assert len(set(alone[0])) < len(alone[0])  # the random model repeats itself greedily
    assert alone[1] != alone[0]
    assert len(set(alone[1])) == len(alone[1])  # +2 per occurrence outweighs a tiny model's logit gaps


@pytest.mark.parametrize(
    "penalty,runs_ahead",
    [
        ({}, True),
        ({"frequency_penalty": 0.5}, False),
        ({"presence_penalty": -1.0}, False),
        ({"repetition_penalty": 1.1}, False),
    ],
)
def test_penalized_sequences_never_run_ahead(tiny_engine, monkeypatch, penalty, runs_ahead):
    """Run-ahead decode (CUDA graphs, GPU only) argmaxes on the device without the penalties: the step
    loop must not choose it while a penalized sequence runs. Checked here on the decision itself."""
    loop = tiny_engine.loop
    tiny_engine.add_request(list(range(5, 25)), SamplingParams(max_tokens=4, ignore_eos=True, **penalty))
    tiny_engine.step()  # the prompt is in: the sequence is decoding
    monkeypatch.setattr(loop.runner, "graphs", object())  # as on a GPU with CUDA graphs
    monkeypatch.setattr(loop.config, "async_decode", True)
    assert loop._overlap_ok() is runs_ahead
    monkeypatch.undo()
    while tiny_engine.has_unfinished():
        tiny_engine.step()


def test_tiny_model_session_turns_take_penalties(tiny_engine):
    params = SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=2.0)
    first = run_turn(tiny_engine, "pen", list(range(5, 25)), params)
    second = run_turn(tiny_engine, "pen", [30, 31, 32], params)
    assert len(set(first.token_ids)) == len(first.token_ids) and len(set(second.token_ids)) == len(second.token_ids)
    tiny_engine.end_session("pen")


# --- SmolLM2 (slow) ----------------------------------------------------------------------------------

LOOP_PROMPT = "Write a short story about a cat."


def test_smollm2_repetition_penalty_equals_hf_generate(smol_engine, smollm2_hf):
    prompt = chat(smol_engine, LOOP_PROMPT)
    # 16 tokens: the penalized greedy reply leaves the plain one at its 10th token, so a penalty that did
    # nothing would fail here
    out = smol_engine.generate([prompt], SamplingParams(max_tokens=16, repetition_penalty=1.3))[0]
    with torch.no_grad():
        ref = smollm2_hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, repetition_penalty=1.3)[
            0, len(prompt) :
        ].tolist()
    assert out.token_ids == ref[: len(out.token_ids)]


def _max_ngram_repeats(ids: list[int], n: int = 6) -> int:
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return max((grams.count(g) for g in set(grams)), default=0)


def test_smollm2_frequency_penalty_breaks_a_greedy_loop(smol_engine):
    prompt = chat(smol_engine, LOOP_PROMPT)
    plain = smol_engine.generate([prompt], SamplingParams(max_tokens=160))[0].token_ids
    penalized = smol_engine.generate([prompt], SamplingParams(max_tokens=160, frequency_penalty=1.0))[0].token_ids
    assert _max_ngram_repeats(plain) >= 3, "the greedy reply is expected to loop"
    assert penalized != plain
    assert _max_ngram_repeats(penalized) <= 1, smol_engine.tokenizer.decode(penalized)
