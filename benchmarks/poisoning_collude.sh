#!/usr/bin/env bash
# Issue #34's poisoning table with colluding devices (called by `benchmarks/poisoning.sh RUN colluding [TAG]`).
#
# RUN: a `server-kit simulate` output of 10 clients whose profiles upload a classifier and a CVAE decoder
# each (role both: RUN/clients/client_KK.bundle and client_KK.decoder.bundle, or RUN/decoders/...). The
# honest seven are clients 0-6; the hostile three take the slots of clients 7-9 (their images), built by
# benchmarks/hostile_bundles.py (the same training as an honest client, on wrong labels):
#
#   honest7     clients 0-6 alone
#   colluding3  + 3 devices uploading one identical pair (classifier + decoder) trained on client 7's images
#               with shifted labels (y -> y + 1), claiming 5,000 examples of every class: identical models
#               and claims, so they agree perfectly with each other
#   flipped3    + clients 7-9 each trained on flipped labels (y -> L - 1 - y), classifier and decoder,
#               claiming the counts of the labels they trained on (honest-looking counts)
#   shifted3    + clients 7-9's honest classifiers, and decoders trained on shifted labels (they draw y - 1
#               when asked for y) with honest-looking counts
#
# Every row is the server's default phases (benchmarks/label_ablation.py --variant default: claim checks
# on). Environment: THREADS (torch threads, default 1), PYTHON (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:?usage: benchmarks/poisoning_collude.sh RUN [TAG]}
tag=${2:+_$2}
py=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code, whatever the interpreter has installed
hostile="$run/hostile_collude"
mkdir -p "$hostile" benchmarks/results
decoder() {  # the decoder bundle of client $1 (two digits)
  if [ -f "$run/clients/client_$1.decoder.bundle" ]; then echo "$run/clients/client_$1.decoder.bundle"
  else echo "$run/decoders/client_$1.decoder.bundle"; fi
}
make() {  # make OUT CLIENT MODE KIND [COUNTS]
  [ -f "$1" ] || $py benchmarks/hostile_bundles.py "$run" --client "$2" --mode "$3" --kind "$4" \
    ${5:+--counts "$5"} --out "$1"
}
honest=()
for k in 00 01 02 03 04 05 06; do honest+=("$run/clients/client_$k.bundle" "$(decoder $k)"); done
# colluding: one pair trained once, uploaded under three names
make "$hostile/collude.bundle" 7 shift classifier claim
make "$hostile/collude.decoder.bundle" 7 shift decoder claim
colluding=()
for k in 07 08 09; do
  cp -n "$hostile/collude.bundle" "$hostile/collude_$k.bundle"
  cp -n "$hostile/collude.decoder.bundle" "$hostile/collude_$k.decoder.bundle"
  colluding+=("$hostile/collude_$k.bundle" "$hostile/collude_$k.decoder.bundle")
done
flipped=()
shifted=()
for k in 7 8 9; do
  make "$hostile/flip_0$k.bundle" $k flip classifier trained
  make "$hostile/flip_0$k.decoder.bundle" $k flip decoder trained
  make "$hostile/shift_0$k.decoder.bundle" $k shift decoder trained
  flipped+=("$hostile/flip_0$k.bundle" "$hostile/flip_0$k.decoder.bundle")
  shifted+=("$run/clients/client_0$k.bundle" "$hostile/shift_0$k.decoder.bundle")
done
row() {  # row NAME BUNDLES...
  local name=$1; shift
  $py benchmarks/label_ablation.py "$run" --threads "${THREADS:-1}" --bundles "$@" \
    --out "benchmarks/results/collude${tag}_$name.json" --variant default
}
row honest7 "${honest[@]}"
row colluding3 "${honest[@]}" "${colluding[@]}"
row flipped3 "${honest[@]}" "${flipped[@]}"
row shifted3 "${honest[@]}" "${shifted[@]}"
$py benchmarks/poisoning_table.py benchmarks/results/collude${tag}_{honest7,colluding3,flipped3,shifted3}.json
