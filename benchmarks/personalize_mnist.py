"""Personalization benchmark: local-only, global, finetune, pkt and kdg models on each client's own test set.

    .venv/bin/python benchmarks/personalize_mnist.py RUN_DIR [--methods finetune pkt kdg] [--out FILE]
        [--update FILE]

RUN_DIR is a `server-kit simulate` output whose server run kept ``synthetic.npz`` (and the generator,
for kdg). Runs `server-kit personalize` (PKE) once, then `edge-sdk personalize` for every client and
method, and evaluates every model in onnxruntime on a test set drawn from the MNIST test split with
the client's label distribution (as in edge_vs_fixed.py). Writes sorted JSON with per-client rows,
means, int8-vs-fp32 size/latency/accuracy and seconds. ``--update FILE`` re-runs only ``--methods`` on the
clients of an earlier output (or on ``--clients``, new ones included), reusing its packages (no second
PKE), and replaces those methods' rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from edge_vs_fixed import client_test_set

from edge_sdk.data import client_name, load_client_data
from edge_sdk.personalize import METHODS, PersonalizeConfig, personalize
from export.atomic import atomic_write_json
from export.bundle import read_bundle
from export.package import read_package
from server_kit.evaluate import evaluate_onnx
from server_kit.personalization.pke import PKEConfig, personalize_server


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=METHODS)
    parser.add_argument("--clients", type=int, nargs="*")
    parser.add_argument("--size", type=int, default=2000, help="client test-set size")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--update", type=Path, help="an earlier output: re-run --methods, keep the rest")
    args = parser.parse_args(argv)
    earlier = json.loads(args.update.read_text(encoding="utf-8")) if args.update else None

    run = args.run_dir
    test = load_client_data(run / "data" / "test.npz")
    bundles = sorted((run / "clients").glob("client_*.bundle"))
    if earlier is None:
        t0 = time.perf_counter()
        pke_report = personalize_server(bundles, run / "server", run / "packages", config=PKEConfig()).report
        pke_seconds = time.perf_counter() - t0
        chosen = args.clients if args.clients is not None else list(range(len(bundles)))
    else:
        pke_report, pke_seconds = earlier["pke"], earlier["pke_seconds"]
        previous = {r["client"]: r for r in earlier["clients"]}
        chosen = args.clients if args.clients is not None else sorted(previous)
    global_onnx = (run / "server" / "global.onnx").read_bytes()
    num_clients = json.loads((run / "data" / "partition.json").read_text(encoding="utf-8"))["num_clients"]
    rows = []
    for k in chosen:
        name = client_name(k, num_clients)
        bundle = read_bundle(run / "clients" / f"{name}.bundle")
        package = read_package(run / "packages" / f"{name}.package")
        data = load_client_data(run / "data" / f"{name}.npz")
        local = client_test_set(test, list(bundle.label_counts), size=args.size, seed=k)
        row: dict = {} if earlier is None else dict(previous.get(k, {}))
        row |= {
            "client": k,
            "arch": bundle.arch,
            "client_test_size": len(local),
            "local_only": evaluate_onnx(bundle.model_onnx, local)["accuracy"],
            "global": evaluate_onnx(global_onnx, local)["accuracy"],
        }
        for method in args.methods:
            t0 = time.perf_counter()
            config = PersonalizeConfig(method=method, train_epochs=args.epochs)
            res = personalize(data, bundle, package, run / "personal" / name / method, config=config)
            seconds = time.perf_counter() - t0
            out = res.out_dir
            row[method] = {
                "fp32": evaluate_onnx((out / "personal.fp32.onnx").read_bytes(), local)["accuracy"],
                "int8": evaluate_onnx((out / "personal.int8.onnx").read_bytes(), local)["accuracy"],
                "kept": res.kept,
                "deploy": evaluate_onnx(res.deploy_onnx.read_bytes(), local)["accuracy"],
                "val_accuracy": res.report["val_accuracy"],
                "size_bytes": res.report["size_bytes"],
                "latency": res.report["latency"],
                "seconds": seconds,
                "config": config.to_dict(),
            }
            if method == "pkt":
                row[method]["alpha"] = res.report["training"]["alpha"]
            print(
                f"client {k} {method}: {row[method]['deploy']:.4f} ({res.kept}, {seconds:.0f} s); "
                f"local-only {row['local_only']:.4f}, global {row['global']:.4f}",
                flush=True,
            )
        rows.append(row)
    if earlier is not None:  # keep the earlier clients that were not re-run
        kept = [r for c, r in previous.items() if c not in chosen]
        rows = sorted([*rows, *kept], key=lambda r: r["client"])

    def mean(key: str, sub: str | None = None) -> float:
        return statistics.fmean(r[key][sub] if sub else r[key] for r in rows)

    summary = {"local_only": mean("local_only"), "global": mean("global")}
    for method in METHODS if earlier is not None else args.methods:
        summary[method] = {
            "deploy": mean(method, "deploy"),
            "fp32": mean(method, "fp32"),
            "int8": mean(method, "int8"),
            "int8_kept": sum(r[method]["kept"] == "int8" for r in rows),
            "seconds_total": sum(r[method]["seconds"] for r in rows),
        }
    result = {
        "run_dir": str(run),
        "pke_seconds": pke_seconds,
        "pke": pke_report,
        "clients": rows,
        "summary": summary,
    }
    print(summary)
    if args.out:
        atomic_write_json(args.out, result)


if __name__ == "__main__":
    main(sys.argv[1:])
