"""`server-kit`: thin command-line wrappers over `aggregate`, `evaluate_onnx` and `simulate`.

The shared plumbing is :mod:`common.cli`; `simulate` reuses the edge's search and CVAE options from
:mod:`edge_sdk.cli` (it runs the same clients). Sub-commands import their library inside the function on
purpose: ``--help`` and a usage error do not load torch.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from common.cli import (
    cli_main,
    out_dir,
    out_file,
    overrides,
    print_json,
    print_skipped,
    root_parser,
    with_knobs,
)
from common.errors import ConfigError
from edge_sdk import __version__
from edge_sdk.cli import add_cvae_knobs, add_search_args, add_unknown_arg, cvae_config, search_config

if TYPE_CHECKING:  # annotations only: the CLI imports the server library when a sub-command runs
    from server_kit.aggregate import AggregateConfig

__all__ = ["main"]

INVERSION_KNOBS = {
    "samples_per_teacher": "samples_per_teacher",
    "steps": "steps",
    "inversion_lr": "lr",
    "inversion_batch_size": "batch_size",
    "inversion_tau": "tau",
    "bn_weight": "bn_weight",
    "tv_weight": "tv_weight",
    "l2_weight": "l2_weight",
    "inversion_classes": "classes",
}
GENERATOR_KNOBS = {
    "generator_steps": "steps",
    "generator_samples": "samples",
    "generator_bn_weight": "bn_weight",
    "generator_div_weight": "div_weight",
    "generator_filter": "filter_fraction",
    "generator_mask": "mask_teachers",
}
LABEL_KNOBS = {
    "label_rule": "rule",
    "label_mask": "mask",
    "drop_mismatch": "drop_mismatch",
    "abstain": "abstain",
}
DISTILL_KNOBS = {
    "distill_epochs": "epochs",
    "distill_lr": "lr",
    "distill_batch_size": "batch_size",
    "tau": "tau",
    "distill_shift": "shift",
}


def add_aggregate_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--server-preset", help="aggregation preset: fast (default) or paper")
    g.add_argument("--student", help="student architecture spec (any edge-sdk spec)")
    g.add_argument(
        "--synth",
        help="synthesis sources, pooled: inversion, generator, decoder (FedMHO); default inversion,generator "
        "plus decoder when cvae_decoder bundles are given; e.g. inversion,decoder",
    )
    g.add_argument(
        "--construction-labels",
        help="sources whose samples keep the class they were made for instead of the teachers' vote "
        "(default: decoder; 'none' for the vote everywhere)",
    )
    g.add_argument(
        "--construction-weight",
        type=float,
        help="weight of the class in a constructed sample's target, the rest the teachers' vote "
        "(default 0.5)",
    )
    g.add_argument(
        "--top-up",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bring each class the vote left below the median class up to it with more decoder samples "
        "(default on when there are decoders)",
    )
    g.add_argument("--decoder-samples", type=int, help="images decoded from the CVAE decoders (paper: 6000)")
    g.add_argument("--decoder-keep", type=float, help="fraction kept nearest each class centroid (R_th 0.8)")
    g.add_argument(
        "--decoder-temperature", type=float, help="decoders sample z ~ N(0, t^2 I), t in (0, 1] (paper: 1)"
    )
    g.add_argument(
        "--fusion",
        choices=["ce", "md", "sd"],
        help="FedMHO: init (FedAvg or consensus distillation), then train on decoder samples with this loss",
    )
    g.add_argument(
        "--fusion-preset", help="FedMHO Table 3 settings: mnist (default), fashionmnist, svhn, emnist, fast"
    )
    g.add_argument("--fusion-epochs", type=int)
    g.add_argument("--fusion-lr", type=float)
    g.add_argument("--fusion-lambda", type=float, help="CE weight of FedMHO-MD/SD (default 0.5)")
    g.add_argument(
        "--fusion-teacher",
        choices=["agreeing", "conditioned", "mean"],
        help="teacher of MD/SD: conditioned (the bundles holding the sample's class, by their share of "
        "it), agreeing (default: conditioned, each classifier's share scaled by how much it recognises "
        "the class on its decoder samples) or mean (the paper's Eqs. 6-7)",
    )
    g.add_argument(
        "--no-fedavg-init",
        dest="fedavg_init",
        action="store_false",
        default=None,
        help="FedMHO: initialise by consensus distillation even when the classifiers share one architecture",
    )
    g.add_argument("--generator-steps", type=int, help="generator training steps")
    g.add_argument("--generator-samples", type=int, help="samples drawn from the trained generator")
    g.add_argument("--generator-bn-weight", type=float, help="generator BN-statistics matching weight")
    g.add_argument("--generator-div-weight", type=float, help="generator diversity loss weight")
    g.add_argument(
        "--generator-filter", type=float, help="fraction of the noisiest generated samples dropped"
    )
    g.add_argument("--server-device", dest="server_device", help="auto (default), cpu or cuda")
    g.add_argument(
        "--labels",
        dest="label_rule",
        choices=["mean", "label-weighted", "conditioned"],
        help="how teacher votes become a sample's label: label-weighted (default: each teacher's vote for a "
        "class scaled by its share of that class), conditioned (weighted by its share of the class the "
        "sample was made for), mean (pFedZKD)",
    )
    g.add_argument(
        "--label-mask",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="each teacher votes only for the classes it has examples of (default: off)",
    )
    g.add_argument(
        "--abstain",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="weigh a teacher with an 'unknown' output (edge-sdk --unknown-output) by how sure it is that "
        "a sample is one of its classes (default: on)",
    )
    g.add_argument(
        "--keep-mismatch",
        dest="drop_mismatch",
        action="store_false",
        default=None,
        help="also distil on samples whose label is not the class they were made for",
    )
    g.add_argument(
        "--verify-claims",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="check each teacher's claimed classes against the other claimants before trusting its label "
        "counts (default: on whenever the inversion source runs)",
    )
    g.add_argument(
        "--inversion-classes",
        choices=["all", "held"],
        help="invert each teacher for every class (default, the paper) or only for the classes it holds",
    )
    g.add_argument(
        "--generator-mask",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the generator's per-teacher cross entropy over the classes a teacher holds only (default: off)",
    )
    g.add_argument(
        "--hard-labels",
        action="store_true",
        default=None,
        help="ablation 'w/o ZSKD': train on the generating teacher's hard labels",
    )
    g.add_argument("--on-error", choices=["stop", "skip"], help="what to do with a bad bundle")
    g.add_argument(
        "--threads",
        type=int,
        help="torch threads on the server (default: the cores that are free at the start)",
    )
    g.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16"],
        help="precision of the forward passes (teachers, student; simulate: the clients' training too): "
        "bf16 autocast where the hardware has it (auto, the default), or as given",
    )
    g.add_argument(
        "--samples-per-teacher", type=int, help="pseudo-samples inverted from each teacher (N_syn)"
    )
    g.add_argument("--steps", type=int, help="optimisation steps per inversion batch (ep)")
    g.add_argument("--inversion-lr", type=float)
    g.add_argument("--inversion-batch-size", type=int)
    g.add_argument("--inversion-tau", type=float, help="temperature of the inversion loss")
    g.add_argument(
        "--bn-weight", type=float, help="BatchNorm-statistics matching weight (fast preset 1, paper 0 = off)"
    )
    g.add_argument("--tv-weight", type=float, help="total-variation prior weight (0 = off, paper)")
    g.add_argument("--l2-weight", type=float, help="l2 image prior weight (0 = off, paper)")
    g.add_argument("--distill-epochs", type=int)
    g.add_argument("--distill-lr", type=float)
    g.add_argument("--distill-batch-size", type=int)
    g.add_argument("--tau", type=float, help="distillation temperature (paper: 4)")
    g.add_argument(
        "--distill-shift", type=float, help="random shift of distillation batches (fraction of side)"
    )
    g.add_argument(
        "--adversarial-rounds",
        type=int,
        help="DENSE-style rounds after the distillation (generator adversarial to the student; default off)",
    )


def aggregate_config(
    args: argparse.Namespace, *, seed: int, base: AggregateConfig | None = None
) -> AggregateConfig:
    """The server settings: ``--server-preset`` (or ``base``, else ``fast``) with the given knobs."""
    from server_kit.aggregate import AggregateConfig

    if base is None or args.server_preset is not None:
        base = AggregateConfig.preset(args.server_preset or "fast")
    inv = with_knobs(base.inversion, args, INVERSION_KNOBS)
    dis = with_knobs(base.distill, args, DISTILL_KNOBS)
    gen = with_knobs(base.generator, args, GENERATOR_KNOBS)
    labels = with_knobs(base.labels, args, LABEL_KNOBS)
    names = ["student", "synth", "hard_labels", "on_error", "threads", "verify_claims", "top_up", "precision"]
    top = overrides(
        args,
        [
            *names,
            "decoder_samples",
            "decoder_keep",
            "decoder_temperature",
            "fedavg_init",
            "construction_weight",
        ],
    )
    if args.construction_labels is not None:
        text = args.construction_labels.strip()
        top["construction_labels"] = () if text == "none" else text
    knobs = {
        "epochs": args.fusion_epochs,
        "lr": args.fusion_lr,
        "lam": args.fusion_lambda,
        "teacher": args.fusion_teacher,
    }
    given = {k: v for k, v in knobs.items() if v is not None}
    if args.fusion is not None or args.fusion_preset is not None or given:
        from server_kit.fusion import FusionConfig

        mode = args.fusion or (base.fusion.mode if base.fusion is not None else None)
        if mode is None:
            raise ConfigError("the --fusion-* options configure FedMHO's fusion: add --fusion ce|md|sd")
        if base.fusion is not None and args.fusion_preset is None:
            top["fusion"] = dataclasses.replace(base.fusion, mode=mode, **given)
        else:
            top["fusion"] = FusionConfig.preset(args.fusion_preset or "mnist", mode=mode, **given)
    if args.server_device is not None:
        top["device"] = args.server_device
    if args.adversarial_rounds is not None:
        from server_kit.adversarial import AdversarialConfig

        top["adversarial"] = AdversarialConfig(rounds=args.adversarial_rounds)
    return dataclasses.replace(
        base, inversion=inv, generator=gen, distill=dis, labels=labels, seed=seed, **top
    )


def cmd_aggregate(args: argparse.Namespace) -> None:
    from edge_sdk.data import load_client_data
    from server_kit.aggregate import aggregate

    config = aggregate_config(args, seed=args.seed)
    eval_data = load_client_data(args.eval) if args.eval else None
    result = aggregate(args.bundles, args.out, config=config, eval_data=eval_data, progress=not args.quiet)
    print_skipped("server-kit", result.report["skipped"])
    acc = "" if result.accuracy is None else f"; test accuracy {result.accuracy:.4f}"
    print(f"wrote {result.global_onnx} ({result.synthetic_size} synthetic samples){acc}")


def cmd_evaluate(args: argparse.Namespace) -> None:
    from edge_sdk.data import load_client_data
    from server_kit.evaluate import evaluate_onnx

    print_json(evaluate_onnx(args.model, load_client_data(args.data)))


def cmd_simulate(args: argparse.Namespace) -> None:
    from server_kit.simulate import SimulateConfig, simulate

    base = SimulateConfig.preset(args.method, dataset=args.dataset, out_dir=Path(args.out))
    given = overrides(args, ["decoders", "shared_init"])
    if args.profiles is not None:
        given["profiles"] = tuple(p for p in args.profiles.split(",") if p)
    config = dataclasses.replace(
        base,
        data_root=args.data_root,
        num_clients=args.num_clients,
        alpha=args.alpha,
        seed=args.seed,
        profile_map=Path(args.profile_map) if args.profile_map else None,
        search=search_config(args, base.search),
        cvae=cvae_config(args, base.cvae),
        unknown_output=args.unknown_output,
        precision=args.precision or "auto",
        aggregate=aggregate_config(args, seed=args.seed, base=base.aggregate),
        val_fraction=args.val_fraction,
        min_size=args.min_size,
        jobs=args.jobs,
        device=args.device,
        progress=not args.quiet,
        **given,
    )
    result = simulate(config)
    print(
        f"global accuracy {result.global_accuracy:.4f} "
        f"(mean classifier client {result.mean_client_test_accuracy or float('nan'):.4f}) "
        f"in {result.seconds['total']:.0f} s; wrote {config.out_dir / 'results.json'}"
    )


def cmd_personalize(args: argparse.Namespace) -> None:
    from server_kit.pke import PKEConfig, personalize_server

    knobs = overrides(args, ["epochs", "lr", "batch_size", "mu", "max_inputs", "seed", "device"])
    result = personalize_server(
        args.bundles, args.aggregate, args.out, config=PKEConfig(**knobs), progress=not args.quiet
    )
    print_skipped("server-kit", result.report["skipped"])
    print(f"wrote {len(result.packages)} packages and {result.report_path}")


def cmd_supernet(args: argparse.Namespace) -> None:
    from server_kit.supernet import SupernetConfig, supernet_from_bundles

    knobs = overrides(args, ["steps", "batch_size", "lr", "random_subnets", "seed", "device"])
    report = supernet_from_bundles(
        args.bundles,
        args.out,
        aggregate_dir=args.aggregate,
        unlabeled=args.unlabeled,
        config=SupernetConfig(**knobs),
        progress=not args.quiet,
    )
    print_skipped("server-kit", report["skipped"])
    steps, inputs = report["config"]["steps"], report["inputs"]
    print(f"wrote {args.out} ({steps} steps on {inputs} {report['data']} inputs)")


def cmd_init(args: argparse.Namespace) -> None:
    from edge_sdk.data import load_client_data
    from edge_sdk.shared_init import write_initial_weights

    if args.data is not None:
        if args.input_shape is not None or args.num_classes is not None:
            raise ConfigError("give the task as --data or as --input-shape with --num-classes, not both")
        data = load_client_data(args.data)
        shape, classes = data.input_shape, data.num_classes
    elif args.input_shape is not None and args.num_classes is not None:
        try:
            shape = tuple(int(v) for v in args.input_shape.split(","))
        except ValueError as err:
            raise ConfigError(f"--input-shape must be C,H,W integers, got {args.input_shape!r}") from err
        classes = args.num_classes
    else:
        raise ConfigError("give the task: --data FILE.npz, or --input-shape C,H,W and --num-classes N")
    path = write_initial_weights(args.out, args.arch, shape, classes, seed=args.seed)  # type: ignore[arg-type]
    print(f"wrote {path} (initial weights of {args.arch} for {classes} classes of {shape}, seed {args.seed})")


def cmd_hetero_avg(args: argparse.Namespace) -> None:
    from server_kit.hetero_avg import hetero_fedavg

    report = hetero_fedavg(args.bundles, args.supernet, args.out)
    print(f"wrote {len(report['clients'])} personalised models and the aggregated supernet to {args.out}")


def cmd_report(args: argparse.Namespace) -> None:
    from server_kit.report import write_report

    print(write_report(args.run_dir))


def build_parser() -> argparse.ArgumentParser:
    parser, command = root_parser(
        "server-kit",
        "Server toolkit: turn client bundles into a global model without any real data.",
        version=__version__,  # the toolkit's one version (edge_sdk's): both CLIs ship in one distribution
    )

    p = command(
        "aggregate", cmd_aggregate, "invert the teachers, distill a global student, write global.onnx"
    )
    p.add_argument("bundles", nargs="+", help="client bundle files")
    p.add_argument("--out", required=True, type=out_dir, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval", help="test .npz to report accuracy on")
    p.add_argument("--quiet", action="store_true")
    add_aggregate_args(p)

    p = command("evaluate", cmd_evaluate, "accuracy of an ONNX classifier on a .npz (JSON)")
    p.add_argument("model", help="ONNX model")
    p.add_argument("--data", required=True, help=".npz with x (uint8 NCHW) and y")

    p = command(
        "simulate", cmd_simulate, "a whole simulated federation: partition, clients, server, evaluation"
    )
    p.add_argument("--dataset", required=True, help="mnist, fashionmnist, cifar10, svhn or digits")
    p.add_argument("--data-root", help="torchvision-layout dataset root (not needed for digits)")
    p.add_argument("--num-clients", type=int, default=10)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-size", type=int, default=10)
    p.add_argument("--out", required=True, type=out_dir, help="output directory (rerun to resume)")
    p.add_argument(
        "--method",
        default="default",
        choices=["default", "fedmho"],
        help="the federation's recipe: default (searched classifiers + decoders, consensus distillation) "
        "or fedmho (FedMHO: 5 classifier + 5 CVAE devices, shared init, FedAvg, fusion MD; see "
        "SimulateConfig.preset); every other option overrides it",
    )
    p.add_argument("--profiles", help="comma-separated profiles, assigned round-robin (default laptop-cpu)")
    p.add_argument(
        "--decoders",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="classifier devices also upload a CVAE decoder where it fits (default on; fedmho: off)",
    )
    p.add_argument(
        "--shared-init",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="when every classifier client trains one architecture (--strategy fixed), start them from "
        "the server's initial weights (default on)",
    )
    p.add_argument("--profile-map", help="TOML: default = 'name' and [clients] index = 'name'")
    p.add_argument("--jobs", type=int, default=1, help="clients trained in parallel processes")
    p.add_argument("--val-fraction", type=float, default=0.2)
    p.add_argument("--device", default="cpu", help="client training device")
    p.add_argument("--quiet", action="store_true")
    add_search_args(p)
    add_cvae_knobs(p)
    add_unknown_arg(p)
    add_aggregate_args(p)

    p = command(
        "personalize",
        cmd_personalize,
        "FedPD PKE on the aggregation's synthetic set: one personalization package per client",
    )
    p.add_argument("bundles", nargs="+", help="the client bundles that were aggregated")
    p.add_argument("--aggregate", required=True, help="the `server-kit aggregate` output directory")
    p.add_argument("--out", required=True, type=out_dir, help="directory for <client>.package files")
    p.add_argument("--epochs", type=int, help="server-model epochs (default 5)")
    p.add_argument("--lr", type=float, help="server-model Adam learning rate (default 1e-3)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--mu", type=float, help="proximal weight to the mean extractor (default 0.6)")
    p.add_argument("--max-inputs", type=int, help="distillation inputs per package (default 2000)")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="cpu or cuda")
    p.add_argument("--quiet", action="store_true")

    p = command(
        "supernet",
        cmd_supernet,
        "train the elastic supernet (HAPFNAS) by distilling the teachers on synthetic or public inputs",
    )
    p.add_argument("bundles", nargs="+", help="classifier bundles (the teachers)")
    p.add_argument(
        "--out", required=True, type=out_file, help="supernet file to write (safetensors in a manifest)"
    )
    p.add_argument("--aggregate", help="a `server-kit aggregate` output: its synthetic set is the input")
    p.add_argument("--unlabeled", help="a public unlabeled .npz (uint8 x) instead of the synthetic set")
    p.add_argument("--steps", type=int, help="sandwich-rule steps (default 300)")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--random-subnets", type=int, help="k random subnets per step (default 2)")
    p.add_argument("--seed", type=int)
    p.add_argument("--device", help="cpu or cuda")
    p.add_argument("--quiet", action="store_true")

    p = command(
        "init",
        cmd_init,
        "publish shared initial weights of one architecture (devices start from them: edge-sdk run --init)",
    )
    p.add_argument("--arch", required=True, help="architecture spec, e.g. C32k5-P-C64k5-P-F10")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights")
    p.add_argument("--out", required=True, type=out_file, help="initial-weights ONNX to write")
    p.add_argument("--data", help="a data file of the task (.npz) to take its input shape and classes from")
    p.add_argument("--input-shape", help="C,H,W of the task's images (instead of --data)")
    p.add_argument("--num-classes", type=int, help="classes of the task (instead of --data)")

    p = command(
        "hetero-avg", cmd_hetero_avg, "heteroFedAvg of elastic-space client models through their supernet"
    )
    p.add_argument("bundles", nargs="+", help="client bundles whose archs are mbv3:... subnets")
    p.add_argument("--supernet", required=True, help="the supernet file the clients searched")
    p.add_argument("--out", required=True, type=out_dir, help="output directory")

    p = command("report", cmd_report, "(re)write RUN_DIR/report.html from the files a simulate run wrote")
    p.add_argument("run_dir", help="the output directory of `server-kit simulate` (holds results.json)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main("server-kit", build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
