"""Tune the server (inversion -> consensus -> distillation) on MNIST teachers, without the edge pipeline.

Partitions MNIST over ``--clients`` clients with ``edge_sdk.data.dirichlet_partition``, trains one small
chain CNN per client with ``edge_sdk.train`` (varied specs, Adam 1e-3, batch 64; no architecture
search), caches the teachers, then runs each requested
experiment through ``server_kit.inversion`` / ``server_kit.distill`` on the modules directly and prints
one JSON line per experiment (student test accuracy, seconds per phase). Synthetic sets are cached per
inversion config (the resume work_dir), so experiments that only change distillation reuse them; the
inversion seconds reported are those of the run that computed the set.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/tune_server.py --alpha 0.5 \
        --experiment base \
        --experiment bn:inv.bn_weight=0.1 \
        --experiment big:inv.samples_per_teacher=1000,kd.epochs=30,student=C32k5-P-C64k5-P-F256-F10

Experiment keys: ``inv.<InversionConfig field>``, ``kd.<DistillConfig field>``,
``consensus=mean|label-weighted``, ``student=<chain spec>``, ``preset=<aggregate preset>`` (applied first).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from edge_sdk.arch import build_model
from edge_sdk.data import ArrayDataset, dirichlet_partition, load_dataset
from edge_sdk.train import TrainConfig, evaluate, seeded, train
from server_kit.distill import DistillConfig, consensus, distill, label_count_weights
from server_kit.inversion import InversionConfig, synthesize_inversion

TEACHER_SPECS = (
    "C32k3-P-C64k3-P-F128-F10",
    "C16k5-P-C32k5-P-F10",
    "C32k5-P-C64k5-P-F10",
    "C16k3-C32k3-P-C64k3-P-F128-F10",
    "C24k3-P-C48k3-P-F10",
    "C32k3-P-C32k3-P-F64-F10",
    "C16k7-P-C32k5-P-F128-F10",
    "C32k3-Pavg-C64k3-Pavg-F10",
    "C8k3-P-C16k3-P-C32k3-P-F10",
    "C32k5-P-F128-F10",
)
INPUT_SHAPE = (1, 28, 28)
NUM_CLASSES = 10


def load_mnist(root: str) -> tuple[ArrayDataset, ArrayDataset]:
    return load_dataset("mnist", root, split="train"), load_dataset("mnist", root, split="test")


def train_teacher(spec: str, data: ArrayDataset, epochs: int, seed: int) -> torch.nn.Module:
    """A client as the edge SDK trains one (Adam 1e-3, batch 64), with its search skipped."""
    with seeded(seed):
        model = build_model(spec, INPUT_SHAPE, NUM_CLASSES)
    train(model, data, config=TrainConfig(epochs=epochs, lr=1e-3, batch_size=64), seed=seed)
    return model.eval()


def accuracy(model: torch.nn.Module, data: ArrayDataset) -> float:
    return evaluate(model, data)[1]


@torch.no_grad()
def ensemble_accuracy(models: list[torch.nn.Module], data: ArrayDataset) -> float:
    probs = consensus(models, data.x.float() / 255, tau=1.0)
    return float((probs.argmax(1) == data.y).float().mean())


def get_teachers(args, train_set: ArrayDataset, test_set: ArrayDataset):
    cache = (
        Path(args.cache_dir) / f"teachers_a{args.alpha}_k{args.clients}_e{args.teacher_epochs}_s{args.seed}"
    )
    cache.mkdir(parents=True, exist_ok=True)
    parts = dirichlet_partition(train_set.y.numpy(), args.clients, args.alpha, args.seed)
    teachers, counts, info = [], [], []
    for k, idx in enumerate(parts):
        spec = TEACHER_SPECS[k % len(TEACHER_SPECS)]
        path = cache / f"teacher_{k:02d}.pt"
        client = train_set.subset(idx)
        if path.exists():
            model = build_model(spec, INPUT_SHAPE, NUM_CLASSES)
            model.load_state_dict(torch.load(path))
            model.eval()
        else:
            t0 = time.time()
            model = train_teacher(spec, client, args.teacher_epochs, args.seed * 1000 + k)
            torch.save(model.state_dict(), path)
            print(
                f"# trained teacher {k} ({spec}, {len(idx)} images) in {time.time() - t0:.1f}s",
                file=sys.stderr,
            )
        teachers.append(model)
        counts.append(client.label_counts())
        info.append({"spec": spec, "n": len(idx), "test_acc": round(accuracy(model, test_set), 4)})
    return teachers, counts, info


def parse_experiment(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition(":")
    settings = dict(item.split("=", 1) for item in rest.split(",") if item)
    return name, settings


def _coerce(cls, key: str, value: str):
    field = {f.name: f for f in dataclasses.fields(cls)}[key]
    kind = str(field.type)
    if "tuple" in kind:
        return tuple(float(v) for v in value.split("/"))
    if "bool" in kind:
        return value.lower() in ("1", "true", "yes")
    if "int" in kind and "float" not in kind:
        return int(value)
    return float(value)


def run_experiment(name, settings, teachers, counts, test_set, args) -> dict:
    inv = dict(samples_per_teacher=600, steps=60, batch_size=200, lr=0.1, tau=4.0)
    kd = dict(epochs=20, batch_size=64, lr=1e-3, tau=4.0)
    student_spec = "C32k3-P-C64k3-P-F128-F10"
    mode = "mean"
    if "preset" in settings:
        from server_kit.aggregate import AggregateConfig

        preset = AggregateConfig.preset(settings["preset"])
        inv, kd = preset.inversion.to_dict(), preset.distill.to_dict()
        inv["betas"] = tuple(inv["betas"])
        student_spec, mode = preset.student, preset.consensus
    for key, value in settings.items():
        if key.startswith("inv."):
            inv[key[4:]] = _coerce(InversionConfig, key[4:], value)
        elif key.startswith("kd."):
            kd[key[3:]] = _coerce(DistillConfig, key[3:], value)
        elif key == "student":
            student_spec = value
        elif key == "consensus":
            mode = value
        elif key != "preset":
            raise SystemExit(f"unknown experiment key {key!r}")
    inv_cfg = InversionConfig(**inv)
    kd_cfg = DistillConfig(**kd)
    tag = hashlib.sha256(json.dumps([inv_cfg.to_dict(), args.seed], sort_keys=True).encode()).hexdigest()[:12]
    work = Path(args.cache_dir) / f"syn_a{args.alpha}_k{args.clients}_e{args.teacher_epochs}_{tag}"
    timing_file = work / "seconds.json"
    t0 = time.time()
    syn = synthesize_inversion(
        teachers,
        num_classes=NUM_CLASSES,
        input_shape=INPUT_SHAPE,
        config=inv_cfg,
        seed=args.seed,
        work_dir=work,
    )
    if timing_file.exists():
        t_inv = json.loads(timing_file.read_text())["inversion"]
    else:
        t_inv = time.time() - t0
        timing_file.write_text(json.dumps({"inversion": t_inv}))
    t0 = time.time()
    weights = label_count_weights(counts) if mode == "label-weighted" else None
    probs = consensus(teachers, syn.x, tau=kd_cfg.tau, class_weights=weights)
    t_cons = time.time() - t0
    # how often the teacher ensemble agrees with the class each image was optimised for
    agree = float((probs.argmax(1) == syn.target_class).float().mean())
    t0 = time.time()
    with seeded(args.seed):
        student = build_model(student_spec, INPUT_SHAPE, NUM_CLASSES)
    targets = probs.argmax(1) if kd_cfg.hard_labels else probs
    losses = distill(student, syn.x, targets, config=kd_cfg, seed=args.seed)
    t_kd = time.time() - t0
    acc = accuracy(student, test_set)
    return {
        "name": name,
        "alpha": args.alpha,
        "inversion": inv_cfg.to_dict(),
        "distill": kd_cfg.to_dict(),
        "student": student_spec,
        "consensus": mode,
        "synthetic": len(syn),
        "consensus_agrees_with_target": round(agree, 4),
        "student_acc": round(acc, 4),
        "final_loss": round(losses[-1], 4),
        "seconds": {"inversion": round(t_inv, 1), "consensus": round(t_cons, 1), "distill": round(t_kd, 1)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-root", default="/work/shared/datasets")
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--teacher-epochs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", default="/tmp/tune_server_cache")
    parser.add_argument("--out", default=None, help="append JSON lines here as well as to stdout")
    parser.add_argument("--experiment", action="append", default=[], help="NAME[:key=value,...]")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    train_set, test_set = load_mnist(args.data_root)
    teachers, counts, info = get_teachers(args, train_set, test_set)
    header = {
        "teachers": info,
        "ensemble_acc": round(ensemble_accuracy(teachers, test_set), 4),
        "alpha": args.alpha,
    }
    print(json.dumps(header), flush=True)
    for text in args.experiment or ["base"]:
        name, settings = parse_experiment(text)
        row = run_experiment(name, settings, teachers, counts, test_set, args)
        line = json.dumps(row, sort_keys=True)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(line + "\n")


if __name__ == "__main__":
    main()
