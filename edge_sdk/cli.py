"""`edge-sdk`: thin command-line wrappers. Each subcommand builds a config and calls one library function.

The shared plumbing (dispatch, errors as one line, output-path types) is :mod:`common.cli`. A command's
config options are generated from its config dataclass by :mod:`common.config_args` (one flag per field,
no flag -> field table), when that command is parsed: ``--help`` and a usage error of another command do
not load torch. The command functions import their library inside the function for the same reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Sequence

from common.cli import Output, cli_main, json_text, out_dir, out_file, renamed_option, root_parser
from common.config_args import add_config_args, given_table
from common.configs import config_from_dict
from edge_sdk import __version__
from edge_sdk.options import add_search_selectors, client_groups, cvae_config, search_classes, search_config

__all__ = ["build_parser", "main"]

logger = logging.getLogger("edge_sdk")


def load_data(args: argparse.Namespace):  # -> ArrayDataset
    from edge_sdk.data import load_client_data

    return load_client_data(
        args.data,
        num_classes=getattr(args, "num_classes", None),
        image_size=getattr(args, "image_size", None),
    )


# the options --help lists (the others are for experts: --help-all): of `search` (the search configs' fields)
# and of `run` (ClientConfig's, its search's and its CVAE's)
SEARCH_COMMON = ("search_epochs", "final_epochs")
RUN_COMMON = ("seed", "device", "role", "precision", "init", "search.final_epochs", "cvae.epochs")


# --- subcommands -------------------------------------------------------------------------------------


def cmd_partition(args: argparse.Namespace) -> Output:
    from edge_sdk.data import partition

    result = partition(
        args.dataset,
        args.data_root,
        num_clients=args.num_clients,
        alpha=args.alpha,
        seed=args.seed,
        out_dir=args.out,
        min_size=args.min_size,
        download=args.download,
        image_size=args.image_size,
    )
    lines = [f"wrote {len(result.client_paths)} client files + {result.test_path.name} to {args.out}"]
    for path, hist in zip(result.client_paths, result.label_histogram, strict=True):
        lines.append(f"{path.name}: n={sum(hist):6d}  classes={list(hist)}")
    data = {
        "clients": [str(path) for path in result.client_paths],
        "test": str(result.test_path),
        "label_histogram": [list(hist) for hist in result.label_histogram],
    }
    return Output(data, lines)


def cmd_profile(args: argparse.Namespace) -> Output:
    from edge_sdk.profiling import measure_device
    from export.atomic import atomic_write_text
    from profiles import profile_to_toml

    profile = measure_device(name=args.name, seconds=args.seconds, role=args.role)
    comments = [f"measured by `edge-sdk profile` (edge_sdk {__version__})", profile.gflops_source]
    text = profile_to_toml(profile, comments=comments)
    lines = []
    if args.out:
        atomic_write_text(args.out, text)
        lines.append(f"wrote {args.out}")
    data = {"profile": dataclasses.asdict(profile), "wrote": args.out}
    return Output(data, [*lines, text.rstrip("\n")])


def cmd_profiles(args: argparse.Namespace) -> Output:
    from profiles import list_profiles, load_profile

    shipped = [load_profile(name) for name in list_profiles()]
    lines = [
        f"{'name':24s} {'role':10s} {'memory_mb':>9s} {'GFLOP/s':>8s} {'latency_ms':>10s} {'max_flops':>12s} "
        f"{'max_params':>11s}"
    ]
    for p in shipped:
        lines.append(
            f"{p.name:24s} {p.role:10s} {p.memory_mb:9.0f} {p.gflops:8.1f} {p.latency_ms:10.1f} "
            f"{p.max_flops:12d} {p.max_params:11d}"
        )
    return Output({"profiles": [dataclasses.asdict(p) for p in shipped]}, lines)


def cmd_search(args: argparse.Namespace) -> Output:
    from common.device import resolve_device
    from edge_sdk.data import split_train_val
    from edge_sdk.search import search
    from export.atomic import atomic_write_json
    from profiles import load_profile

    data = load_data(args)
    train_split, val_split = split_train_val(data, val_fraction=args.val_fraction, seed=args.seed)
    result = search(
        train_split,
        val_split,
        profile=load_profile(args.profile),
        config=search_config(args, given_table(args, args.flags)),
        seed=args.seed,
        device=resolve_device(args.device),
        progress=not args.quiet,
        precision=args.precision,
    )
    atomic_write_json(args.out, result.to_dict())
    line = (
        f"best {result.best_spec} (val CE {result.best_fitness:.4f}); "
        f"{result.candidate_epochs} candidate-epochs, "
        f"{result.rejected} over budget, {result.cache_hits} cache hits; wrote {args.out}"
    )
    data = {
        "best_spec": str(result.best_spec),
        "best_fitness": result.best_fitness,
        "candidate_epochs": result.candidate_epochs,
        "rejected": result.rejected,
        "cache_hits": result.cache_hits,
        "wrote": args.out,
    }
    return Output(data, [line])


def cmd_train(args: argparse.Namespace) -> Output:
    from edge_sdk.artifacts import save_trained_model
    from edge_sdk.data import split_train_val
    from edge_sdk.final_training import train_final

    data = load_data(args)
    train_split, val_split = split_train_val(data, val_fraction=args.val_fraction, seed=args.seed)
    trained = train_final(
        args.arch,
        train_split,
        val_split,
        epochs=args.train_epochs,
        lr=args.lr,
        batch_size=args.batch_size,
        seed=args.seed,
        device=args.device,
        progress=not args.quiet,
        unknown_output=args.unknown_output,
        precision=args.precision,
    )
    save_trained_model(trained, args.out)
    line = f"{trained.arch}: val accuracy {trained.metrics['val_accuracy']:.4f}; wrote {args.out}"
    return Output({"arch": trained.arch, "metrics": dict(trained.metrics), "wrote": args.out}, [line])


def cmd_export(args: argparse.Namespace) -> Output:
    from edge_sdk.artifacts import bundle_model, load_trained_model
    from profiles import load_profile

    trained, onnx_bytes = load_trained_model(args.model)
    bundle = bundle_model(
        trained, load_profile(args.profile), args.out, seed=args.seed, onnx_bytes=onnx_bytes
    )
    line = f"wrote {args.out} ({bundle.kind}, {bundle.arch}, sha256 {bundle.sha256[:12]})"
    data = {"kind": bundle.kind, "arch": bundle.arch, "sha256": bundle.sha256, "wrote": args.out}
    return Output(data, [line])


def cmd_run(args: argparse.Namespace) -> Output:
    from edge_sdk.footprint import check_hosts
    from profiles import load_profile

    profile = load_profile(args.profile)
    table = given_table(args, args.flags)
    if not args.emulate:  # before torch: a device that cannot host it hears so at once
        check_hosts(profile, table.get("role", "auto"))
    from edge_sdk.client import ClientConfig, run_client

    data = load_data(args)
    chosen = table.pop("search", {})
    search = search_config(args, chosen)
    if table.get("init") is not None and args.strategy is None and "fixed_arch" not in chosen:
        # the file names the architecture: train it (a conflicting --strategy / --fixed-arch is refused)
        from edge_sdk.search import replace_search_config
        from edge_sdk.shared_init import read_initial_weights

        weights = read_initial_weights(
            table["init"], input_shape=data.input_shape, num_classes=data.num_classes
        )
        search = replace_search_config(search, strategy="fixed", fixed_arch=weights.arch)
    table |= {"search": search, "cvae": cvae_config(args, table.pop("cvae", {})), "progress": not args.quiet}
    config = config_from_dict(ClientConfig, table, what="edge-sdk run options")
    result = run_client(data, profile=profile, config=config, out=args.out, hosted=not args.emulate)
    m = result.metrics
    data = {
        "arch": result.arch,
        "role": result.role,
        "metrics": dict(m),
        "seconds": dict(result.seconds),
        "wrote": [str(result.bundle_path), *map(str, result.extra_bundles), str(result.report_path)],
    }
    if result.search is None:  # role cvae
        line = (
            f"{result.arch}: val loss {m['val_loss']:.4f}, decoder {m['decoder_flops']} FLOPs, "
            f"{m['decoder_params']} params; wrote {result.bundle_path} (cvae_decoder)"
        )
        return Output(data, [line])
    lines = [
        f"{result.arch}: val accuracy {m['val_accuracy']:.4f}, {m['flops']} FLOPs, {m['params']} params, "
        f"{m['candidate_epochs']} candidate-epochs; wrote {result.bundle_path}"
    ]
    lines += [f"wrote {extra} (cvae_decoder)" for extra in result.extra_bundles]
    return Output(data, lines)


def cmd_inspect(args: argparse.Namespace) -> Output:
    """The manifest as JSON in both formats (it always was: scripts parse it)."""
    from export.atomic import atomic_write_bytes
    from export.bundle import read_bundle

    bundle = read_bundle(args.file)
    if args.extract_onnx:
        atomic_write_bytes(args.extract_onnx, bundle.model_onnx)
        logger.info("wrote %s", args.extract_onnx)
    manifest = bundle.manifest()
    return Output(manifest, [json_text(manifest)])


def cmd_upgrade(args: argparse.Namespace) -> Output:
    from export.bundle import SCHEMA_VERSION, upgrade_bundle

    upgraded = {path: upgrade_bundle(path) for path in args.files}
    lines = [
        f"{path}: {'upgraded to' if done else 'already'} schema {SCHEMA_VERSION}"
        for path, done in upgraded.items()
    ]
    return Output({"schema_version": SCHEMA_VERSION, "upgraded": upgraded}, lines)


def cmd_personalize(args: argparse.Namespace) -> Output:
    from edge_sdk.personalize import PersonalizeConfig, personalize
    from export.bundle import read_bundle
    from export.package import read_package

    config = config_from_dict(PersonalizeConfig, given_table(args, args.flags), what="personalize options")
    result = personalize(
        load_data(args),
        read_bundle(args.model),
        read_package(args.package),
        args.out,
        config=config,
        progress=not args.quiet,
    )
    r = result.report
    line = (
        f"{r['method']}: val accuracy fp32 {r['val_accuracy']['fp32']:.4f}, "
        f"int8 {r['val_accuracy']['int8']:.4f} "
        f"(before: own {r['val_accuracy_before']['own_model']:.4f}, global "
        f"{r['val_accuracy_before']['global_model']:.4f}); kept {result.kept}: wrote {result.deploy_onnx}"
    )
    data = {
        "method": r["method"],
        "val_accuracy": r["val_accuracy"],
        "val_accuracy_before": r["val_accuracy_before"],
        "kept": result.kept,
        "wrote": str(result.deploy_onnx),
    }
    return Output(data, [line])


def cmd_deploy(args: argparse.Namespace) -> Output:
    from edge_sdk.deploy import DeployConfig, deploy

    config = config_from_dict(DeployConfig, given_table(args, args.flags), what="deploy options")
    from edge_sdk.data import load_client_data

    calibration = None
    if args.calibration is not None:  # deploy refuses --int8 without it, before reading the model
        calibration = load_client_data(args.calibration).x.float().div(255).numpy()
    result = deploy(args.model, args.out, config=config, calibration=calibration)
    agreement = (
        "conversion only (its runtime does not run here)"
        if result.top1_agreement is None
        else f"top-1 agreement with the float32 ONNX {result.top1_agreement:.4f} on {result.check_images} "
        f"images (max logit difference {result.max_logit_diff:.3g})"
    )
    names = ", ".join(str(p) for p in result.files)
    line = f"{result.target}{' int8' if result.int8 else ''}: wrote {names}; {agreement}"
    data = {
        "target": result.target,
        "int8": result.int8,
        "wrote": [str(p) for p in result.files],
        "class_names": list(result.class_names),
        "input_shape": list(result.input_shape),
        "check_images": result.check_images,
        "top1_agreement": result.top1_agreement,
        "max_logit_diff": result.max_logit_diff,
        "needs": result.needs,
    }
    return Output(data, [line])


def _partition_args(p: argparse.ArgumentParser) -> None:
    """``edge-sdk partition``'s options."""
    p.add_argument(
        "--dataset",
        required=True,
        help="mnist, fashionmnist, cifar10, svhn, digits, or folder (your own images)",
    )
    p.add_argument(
        "--data-root",
        help="the dataset's root (not needed for digits): torchvision's layout, a folder holding "
        "cifar10-jpeg.tar.gz, or for folder, a folder (or .tar.gz) with train/<class>/ and test/<class>/",
    )
    p.add_argument(
        "--image-size",
        type=int,
        help="folder only: scale and centre-crop every image to this square size (else all must share one)",
    )
    p.add_argument("--num-clients", type=int, required=True, help="client files to write (>= 1)")
    p.add_argument(
        "--alpha", type=float, required=True, help="Dirichlet concentration (> 0; smaller = more skew)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the split (same seed, same files)")
    p.add_argument("--min-size", type=int, default=10, help="minimum samples per client")
    p.add_argument("--download", action="store_true", help="download the dataset if missing (needs internet)")
    p.add_argument("--out", required=True, type=out_dir, help="output directory")


