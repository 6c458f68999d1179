"""How recognisable the uploaded CVAE decoders' samples are, per class (issue #18).

    .venv/bin/python benchmarks/decoder_quality.py RUN_DIR [RUN_DIR ...] --out FILE.json
        [--reference reference.onnx] [--per-class 300] [--samples 6000] [--temperature 1.0] [--threads 2]
        [--weighting examples|federation]

A reference classifier is trained on real images (the union of the run's client files, i.e. the
training set; CNN1, 3 epochs: about 99 % on MNIST's test set) and saved to ``--reference`` (reused when
it exists). It judges decoder samples the way a person would: a sample of class c is recognisable when
the reference calls it c. For each run:

- ``per_decoder``: every decoder bundle sampled ``--per-class`` times for each class it holds (z ~ N(0, I));
- ``server``: the server's own decoder set, as ``aggregate`` draws it (``--samples`` images allocated by
  the decoders' label counts, or with ``--weighting federation`` by every bundle's, as the fedmho preset
  does; the same seed), before and after FedMHO's centroid filter (R_th 0.8): the samples the global model
  trains on.

Only evaluation touches real data here (the reference's training set and test set), never the toolkit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_sdk.artifacts import load_trained_model, save_trained_model
from edge_sdk.data import ArrayDataset, load_client_data, split_train_val
from edge_sdk.final_training import train_final
from export.atomic import atomic_write_json
from export.bundle import read_bundle
from server_kit.synthesis.decoders import filter_by_centroid, load_decoder, sample_decoders

REFERENCE_ARCH = "C32k5-P-C64k5-P-F10"


def reference_classifier(run: Path, path: Path, *, epochs: int = 3) -> torch.nn.Module:
    """CNN1 trained on the run's training images (every client file), saved at ``path``; reused."""
    if path.is_file():
        return load_trained_model(path)[0].module.eval()
    parts = [load_client_data(p) for p in sorted((run / "data").glob("client_*.npz"))]
    data = ArrayDataset(
        torch.cat([p.x for p in parts]), torch.cat([p.y for p in parts]), parts[0].num_classes
    )
    train, val = split_train_val(data, val_fraction=0.05, seed=0)
    trained = train_final(REFERENCE_ARCH, train, val, epochs=epochs, seed=0, precision="fp32")
    save_trained_model(trained, path)
    return trained.module.eval()


@torch.inference_mode()
def recognised(
    reference: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, classes: int
) -> list[float | None]:
    """Per class: the fraction of samples made for it that ``reference`` calls it (None: no sample)."""
    predicted = torch.cat([reference(x[i : i + 512]).argmax(1) for i in range(0, len(x), 512)])
    made = torch.bincount(y, minlength=classes)
    hits = torch.bincount(y[predicted == y], minlength=classes)
    return [round(float(h) / float(m), 4) if m else None for h, m in zip(hits, made, strict=True)]


def _summary(per_class: list[float | None]) -> dict[str, Any]:
    scored = [v for v in per_class if v is not None]
    return {"per_class": per_class, "min": min(scored) if scored else None, "mean": float(np.mean(scored))}


def measure(
    run: Path,
    reference: torch.nn.Module,
    *,
    per_class: int,
    samples: int,
    temperature: float,
    weighting: str = "examples",
) -> dict[str, Any]:
    paths = sorted(run.glob("clients/*.bundle"))
    bundles = [(p, read_bundle(p)) for p in paths]
    decoders = [(p, b) for p, b in bundles if b.kind == "cvae_decoder"]
    if not decoders:
        raise SystemExit(f"{run}: no cvae_decoder bundles in clients/")
    classes = decoders[0][1].num_classes
    modules = [load_decoder(b) for _, b in decoders]
    counts = [list(b.label_counts) for _, b in decoders]
    rows = []
    for (path, bundle), module, row in zip(decoders, modules, counts, strict=True):
        held = [per_class if n > 0 else 0 for n in row]  # the same number of samples of each held class
        x, y = sample_decoders(
            [module], [held], total=sum(held), num_classes=classes, seed=0, temperature=temperature
        )
        rows.append(
            {
                "bundle": path.name,
                "arch": bundle.arch,
                "label_counts": row,
                **_summary(recognised(reference, x, y, classes)),
            }
        )
    federation = None
    if weighting == "federation":  # every upload's counts, as aggregate's decoder_weighting="federation"
        federation = [sum(col) for col in zip(*(b.label_counts for _, b in bundles), strict=True)]
    x, y = sample_decoders(
        modules, counts, total=samples, num_classes=classes, seed=0, temperature=temperature,
        weighting=weighting, class_counts=federation,
    )  # fmt: skip
    keep = filter_by_centroid(x, y, keep=0.8)
    return {
        "run": str(run),
        "temperature": temperature,
        "weighting": weighting,
        "per_decoder": rows,
        "server": {
            "sampled": len(y),
            "before_filter": _summary(recognised(reference, x, y, classes)),
            "after_filter": _summary(recognised(reference, x[keep], y[keep], classes)),
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reference", type=Path, default=Path("runs/bench/reference-cnn1.onnx"))
    parser.add_argument("--per-class", type=int, default=300)
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="z ~ N(0, t^2 I), as --decoder-temperature"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weighting", choices=("examples", "federation"), default="examples")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    reference = reference_classifier(args.runs[0], args.reference)
    test = load_client_data(args.runs[0] / "data" / "test.npz")
    accuracy = recognised(reference, test.x.float() / 255, test.y, test.num_classes)
    results = {
        "reference": {"arch": REFERENCE_ARCH, "file": str(args.reference), **_summary(accuracy)},
        "runs": [
            measure(
                run,
                reference,
                per_class=args.per_class,
                samples=args.samples,
                temperature=args.temperature,
                weighting=args.weighting,
            )
            for run in args.runs
        ],
    }
    atomic_write_json(args.out, results)
    print(f"reference on the test set: mean per-class {results['reference']['mean']:.4f}", file=sys.stderr)
    for run in results["runs"]:
        server = run["server"]
        print(
            f"{run['run']}: server decoder set, lowest class {server['before_filter']['min']} before the "
            f"filter, {server['after_filter']['min']} after; after, per class: "
            f"{server['after_filter']['per_class']}"
        )


if __name__ == "__main__":
    main()
