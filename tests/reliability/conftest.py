"""The reliability suite: fault injection, fuzzing, load. Each test adds what it did to ``reliability_report``;
with ``CHAINKV_RELIABILITY_REPORT=path.json`` the totals are written there when the run ends
(benchmarks/reliability.py does that). ``CHAINKV_LOAD_FULL=1`` runs the full-size load test."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import pytest

REPORT: dict = {"faults": [], "fuzz": {}, "load": None, "tampering": []}


@pytest.fixture(scope="session")
def reliability_report() -> dict:
    return REPORT


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("CHAINKV_RELIABILITY_REPORT")
    if not path or not (REPORT["faults"] or REPORT["fuzz"] or REPORT["load"]):
        return
    faults = REPORT["faults"]
    fuzz = REPORT["fuzz"]
    out = {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
        "pytest_exit_status": int(exitstatus),
        "faults_injected": sum(f["count"] for f in faults),
        "sessions_lost": sum(f["sessions_lost"] for f in faults) + (REPORT["load"] or {}).get("sessions_lost", 0),
        "committed_turns_lost": sum(f.get("committed_turns_lost", 0) for f in faults),
        "faults": faults,
        "inputs_fuzzed": sum(v["inputs"] for v in fuzz.values()),
        "crashes": sum(v["crashes"] for v in fuzz.values()),
        "fuzz": fuzz,
        "load": REPORT["load"],
        "tampering": REPORT["tampering"],
        "rolled_back_records_served": sum(t.get("served", 0) for t in REPORT["tampering"]),
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=2) + "\n")
