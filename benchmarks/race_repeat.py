"""The sidecar's busy/cancel race (issue 30), repeated under load: batches of its three tests.

Each batch is one pytest process running the three tests of tests/test_sidecar_server.py that send a
turn right after a rejected, cancelled or expired one, ``--count`` times each (pytest-repeat; the
module's sidecars, Redis and SmolLM2 engine are set up once per batch). Batches run until
``--minutes`` have passed; every run's outcome comes from the batch's JUnit XML, and the 1-minute
load average is sampled at each batch's edges. The runs are added to ``--out`` (earlier sessions'
runs are kept and counted in the totals), so the figure grows across sessions.

    pip install pytest-repeat==0.9.4
    python benchmarks/race_repeat.py --minutes 60 --count 5   # best with the test suite running alongside
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = (
    "test_a_turn_sent_right_after_a_rejected_or_cancelled_one_is_not_refused_as_busy",
    "test_a_turn_that_arrives_before_the_cancel_of_the_running_one_waits_for_its_rollback",
    "test_many_turns_sent_right_after_a_rejected_cancelled_or_expired_one_all_run",
)


def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_batch(count: int, xml: Path) -> tuple[int, list[dict]]:
    """One pytest process; returns its exit code and one record per test run."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_sidecar_server.py"]
    cmd += ["-k", " or ".join(TESTS), f"--count={count}", f"--junitxml={xml}"]
    rc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    runs = []
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = case.get("name", "").split("[")[0]
            failed = [c for c in case if c.tag in ("failure", "error")]
            runs.append(
                {
                    "test": name,
                    "seconds": float(case.get("time", 0)),
                    "failed": bool(failed),
                    "message": (failed[0].get("message") or "")[:300] if failed else "",
                }
            )
    return rc, runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=60.0, help="start no batch after this long")
    ap.add_argument("--count", type=int, default=5, help="runs of each test per batch")
    ap.add_argument("--session", default="", help="a label for this session's batches")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "race_repeat.json"))
    args = ap.parse_args()
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {"tests": {t: {"runs": 0, "failures": 0} for t in TESTS}}
    session = {"label": args.session, "started_at": now(), "command": " ".join(sys.argv), "batches": []}
    result.setdefault("sessions", []).append(session)
    deadline = time.time() + 60 * args.minutes
    n = 0
    while time.time() < deadline:
        n += 1
        xml = Path(f"/tmp/race_repeat_{os.getpid()}_{n}.xml")
        load_before = os.getloadavg()[0]
        t0 = time.time()
        rc, runs = run_batch(args.count, xml)
        batch = {
            "rc": rc,
            "seconds": round(time.time() - t0, 1),
            "load_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "runs": len(runs),
            "failures": [r for r in runs if r["failed"]],
        }
        session["batches"].append(batch)
        for r in runs:
            t = result["tests"].setdefault(r["test"], {"runs": 0, "failures": 0})
            t["runs"] += 1
            t["failures"] += int(r["failed"])
        result["total_runs"] = sum(t["runs"] for t in result["tests"].values())
        result["total_failures"] = sum(t["failures"] for t in result["tests"].values())
        session["ended_at"] = now()
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(
            f"batch {n}: {len(runs)} runs, {len(batch['failures'])} failed, rc {rc}, {batch['seconds']} s", flush=True
        )
        if not runs:  # nothing ran (a collection error): do not spin
            raise SystemExit(f"batch {n} ran no test (pytest exit {rc})")


if __name__ == "__main__":
    main()
