"""Issue check: a PSO-searched client model vs the fixed CNN1 baseline on the client's own test distribution.

    .venv/bin/python benchmarks/edge_vs_fixed.py RUN_DIR [--clients 0 1 2] [--out FILE]
        [--rerun DIR [--search KEY=VALUE ...]] [--fixed-from FILE]

RUN_DIR is a `server-kit simulate` output. For each client: its bundled ONNX (from `edge-sdk run`) and CNN1
trained with the same code path (`edge_sdk.client.train_final`) for the same number of final epochs on the
same train/validation split, both evaluated in onnxruntime on a test set drawn from the MNIST test split
with the client's own label distribution (seeded). Prints and writes sorted JSON.

``--rerun DIR`` runs the device pipeline again (`edge_sdk.client.run_client`, the `fast` search preset
with ``--search`` overrides, same profile, seed and split as the run's bundle) and compares its bundle
instead, e.g. to measure a change of the search defaults. ``--fixed-from`` reuses the CNN1 rows of an
earlier output (same seed and split give the same CNN1, so there is no need to train it again).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from edge_sdk.client import ClientConfig, run_client, train_final
from edge_sdk.data import ArrayDataset, load_client_data, split_train_val
from edge_sdk.search import SearchConfig
from edge_sdk.zoo import CNN1
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
    args = parser.parse_args(argv)
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.search)}
    earlier = {}
    if args.fixed_from:
        earlier = {r["client"]: r["fixed_cnn1"] for r in json.loads(args.fixed_from.read_text())["clients"]}

    test = load_client_data(args.run_dir / "data" / "test.npz")
    bundles = sorted((args.run_dir / "clients").glob("client_*.bundle"))
    chosen = args.clients if args.clients is not None else list(range(len(bundles)))
    rows = []
    for k in chosen:
        bundle = read_bundle(args.run_dir / "clients" / f"client_{k:02d}.bundle")
        local = client_test_set(test, list(bundle.label_counts), size=args.size, seed=k)
        data = load_client_data(args.run_dir / "data" / f"client_{k:02d}.npz")
        # the simulate run gave client k the seed (run seed + k); reuse it for the same split and init
        seed = int(bundle.seed)
        train_split, val_split = split_train_val(data, val_fraction=args.val_fraction, seed=seed)
        epochs = int(bundle.metrics["final_epochs"])
        if args.rerun:
            search = SearchConfig.preset("fast", final_epochs=epochs, **overrides)
            config = ClientConfig(search=search, seed=seed, role="classifier")
            out = args.rerun / f"client_{k:02d}.bundle"
            run_client(data, profile=load_profile(str(bundle.profile["name"])), config=config, out=out)
            bundle = read_bundle(out)
        if k in earlier:
            fixed_row = earlier[k]
        else:
            t0 = time.perf_counter()
            fixed = train_final(str(CNN1), train_split, val_split, epochs=epochs, seed=seed)
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
        row = {
            "client": k,
            "profile": bundle.profile["name"],
            "client_test_size": len(local),
            "searched": {
                "arch": bundle.arch,
                "accuracy": evaluate_onnx(bundle.model_onnx, local)["accuracy"],
                "final_epochs": epochs,
                "candidate_epochs": bundle.metrics["candidate_epochs"],
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
            summary = {
                "searched_mean": float(np.mean([r["searched"]["accuracy"] for r in rows])),
                "fixed_cnn1_mean": float(np.mean([r["fixed_cnn1"]["accuracy"] for r in rows])),
            }
            atomic_write_json(
                args.out,
                {
                    "run_dir": str(args.run_dir),
                    "rerun": str(args.rerun) if args.rerun else None,
                    "search_overrides": overrides,
                    "clients": rows,
                    "summary": summary,
                },
            )


if __name__ == "__main__":
    main(sys.argv[1:])