def _profile_args(p: argparse.ArgumentParser) -> None:
    """``edge-sdk profile``'s options."""
    p.add_argument("--out", type=out_file, help="profile TOML to write")
    p.add_argument("--name", default="this-device")
    p.add_argument("--role", default="classifier", choices=["classifier", "cvae"])
    p.add_argument("--seconds", type=float, default=2.0, help="time per micro-benchmark")


def _export_args(p: argparse.ArgumentParser) -> None:
    """``edge-sdk export``'s options."""
    p.add_argument("--model", required=True, help="model .onnx written by `edge-sdk train`")
    p.add_argument("--profile", required=True)
    p.add_argument("--seed", type=int, default=0, help="seed recorded in the bundle manifest")
    p.add_argument("--out", required=True, type=out_file, help="bundle file to write")


def _inspect_args(p: argparse.ArgumentParser) -> None:
    """``edge-sdk inspect``'s options."""
    p.add_argument("file")
    p.add_argument("--extract-onnx", type=out_file, help="write the bundled ONNX model here")


def _data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True, help="client data: .npz (x, y) or an image folder")
    p.add_argument("--num-classes", type=int, help="class count when the data file does not record it")
    p.add_argument(
        "--image-size", type=int, help="an image folder's images scaled and centre-cropped to this square"
    )


