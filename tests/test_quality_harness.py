"""benchmarks/quality.py end to end at a tiny size: the report's structure, dense as its own
reference, and the two agreement modes (a selection method acts only at decode)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import quality

pytestmark = pytest.mark.slow


def test_quality_report_runs_both_agreement_modes(tmp_path):
    out = tmp_path / "q.json"
    quality.main(
        [
            "--methods",
            "quest,h2o",
            "--budgets",
            "0.25",
            "--samples",
            "2",
            "--context",
            "200",
            "--segments",
            "2",
            "--kl-context",
            "160",
            "--continuation",
            "12",
            "--batch",
            "2",
            "--out",
            str(out),
        ]
    )
    d = json.loads(out.read_text())
    pk = {r["method"]: r for r in d["passkey"]["rows"]}
    assert set(pk) == {"dense", "quest", "h2o"} and all(r["samples"] == 2 for r in pk.values())
    assert pk["dense"]["evicted_fraction"] == 0 and pk["quest"]["evicted_fraction"] == 0
    assert pk["h2o"]["evicted_fraction"] > 0.5  # a 25% budget frees most of the prompt's KV
    ag = {r["method"]: r for r in d["agreement"]["rows"]}
    assert d["agreement"]["modes"] == ["prefill", "decode"]
    assert ag["dense"]["top1_agreement"] == 1 and ag["dense"]["decode_top1_agreement"] == 1
    # quest selects pages only in decode steps: a prefilled continuation reads everything, as dense does
    assert ag["quest"]["top1_agreement"] == 1 and ag["quest"]["mean_kl"] == 0
    for r in ag.values():
        assert r["positions"] == r["decode_positions"] == 24
        assert all(math.isfinite(r[k]) for k in ("mean_kl", "decode_mean_kl"))
    assert ag["h2o"]["decode_mean_kl"] > 0 and ag["quest"]["decode_mean_kl"] > 0
