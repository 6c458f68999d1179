"""Issue #31 check: device bundles (``edge-sdk run``) of one client judged on the test set, for the
searched-vs-hand-made comparison on color images.

    .venv/bin/python benchmarks/color_bundles.py CLIENT.npz BUNDLE... --data-root DIR [--out FILE.jsonl]

Each bundle's classifier runs in onnxruntime (float32) on the dataset's whole test split (``--dataset``,
cifar10 by default) and on a 2,000-image draw with the client's label distribution (seeded by ``--seed``,
as ``edge_vs_fixed.py`` draws it). One JSON row per bundle: its architecture, cost, search and training
epochs, the accuracies.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from edge_vs_fixed import client_test_set

from edge_sdk.data import load_client_data, load_dataset
from export.bundle import read_bundle
from server_kit.evaluate import evaluate_onnx


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("client", type=Path)
    parser.add_argument("bundles", type=Path, nargs="+")
    parser.add_argument("--dataset", default="cifar10")
    parser.add_argument("--data-root", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    data = load_client_data(args.client)
    test = load_dataset(args.dataset, args.data_root, split="test")
    local = client_test_set(test, data.label_counts(), size=2000, seed=args.seed)
    for path in args.bundles:
        bundle = read_bundle(path)
        report = json.loads(Path(f"{path}.report.json").read_text(encoding="utf-8"))
        m = bundle.metrics
        row = {
            "bundle": str(path),
            "client": args.client.name,
            "profile": bundle.profile["name"],
            "arch": bundle.arch,
            "flops": m["flops"],
            "params": m["params"],
            "final_epochs": m["final_epochs"],
            "candidate_epochs": m.get("candidate_epochs"),
            "finalists": [f.get("arch") for f in report.get("finalists", [])],
            "val_accuracy": round(m["val_accuracy"], 4),
            "test_accuracy": round(evaluate_onnx(bundle.model_onnx, test)["accuracy"], 4),
            "client_test_accuracy": round(evaluate_onnx(bundle.model_onnx, local)["accuracy"], 4),
        }
        line = json.dumps(row, sort_keys=True)
        print(line)
        if args.out:
            with args.out.open("a", encoding="utf-8") as file:
                file.write(line + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
