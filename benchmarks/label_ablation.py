"""Label-skew ablation: the server's phases on the client bundles of one simulate run, one variant a row.

    .venv/bin/python benchmarks/label_ablation.py runs/bench/pso-a0.1 --threads 2 \\
        --variant old:labels.rule=mean,labels.mask=0,labels.drop_mismatch=0,inversion.classes=all \\
        --variant default

Every variant is an :class:`server_kit.aggregate_config.AggregateConfig` (the default, then
``section.field=value``
overrides; sections ``labels``, ``inversion``, ``generator``, ``distill``, or a top-level field) run through
the same phases ``server-kit aggregate`` runs (``synthesize``, ``label``, ``train_global``), so a row here
is what the CLI would give. Variants that differ only after synthesis share its samples (cached in
memory; the inversion's chunks are kept in ``--work``, so a rerun resumes). Prints one JSON line per
variant and writes them all, with the teacher ensemble's ceilings on the real test set, to ``--out``:

* ``mean``: argmax of the mean consensus; ``label_weighted``: each teacher's vote for class c scaled by its
  share of c; ``label_weighted_masked``: the same with each teacher's softmax over its own classes;
  ``oracle``: some teacher is right.

``--real N`` is a diagnostic, never the server's path: the synthetic set is replaced by N real training images
of the clients (pooled from ``RUN/data/client_*.npz``, drawn with ``--seed``), labelled by the same vote and
distilled the same way, so the gap between its row and a synthetic row is what synthesis loses and the gap
between its row and the label-weighted ceiling is what the distillation loses. The true labels are not used.
Every row also holds ``fidelity``: how often the student's class is the vote's, on the images it was distilled
on and on the test images, and that vote's own accuracy there (the vote at the distillation's temperature,
which the ceilings' rules, at temperature 1, are not).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch

from edge_sdk.data import load_client_data
from edge_sdk.train import to_float
from export.atomic import atomic_write_json
from server_kit.aggregate_config import AggregateConfig
from server_kit.labelling import label, top_up
from server_kit.labelling.ceilings import teacher_ceilings
from server_kit.synthesis import Synthesis, SyntheticSet, synthesize, with_views
from server_kit.teachers import Federation, split_kinds, without_clones
from server_kit.teachers.loading import read_uploads, teachers_from_bundles
from server_kit.training import train_global
from server_kit.training.adversarial import AdversarialConfig

SECTIONS = ("labels", "inversion", "generator", "distill", "adversarial")


def _coerce(current: Any, text: str) -> Any:
    if current is None:  # an optional field: none, a bool, a number or a "+"-joined list of names
        lowered = text.lower()
        if not lowered.replace(".", "", 1).isdigit() and lowered not in ("none", "true", "false"):
            return tuple(x for x in text.split("+") if x)
        if lowered == "none":
            return None
        if lowered in ("0", "1", "true", "false"):
            return lowered in ("1", "true")
        return float(text) if "." in text else int(text)
    if isinstance(current, bool):
        return text.lower() in ("1", "true", "yes")
    if isinstance(current, int):
        return int(text)
    if isinstance(current, float):
        return float(text)
    if isinstance(current, tuple):
        return tuple(x for x in text.split("+") if x)
    return text


def variant_config(spec: str, seed: int) -> tuple[str, AggregateConfig]:
    """``name[:key=value,...]`` -> (name, config)."""
    name, _, body = spec.partition(":")
    config = AggregateConfig(seed=seed)
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        section, _, field = key.partition(".")
        if field:
            if section not in SECTIONS:
                raise SystemExit(f"unknown section {section!r} in {spec!r}; expected one of {SECTIONS}")
            sub = getattr(config, section)
            if sub is None and section == "adversarial":  # off by default: start from its defaults
                sub = AdversarialConfig()
            sub = dataclasses.replace(sub, **{field: _coerce(getattr(sub, field), value)})
            config = dataclasses.replace(config, **{section: sub})
        else:
            config = dataclasses.replace(config, **{key: _coerce(getattr(config, key), value)})
    return name, config


def as_synthesis(x: torch.Tensor, fed: Federation) -> Synthesis:
    """Real float images in the place of a synthetic set: made for no class, so only the vote labels."""
    part = SyntheticSet(
        x=x,
        teacher=torch.full((len(x),), -1, dtype=torch.long),
        target_class=torch.zeros(len(x), dtype=torch.long),
    )
    counts = [list(map(int, c)) for c in fed.label_counts]
    report = {"synthetic_sources": {"real": len(part)}, "claims": None}
    return Synthesis(synthetic=part, parts={"real": part}, label_counts=counts, seconds={}, report=report)


def real_images(run: Path, fed: Federation, n: int, seed: int) -> Synthesis:
    """``n`` of the clients' own training images as the "synthetic" set (see the module docstring)."""
    xs = [load_client_data(path).x for path in sorted((run / "data").glob("client_*.npz"))]
    pool = torch.cat([torch.as_tensor(x) for x in xs])
    pick = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed))[:n]
    return as_synthesis(to_float(pool[pick]), fed)


def without_drop(config: AggregateConfig) -> AggregateConfig:
    """``config`` keeping every sample the vote labels: a real image was made for no class, so there is
    no target class for the vote to mismatch."""
    return dataclasses.replace(config, labels=dataclasses.replace(config.labels, drop_mismatch=False))


