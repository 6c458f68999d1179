"""The device work of a simulated federation, per client, from its run directory (issue #32).

    .venv/bin/python benchmarks/device_work.py RUN_DIR [--json FILE]

Reads every client report (``RUN_DIR/clients/*.bundle.report.json``) and partition
(``RUN_DIR/data/*.npz``, for the split sizes) and prints per client: the search's candidate epochs, the
final-training epochs over all finalists (the halving's rungs and the chosen one's rest), the epoch whose
weights were kept, the seconds of the search, the final training and the CVAE, and the training FLOPs
counted as :func:`edge_sdk.plan.actual_flops` counts them, so reports of code from before the device plan
(no ``device_plan``) are counted the same way; where the report has a plan, its estimate beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edge_sdk.plan import actual_flops


def client_work(report: dict[str, Any], n: int) -> dict[str, Any]:
    """One client's row; ``n`` is the size of its partition."""
    config = report["config"]
    val_fraction = config["val_fraction"]
    n_val = min(max(1, round(n * val_fraction)), n - 1)  # edge_sdk.data.split_train_val's rule
    n_train = n - n_val
    seconds = report["seconds"]
    search = config.get("search", {})
    finalists = report.get("finalists", [])
    decoder = report.get("decoder") or (report if report.get("search") is None else None)
    cvae_flops = int(decoder["metrics"]["flops"]) if decoder else None
    spent = actual_flops(
        candidates=[(e["flops"], e["epochs"]) for e in (report.get("search") or {}).get("evaluations", [])],
        finalists=finalists,
        search_subset=min(n_train, search.get("max_train_samples") or n_train),
        val_every_epoch=search.get("plateau_patience", 0) > 0,
        cvae_flops=cvae_flops,
        cvae_epochs=config.get("cvae", {}).get("epochs", 0),
        n_train=n_train,
        n_val=n_val,
    )
    metrics = report.get("metrics", {})
    plan = report.get("device_plan")
    return {
        "profile": report["profile"],
        "role": report["role"],
        "n_train": n_train,
        "candidate_epochs": metrics.get("candidate_epochs", 0),
        "final_training_epochs": sum(r.get("final_epochs", r["epochs"]) for r in finalists),
        "chosen_epochs": metrics.get("final_epochs"),
        "best_epoch": metrics.get("best_epoch", metrics.get("final_epochs")),
        "val_accuracy": metrics.get("val_accuracy"),
        "seconds": {k: seconds.get(k, 0.0) for k in ("search", "train", "cvae_train")},
        "gflop": {k: round(v / 1e9, 1) for k, v in spent.items()},
        "planned_gflop": round(plan["planned"]["total"] / 1e9, 1) if plan else None,
        "estimated_s": plan["planned"]["seconds"] if plan else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = {}
    for path in sorted((args.run_dir / "clients").glob("*.bundle.report.json")):
        name = path.name.split(".")[0]
        with np.load(args.run_dir / "data" / f"{name}.npz") as data:
            n = len(data["y"])
        rows[name] = client_work(json.loads(path.read_text()), n)
    print(
        "| client | profile | train images | candidate epochs | final-training epochs (chosen, kept) "
        "| search s | final s | CVAE s | device s | GFLOP search / final / CVAE | planned GFLOP (est. s) "
        "| val % |"
    )
    print("|" + "---|" * 12)
    for name, r in rows.items():
        s, g = r["seconds"], r["gflop"]
        planned = f"{r['planned_gflop']:,.0f} ({r['estimated_s']:.0f})" if r["planned_gflop"] else ""
        print(
            f"| {name} | {r['profile']} | {r['n_train']} | {r['candidate_epochs']} | "
            f"{r['final_training_epochs']} ({r['chosen_epochs']}, {r['best_epoch']}) | {s['search']:.0f} | "
            f"{s['train']:.0f} | {s['cvae_train']:.0f} | {sum(s.values()):.0f} | "
            f"{g['search']:,.0f} / {g['final_training']:,.0f} / {g['cvae']:,.0f} | {planned} | "
            f"{100 * (r['val_accuracy'] or 0):.2f} |"
        )
    total = {
        "final_training_epochs": sum(r["final_training_epochs"] for r in rows.values()),
        "device_s": round(sum(sum(r["seconds"].values()) for r in rows.values()), 1),
        "train_s": round(sum(r["seconds"]["train"] for r in rows.values()), 1),
        "search_s": round(sum(r["seconds"]["search"] for r in rows.values()), 1),
        "gflop": round(sum(r["gflop"]["total"] for r in rows.values()), 1),
        "final_gflop": round(sum(r["gflop"]["final_training"] for r in rows.values()), 1),
    }
    print(f"total: {json.dumps(total)}")
    if args.json:
        args.json.write_text(json.dumps({"clients": rows, "total": total}, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
