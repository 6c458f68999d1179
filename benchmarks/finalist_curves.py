"""The finalists' whole learning curves, to judge the rule that picks among them (issue #31).

    .venv/bin/python benchmarks/finalist_curves.py RUN_DIR --clients 0 1 5 6 --out FILE

For each classifier client of a `server-kit simulate` run: every finalist its search kept (the report's
``search.finalists``, in the search's order) trained through all of the final training, in the segments
and with the seeds :func:`edge_sdk.client._train_finalists` gives the one it keeps (the first rung, the
later rungs, the rest under one learning-rate schedule), so each curve is what the client would have
trained had that finalist been chosen. Validation loss and accuracy after every epoch, and the accuracy on
the client's own test distribution (``edge_vs_fixed.client_test_set``, in torch, float32) after each
segment. Beside them the hand-made CNN1 trained as ``--strategy fixed`` trains it (one segment, the
client's seed). Any rule over (rung, validation numbers, cost) can then be scored offline: which finalist
it keeps, and what that finalist reaches on the client's test set after the whole training.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from edge_vs_fixed import client_test_set

from edge_sdk.client import finalist_seed
from edge_sdk.data import client_name, load_client_data, split_train_val
from edge_sdk.final_training import train_final
from edge_sdk.halving import halving_rungs
from edge_sdk.models.zoo import CNN1
from edge_sdk.search import build_search_config
from edge_sdk.train import evaluate
from export.atomic import atomic_write_json


def segments(seed: int, finalists: int, final_epochs: int) -> list[tuple[int, int]]:
    """(epochs, seed) of each part of the chosen finalist's training, as the client runs it."""
    config = build_search_config("fast", final_epochs=final_epochs)
    rungs = halving_rungs(finalists, config.finalist_epochs(), config.finalist_keep)
    parts = [(e, finalist_seed(seed, r)) for r, (_, e) in enumerate(rungs)]
    rest = final_epochs - sum(e for e, _ in parts)
    return parts + ([(rest, finalist_seed(seed, None))] if rest > 0 else [])


def curve(arch: str, parts: list[tuple[int, int]], train, val, test, final_epochs: int) -> dict[str, Any]:
    """One architecture trained in ``parts``, one schedule over ``final_epochs``."""
    model, optimizer, done, val_curve, tests = None, None, 0, [], []
    for epochs, seed in parts:
        trained = train_final(
            arch, train, val, epochs=epochs, seed=seed, init=model, optimizer=optimizer, precision="fp32",
            track_val=True, schedule_span=(done, max(done + epochs, final_epochs)), device="cpu",
        )  # fmt: skip
        model, optimizer, done = trained.module, trained.optimizer, done + epochs
        val_curve += [[h["val_loss"], h["val_accuracy"]] for h in trained.history]
        tests.append([done, evaluate(model, test)[1]])
        model.train()
    return {"arch": arch, "flops": trained.metrics["flops"], "params": trained.metrics["params"],
            "val": val_curve, "test": tests}  # fmt: skip


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--clients", type=int, nargs="+", required=True)
    parser.add_argument("--size", type=int, default=2000, help="client test-set size")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    run = args.run_dir
    test = load_client_data(run / "data" / "test.npz")
    num_clients = json.loads((run / "data" / "partition.json").read_text())["num_clients"]
    rows = json.loads(args.out.read_text())["clients"] if args.out.is_file() else []
    for k in args.clients:
        if any(r["client"] == k for r in rows):
            continue
        name = client_name(k, num_clients)
        report = json.loads((run / "clients" / f"{name}.bundle.report.json").read_text())
        finalists = report["search"]["finalists"]
        seed, final_epochs = int(report["config"]["seed"]), int(report["metrics"]["final_epochs"])
        data = load_client_data(run / "data" / f"{name}.npz")
        train, val = split_train_val(data, val_fraction=float(report["config"]["val_fraction"]), seed=seed)
        local = client_test_set(test, list(train.label_counts()), size=args.size, seed=k)
        parts = segments(seed, len(finalists), final_epochs)
        row = {
            "client": k, "profile": report["profile"], "n_val": len(val), "parts": parts,
            "recorded": report["finalists"], "chosen": report["arch"],
            "finalists": [curve(a, parts, train, val, local, final_epochs) for a in finalists],
            "cnn1": curve(str(CNN1), [(final_epochs, seed)], train, val, local, final_epochs),
        }  # fmt: skip
        print(json.dumps({"client": k, "test": {f["arch"]: f["test"][-1][1] for f in row["finalists"]}}))
        rows = sorted([*rows, row], key=lambda r: r["client"])
        atomic_write_json(args.out, {"run_dir": str(run), "clients": rows})


if __name__ == "__main__":
    main(sys.argv[1:])
