"""benchmarks/agent_quality.py: the task families (seeded, answerable from their text) and the
harness end to end at a tiny size on SmolLM2 - per family, dense on the chain answers exactly as
dense re-prefill does, a method whose budget holds everything answers as dense, and a destructive
budget (16 tokens per head) scores lower: a harness that cannot see a loss fails here."""

from __future__ import annotations

import json

import pytest

from benchmarks import agent_quality
from benchmarks.agent_quality_report import section
from benchmarks.agent_tasks import FAMILIES, SIZES, Size, is_correct, make_samples


def _text(sample) -> str:
    return "".join(p.text for t in sample.turns for p in t.pieces)


def test_families_are_seeded_and_answerable():
    for fam in FAMILIES:
        for size in SIZES["cpu"][fam]:
            a, b = make_samples(fam, size, 3, 7), make_samples(fam, size, 3, 7)
            assert [_text(s) for s in a] == [_text(s) for s in b]  # same seed, same samples
            assert _text(a[0]) != _text(a[1]) != _text(make_samples(fam, size, 1, 8)[0])
            for s in a:
                assert len(s.turns) == size.turns
                qs = s.questions
                assert qs and all(t.question.isdigit() for _, t in qs)
                for i, turn in qs:
                    before = "".join(
                        p.text for t in s.turns[: i + 1] for p in t.pieces
                    )  # the question turn may hold it
                    assert f": {turn.question}\n" in before + "\n" or f": {turn.question}<" in before
                    assert 0 <= turn.distance < size.turns


def test_running_state_asks_for_the_last_update():
    s = make_samples("state", Size(5, 4, lag=2), 1, 3)[0]
    key = s.turns[-1].pieces[-1].text.split("\n")[-1].rstrip(":")  # the answer starts "key:"
    updates = [
        line.split(": ")[1]
        for t in s.turns
        for p in t.pieces
        if p.role == "tool"
        for line in p.text.splitlines()
        if line.startswith(key + ":")
    ]
    assert len(updates) == 3 and updates[-1] == s.turns[-1].question and len(set(updates)) == 3
    assert s.turns[-1].distance == 2
    tool_turns = [i for i, t in enumerate(s.turns) if any(key + ":" in p.text for p in t.pieces if p.role == "tool")]
    assert tool_turns == [0, 1, 2]


def test_shared_questions_cover_different_sections():
    s = make_samples("shared", Size(5, 40), 1, 0)[0]
    doc = [
        line.split(": ")[0]
        for p in s.turns[0].pieces
        if p.role == "tool"
        for line in p.text.splitlines()
        if ": " in line
    ]
    asked = [t.pieces[-1].text.split("\n")[-1].rstrip(":") for _, t in s.questions]
    assert len(doc) == 40 and [t.distance for _, t in s.questions] == [1, 2, 3, 4]
    assert [doc.index(k) // 10 for k in asked] == [0, 1, 2, 3]


def test_exact_match_scoring():
    assert is_correct(" 4821.", "4821") and is_correct("4821", "4821") and is_correct(' "4821"', "4821")
    assert not is_correct(" 48212", "4821") and not is_correct(" 4821 and 7", "4821") and not is_correct("", "4821")


@pytest.mark.slow
def test_harness_sees_equality_and_loss(tmp_path):
    out = tmp_path / "aq.json"
    d = agent_quality.main(
        [
            "--size",
            "test",
            "--samples",
            "3",
            "--methods",
            "snapkv",
            "--budgets",
            "100000,16",
            "--prunes",
            "none",
            "--once-method",
            "",
            "--calibrate",
            "0",
            "--device",
            "cpu",
            "--kv-cache-gb",
            "0.5",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["rows"] == d["rows"]
    rows = {(r["config"], r["family"], r["size"]): r for r in d["rows"]}
    groups = {(r["family"], r["size"]) for r in d["rows"]}
    assert {f for f, _ in groups} == set(FAMILIES)
    for fam, size in groups:
        ref = rows[("reprefill", fam, size)]
        assert ref["accuracy"] > 0, (fam, size)  # the tiny sizes are within SmolLM2's reach
        # dense on the chain: the same answers as dense re-prefilled every turn
        assert rows[("dense", fam, size)]["agreement"] == 1.0, (fam, size)
        assert rows[("dense", fam, size)]["kv_fraction"] == 1.0
        # a budget that holds the whole session: dense's answers, nothing evicted
        full = rows[("snapkv@100000tok", fam, size)]
        assert full["agreement"] == 1.0 and full["kv_fraction"] == 1.0, (fam, size)
        # 16 tokens per head: a loss the harness must see
        tiny = rows[("snapkv@16tok", fam, size)]
        assert tiny["accuracy"] < ref["accuracy"] and tiny["kv_fraction"] < 0.5, (fam, size)
    assert set(d["recommended"]) == {"100000tok", "16tok"}
    md = section(d, "agent_quality_test")
    assert "| dense |" in md and "snapkv@16tok" in md and "Recommended default" in md
