"""Tune the conditional-generator synthesis (server_kit.generator) on MNIST teachers.

Reuses the teachers of ``benchmarks/tune_server.py`` (same partition, specs and cache directory: 10
Dirichlet clients, small chain CNNs), then for each experiment trains a generator, samples and filters
a synthetic set, labels it by (label-weighted) consensus and distils a fresh student, printing one JSON
line with the student's test accuracy and the seconds of every phase. Trained generators are cached by
their training-relevant settings, so experiments that change only the filter or the sample count reuse
them; the training seconds reported are those of the run that trained it.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/tune_generator.py --alpha 0.5 \
        --experiment base \
        --experiment nodiv:g.div_weight=0 \
        --experiment f02:g.filter_fraction=0.2

Experiment keys: ``g.<GeneratorConfig field>``, ``kd.<DistillConfig field>``, ``student=<chain spec>``,
``consensus=mean|label-weighted``, ``drop=gradient|random`` (``random``: a control that drops as many
samples as the filter would, uniformly at random).
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tune_server import INPUT_SHAPE, NUM_CLASSES, TEACHER_SPECS, accuracy, get_teachers, load_mnist

from edge_sdk.arch import build_model
from edge_sdk.data import dirichlet_partition
from edge_sdk.train import seeded
from server_kit.distill import DistillConfig, consensus, distill, label_count_weights
from server_kit.generator import (
    ConditionalGenerator,
    GeneratorConfig,
    filter_noisy,
    gradient_noise_scores,
    sample_generator,
    train_generator,
)

# fields that do not change the trained generator (unless the filter also runs during training)
SAMPLING_FIELDS = ("samples", "filter_fraction")


def cached_teachers(args, train_set, test_set) -> tuple[list[torch.nn.Module], list[list[int]]]:
    """tune_server's teachers and label counts; read from its cache without re-scoring them on the test
    set (that costs minutes of CPU), trained through tune_server when the cache is incomplete."""
    cache = (
        Path(args.cache_dir) / f"teachers_a{args.alpha}_k{args.clients}_e{args.teacher_epochs}_s{args.seed}"
    )
    paths = [cache / f"teacher_{k:02d}.pt" for k in range(args.clients)]
    if not all(p.exists() for p in paths):
        teachers, counts, _ = get_teachers(args, train_set, test_set)
        return teachers, counts
    parts = dirichlet_partition(train_set.y.numpy(), args.clients, args.alpha, args.seed)
    teachers, counts = [], []
    for k, (idx, path) in enumerate(zip(parts, paths, strict=True)):
        model = build_model(TEACHER_SPECS[k % len(TEACHER_SPECS)], INPUT_SHAPE, NUM_CLASSES)
        model.load_state_dict(torch.load(path))
        teachers.append(model.eval())
        counts.append(train_set.subset(idx).label_counts())
    return teachers, counts


def _coerce(cls, key: str, value: str):
    kind = str({f.name: f for f in dataclasses.fields(cls)}[key].type)
    if "bool" in kind:
        return value.lower() in ("1", "true", "yes")
    if "int" in kind and "float" not in kind:
        return int(value)
    return float(value)


def trained_generator(
    cfg: GeneratorConfig, teachers, counts, args
) -> tuple[ConditionalGenerator, dict, float, str]:
    """Train (or load the cached) generator; returns (G, mean of the last 10 loss dicts, seconds, tag)."""
    key = cfg.to_dict()
    if not cfg.filter_during_training:
        for name in SAMPLING_FIELDS:
            key.pop(name)
    tag = hashlib.sha256(json.dumps([key, args.seed], sort_keys=True).encode()).hexdigest()[:12]
    path = Path(args.cache_dir) / f"gen_a{args.alpha}_k{args.clients}_e{args.teacher_epochs}_{tag}.pt"
    if path.exists():
        saved = torch.load(path)
        generator = ConditionalGenerator(
            nz=cfg.nz, num_classes=NUM_CLASSES, input_shape=INPUT_SHAPE, width=cfg.width
        )
        generator.load_state_dict(saved["state"])
        return generator.eval(), saved["last"], saved["seconds"], tag
    t0 = time.time()
    generator, losses = train_generator(
        teachers, counts, input_shape=INPUT_SHAPE, num_classes=NUM_CLASSES, config=cfg, seed=args.seed
    )
    seconds = time.time() - t0
    last = {k: sum(step[k] for step in losses[-10:]) / len(losses[-10:]) for k in losses[-1]}
    torch.save({"state": generator.state_dict(), "last": last, "seconds": seconds}, path)
    return generator, last, seconds, tag


_SAMPLED: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, float]] = {}
_SCORED: dict[tuple[str, int], tuple[torch.Tensor, float]] = {}


def sampled(tag: str, generator, cfg: GeneratorConfig, counts, args):
    """(x, y, seconds) of a generator's synthetic set, drawn once per run."""
    key = (tag, cfg.samples)
    if key not in _SAMPLED:
        t0 = time.time()
        pooled = [sum(col) for col in zip(*counts, strict=True)]
        x, y = sample_generator(generator, pooled, n=cfg.samples, seed=args.seed)
        _SAMPLED[key] = (x, y, time.time() - t0)
    return _SAMPLED[key]


