"""int8 agreement with float32 per CPU class and quantization scheme, in onnxruntime.

onnxruntime picks its integer kernels from the CPU it runs on (cpuid), so the same int8 model can give
other predictions on another CPU: on x86-64 without VNNI the u8 x s8 kernels sum pairs of products in
16 bits with saturation. This script trains one model per family on a dataset, quantizes it with each
scheme, and writes everything the scoring step needs; the scoring step then runs once per CPU class,
natively or under ``qemu-x86_64 -cpu MODEL`` (user-mode emulation: cpuid reports that model's
features, so onnxruntime dispatches the kernels that CPU class would run).

    python benchmarks/int8_cpu_classes.py prepare --dataset mnist --data-root ../shared/datasets --out W
    python benchmarks/int8_cpu_classes.py score W native
    qemu-x86_64 -cpu Haswell .venv/bin/python benchmarks/int8_cpu_classes.py score W haswell-avx2
    python benchmarks/int8_cpu_classes.py summary W

Where the CPU has CPUID faulting (``cpuid_fault`` in /proc/cpuinfo), ``benchmarks/cpuid_haswell.c``
gives the Haswell class at native speed instead of qemu's: build it and run the scoring step under
``LD_PRELOAD=cpuid_haswell.so`` (its header says how, and what it does not hide).

``FAMILY.SCHEME.onnx`` quantizes every node with that scheme; ``FAMILY.default.onnx`` is what
``edge-sdk deploy --int8`` writes: the default scheme with its agreement rule (the nodes that flip most
predictions on held-out training images stay float32; ``prepare.json`` names them, or says why the
rule refused the model).

The scoring step imports only numpy and onnxruntime (it runs under emulation, where torch is slow).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

# families the search and the server produce: a chain CNN (PSO), an elastic subnet (evolution), the
# server's default student; the zoo's ResNet-18 as a deep network with residual adds
FAMILIES = {
    "chain": "C32k5-P-C64k5-P-F10",
    "elastic": "mbv3:s16-16:k3e3-24:k3e3-32:k3e3.k3e3-64:k3e3.k3e3",
    "student": "C32k3-P-C64k3-P-F128-F10",
}


def prepare(args: argparse.Namespace) -> None:
    import torch

    from common.errors import ExportError
    from edge_sdk.data import load_dataset
    from edge_sdk.models.arch import build_model, parse_arch
    from edge_sdk.train import TrainConfig, to_float, train
    from export.onnx_export import export_onnx, read_metadata
    from export.quantize import QUANTIZATION_KEY, SCHEMES, quantize_int8

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    tr = load_dataset(args.dataset, args.data_root, split="train")
    te = load_dataset(args.dataset, args.data_root, split="test")
    order = torch.randperm(len(tr), generator=torch.Generator().manual_seed(args.seed))
    sub = tr.subset(order[: args.train_images])
    np.save(out / "test_x.npy", to_float(te.x).numpy())
    np.save(out / "test_y.npy", te.y.numpy())
    calib = to_float(sub.x[: args.calibration]).numpy()
    # the device's held-out images: training images the model never saw, never the test set
    check = to_float(tr.x[order[args.train_images : args.train_images + args.check]]).numpy()
    trained = {"dataset": args.dataset, "train_images": args.train_images, "epochs": args.epochs}
    trained |= {"seed": args.seed, "weight_decay": args.weight_decay, "families": FAMILIES}
    reuse = _same_settings(out / "prepare.json", trained)
    floats = {}
    for family, arch in FAMILIES.items():
        path = out / f"{family}.fp32.onnx"
        if reuse and path.is_file():
            fp32 = path.read_bytes()  # trained with these very settings (prepare.json)
        else:
            torch.manual_seed(args.seed)
            model = build_model(parse_arch(arch), te.input_shape, te.num_classes)
            config = TrainConfig(epochs=args.epochs, precision="fp32", weight_decay=args.weight_decay)
            train(model, sub, config=config, seed=args.seed)
            fp32 = export_onnx(model.eval().cpu(), te.input_shape, keep_batchnorm=False, seed=args.seed)
            path.write_bytes(fp32)
        for scheme in SCHEMES:
            # each scheme as it is: the agreement rule would hide what the scheme's rounding costs
            int8 = quantize_int8(fp32, calib, scheme=scheme, min_agreement=None)
            (out / f"{family}.{scheme}.onnx").write_bytes(int8)
        try:  # the default, as `edge-sdk deploy --int8` writes it
            guarded = quantize_int8(fp32, calib, check=check)
            (out / f"{family}.default.onnx").write_bytes(guarded)
            floats[family] = json.loads(read_metadata(guarded)[QUANTIZATION_KEY])
        except ExportError as err:
            (out / f"{family}.default.onnx").unlink(missing_ok=True)
            floats[family] = {"refused": str(err)}
        print(f"{family}: trained and quantized", flush=True)
    meta = trained | {"calibration": args.calibration, "check": args.check, "default": floats}
    (out / "prepare.json").write_text(json.dumps(meta, indent=1))


def _same_settings(path: Path, trained: dict[str, object]) -> bool:
    """Whether the fp32 models in the work folder were trained with exactly these settings."""
    if not path.is_file():
        return False
    done = json.loads(path.read_text())
    return {key: done.get(key) for key in trained} == json.loads(json.dumps(trained))


def score(args: argparse.Namespace) -> None:
    import onnxruntime as ort

    work = Path(args.work)
    x = np.load(work / "test_x.npy", mmap_mode="r")[: args.limit]
    preds = {}
    for path in sorted(work.glob(f"*.{args.scheme}.onnx")):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        name = session.get_inputs()[0].name
        logits = np.concatenate([session.run(None, {name: x[i : i + 500]})[0] for i in range(0, len(x), 500)])
        preds[path.name.removesuffix(".onnx")] = logits.argmax(1)
        print(f"{args.cpu_class}: {path.name}", flush=True)
    done = work / f"preds-{args.cpu_class}.npz"
    if done.is_file():  # a --scheme run adds to this CPU class's earlier predictions
        with np.load(done) as earlier:
            preds = {key: earlier[key] for key in earlier.files} | preds
    np.savez(done, **preds)


def summary(args: argparse.Namespace) -> None:
    work = Path(args.work)
    y = np.load(work / "test_y.npy")
    runs = {
        p.name.removeprefix("preds-").removesuffix(".npz"): np.load(p)
        for p in sorted(work.glob("preds-*.npz"))
    }
    ref = runs.get("native")
    default = json.loads((work / "prepare.json").read_text()).get("default", {})
    rows = []
    for cpu, preds in runs.items():
        for key in sorted(preds.files):
            family, scheme = key.split(".", 1)
            if scheme == "fp32":
                continue
            fp32 = (ref if ref is not None else preds)[f"{family}.fp32"][: len(preds[key])]
            rows.append(
                {
                    "cpu": cpu,
                    "family": family,
                    "scheme": scheme,
                    "agreement": float((preds[key] == fp32).mean()),
                    "images": len(preds[key]),
                    "same_as_native": None
                    if ref is None
                    else float((ref[key][: len(fp32)] == preds[key]).mean()),
                    "int8_acc": float((preds[key] == y[: len(fp32)]).mean()),
                    "fp32_acc": float((fp32 == y[: len(fp32)]).mean()),
                    "float_nodes": _floats(default.get(family)) if scheme == "default" else "-",
                }
            )
    (work / "summary.json").write_text(json.dumps(rows, indent=1))
    print(
        "| CPU class | family | scheme | test images | agreement with fp32 | same int8 prediction as native "
        "| int8 top-1 | fp32 top-1 | nodes kept in float32 |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['cpu']} | {r['family']} | {r['scheme']} | {r['images']} | {100 * r['agreement']:.2f} % "
            f"| {_percent(r['same_as_native'])} "
            f"| {100 * r['int8_acc']:.2f} % | {100 * r['fp32_acc']:.2f} % | {r['float_nodes']} |"
        )


def _floats(record: dict | None) -> str:
    """The default's float32 nodes as the table shows them: their count and names, or the refusal."""
    if not record:
        return "?"
    if "refused" in record:
        return "refused: float32 deployed"
    names = record["float_nodes"]
    return f"{len(names)}" + (f" ({', '.join(names)})" if names else "")


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.2f} %"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="train, export and quantize one model per family")
    p.add_argument("--dataset", default="mnist")
    p.add_argument("--data-root", default="../shared/datasets")
    p.add_argument("--out", required=True)
    p.add_argument("--train-images", type=int, default=10_000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--calibration", type=int, default=256)
    p.add_argument("--check", type=int, default=2000, help="held-out training images for the agreement rule")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    s = sub.add_parser("score", help="predict the test set with every model, on this CPU")
    s.add_argument("work")
    s.add_argument("cpu_class")
    s.add_argument("--scheme", default="*", help="score only this scheme's models (fp32, u8s7, ...)")
    s.add_argument("--limit", type=int, default=None, help="score only the first N test images")
    m = sub.add_parser("summary", help="agreement table over every scored CPU class")
    m.add_argument("work")
    args = parser.parse_args(argv)
    {"prepare": prepare, "score": score, "summary": summary}[args.cmd](args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
