"""Issue check: a PSO-searched client model vs the fixed CNN1 baseline on the client's own test distribution.

    .venv/bin/python benchmarks/edge_vs_fixed.py RUN_DIR [--clients 0 1 2] [--out FILE]
        [--rerun DIR [--search KEY=VALUE ...]] [--fixed-from FILE] [--precision fp32]

RUN_DIR is a `server-kit simulate` output. For each client: its bundled ONNX (from `edge-sdk run`) and CNN1
trained with the same code path (`edge_sdk.final_training.train_final`) for the same number of final epochs on
the same train/validation split, both evaluated in onnxruntime on a test set drawn from the MNIST test split
with the client's own label distribution (seeded). Prints and writes sorted JSON.

Each row says whether CNN1 fits the client's device budget (``cnn1_fits``; where it does not, the CNN1
row is a model the device could not train). ``--rerun DIR`` runs the device pipeline again
(`edge_sdk.client.run_client`, the `fast` search preset with ``--search`` overrides, same profile, seed and
split as the run's bundle) and compares its bundle instead, e.g. to measure a change of the search
defaults; its rows list the search's finalists (each trained for the final epochs, the most accurate on
validation bundled) and the final-training epochs. ``--fixed-from`` reuses the CNN1 rows of an earlier
output (same seed and split give the same CNN1, so there is no need to train it again). ``--update``
re-measures the chosen clients inside an existing ``--out`` and keeps its other rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from edge_sdk.client import ClientConfig, run_client
from edge_sdk.data import ArrayDataset, client_name, load_client_data, split_train_val
from edge_sdk.final_training import train_final
from edge_sdk.models.arch import build_model
from edge_sdk.models.zoo import CNN1
from edge_sdk.profiling import fits, profile_model
from edge_sdk.search import build_search_config
from export.atomic import atomic_write_json
from export.bundle import read_bundle
from export.onnx_export import export_onnx
from profiles import load_profile
from server_kit.evaluate import evaluate_onnx


def client_test_set(test: ArrayDataset, label_counts: list[int], *, size: int, seed: int) -> ArrayDataset:
    """A test set following the client's label distribution (sampling without replacement per class)."""
    rng = np.random.default_rng(seed)
    share = np.asarray(label_counts, dtype=float) / max(1, sum(label_counts))
    y = test.y.numpy()
    idx = []
    for c, p in enumerate(share):
        pool = np.flatnonzero(y == c)
        take = min(len(pool), round(p * size))
        idx.append(rng.choice(pool, size=take, replace=False))
    return test.subset(np.sort(np.concatenate(idx)))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--clients", type=int, nargs="*")
    parser.add_argument("--size", type=int, default=2000, help="client test-set size")
    parser.add_argument("--val-fraction", type=float, default=0.2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rerun", type=Path, help="re-run the clients into this directory")
    parser.add_argument("--search", nargs="*", default=[], help="search overrides KEY=VALUE (JSON values)")
    parser.add_argument("--fixed-from", type=Path, help="an earlier output whose CNN1 rows are reused")
    parser.add_argument(
        "--precision", default="auto", choices=("auto", "fp32", "bf16"),
        help="CNN1's training and a rerun's (a simulate run's own: its --precision)",
    )  # fmt: skip
    parser.add_argument(
        "--update", action="store_true", help="keep the other clients' rows of an existing --out"
    )
    args = parser.parse_args(argv)
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.search)}
    earlier = {}
    if args.fixed_from:
        earlier = {r["client"]: r["fixed_cnn1"] for r in json.loads(args.fixed_from.read_text())["clients"]}

    test = load_client_data(args.run_dir / "data" / "test.npz")
    bundles = sorted((args.run_dir / "clients").glob("client_*.bundle"))
    partition_json = (args.run_dir / "data" / "partition.json").read_text(encoding="utf-8")
    num_clients = json.loads(partition_json)["num_clients"]
    chosen = args.clients if args.clients is not None else list(range(len(bundles)))
    kept = []
    if args.update and args.out and args.out.is_file():
        kept = [r for r in json.loads(args.out.read_text())["clients"] if r["client"] not in chosen]
    rows = []
    for k in chosen:
        name = client_name(k, num_clients)
        bundle = read_bundle(args.run_dir / "clients" / f"{name}.bundle")
        local = client_test_set(test, list(bundle.label_counts), size=args.size, seed=k)
        data = load_client_data(args.run_dir / "data" / f"{name}.npz")
        # the simulate run gave client k the seed (run seed + k); reuse it for the same split and init
        seed = int(bundle.seed)
        train_split, val_split = split_train_val(data, val_fraction=args.val_fraction, seed=seed)
        epochs = int(bundle.metrics["final_epochs"])
        profile = load_profile(str(bundle.profile["name"]))
        shape, classes = data.input_shape, data.num_classes
        if args.rerun:
            search = build_search_config("fast", final_epochs=epochs, **overrides)
            config = ClientConfig(search=search, seed=seed, role="classifier", precision=args.precision)
            out = args.rerun / f"{name}.bundle"
            res = run_client(data, profile=profile, config=config, out=out)
            bundle = read_bundle(out)
            finalists = json.loads(res.report_path.read_text()).get("finalists", [])
        else:
            finalists = []
        if k in earlier:
            fixed_row = earlier[k]
        else:
            t0 = time.perf_counter()
            fixed = train_final(
                str(CNN1), train_split, val_split, epochs=epochs, seed=seed, precision=args.precision
            )
            fixed_seconds = time.perf_counter() - t0
            fixed_onnx = export_onnx(fixed.module, fixed.input_shape, metadata={"arch": fixed.arch})
            fixed_row = {
                "arch": fixed.arch,
                "accuracy": evaluate_onnx(fixed_onnx, local)["accuracy"],
                "final_epochs": epochs,
                "flops": fixed.metrics["flops"],
                "params": fixed.metrics["params"],
                "train_seconds": round(fixed_seconds, 3),
            }
        n_final = int(bundle.metrics.get("finalists", 1))
        row = {
            "client": k,
            "profile": bundle.profile["name"],
            "cnn1_fits": fits(profile_model(build_model(CNN1, shape, classes), shape), profile) is None,
            "client_test_size": len(local),
            "searched": {
                "arch": bundle.arch,
                "accuracy": evaluate_onnx(bundle.model_onnx, local)["accuracy"],
                "final_epochs": epochs,
                "candidate_epochs": bundle.metrics["candidate_epochs"],
                "finalists": finalists,
                "final_training_epochs": n_final * epochs,
                "flops": bundle.metrics["flops"],
                "params": bundle.metrics["params"],
                "search_seconds": bundle.metrics["search_seconds"],
                "train_seconds": bundle.metrics["train_seconds"],
            },
            "fixed_cnn1": fixed_row,
        }
        print(json.dumps(row, sort_keys=True), flush=True)
        rows.append(row)
        if args.out:  # after every client: a partial result survives a stop
            done = sorted(kept + rows, key=lambda r: r["client"])
            summary = {
                "searched_mean": float(np.mean([r["searched"]["accuracy"] for r in done])),
                "fixed_cnn1_mean": float(np.mean([r["fixed_cnn1"]["accuracy"] for r in done])),
            }
            atomic_write_json(
                args.out,
                {
                    "run_dir": str(args.run_dir),
                    "rerun": str(args.rerun) if args.rerun else None,
                    "search_overrides": overrides,
                    "precision": args.precision,
                    "clients": done,
                    "summary": summary,
                },
            )


if __name__ == "__main__":
    main(sys.argv[1:])
