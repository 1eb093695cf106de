"""benchmarks/agent_fidelity.py: the agent transcripts (seeded, built from the repo's text, every
question answerable from the step it names), the attention-recall arithmetic, and the harness end to
end at its tiny size on SmolLM2: dense against itself agrees at every position and holds all of its
attention; streaming_llm at 10% of the context holds less of it on the device, and its +recall
variant holds on the device or in the cold tier at least what the device alone holds."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import agent_fidelity
from benchmarks.agent_fidelity_report import section
from benchmarks.agent_transcripts import KINDS, is_correct, make_transcript
from benchmarks.fidelity_measures import attention_recall


def _count(text: str) -> int:
    return max(1, len(text) // 4)


def test_transcripts_are_seeded_and_answerable():
    a, b = make_transcript(3, 4000, _count), make_transcript(3, 4000, _count)
    assert [t.text for t in a.turns] == [t.text for t in b.turns]
    assert [t.text for t in a.turns] != [t.text for t in make_transcript(4, 4000, _count).turns]
    tools = [t for t in a.turns if t.answer is None]
    assert len(tools) == 6 and {t.kind for t in tools} == set(KINDS)
    assert a.turns[0].text.startswith("<|im_start|>system\n")
    assert all(t.text.endswith("<|im_start|>assistant\n") for t in a.turns)
    assert 3000 < sum(_count(t.text) + t.reply_tokens for t in a.turns) < 5000
    qs = [a.turns[i] for i in a.questions]
    assert len(qs) == 3 and len({q.step for q in qs}) == 3
    for q in qs:
        step = tools[q.step - 1]
        assert q.kind == step.kind and f'"step": {q.step},' in step.text
        output = step.text.split("<|im_start|>tool\n")[1]
        assert is_correct(output, q.answer)  # the named step's tool output holds the answer
        if q.kind in ("json", "log"):  # planted values: no other step holds them
            assert not any(is_correct(t.text, q.answer) for t in tools if t is not step)


def test_exact_match_is_a_whole_token():
    assert is_correct("The port is 48213.", "48213") and is_correct("`run_rank` starts", "run_rank")
    assert not is_correct("port 482130", "48213") and not is_correct("run_ranks", "run_rank")
    assert is_correct("docs/sidecar.md covers", "sidecar.md")


def test_attention_recall_is_the_held_share():
    mass = torch.tensor([[[0.5, 0.25, 0.25], [0.0, 0.0, 1.0]]])  # [L=1, H=2, T=3]
    held = torch.tensor([[[True, False, True], [True, True, False]]])
    assert attention_recall(mass, held) == pytest.approx((0.75 + 0.0) / 2)
    assert attention_recall(mass, torch.ones_like(held)) == pytest.approx(1.0)


def test_configurations_order_and_recall_variants():
    cfgs = agent_fidelity.build_configs(["h2o", "quest", "snapkv"], [0.25, 0.1])
    names = [c.name for c in cfgs]
    assert names[:5] == ["dense", "snapkv+recall@0.25", "snapkv@0.25", "h2o+recall@0.25", "h2o@0.25"]
    assert "quest@0.1" in names and "quest+recall@0.1" not in names
    assert cfgs[1].spec().method == "snapkv+recall" and cfgs[1].spec().budget_ratio == 0.25
    variants = agent_fidelity.build_configs(["snapkv"], [0.25], [{}, {"recall_interval": 4}])
    assert [c.name for c in variants] == [
        "dense",
        "snapkv+recall@0.25",
        "snapkv+recall[recall_interval=4]@0.25",
        "snapkv@0.25",
    ]
    assert variants[2].spec().method_args == {"recall_interval": 4} and variants[1].spec().method_args == {}


@pytest.mark.slow
def test_harness_sees_equality_and_loss(tmp_path):
    out = tmp_path / "fid.json"
    d = agent_fidelity.main(["--size", "tiny", "--device", "cpu", "--kv-cache-gb", "0.25", "--out", str(out)])
    assert json.loads(out.read_text())["summary"] == d["summary"]
    s = {x["config"]: x for x in d["summary"]}
    assert set(s) == {"dense", "streaming_llm+recall@0.1", "streaming_llm@0.1"} and not d["skipped"]
    dense = s["dense"]
    assert dense["agreement"] == 1.0 and dense["positions"] > 0
    assert dense["attention_recall_device"] == pytest.approx(1.0) == dense["attention_recall_held"]
    assert dense["kv_fraction"] == 1.0 and dense["cold_fraction"] == 0.0
    plain, recall = s["streaming_llm@0.1"], s["streaming_llm+recall@0.1"]
    assert plain["attention_recall_device"] < 0.99 and plain["kv_fraction"] < 0.5
    assert plain["attention_recall_held"] == plain["attention_recall_device"]  # no cold tier without recall
    assert recall["cold_fraction"] > 0 and recall["attention_recall_held"] >= recall["attention_recall_device"]
    md = section(d, "agent_fidelity_test")
    assert "| dense | no | 1 |" in md and "streaming_llm" in md
