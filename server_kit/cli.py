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

from common.checks import check_output_dir
from common.cli import (
    Output,
    cli_main,
    json_text,
    out_dir,
    out_file,
    overrides,
    print_skipped,
    root_parser,
    with_knobs,
)
from common.configs import read_config_file
from common.errors import ConfigError
from edge_sdk import __version__
from edge_sdk.cli import add_cvae_knobs, add_search_args, add_unknown_arg, cvae_config, search_config

if TYPE_CHECKING:  # annotations only: the CLI imports the server library when a sub-command runs
    from server_kit.aggregate import AggregateConfig
    from server_kit.simulate import SimulateConfig

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
    "distill_tau": "tau",
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
        help="FedMHO: init (FedAvg or consensus distillation), then train on decoder samples with this loss; "
        "the --fusion-* options need it (or a preset with fusion)",
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
    g.add_argument(
        "--distill-tau",
        type=float,
        help="distillation temperature (paper: 4; was --tau, which edge-sdk personalize uses for PKT)",
    )
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
            dests = ("fusion_preset", "fusion_epochs", "fusion_lr", "fusion_lambda", "fusion_teacher")
            named = ["--" + d.replace("_", "-") for d in dests if getattr(args, d) is not None]
            raise ConfigError(
                f"{', '.join(named)} configure FedMHO's fusion, which is off: expected --fusion ce|md|sd "
                "with them; add --fusion or drop them"
            )
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


def cmd_aggregate(args: argparse.Namespace) -> Output:
    from edge_sdk.data import load_client_data
    from server_kit.aggregate import AggregateConfig, aggregate

    base = AggregateConfig.from_dict(read_config_file(args.config)) if args.config is not None else None
    seed = args.seed if args.seed is not None else base.seed if base is not None else 0
    config = aggregate_config(args, seed=seed, base=base)
    if args.print_config:  # JSON in both formats: --config reads it back from a .json file
        return Output(config.to_dict(), [json_text(config.to_dict())])
    eval_data = load_client_data(args.eval) if args.eval else None
    result = aggregate(args.bundles, args.out, config=config, eval_data=eval_data, progress=not args.quiet)
    print_skipped(result.report["skipped"])
    acc = "" if result.accuracy is None else f"; test accuracy {result.accuracy:.4f}"
    data = {
        "accuracy": result.accuracy,
        "synthetic_size": result.synthetic_size,
        "skipped": result.report["skipped"],
        "wrote": [str(result.global_onnx), str(result.report_path)],
    }
    return Output(data, [f"wrote {result.global_onnx} ({result.synthetic_size} synthetic samples){acc}"])


def cmd_evaluate(args: argparse.Namespace) -> Output:
    """The metrics as JSON in both formats (it always was: scripts parse it)."""
    from edge_sdk.data import load_client_data
    from server_kit.evaluate import evaluate_onnx

    metrics = evaluate_onnx(args.model, load_client_data(args.data))
    return Output(metrics, [json_text(metrics)])


# simulate's plain options (flag dest = SimulateConfig field): each overrides the preset or --config file
SIMULATE_FIELDS = [
    *("data_root", "num_clients", "alpha", "seed", "decoders", "shared_init"),
    *("val_fraction", "min_size", "jobs", "device", "precision", "resume"),
]


def simulate_config(args: argparse.Namespace) -> SimulateConfig:
    """The federation: ``--config`` (a TOML file, or a run's results.json to replay it) or ``--method``'s
    preset, with every option given on the command line over it (``--out`` over the file's out_dir)."""
    from server_kit.simulate import SimulateConfig

    if args.config is not None:
        if args.method is not None:
            raise ConfigError(
                "simulate takes --method (a preset) or --config (a file), got both; fix: drop one, or write "
                "the preset's fields into the file (--method ... --print-config shows them)"
            )
        data = read_config_file(args.config)
        data |= {"dataset": args.dataset} if args.dataset is not None else {}
        data |= {"out_dir": args.out} if args.out is not None else {}
        if "dataset" not in data or "out_dir" not in data:
            raise ConfigError(
                f"simulate needs a dataset and an output directory, got {args.config} without "
                f"{'dataset' if 'dataset' not in data else 'out_dir'}; fix: add it to the file, or give "
                f"{'--dataset' if 'dataset' not in data else '--out'}"
            )
        base = SimulateConfig.from_dict(data)
    elif args.dataset is None or args.out is None:
        raise ConfigError(
            "simulate needs --dataset and --out, got "
            f"{'neither' if args.dataset is None and args.out is None else 'only one'}; fix: give both, "
            "or --config FILE naming them (dataset, out_dir)"
        )
    else:
        base = SimulateConfig.preset(args.method or "default", dataset=args.dataset, out_dir=Path(args.out))
    given = overrides(args, SIMULATE_FIELDS)
    if args.profiles is not None:
        given["profiles"] = tuple(p for p in args.profiles.split(",") if p)
    if args.profile_map is not None:
        given["profile_map"] = Path(args.profile_map)
    if args.unknown_output:
        given["unknown_output"] = True
    if args.quiet:
        given["progress"] = False
    config = dataclasses.replace(
        base,
        search=search_config(args, base.search),
        cvae=cvae_config(args, base.cvae),
        aggregate=aggregate_config(args, seed=given.get("seed", base.aggregate.seed), base=base.aggregate),
        **given,
    )
    check_output_dir(config.out_dir)  # the file's out_dir was not checked at parse time as --out is
    return config


