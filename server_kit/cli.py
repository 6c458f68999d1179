"""`server-kit`: thin command-line wrappers over `aggregate`, `evaluate_onnx`, `simulate` and the rest.

The shared plumbing is :mod:`common.cli`. A command's config options are generated from its config
dataclass by :mod:`common.config_args` (one flag per field: ``--distill-epochs`` is ``distill.epochs``; no
flag -> field table), when that command is parsed; `simulate` takes the edge's search and CVAE options
the same way, through its ``search`` and ``cvae`` fields. ``--help`` and a usage error of another
command do not load torch; the command functions import their library inside the function likewise.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.checks import check_output_dir
from common.cli import (
    Output,
    cli_main,
    expert,
    json_text,
    out_dir,
    out_file,
    print_skipped,
    renamed_option,
    root_parser,
)
from common.config_args import Flag, add_config_args, given_options, given_table
from common.configs import config_from_dict, read_config_file
from common.errors import ConfigError
from edge_sdk import __version__
from edge_sdk.options import client_groups, cvae_config, search_classes, search_config

if TYPE_CHECKING:  # annotations only: the CLI imports the server library when a sub-command runs
    from server_kit.aggregate_config import AggregateConfig
    from server_kit.federation import SimulateConfig
    from server_kit.training import FusionConfig

__all__ = ["main"]


# the argument groups of the server's options, in the order --help shows them: the dotted path of a
# nested config of AggregateConfig ("" for its own fields) -> the group's title
SERVER_GROUPS = {
    "": "server",
    "inversion": "server: model inversion",
    "generator": "server: generator",
    "labels": "server: labels of the synthetic samples",
    "distill": "server: distillation",
    "adversarial": "server: adversarial rounds",
    "fusion": "server: FedMHO fusion",
    "budget": "server: teachers' cost budget",
}
# the server's options --help lists; every other one is for experts (--help-all)
SERVER_COMMON = ("student", "device", "seed", "synth", "threads", "on_error", "distill.epochs")


def server_groups(p: argparse.ArgumentParser, prefix: str = "") -> dict[str, Any]:
    """The server's argument groups of ``p``, keyed by the nested config's path under ``prefix``."""
    return {
        ".".join(filter(None, (prefix, key))): p.add_argument_group(title)
        for key, title in SERVER_GROUPS.items()
    }


def add_server_presets(server: Any, fusion: Any) -> None:
    """The presets the server's options go over (not fields: they pick the base values), in the server's
    argument group and the fusion's."""
    server.add_argument("--aggregate-preset", help="the aggregation's preset: fast (default) or paper")
    renamed_option(server, "--server-preset", "--aggregate-preset")
    expert(
        fusion.add_argument(
            "--fusion-preset",
            help="FedMHO's settings of one dataset: mnist (default), fashionmnist, svhn, emnist, fast; needs "
            "--fusion-mode (or a preset or file with fusion)",
        )
    )


def _fusion(
    args: argparse.Namespace, given: Mapping[str, Any], base: FusionConfig | None, named: list[str]
) -> FusionConfig:
    """FedMHO's fusion from ``--fusion-preset`` and the ``--fusion-*`` fields given, over ``base``; its
    options without a mode (given, or the base's) are refused: fusion is off."""
    from server_kit.training import FusionConfig

    mode = given.get("mode", base.mode if base is not None else None)
    if mode is None:
        raise ConfigError(
            f"{', '.join(named)} configure FedMHO's fusion, which is off: expected --fusion-mode ce|md|sd "
            "with them; add --fusion-mode or drop them"
        )
    if base is not None and args.fusion_preset is None:
        return config_from_dict(FusionConfig, given, what="fusion options", base=base)
    return FusionConfig.preset(args.fusion_preset or "mnist", **{**given, "mode": mode})


def aggregate_config(
    args: argparse.Namespace, given: Mapping[str, Any], *, base: AggregateConfig | None = None
) -> AggregateConfig:
    """The server settings: ``--aggregate-preset`` (or ``base``, else ``fast``) with the fields ``given``
    (a nested table, :func:`common.config_args.given_table`)."""
    from server_kit.aggregate_config import AggregateConfig

    if base is None or args.aggregate_preset is not None:
        base = AggregateConfig.preset(args.aggregate_preset or "fast")
    table = dict(given)
    fusion = table.pop("fusion", {})
    if fusion or args.fusion_preset is not None:
        named = ["--fusion-preset"] if args.fusion_preset is not None else []
        named += given_options(args, args.flags, ("fusion",)) + given_options(
            args, args.flags, ("aggregate", "fusion")
        )
        table["fusion"] = _fusion(args, fusion, base.fusion, named)
    return config_from_dict(AggregateConfig, table, what="aggregate options", base=base)


def _usable_here(*devices: str) -> list[Any]:  # -> list[torch.device]
    """Each device resolved on this machine (CUDA where asked): checked before --print-config or any work,
    and passed on where the run takes a resolved one."""
    from common.device import resolve_device

    return [resolve_device(device) for device in devices]


