#!/usr/bin/env bash
# FedMHO with the `both` role (ours): the classifier devices of a finished FedMHO row also train and upload a
# CVAE decoder, so the server samples 10 decoders instead of 5. Server: the same FedMHO-MD settings.
#
#   benchmarks/fedmho_both.sh [SRC_ROW]      (default fedmho-md-a0.5; writes runs/bench/SRC_ROW-both and
#                                             benchmarks/results/SRC_ROW-both/)
# The decoder of client k is trained as `edge-sdk run --role cvae` would train it on that device (same data,
# seed k, the mnist CVAE preset); its classifier bundle is reused unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
src_row=${1:-fedmho-md-a0.5}
src=runs/bench/$src_row; run=runs/bench/$src_row-both; keep=benchmarks/results/$src_row-both
mkdir -p "$run/clients" "$keep"
cp "$src"/clients/client_*.bundle "$run/clients/"
for report in "$src"/clients/client_*.bundle.report.json; do
  role=$(.venv/bin/python -c "import json,sys; print(json.load(open(sys.argv[1]))['role'])" "$report")
  [ "$role" = classifier ] || continue
  name=$(basename "$report" .bundle.report.json)   # client_00
  k=$((10#${name#client_}))
  out=$run/clients/$name.decoder.bundle
  [ -f "$out" ] || /usr/bin/time -v -o "$keep/${name}_decoder_time.txt" .venv/bin/edge-sdk run --quiet \
    --data "$src/data/$name.npz" --profile laptop-cpu --role cvae --cvae-preset mnist --seed "$k" --out "$out"
done
cmd=(.venv/bin/server-kit aggregate "$run"/clients/*.bundle --out "$run/server" --synth decoder --fusion-mode md
     --fusion-preset mnist --threads 1 --quiet --eval "$src/data/test.npz")
printf '%q ' "${cmd[@]}" > "$keep/command.txt"
echo >> "$keep/command.txt"
/usr/bin/time -v -o "$keep/time.txt" "${cmd[@]}" | tee "$keep/stdout.txt"
cp "$run/server/report.json" "$keep/server_report.json"
