#!/usr/bin/env bash
# Poisoning benchmark (MNIST, alpha 0.5, 10 clients): the 8 honest clients alone vs the same 8 plus 2 hostile
# ones (client 8 trained on random labels, client 9 on shifted labels claiming 5,000 examples of every class),
# aggregated by the server phases (benchmarks/label_ablation.py) with the default and without the claim checks.
# Every client uploads what the default `both` role uploads: its classifier and its CVAE decoder, so the
# hostile two upload a decoder trained on the same wrong labels, with the same claimed counts.
#
#   benchmarks/poisoning.sh RUN      (RUN: a simulate output with 10 client bundles, e.g. runs/bench/default-a0.5,
#                                     and RUN/decoders/client_KK.decoder.bundle, made by the clients' own CVAE)
#
# Writes benchmarks/results/poisoning_honest8.json and poisoning_hostile2.json.
#
#   benchmarks/poisoning.sh RUN colluding [TAG]
#
# Issue #34's colluding-devices table: clients 0-6 as uploaded (classifier and decoder each) alone, then
# with three hostile devices in the slots of clients 7-9, one attack a row (benchmarks/poisoning_collude.sh).
# Writes benchmarks/results/collude[_TAG]_{honest7,colluding3,flipped3,shifted3}.json and prints the table.
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:?usage: benchmarks/poisoning.sh RUN [colluding [TAG]]}
py=${PYTHON:-.venv/bin/python}
if [ "${2:-}" = colluding ]; then
  exec benchmarks/poisoning_collude.sh "$run" "${3:-}"
fi
hostile="$run/hostile"
mkdir -p "$hostile"
for kind in classifier decoder; do
  suffix=$([ "$kind" = decoder ] && echo .decoder || true)
  [ -f "$hostile/client_08_random$suffix.bundle" ] || $py benchmarks/hostile_bundles.py "$run" --client 8 \
    --mode random --kind $kind --out "$hostile/client_08_random$suffix.bundle"
  [ -f "$hostile/client_09_shift$suffix.bundle" ] || $py benchmarks/hostile_bundles.py "$run" --client 9 \
    --mode shift --kind $kind --out "$hostile/client_09_shift$suffix.bundle"
done
honest=("$run"/clients/client_0[0-7].bundle "$run"/decoders/client_0[0-7].decoder.bundle)
$py benchmarks/label_ablation.py "$run" --threads "${THREADS:-1}" --bundles "${honest[@]}" \
  --out benchmarks/results/poisoning_honest8.json --variant default &
$py benchmarks/label_ablation.py "$run" --threads "${THREADS:-1}" --bundles "${honest[@]}" "$hostile"/*.bundle \
  --out benchmarks/results/poisoning_hostile2.json --variant default --variant "noverify:verify_claims=0"
wait
