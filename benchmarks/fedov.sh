#!/usr/bin/env bash
# FedOV ablation: the same clients trained with and without the "unknown" output, aggregated by the default
# server phases (benchmarks/label_ablation.py) beside the decoders the clients uploaded.
#
#   benchmarks/fedov.sh RUN DECODER_DIR      (RUN: a simulate output with data/client_KK.npz and
#                                             data/test.npz; DECODER_DIR: client_KK.decoder.bundle files)
#
# Every client trains one architecture (ARCH, default a small two-conv chain, so the ablation compares the
# output and nothing else) for EPOCHS epochs with seed = its index, once plain and once with
# --unknown-output, on its own data; `edge-sdk export` bundles both for the laptop-cpu profile. Then:
#   plain   the plain bundles + decoders, the default server
#   fedov   the unknown-output bundles + decoders, the default server (labels.abstain on)
#   ignore  the unknown-output bundles + decoders, the unknown output ignored (labels.abstain=0)
# Writes benchmarks/results/fedov_<RUN name>_{plain,unknown}.json (rows with ceilings) and the client
# accuracies to benchmarks/results/fedov_<RUN name>_clients.json.
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:?usage: benchmarks/fedov.sh RUN DECODER_DIR}
decoders=${2:?usage: benchmarks/fedov.sh RUN DECODER_DIR}
arch=${ARCH:-C16k5-P-C32k5-P-F10}
epochs=${EPOCHS:-8}
py=.venv/bin/python
name=$(basename "$run")
work="$run/fedov"
export OMP_NUM_THREADS=${THREADS:-1}
train() {  # $1 variant, $2 extra flag
  mkdir -p "$work/$1"
  for data in "$run"/data/client_*.npz; do
    k=$(basename "$data" .npz)
    [ -f "$work/$1/$k.bundle" ] && continue
    .venv/bin/edge-sdk train --data "$data" --arch "$arch" --train-epochs "$epochs" --seed "${k#client_}" \
      --out "$work/$1/$k.onnx" --quiet $2
    .venv/bin/edge-sdk export --model "$work/$1/$k.onnx" --profile laptop-cpu --seed "${k#client_}" \
      --out "$work/$1/$k.bundle"
  done
}
train plain "" &
train unknown --unknown-output
wait
$py - "$run" "$work" > "benchmarks/results/fedov_${name}_clients.json" <<'PY'
import json, sys
from pathlib import Path
from edge_sdk.data import load_client_data
from export.bundle import read_bundle
from server_kit.evaluate import evaluate_onnx
run, work = Path(sys.argv[1]), Path(sys.argv[2])
test = load_client_data(run / "data" / "test.npz")
rows = {}
for variant in ("plain", "unknown"):
    rows[variant] = []
    for path in sorted((work / variant).glob("client_*.bundle")):
        b = read_bundle(path)
        acc = evaluate_onnx(b.model_onnx, test, unknown_output=b.unknown_output)["accuracy"]
        rows[variant].append({"client": path.stem, "val_accuracy": b.metrics["val_accuracy"], "test_accuracy": acc})
print(json.dumps(rows, indent=1))
PY
$py benchmarks/label_ablation.py "$run" --bundles "$work"/plain/client_*.bundle "$decoders"/client_*.decoder.bundle \
  --work "$work/ablation_plain" --out "benchmarks/results/fedov_${name}_plain.json" --variant plain &
$py benchmarks/label_ablation.py "$run" --bundles "$work"/unknown/client_*.bundle "$decoders"/client_*.decoder.bundle \
  --work "$work/ablation_unknown" --out "benchmarks/results/fedov_${name}_unknown.json" \
  --variant fedov --variant "ignore:labels.abstain=0"
wait