@torch.no_grad()
def predictions(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([model(x[i : i + 1024]).argmax(1) for i in range(0, len(x), 1024)])


def fidelity(pred: torch.Tensor, targets: torch.Tensor) -> float:
    """How often the student's class is the vote's (the distillation's fidelity, Stanton et al. 2021)."""
    return float((pred == targets.argmax(1)).float().mean())


def per_class_accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int) -> list:
    return class_accuracies(predictions(model, x), y, num_classes)


def class_accuracies(pred: torch.Tensor, y: torch.Tensor, num_classes: int) -> list:
    return [float((pred[y == c] == c).float().mean()) for c in range(num_classes)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", help="a `server-kit simulate` output directory (clients/, data/test.npz)")
    parser.add_argument("--variant", action="append", default=[], help="name[:section.field=value,...]")
    parser.add_argument("--bundles", nargs="+", help="bundle files instead of RUN/clients/client_*.bundle")
    parser.add_argument("--ceilings-only", action="store_true", help="the teachers' ceilings, no variant")
    parser.add_argument("--real", type=int, help="diagnostic: N real client images instead of synthesis")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", help="work directory (inversion chunks); default RUN/ablation")
    parser.add_argument(
        "--out", help="JSON of every row; default benchmarks/results/label_ablation_<run>.json"
    )
    args = parser.parse_args()
    if args.real is not None and args.real < 1:
        parser.error(f"--real must be a positive number of images, got {args.real}")
    torch.set_num_threads(args.threads)
    run = Path(args.run)
    work = Path(args.work) if args.work else run / "ablation"
    out = (
        Path(args.out) if args.out else Path(__file__).parent / "results" / f"label_ablation_{run.name}.json"
    )
    rows: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}

    paths = args.bundles or sorted(glob.glob(str(run / "clients" / "client_*.bundle")))
    clones: list[tuple[str, str]] = []  # one model under several names counts once, as the server does
    uploads = without_clones(read_uploads(paths), on_error="skip", skipped=clones)
    paths = [str(path) for path, _ in uploads]
    classifiers, decoders = split_kinds(uploads)  # cvae_decoder bundles feed the decoder source
    teachers = teachers_from_bundles(classifiers, skipped=[])
    fed = Federation.from_teachers(teachers, torch.device("cpu"), decoders)
    test = load_client_data(run / "data" / "test.npz")
    x_test, y_test = to_float(test.x), test.y
    if "ceilings" not in rows:
        rows["ceilings"] = teacher_ceilings(fed, x_test, y_test)
    print("ceilings", json.dumps(rows["ceilings"]), flush=True)
    if args.ceilings_only:
        atomic_write_json(out, rows)
        return

    cache: dict[str, Any] = {}
    for spec in args.variant or ["default"]:
        name, config = variant_config(spec, args.seed)
        config = config.for_task(fed.input_shape)  # the server's auto settings, as aggregate decides them
        if args.real:
            config = without_drop(config)
        key = json.dumps(
            [
                paths,
                config.synth,
                config.inversion.to_dict(),
                config.generator.to_dict(),
                config.seed,
                config.checks_claims,
                config.decoder_samples,
                config.decoder_keep,
            ]
        )
        t0 = time.perf_counter()
        if args.real and key not in cache:
            cache[key] = real_images(run, fed, args.real, config.seed)
        elif key not in cache:
            # one work folder per synthesis (the server writes through no link, so chunks are not shared
            # between syntheses by linking one folder into another)
            tag = "synth_" + hashlib.sha256(key.encode()).hexdigest()[:12]
            (work / tag).mkdir(parents=True, exist_ok=True)
            cache[key] = synthesize(fed, config.synthesis_config(bool(fed.decoders)), work / tag)
        synthesis = with_views(cache[key], config.views)
        t_synth = time.perf_counter() - t0
        t0 = time.perf_counter()
        labels = label(fed, synthesis, config.labelling_config())
        synthesis, labels = top_up(fed, synthesis, labels, config.labelling_config())
        t_label = time.perf_counter() - t0
        training = train_global(fed, synthesis, labels, config.training_config(), teachers=teachers)
        # the vote the student learned, on the test images (unmirrored, nothing dropped): how faithfully the
        # student copies it there, against on the images it was distilled on
        test_vote = label(fed, as_synthesis(x_test, fed), without_drop(config).labelling_config())
        keep = labels.keep
        test_pred = predictions(training.student, x_test)
        per_class = class_accuracies(test_pred, y_test, fed.num_classes)
        acc = float(
            sum(per_class[c] * int((y_test == c).sum()) for c in range(fed.num_classes)) / len(y_test)
        )
        rows[name] = {
            "spec": spec,
            "bundles": paths,
            "skipped": clones,
            "accuracy": acc,
            "per_class_accuracy": per_class,
            "min_class_accuracy": min(per_class),
            "fidelity": {
                "transfer": fidelity(
                    predictions(training.student, synthesis.synthetic.x[keep]), labels.targets[keep]
                ),
                "test": fidelity(test_pred, test_vote.targets),
                "vote_test_accuracy": float((test_vote.targets.argmax(1) == y_test).float().mean()),
            },
            "labels": labels.report,
            "synthetic_sources": synthesis.report["synthetic_sources"],
            "claims": synthesis.report["claims"],
            "decoder_claims": (synthesis.report.get("decoders") or {}).get("claims"),
            "seconds": {"synthesis": t_synth, "labels": t_label, **training.seconds},
            "config": config.to_dict(),
        }
        print(
            name,
            json.dumps({k: rows[name][k] for k in ("accuracy", "min_class_accuracy", "fidelity")}),
            flush=True,
        )
        atomic_write_json(out, rows)


if __name__ == "__main__":
    main()