def _training_args(p: argparse.ArgumentParser) -> None:
    """search and train take no config class: their few options are declared here."""
    from edge_sdk.precision import PRECISIONS

    _data_args(p)
    p.add_argument("--val-fraction", type=float, default=0.2, help="local validation split")
    p.add_argument(
        "--device", default="auto", help="where to train: auto (CUDA when present), cpu, cuda or cuda:N"
    )
    p.add_argument(
        "--precision",
        default="auto",
        choices=PRECISIONS,
        help="training precision: bf16 autocast where the hardware has it (auto, the default), or as "
        "given; the exported model and its reported accuracy are float32",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the split, search and training")


def _build_search(p: argparse.ArgumentParser) -> None:
    _training_args(p)
    p.add_argument("--profile", required=True, help="shipped profile name or path to a profile TOML")
    p.add_argument("--out", required=True, type=out_file, help="search result JSON")
    group = p.add_argument_group("architecture search")
    add_search_selectors(group)
    flags = add_config_args(p, search_classes(), groups={"": group}, common=SEARCH_COMMON)
    p.set_defaults(flags=flags)


def _build_train(p: argparse.ArgumentParser) -> None:
    _training_args(p)
    p.add_argument("--arch", required=True, help="architecture spec, e.g. C32k3-P-C64k5-P-F128-F10")
    p.add_argument("--train-epochs", type=int, default=8, help="epochs of training the architecture")
    renamed_option(p, "--epochs", "--train-epochs")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--out", required=True, type=out_file, help="model .onnx to write")
    p.add_argument(
        "--unknown-output",
        action="store_true",
        help="FedOV: train the classifier with an extra 'none of my classes' output on corrupted local "
        "images, so the server can tell when it does not know a sample",
    )


def _build_run(p: argparse.ArgumentParser) -> None:
    from edge_sdk.client import ClientConfig

    _data_args(p)
    p.add_argument("--profile", required=True, help="shipped profile name or path to a profile TOML")
    p.add_argument("--out", required=True, type=out_file, help="bundle file to write")
    p.add_argument(
        "--emulate",
        action="store_true",
        help="this machine stands in for the profile's device (testing, simulation): the toolkit's own "
        "memory is not held to the profile's memory_mb (without it, a device too small to run "
        "`edge-sdk run` is refused and auto steps down to a role that fits)",
    )
    flags = add_config_args(
        p,
        ClientConfig,
        flatten=("search",),
        skip=("progress",),
        families={"search": search_classes()},
        groups=client_groups(p, "device"),
        common=RUN_COMMON,
    )
    p.set_defaults(flags=flags)


def _build_personalize(p: argparse.ArgumentParser) -> None:
    from edge_sdk.personalize import PersonalizeConfig

    _data_args(p)
    p.add_argument("--model", required=True, help="this device's bundle from `edge-sdk run`")
    p.add_argument("--package", required=True, help="the package `server-kit personalize` wrote for it")
    p.add_argument("--out", required=True, type=out_dir, help="output directory")
    p.set_defaults(flags=add_config_args(p, PersonalizeConfig))


def _build_deploy(p: argparse.ArgumentParser) -> None:
    from edge_sdk.deploy import DeployConfig

    p.add_argument(
        "model",
        help="a classifier the toolkit wrote: global.onnx, a personalized deploy.onnx, a client .bundle",
    )
    p.add_argument("--out", required=True, type=out_file, help="the file to write (side files beside it)")
    p.add_argument(
        "--calibration",
        help="this device's data (.npz or image folder): calibrates --int8, and the converted model is "
        "checked against the float32 one on it",
    )
    p.set_defaults(flags=add_config_args(p, DeployConfig))


def build_parser() -> argparse.ArgumentParser:
    parser, command = root_parser(
        "edge-sdk",
        "Edge SDK: profile the device, search/train a model under its budget, export ONNX, write a bundle.",
        version=__version__,
    )
    _partition_args(
        command(
            "partition", cmd_partition, "Dirichlet label-skew partition of a dataset into client .npz files"
        )
    )
    _profile_args(command("profile", cmd_profile, "measure this device and write a profile TOML"))
    command("profiles", cmd_profiles, "list the shipped device profiles")
    command(
        "search",
        cmd_search,
        "architecture search under the device budget (writes search JSON)",
        _build_search,
    )
    command(
        "train",
        cmd_train,
        "train one architecture on local data (writes a BN-preserving ONNX model)",
        _build_train,
    )
    _export_args(command("export", cmd_export, "wrap a model from `edge-sdk train` into a client bundle"))
    command(
        "run",
        cmd_run,
        "search -> train -> export -> bundle in one call (or train a CVAE: --role)",
        _build_run,
    )
    command(
        "personalize",
        cmd_personalize,
        "personalise this device's model with the server's package; export fp32 and int8 ONNX",
        _build_personalize,
    )
    command(
        "deploy",
        cmd_deploy,
        "convert a classifier for a phone runtime: onnx, ort, tflite, executorch, executorch-train "
        "(a training program: fine-tuning on the phone) or coreml",
        _build_deploy,
    )
    _inspect_args(
        command("inspect", cmd_inspect, "print a bundle's manifest (and optionally extract its ONNX)")
    )
    p = command(
        "upgrade",
        cmd_upgrade,
        "rewrite schema-1 bundles you made yourself in place as the current schema (verifies each first)",
    )
    p.add_argument("files", nargs="+", help="bundle files")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return cli_main("edge-sdk", build_parser(), argv)


if __name__ == "__main__":
    raise SystemExit(main())
