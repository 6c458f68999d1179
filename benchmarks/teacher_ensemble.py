"""Accuracy of the teacher ensemble itself on the real MNIST test set: the ceiling of data-free distillation.

    .venv/bin/python benchmarks/teacher_ensemble.py RUN_NAME [RUN_NAME ...]

For each `runs/bench/RUN_NAME` (a simulate output with 10 client bundles): the argmax accuracy of the
mean consensus and of the label-weighted consensus (`server_kit.training.distill.consensus`, tau 1) of all
classifier teachers on `data/test.npz`. Writes benchmarks/results/teacher_ensemble.json.
"""

from __future__ import annotations

import glob
import sys
from pathlib import Path

import torch

from edge_sdk.data import load_client_data
from edge_sdk.train import to_float
from export.atomic import atomic_write_json
from server_kit.labelling.labels import consensus
from server_kit.teachers.counts import class_shares
from server_kit.teachers.loading import load_teachers


def main(runs: list[str]) -> None:
    out = {}
    for run in runs:
        paths = sorted(glob.glob(f"runs/bench/{run}/clients/client_*.bundle"))
        teachers, _ = load_teachers(paths)
        test = load_client_data(f"runs/bench/{run}/data/test.npz")
        x, y = to_float(test.x), test.y
        modules = [t.module for t in teachers]
        weights = class_shares([t.bundle.label_counts for t in teachers])
        mean = consensus(modules, x, tau=1.0)
        weighted = consensus(modules, x, tau=1.0, class_weights=weights)
        out[run] = {
            "mean_consensus": float((mean.argmax(1) == y).float().mean()),
            "label_weighted": float((weighted.argmax(1) == y).float().mean()),
        }
        print(run, out[run], flush=True)
    atomic_write_json(Path(__file__).parent / "results" / "teacher_ensemble.json", out)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