def scored(tag: str, cfg: GeneratorConfig, x, y, teachers, counts):
    """(noise scores, seconds) of a synthetic set, computed once per run."""
    key = (tag, cfg.samples)
    if key not in _SCORED:
        t0 = time.time()
        _SCORED[key] = (gradient_noise_scores(teachers, x, y, label_count_weights(counts)), time.time() - t0)
    return _SCORED[key]


def run_experiment(name: str, settings: dict[str, str], teachers, counts, test_set, args) -> dict:
    g_fields, kd = {}, dict(epochs=20, batch_size=64, lr=1e-3, tau=4.0)
    student_spec, mode, drop = "C32k3-P-C64k3-P-F128-F10", "label-weighted", "gradient"
    for key, value in settings.items():
        if key.startswith("g."):
            g_fields[key[2:]] = _coerce(GeneratorConfig, key[2:], value)
        elif key.startswith("kd."):
            kd[key[3:]] = _coerce(DistillConfig, key[3:], value)
        elif key == "student":
            student_spec = value
        elif key == "consensus":
            mode = value
        elif key == "drop":
            drop = value
        else:
            raise SystemExit(f"unknown experiment key {key!r}")
    cfg = GeneratorConfig.preset("fast", **g_fields)
    kd_cfg = DistillConfig(**kd)
    generator, last, t_train, tag = trained_generator(cfg, teachers, counts, args)
    weights = label_count_weights(counts)

    x, y, t_sample = sampled(tag, generator, cfg, counts, args)
    t_score = 0.0
    if cfg.filter_fraction > 0 and drop == "random":  # control: drop as many, chosen at random
        scores = torch.rand(x.shape[0], generator=torch.Generator().manual_seed(args.seed))
        keep = filter_noisy(scores, cfg.filter_fraction)
        x, y = x[keep], y[keep]
    elif cfg.filter_fraction > 0:
        scores, t_score = scored(tag, cfg, x, y, teachers, counts)
        keep = filter_noisy(scores, cfg.filter_fraction)
        x, y = x[keep], y[keep]

    t0 = time.time()
    probs = consensus(
        teachers, x, tau=kd_cfg.tau, class_weights=weights if mode == "label-weighted" else None
    )
    t_cons = time.time() - t0
    agree = float((probs.argmax(1) == y).float().mean())  # ensemble agrees with the conditioning label

    t0 = time.time()
    with seeded(args.seed):
        student = build_model(student_spec, INPUT_SHAPE, NUM_CLASSES)
    distill(student, x, probs, config=kd_cfg, seed=args.seed)
    t_kd = time.time() - t0
    return {
        "name": name,
        "alpha": args.alpha,
        "generator": cfg.to_dict(),
        "distill": kd_cfg.to_dict(),
        "student": student_spec,
        "consensus": mode,
        "drop": drop if cfg.filter_fraction > 0 else "none",
        "synthetic": int(x.shape[0]),
        "last10_losses": {k: round(v, 4) for k, v in last.items()},
        "consensus_agrees_with_label": round(agree, 4),
        "student_acc": round(accuracy(student, test_set), 4),
        "seconds": {
            "train": round(t_train, 1),
            "sample": round(t_sample, 1),
            "filter": round(t_score, 1),
            "consensus": round(t_cons, 1),
            "distill": round(t_kd, 1),
        },
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
    teachers, counts = cached_teachers(args, train_set, test_set)
    print(json.dumps({"label_counts": counts, "alpha": args.alpha}), flush=True)
    for text in args.experiment or ["base"]:
        name, _, rest = text.partition(":")
        settings = dict(item.split("=", 1) for item in rest.split(",") if item)
        line = json.dumps(run_experiment(name, settings, teachers, counts, test_set, args), sort_keys=True)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(line + "\n")


if __name__ == "__main__":
    main()
