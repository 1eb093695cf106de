"""The reliability report: run tests/reliability (faults, fuzzing, load) and save what they measured.

    python benchmarks/reliability.py                 # full size: 64 sessions x 5 turns, 100 fuzz examples per RPC
    python benchmarks/reliability.py --ci            # the CI sizes

Writes benchmarks/results/reliability.json: faults injected, sessions lost (must be 0), inputs
fuzzed, crashes (must be 0), the load held (sessions, turns, pool, preemptions, demotions). Exits
non-zero if the suite failed or the report shows a lost session or a crash.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "reliability.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ci", action="store_true", help="the CI sizes (8 sessions x 3 turns, 20 fuzz examples per RPC)")
    p.add_argument("--fuzz-examples", type=int, default=100, help="hypothesis examples per RPC (full size)")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    env = dict(
        os.environ,
        CHAINKV_RELIABILITY_REPORT=args.out,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    if not args.ci:
        env.update(CHAINKV_LOAD_FULL="1", CHAINKV_FUZZ_EXAMPLES=str(args.fuzz_examples))
    rc = subprocess.call(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/reliability"], cwd=ROOT, env=env
    )
    report = json.loads(Path(args.out).read_text())
    report["size"] = "ci" if args.ci else "full"
    report["command"] = "python benchmarks/reliability.py" + (" --ci" if args.ci else "")
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    load = report.get("load") or {}
    print(
        f"faults injected {report['faults_injected']}, sessions lost {report['sessions_lost']}, "
        f"inputs fuzzed {report['inputs_fuzzed']}, crashes {report['crashes']}, load "
        f"{load.get('sessions')} sessions x {load.get('turns_per_session')} turns on a {load.get('pool_pages')}-page "
        f"pool: {load.get('turns_completed')} turns completed in {load.get('wall_s')} s"
    )
    print(f"wrote {Path(args.out).relative_to(ROOT) if Path(args.out).is_relative_to(ROOT) else args.out}")
    bad = report["sessions_lost"] or report["crashes"] or report.get("committed_turns_lost")
    return 1 if rc or bad else 0


if __name__ == "__main__":
    sys.exit(main())
