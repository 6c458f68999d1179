"""Issue #31 check: one client's classifier on color images under a training recipe (augmentation, weight
decay, schedule), its test accuracy on the whole test set and on a test set with the client's labels.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/color_recipe.py CLIENT.npz --data-root DIR \
        --arch SPEC --epochs N [--augment auto|none|crop-flip] [--schedule auto|constant|cosine] \
        [--weight-decay X] [--seed S] [--out FILE.jsonl]

The client file comes from ``edge-sdk partition``; the model trains through the device's own code path
(``edge_sdk.final_training.train_final``, float32, the client's seeded 80/20 train/validation split) and is
judged in float32 on the dataset's test split (``--dataset``, cifar10 by default): all of it, and a
2,000-image draw with the client's label distribution (seeded, as ``edge_vs_fixed.py`` draws it). One JSON
row is printed and, with ``--out``, appended.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from edge_vs_fixed import client_test_set

from edge_sdk.data import load_client_data, load_dataset, split_train_val
from edge_sdk.final_training import train_final
from edge_sdk.train import TrainConfig, evaluate


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("client", type=Path)
    parser.add_argument("--dataset", default="cifar10")
    parser.add_argument("--data-root", type=Path, required=True)
    parser.add_argument("--arch", required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--augment", default="auto")
    parser.add_argument("--schedule", default="auto")
    parser.add_argument("--weight-decay", type=float)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    data = load_client_data(args.client)
    test = load_dataset(args.dataset, args.data_root, split="test")
    train_split, val_split = split_train_val(data, val_fraction=0.2, seed=args.seed)
    recipe = TrainConfig(augment=args.augment, schedule=args.schedule, weight_decay=args.weight_decay)
    start = time.perf_counter()
    trained = train_final(
        args.arch,
        train_split,
        val_split,
        epochs=args.epochs,
        seed=args.seed,
        precision="fp32",
        augment=args.augment,
        schedule=args.schedule,
        weight_decay=args.weight_decay,
    )
    seconds = time.perf_counter() - start
    local = client_test_set(test, data.label_counts(), size=2000, seed=args.seed)
    row = {
        "client": args.client.name,
        "arch": trained.arch,
        "epochs": args.epochs,
        "seed": args.seed,
        "recipe": vars(recipe.recipe(data.input_shape)),
        "options": {"augment": args.augment, "schedule": args.schedule, "weight_decay": args.weight_decay},
        "val_accuracy": round(trained.metrics["val_accuracy"], 4),
        "test_accuracy": round(evaluate(trained.module, test)[1], 4),
        "client_test_accuracy": round(evaluate(trained.module, local)[1], 4),
        "flops": trained.metrics["flops"],
        "params": trained.metrics["params"],
        "train_seconds": round(seconds, 1),
    }
    line = json.dumps(row, sort_keys=True)
    print(line)
    if args.out:
        with args.out.open("a", encoding="utf-8") as file:
            file.write(line + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