def cmd_aggregate(args: argparse.Namespace) -> Output:
    from edge_sdk.data import load_client_data
    from server_kit.aggregate import aggregate
    from server_kit.aggregate_config import AggregateConfig

    base = AggregateConfig.from_dict(read_config_file(args.config)) if args.config is not None else None
    config = aggregate_config(args, given_table(args, args.flags), base=base)
    (device,) = _usable_here(config.device)
    if args.print_config:  # JSON in both formats: --config reads it back from a .json file
        return Output(config.to_dict(device), [json_text(config.to_dict(device))])
    eval_data = load_client_data(args.eval) if args.eval else None
    result = aggregate(
        args.bundles, args.out, config=config, eval_data=eval_data, progress=not args.quiet, device=device
    )
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


def simulate_config(args: argparse.Namespace) -> SimulateConfig:
    """The federation: ``--config`` (a TOML or YAML file, or a run's results.json to replay it) or
    ``--federation-preset``, with every option given on the command line over it (``--out`` over the
    file's out_dir). The server's precision follows ``--precision`` unless ``--aggregate-precision`` is
    given (its seed is the config's ``seed``, :class:`SimulateConfig` sees to that)."""
    from server_kit.federation import SimulateConfig

    table = given_table(args, args.flags)
    dataset = table.pop("dataset", None)
    if args.config is not None:
        if args.federation_preset is not None:
            raise ConfigError(
                "simulate takes --federation-preset or --config (a file), got both; fix: drop one, or write "
                "the preset's fields into the file (--federation-preset ... --print-config shows them)"
            )
        data = read_config_file(args.config)
        data |= {"dataset": dataset} if dataset is not None else {}
        data |= {"out_dir": args.out} if args.out is not None else {}
        if "dataset" not in data or "out_dir" not in data:
            raise ConfigError(
                f"simulate needs a dataset and an output directory, got {args.config} without "
                f"{'dataset' if 'dataset' not in data else 'out_dir'}; fix: add it to the file, or give "
                f"{'--dataset' if 'dataset' not in data else '--out'}"
            )
        base = SimulateConfig.from_dict(data)
    elif dataset is None or args.out is None:
        raise ConfigError(
            "simulate needs --dataset and --out, got "
            f"{'neither' if dataset is None and args.out is None else 'only one'}; fix: give both, "
            "or --config FILE naming them (dataset, out_dir)"
        )
    else:
        base = SimulateConfig.preset(
            args.federation_preset or "default", dataset=dataset, out_dir=Path(args.out)
        )
    server = table.pop("aggregate", {})
    if "precision" in table:
        server.setdefault("precision", table["precision"])
    table |= {
        "search": search_config(args, table.pop("search", {}), base.search),
        "cvae": cvae_config(args, table.pop("cvae", {}), base.cvae),
        "aggregate": aggregate_config(args, server, base=base.aggregate),
    }
    if args.quiet:
        table["progress"] = False
    config = config_from_dict(SimulateConfig, table, what="simulate options", base=base)
    check_output_dir(config.out_dir)  # the file's out_dir was not checked at parse time as --out is
    return config


def cmd_simulate(args: argparse.Namespace) -> Output:
    from server_kit.federation import simulate

    config = simulate_config(args)
    device, server_device = _usable_here(config.device, config.aggregate.device)
    if args.print_config:  # JSON in both formats: --config reads it back from a .json file
        return Output(config.to_dict(), [json_text(config.to_dict())])
    result = simulate(config, device=device, server_device=server_device)
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
    from server_kit.personalization import PKEConfig, personalize_server

    config = config_from_dict(PKEConfig, given_table(args, args.flags), what="personalize options")
    result = personalize_server(
        args.bundles, args.aggregate, args.out, config=config, progress=not args.quiet
    )
    print_skipped(result.report["skipped"])
    data = {
        "packages": [str(path) for path in result.packages],
        "skipped": result.report["skipped"],
        "wrote": str(result.report_path),
    }
    return Output(data, [f"wrote {len(result.packages)} packages and {result.report_path}"])


def cmd_supernet(args: argparse.Namespace) -> Output:
    from server_kit.personalization import SupernetConfig, supernet_from_bundles

    config = config_from_dict(SupernetConfig, given_table(args, args.flags), what="supernet options")
    report = supernet_from_bundles(
        args.bundles,
        args.out,
        aggregate_dir=args.aggregate,
        unlabeled=args.unlabeled,
        config=config,
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
    from server_kit.personalization import hetero_fedavg

    report = hetero_fedavg(args.bundles, args.supernet, args.out)
    line = f"wrote {len(report['clients'])} personalised models and the aggregated supernet to {args.out}"
    return Output({"clients": report["clients"], "wrote": args.out}, [line])


def cmd_report(args: argparse.Namespace) -> Output:
    from server_kit.report import write_report

    path = write_report(args.run_dir)
    return Output({"wrote": str(path)}, [str(path)])


def _config_file_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--config",
        help=f"a TOML or YAML file of {what} or a run's JSON record (results.json, report.json, "
        "--print-config's output) to replay it; every option given overrides it",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as JSON (sorted keys; --config reads it back from a .json file) "
        "and exit without running",
    )


