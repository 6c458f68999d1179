"""HAPFNAS checks on a finished MNIST federation: supernet proxy quality and evolution vs PSO.

    .venv/bin/python benchmarks/hapfnas_mnist.py RUN_DIR [--clients 0 1] [--subnets 10] [--steps 300]
        [--predictor-specs 100] [--scratch-from FILE] --out FILE

RUN_DIR is a `server-kit simulate` output whose server kept ``synthetic.npz``. Steps, all measured:
1. `server-kit supernet` on the run's teachers and synthetic set (sandwich rule, inplace distillation).
2. For the first client: ``--subnets`` subnets spread over FLOPs (smallest, largest, random between), each
   scored by the supernet proxy (inherited weights + BN recalibration on the client's train split,
   validation accuracy) and by training from scratch for ``--scratch-epochs``; Spearman / Kendall between
   the two (HAPFNAS Fig. 8); then the random-forest predictor's 5-fold out-of-fold rank correlation on
   ``--predictor-specs`` proxy-scored subnets (Fig. 9).
3. For each client: `edge-sdk run --strategy evolution --supernet` (same profile, final epochs and seed
   as the PSO bundle of the run) on the client's data; accuracy on the client's own test distribution
   beside the PSO bundle's, candidate-epochs, seconds and the predictor's held-out rank correlation.
Writes sorted JSON. ``--scratch-from`` takes the train-from-scratch accuracies of an earlier output for the
same client (the subnets, split and seeds are the same), so a second supernet costs only its own steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from edge_vs_fixed import client_test_set

from edge_sdk.client import ClientConfig, run_client
from edge_sdk.data import client_name, load_client_data, split_train_val
from edge_sdk.final_training import train_final
from edge_sdk.models.elastic.space import encode, sample_elastic
from edge_sdk.models.elastic.spec import cost_of, largest, smallest
from edge_sdk.models.elastic.supernet import extract
from edge_sdk.models.elastic.supernet_file import load_supernet
from edge_sdk.strategies.evolution import EvolutionConfig
from edge_sdk.strategies.predictor import predictor, rank_correlation
from edge_sdk.strategies.supernet_proxy import recalibrate_bn, supernet_proxy
from edge_sdk.train import evaluate
from export.atomic import atomic_write_json
from export.bundle import read_bundle
from profiles import load_profile
from server_kit.evaluate import evaluate_onnx
from server_kit.personalization.supernet import SupernetConfig, supernet_from_bundles


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--clients", type=int, nargs="*", default=[0])
    parser.add_argument("--subnets", type=int, default=10)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--scratch-epochs", type=int, default=2)
    parser.add_argument(
        "--predictor-specs", type=int, default=100, help="proxy-scored specs for Fig. 9 (0: skip)"
    )
    parser.add_argument(
        "--unlabeled",
        type=Path,
        help="train the supernet on this .npz of uint8 images (x) instead of the run's synthetic set",
    )
    parser.add_argument(
        "--scratch-from",
        type=Path,
        help="an earlier output of the same client and subnets: reuse its train-from-scratch accuracies",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    run = args.run_dir
    bundles = sorted((run / "clients").glob("client_*.bundle"))
    num_clients = json.loads((run / "data" / "partition.json").read_text(encoding="utf-8"))["num_clients"]
    result: dict = {"run_dir": str(run)}

    t0 = time.perf_counter()
    work = run / "hapfnas" / args.out.stem  # one folder per output: runs on one federation do not collide
    supernet_path = work / "supernet.file"
    report = supernet_from_bundles(
        bundles,
        supernet_path,
        aggregate_dir=None if args.unlabeled else run / "server",
        unlabeled=args.unlabeled,
        config=SupernetConfig(steps=args.steps),
        progress=True,
    )
    result["supernet"] = {
        "seconds": time.perf_counter() - t0,
        "steps": args.steps,
        "data": report["data"],
        "inputs": report["inputs"],
    }
    supernet = load_supernet(supernet_path)

    first = args.clients[0]
    data = load_client_data(run / "data" / f"{client_name(first, num_clients)}.npz")
    seed = int(read_bundle(bundles[first]).seed)
    train, val = split_train_val(data, val_fraction=0.2, seed=seed)
    rng = np.random.default_rng(0)
    specs = [smallest(), largest(), *(sample_elastic(rng) for _ in range(args.subnets - 2))]
    specs.sort(key=lambda s: cost_of(s, data.input_shape, data.num_classes)[0])
    earlier = {}
    if args.scratch_from:
        old = json.loads(args.scratch_from.read_text())["proxy_vs_scratch"]
        if old["client"] == first and old["scratch_epochs"] == args.scratch_epochs:
            earlier = {r["spec"]: r for r in old["subnets"]}
    rows = []
    for spec in specs:
        t1 = time.perf_counter()
        model = extract(supernet, spec)
        recalibrate_bn(model, train, batches=8, seed=seed)
        proxy_loss, proxy_acc = evaluate(model, val)
        proxy_s = time.perf_counter() - t1
        if str(spec) in earlier:  # same spec, split, seed and epochs: the same training
            trained = {k: earlier[str(spec)][k] for k in ("scratch_accuracy", "scratch_seconds")}
        else:
            t1 = time.perf_counter()
            scratch = train_final(str(spec), train, val, epochs=args.scratch_epochs, seed=seed)
            trained = {
                "scratch_accuracy": scratch.metrics["val_accuracy"],
                "scratch_seconds": time.perf_counter() - t1,
            }
        rows.append(
            {
                "spec": str(spec),
                "flops": cost_of(spec, data.input_shape, data.num_classes)[0],
                "proxy_accuracy": proxy_acc,
                "proxy_loss": proxy_loss,
                "proxy_seconds": proxy_s,
                **trained,
            }
        )
        print(rows[-1], flush=True)
    proxy = [r["proxy_accuracy"] for r in rows]
    scratch_acc = [r["scratch_accuracy"] for r in rows]
    result["proxy_vs_scratch"] = {
        "client": first,
        "scratch_epochs": args.scratch_epochs,
        "subnets": rows,
        **rank_correlation(np.asarray(proxy), np.asarray(scratch_acc)),
    }
    atomic_write_json(args.out, result)  # a partial result survives a stop during the client runs

    # HAPFNAS Fig. 9: how well the random forest (the evolution's own settings) ranks specs it has not
    # seen. ``--predictor-specs`` random subnets are scored by the proxy (validation loss, the fitness the
    # evolution minimises); 5-fold out-of-fold predictions against those scores.
    if args.predictor_specs > 0:
        t1 = time.perf_counter()
        fitness = supernet_proxy(supernet, train, val, seed=seed)
        pool = [sample_elastic(rng) for _ in range(args.predictor_specs)]
        x = np.stack([encode(spec) for spec in pool])
        y = np.asarray([fitness(spec) for spec in pool])
        predicted = np.empty_like(y)
        for fold in np.array_split(np.random.default_rng(1).permutation(len(pool)), 5):
            rest = np.setdiff1d(np.arange(len(pool)), fold)
            predicted[fold] = predictor(0).fit(x[rest], y[rest]).predict(x[fold])
        result["predictor"] = {
            "client": first,
            "specs": len(pool),
            "folds": 5,
            **rank_correlation(predicted, y),
            "seconds": time.perf_counter() - t1,
        }
        print(result["predictor"], flush=True)
        atomic_write_json(args.out, result)

    test = load_client_data(run / "data" / "test.npz")
    evo_rows = []
    for k in args.clients:
        bundle = read_bundle(bundles[k])
        data = load_client_data(run / "data" / f"{client_name(k, num_clients)}.npz")
        local = client_test_set(test, list(bundle.label_counts), size=2000, seed=k)
        search = EvolutionConfig.preset(
            "fast",
            supernet=str(supernet_path),
            final_epochs=int(bundle.metrics["final_epochs"]),
        )
        config = ClientConfig(search=search, seed=int(bundle.seed), role="classifier")
        t1 = time.perf_counter()
        out = work / "evolution" / f"{client_name(k, num_clients)}.bundle"
        res = run_client(data, profile=load_profile(str(bundle.profile["name"])), config=config, out=out)
        evo = read_bundle(out)
        evo_rows.append(
            {
                "client": k,
                "profile": bundle.profile["name"],
                "pso": {
                    "arch": bundle.arch,
                    "accuracy": evaluate_onnx(bundle.model_onnx, local)["accuracy"],
                    "candidate_epochs": bundle.metrics["candidate_epochs"],
                    "search_seconds": bundle.metrics["search_seconds"],
                    "flops": bundle.metrics["flops"],
                },
                "evolution": {
                    "arch": evo.arch,
                    "accuracy": evaluate_onnx(evo.model_onnx, local)["accuracy"],
                    "candidate_epochs": evo.metrics["candidate_epochs"],
                    "search_seconds": evo.metrics["search_seconds"],
                    "flops": evo.metrics["flops"],
                    "seconds": time.perf_counter() - t1,
                    "predictor_heldout": res.search.details.get("predictor_heldout") if res.search else None,
                },
            }
        )
        print(evo_rows[-1], flush=True)
        result["evolution_vs_pso"] = evo_rows
        atomic_write_json(args.out, result)


if __name__ == "__main__":
    main(sys.argv[1:])
