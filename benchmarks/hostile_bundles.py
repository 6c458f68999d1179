"""Hostile client bundles for the poisoning benchmark: a device that trains on wrong labels and may lie.

    .venv/bin/python benchmarks/hostile_bundles.py runs/bench/pso-a0.5 --client 8 --mode random \\
        --out runs/bench/hostile-a0.5/client_08_random.bundle

Modes, both on the client's own images (``RUN/data/client_KK.npz``), trained like an honest client (CNN1,
``edge_sdk.train``, Adam 1e-3, batch 64):

* ``random``: every label replaced by a uniformly random class; the bundle reports the counts of the labels
  it trained on (honest about counts, useless as a teacher).
* ``shift``: every label y replaced by (y + 1) mod L, and the bundle claims ``--claim`` examples of every
  class (5,000 by default): a liar whose counts would own every class under label-share weighting. Its
  decoder draws class y - 1 when asked for y.
* ``flip``: every label y replaced by L - 1 - y (a flipped teacher).

``--counts trained`` makes any mode claim the counts of the labels it trained on (honest-looking counts,
the default of ``random`` and ``flip``); ``--counts claim`` claims ``--claim`` of every class (the default
of ``shift``). Colluding devices upload one such bundle under several names (``benchmarks/poisoning.sh``).

``--kind decoder`` trains the device's default CVAE (``edge_sdk.cvae.CVAEConfig``) on the same wrong labels
and writes its ``cvae_decoder`` bundle with the same counts, as a hostile client of the ``both`` role
uploads beside its classifier: its samples of class y show another class (shift) or any class (random).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from common.seeding import seeded
from edge_sdk.artifacts import TrainedCVAE, bundle_cvae
from edge_sdk.cvae import CVAEConfig
from edge_sdk.data import ArrayDataset, client_name, load_client_data, split_train_val
from edge_sdk.final_training import train_cvae_final
from edge_sdk.models.arch import build_model
from edge_sdk.train import TrainConfig, train
from export.bundle import Bundle, write_bundle
from export.onnx_export import export_onnx
from profiles import load_profile

ARCH = "C32k5-P-C64k5-P-F10"  # pFedZKD's CNN1, the arch most honest clients end up with


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", help="a simulate output directory (its data/client_KK.npz is used)")
    parser.add_argument("--client", type=int, required=True)
    parser.add_argument("--mode", choices=["random", "shift", "flip"], required=True)
    parser.add_argument(
        "--counts", choices=["trained", "claim"], help="default: claim for shift, else trained"
    )
    parser.add_argument("--kind", choices=["classifier", "decoder"], default="classifier")
    parser.add_argument("--claim", type=int, default=5000, help="claimed examples per class (shift)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    manifest = json.loads((Path(args.run) / "data" / "partition.json").read_text(encoding="utf-8"))
    name = client_name(args.client, manifest["num_clients"])
    data = load_client_data(Path(args.run) / "data" / f"{name}.npz")
    num_classes = data.num_classes
    gen = torch.Generator().manual_seed(args.seed)
    if args.mode == "random":
        y = torch.randint(0, num_classes, data.y.shape, generator=gen)
    elif args.mode == "flip":
        y = num_classes - 1 - data.y
    else:
        y = (data.y + 1) % num_classes
    poisoned = ArrayDataset(data.x, y, num_classes)
    if (args.counts or ("claim" if args.mode == "shift" else "trained")) == "trained":
        counts = torch.bincount(y, minlength=num_classes).tolist()
    else:
        counts = [args.claim] * num_classes
    if args.kind == "decoder":
        write_decoder(poisoned, counts, args.seed, args.out)
        print(f"wrote {args.out}: {args.mode} decoder, claims {counts}")
        return
    with seeded(args.seed):
        model = build_model(ARCH, data.input_shape, num_classes)
    train(model, poisoned, config=TrainConfig(epochs=args.epochs, lr=1e-3, batch_size=64), seed=args.seed)
    model.eval()
    bundle = Bundle(
        kind="classifier",
        model_onnx=export_onnx(model, data.input_shape, metadata={"arch": ARCH}),
        arch=ARCH,
        num_classes=num_classes,
        input_shape=data.input_shape,
        label_counts=counts,
        num_examples=sum(counts),
        profile={"name": "laptop-cpu"},
        metrics={"val_accuracy": 0.99},
        seed=args.seed,
        sdk_version="hostile",
    )
    write_bundle(bundle, args.out)
    print(f"wrote {args.out}: {args.mode}, claims {counts}")


def write_decoder(poisoned: ArrayDataset, counts: list[int], seed: int, out: str) -> None:
    """The device's CVAE trained on the poisoned labels, bundled with the claimed counts."""
    profile = load_profile("laptop-cpu")
    train_split, val_split = split_train_val(poisoned, val_fraction=0.2, seed=seed)
    trained = train_cvae_final(train_split, val_split, config=CVAEConfig(), profile=profile, seed=seed)
    lying = TrainedCVAE(**{**trained.__dict__, "label_counts": tuple(counts), "num_examples": sum(counts)})
    bundle_cvae(lying, profile, out, seed=seed)


if __name__ == "__main__":
    main()
