#!/usr/bin/env bash
# FedMHO at the paper's setting (issue #18): one whole `simulate --federation-preset fedmho` row per alpha, then the
# server variants on the same client bundles and the decoders' recognisability.
#
#   benchmarks/fedmho_rows.sh ROW ALPHA [--timed-only | --variants-only]
#       e.g. benchmarks/fedmho_rows.sh fedmho3-a0.3 0.3
#
# The simulate row is timed by benchmarks/speed.py (wall, CPU, peak PSS of the process tree): run it alone on
# an idle machine. The variants are accuracy rows (they may share the cores): FedAvg alone (fusion for 0
# epochs), CE, SD, and the MD / SD teachers `conditioned` and `mean` (the paper's Eqs. 6-7). Raw files:
# benchmarks/results/ROW/.
set -euo pipefail
cd "$(dirname "$0")/.."
row=$1; alpha=$2; what=${3:-all}
temp=0.9  # the decoders' sampling temperature of simulate's fedmho preset (server_kit.federation.simulate.FEDMHO_TEMPERATURE)
weighting=federation  # the preset's split of the decoder budget over classes (AggregateConfig.decoder_weighting)
run=runs/bench/$row; keep=benchmarks/results/$row
mkdir -p "$keep"
py=.venv/bin/python
if [ "$what" != --variants-only ]; then
  cmd=(.venv/bin/server-kit simulate --federation-preset fedmho --dataset mnist --data-root ../shared/datasets
       --num-clients 10 --seed 0 --jobs 2 --quiet --out "$run" --alpha "$alpha")
  printf '%q ' "${cmd[@]}" > "$keep/command.txt"; echo >> "$keep/command.txt"
  $py benchmarks/speed.py --out "$keep/speed.json" --results "$run/results.json" -- "${cmd[@]}" \
    > "$keep/speed.txt" 2>&1
  cp "$run/results.json" "$keep/results.json"
  cp "$run/server/report.json" "$keep/server_report.json"
fi
[ "$what" = --timed-only ] && exit 0
variant() {  # NAME [aggregate options]
  local name=$1; shift
  .venv/bin/server-kit aggregate "$run"/clients/*.bundle --out "$run/variants/$name" --synth decoder \
    --threads 1 --quiet --eval "$run/data/test.npz" --decoder-temperature "$temp" \
    --decoder-weighting "$weighting" "$@" > /dev/null
  cp "$run/variants/$name/report.json" "$keep/variant_$name.json"
}
variant fedavg --fusion-mode md --fusion-epochs 0
variant ce --fusion-mode ce
variant md --fusion-mode md
variant sd --fusion-mode sd
variant md-conditioned --fusion-mode md --fusion-teacher conditioned
variant sd-conditioned --fusion-mode sd --fusion-teacher conditioned
variant md-mean --fusion-mode md --fusion-teacher mean
variant sd-mean --fusion-mode sd --fusion-teacher mean
$py benchmarks/decoder_quality.py "$run" --out "$keep/decoder_quality.json" --threads 1 --temperature "$temp" \
  --weighting "$weighting" \
  > "$keep/decoder_quality.txt" 2>&1
$py - "$keep" <<'EOF'
import json, sys
from pathlib import Path
keep = Path(sys.argv[1])
for f in sorted(keep.glob("variant_*.json")):
    r = json.loads(f.read_text())
    per = [round(100 * v, 1) for v in r["per_class_accuracy"]]
    print(f"{f.stem[8:]:16s} {100 * r['accuracy']:6.2f}  lowest class {min(per):5.1f}  server {r['seconds']['total']:.1f} s")
EOF