def _build_aggregate(p: argparse.ArgumentParser) -> None:
    from server_kit.aggregate_config import AggregateConfig

    p.add_argument("bundles", nargs="+", help="client bundle files")
    p.add_argument("--out", required=True, type=out_dir, help="output directory")
    p.add_argument("--eval", help="test .npz to report accuracy on")
    _config_file_args(p, "the server's settings (nested tables: [distill], [inversion], ...)")
    groups = server_groups(p)
    add_server_presets(groups[""], groups["fusion"])
    flags = add_config_args(
        p,
        AggregateConfig,
        skip=("distill.hard_labels",),  # the loss's own switch, which an aggregation sets from --hard-labels
        groups=groups,
        common=SERVER_COMMON,
    )
    p.set_defaults(flags=flags)


# the federation's options --help lists, beside the server's (SERVER_COMMON); the rest: --help-all
SIMULATE_COMMON = (
    *("dataset", "data_root", "image_size", "num_clients", "alpha", "seed", "profiles", "jobs"),
    *("device", "precision", "resume", "search.final_epochs", "cvae.epochs"),
    *(f"aggregate.{name}" for name in SERVER_COMMON if name != "seed"),  # the server's seed is --seed
)


def _build_simulate(p: argparse.ArgumentParser) -> None:
    from server_kit.federation import SimulateConfig

    _config_file_args(p, "a federation's settings (nested tables: [search], [cvae], [aggregate], ...)")
    p.add_argument(
        "--out", type=out_dir, help="output directory (rerun to resume); over the --config file's out_dir"
    )
    renamed_option(p, "--method", "--federation-preset")
    p.add_argument(
        "--federation-preset",
        choices=["default", "fedmho"],
        help="the federation's recipe: default (searched classifiers and decoders, consensus "
        "distillation) or fedmho (FedMHO: classifier and CVAE devices, shared initial weights, FedAvg, "
        "fusion); every other option overrides it",
    )
    groups = client_groups(p, "federation", prefix="clients: ") | server_groups(p, "aggregate")
    add_server_presets(groups["aggregate"], groups["aggregate.fusion"])
    flags: tuple[Flag, ...] = add_config_args(
        p,
        SimulateConfig,
        flatten=("search", "aggregate"),
        # --out; --quiet; the server's seed is --seed; the loss's hard labels follow --hard-labels
        skip=("out_dir", "progress", "aggregate.seed", "aggregate.distill.hard_labels"),
        families={"search": search_classes()},
        groups=groups,
        common=SIMULATE_COMMON,
    )
    p.set_defaults(flags=flags)


def _build_personalize(p: argparse.ArgumentParser) -> None:
    from server_kit.personalization import PKEConfig

    p.add_argument("bundles", nargs="+", help="the client bundles that were aggregated")
    p.add_argument("--aggregate", required=True, help="the `server-kit aggregate` output directory")
    p.add_argument("--out", required=True, type=out_dir, help="directory for <client>.package files")
    p.set_defaults(flags=add_config_args(p, PKEConfig))


def _build_supernet(p: argparse.ArgumentParser) -> None:
    from server_kit.personalization import SupernetConfig

    p.add_argument("bundles", nargs="+", help="classifier bundles (the teachers)")
    p.add_argument(
        "--out", required=True, type=out_file, help="supernet file to write (safetensors in a manifest)"
    )
    p.add_argument("--aggregate", help="a `server-kit aggregate` output: its synthetic set is the input")
    p.add_argument("--unlabeled", help="a public unlabeled .npz (uint8 x) instead of the synthetic set")
    p.set_defaults(flags=add_config_args(p, SupernetConfig))


def build_parser() -> argparse.ArgumentParser:
    parser, command = root_parser(
        "server-kit",
        "Server toolkit: turn client bundles into a global model without any real data.",
        version=__version__,  # the toolkit's one version (edge_sdk's): both CLIs ship in one distribution
    )
    command(
        "aggregate",
        cmd_aggregate,
        "invert the teachers, distill a global student, write global.onnx",
        _build_aggregate,
    )

    p = command("evaluate", cmd_evaluate, "accuracy of an ONNX classifier on a .npz (JSON)")
    p.add_argument("model", help="ONNX model")
    p.add_argument("--data", required=True, help=".npz with x (uint8 NCHW) and y")

    command(
        "simulate",
        cmd_simulate,
        "a whole simulated federation: partition, clients, server, evaluation",
        _build_simulate,
    )
    command(
        "personalize",
        cmd_personalize,
        "FedPD PKE on the aggregation's synthetic set: one personalization package per client",
        _build_personalize,
    )
    command(
        "supernet",
        cmd_supernet,
        "train the elastic supernet (HAPFNAS) by distilling the teachers on synthetic or public inputs",
        _build_supernet,
    )

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
