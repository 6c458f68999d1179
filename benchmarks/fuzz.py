"""The long fuzz run of issues #16 and #34: mutated bundles, packages, supernets and weights files, and
hostile config files, shared initial weights, Flower task fields and run directories (one kind each).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fuzz.py --cases 2400 --seed 0 --jobs 2 \\
        --out benchmarks/results/fuzz.json
    .venv/bin/python benchmarks/fuzz.py --replay classifier:onnx_loop:0:3     # one case, in the foreground

Same harness as ``tests/fuzz`` (a forked child per case, 10 s timeout, 2x honest-peak RSS cap, a secret
planted in the cwd); prints progress and the outcome table per kind x mutator, and writes every failing
case (outcome, error, raising frame, mutant note) to ``--out``, with the cases per kind (boundary).
Exits 1 when any case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.fuzz is not installed

import torch

from tests.fuzz.cases import FAILURES, Case, Result, as_dict, format_table, plan
from tests.fuzz.consumers import CONSUMERS
from tests.fuzz.mutators import make_mutant
from tests.fuzz.runner import CASE_FILE, DEFAULT_TIMEOUT_S, Runner
from tests.fuzz.seeds import KINDS


def replay(case_id: str, root: Path) -> int:
    """Build one case and run its consumer in this process, so the full traceback is printed."""
    case = Case.parse(case_id)
    runner = Runner(root)
    workdir = root / "replay"
    (workdir / "sub").mkdir(parents=True, exist_ok=True)
    mutant = make_mutant(runner.seed_files[case.kind], case.mutator, case.seed, case.index, workdir)
    (workdir / CASE_FILE).write_bytes(mutant.data)
    print(f"{case.id}: {mutant.note} ({len(mutant.data)} bytes, must_refuse={mutant.must_refuse})")
    print(f"file: {workdir / CASE_FILE} (no timeout, no memory cap, no secret planted here)")
    os.chdir(workdir)
    try:
        CONSUMERS[case.kind](workdir / CASE_FILE, runner.seeds, workdir)
    except BaseException:  # show whatever it is
        traceback.print_exc()
        return 1
    print("accepted")
    return 0


def _table(results: list[Result]) -> dict[str, dict[str, int]]:
    table: dict[str, Counter[str]] = {}
    for r in results:
        table.setdefault(f"{r.kind}:{r.mutator}", Counter())[r.outcome] += 1
    return {pair: dict(sorted(counts.items())) for pair, counts in sorted(table.items())}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=int, default=2400, help="number of cases (round-robin over pairs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="children at once (one core each)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per case")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {KINDS}")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fuzz.json"))
    parser.add_argument("--replay", metavar="CASE_ID", help="run one case id in the foreground and stop")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="fuzz-") as tmp:
        if args.replay:
            return replay(args.replay, Path(tmp))
        kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
        runner = Runner(tmp, timeout_s=args.timeout)
        honest = runner.calibrate(kinds)
        for kind, result in honest.items():
            cap = runner.budgets[kind].rss_cap_kb / 1024
            print(f"honest {kind}: peak RSS {result.peak_rss_mb:.0f} MB, cap {cap:.0f} MB")
        cases = plan(args.cases, args.seed, kinds)
        results: list[Result] = []
        started = time.monotonic()
        for result in runner.run(cases, jobs=args.jobs):
            results.append(result)
            if result.outcome in FAILURES:
                print(f"  {result.outcome:9} {result.case}: {result.error_type} {result.message[:100]!r}")
            if len(results) % 100 == 0 or len(results) == len(cases):
                counts = Counter(r.outcome for r in results)
                done = f"{len(results)}/{len(cases)} {time.monotonic() - started:.0f} s"
                print(f"[{done}] {dict(sorted(counts.items()))}", flush=True)
    seconds = time.monotonic() - started
    print(format_table(results, "pair"))
    print(format_table(results, "kind"))
    failed = [r for r in results if r.outcome in FAILURES]
    report = {
        "cases": len(results),
        "seed": args.seed,
        "jobs": args.jobs,
        "timeout_s": args.timeout,
        "seconds": round(seconds, 1),
        "rss_cap_mb": {k: round(b.rss_cap_kb / 1024, 1) for k, b in runner.budgets.items()},
        "outcomes": dict(sorted(Counter(r.outcome for r in results).items())),
        "table": _table(results),
        "failures": [as_dict(r) for r in failed],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    print(f"{len(failed)} failing cases of {len(results)} in {seconds:.0f} s; wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