def cmd_simulate(args: argparse.Namespace) -> Output:
    from server_kit.simulate import simulate

    config = simulate_config(args)
    if args.print_config:  # JSON in both formats: --config reads it back from a .json file
        return Output(config.to_dict(), [json_text(config.to_dict())])
    result = simulate(config)
    line = (
        f"global accuracy {result.global_accuracy:.4f} "
        f"(mean classifier client {result.mean_client_test_accuracy or float('nan'):.4f}) "
        f"in {result.seconds['total']:.0f} s; wrote {config.out_dir / 'results.json'}"
    )
    data = {
        "global_accuracy": result.global_accuracy,
        "mean_client_test_accuracy": result.mean_client_test_accuracy,
        "resumed_clients": result.resumed_clients,
        "seconds": result.seconds,
        "wrote": str(config.out_dir / "results.json"),
    }
    return Output(data, [line])


def cmd_personalize(args: argparse.Namespace) -> Output:
    from server_kit.pke import PKEConfig, personalize_server

    knobs = overrides(args, ["epochs", "lr", "batch_size", "mu", "max_inputs", "seed", "device"])
    result = personalize_server(
        args.bundles, args.aggregate, args.out, config=PKEConfig(**knobs), progress=not args.quiet
    )
    print_skipped(result.report["skipped"])
    data = {
        "packages": [str(path) for path in result.packages],
        "skipped": result.report["skipped"],
        "wrote": str(result.report_path),
    }
    return Output(data, [f"wrote {len(result.packages)} packages and {result.report_path}"])


def cmd_supernet(args: argparse.Namespace) -> Output:
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
    print_skipped(report["skipped"])
    steps, inputs = report["config"]["steps"], report["inputs"]
    data = {
        "steps": steps,
        "inputs": inputs,
        "data": report["data"],
        "skipped": report["skipped"],
        "wrote": args.out,
    }
    return Output(data, [f"wrote {args.out} ({steps} steps on {inputs} {report['data']} inputs)"])


def cmd_init(args: argparse.Namespace) -> Output:
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
    line = f"wrote {path} (initial weights of {args.arch} for {classes} classes of {shape}, seed {args.seed})"
    data = {"arch": args.arch, "input_shape": list(shape), "num_classes": classes, "seed": args.seed}
    return Output(data | {"wrote": str(path)}, [line])


def cmd_hetero_avg(args: argparse.Namespace) -> Output:
    from server_kit.hetero_avg import hetero_fedavg

    report = hetero_fedavg(args.bundles, args.supernet, args.out)
    line = f"wrote {len(report['clients'])} personalised models and the aggregated supernet to {args.out}"
    return Output({"clients": report["clients"], "wrote": args.out}, [line])


def cmd_report(args: argparse.Namespace) -> Output:
    from server_kit.report import write_report

    path = write_report(args.run_dir)
    return Output({"wrote": str(path)}, [str(path)])


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
    p.add_argument("--seed", type=int, help="seed of the server's synthesis and training (default 0)")
    p.add_argument("--eval", help="test .npz to report accuracy on")
    p.add_argument(
        "--config",
        help="a TOML file of AggregateConfig fields (nested tables: [distill], [inversion], ...) or a "
        "server report.json to replay it; every other option given overrides it",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as JSON (sorted keys; --config reads it back from a .json file) "
        "and exit without running",
    )
    add_aggregate_args(p)

    p = command("evaluate", cmd_evaluate, "accuracy of an ONNX classifier on a .npz (JSON)")
    p.add_argument("model", help="ONNX model")
    p.add_argument("--data", required=True, help=".npz with x (uint8 NCHW) and y")

    p = command(
        "simulate", cmd_simulate, "a whole simulated federation: partition, clients, server, evaluation"
    )
    p.add_argument(
        "--config",
        help="a TOML file of SimulateConfig fields (nested tables: [search], [cvae], [aggregate], ...) or a "
        "run's results.json to replay it; every other option given overrides it",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as JSON (sorted keys; --config reads it back from a .json file) "
        "and exit without running",
    )
    p.add_argument("--dataset", help="mnist, fashionmnist, cifar10, svhn or digits (or the --config file's)")
    p.add_argument("--data-root", help="torchvision-layout dataset root (not needed for digits)")
    p.add_argument("--num-clients", type=int, help="clients in the federation (default 10)")
    p.add_argument("--alpha", type=float, help="Dirichlet concentration of the label skew (default 0.5)")
    p.add_argument(
        "--seed", type=int, help="seed of the partition, the clients (seed + k) and the server (default 0)"
    )
    p.add_argument("--min-size", type=int, help="fewest examples a client gets (default 10)")
    p.add_argument(
        "--out", type=out_dir, help="output directory (rerun to resume); over the --config file's out_dir"
    )
    p.add_argument(
        "--resume",
        choices=["auto", "strict", "off"],
        help="a rerun into the same --out: auto reuses the partition, client bundles and inversion chunks "
        "made with the same settings, data and code and redoes the rest; strict refuses files made "
        "otherwise; off redoes everything (default auto)",
    )
    p.add_argument(
        "--method",
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
    p.add_argument("--jobs", type=int, help="clients trained in parallel processes (default 1)")
    p.add_argument("--val-fraction", type=float, help="share of each client's data held out (default 0.2)")
    p.add_argument("--device", help="client training device (default cpu)")
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
