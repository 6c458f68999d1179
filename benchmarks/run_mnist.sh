#!/usr/bin/env bash
# MNIST benchmark rows: `server-kit simulate` with 10 clients, measured with /usr/bin/time -v.
#
#   benchmarks/run_mnist.sh ROW [extra simulate options]
#
# ROW is one of: pso-a0.1 pso-a0.3 pso-a0.5 fixed-a0.5 randompool-a0.5, fedmho-md-a{0.1,0.3,0.5} (5 classifier
# + 5 CVAE clients), the server-only rows that reuse another row's clients (nozskd-a0.5, generator-a0.5,
# pooled-a0.5, labelweighted-a0.5, inversion-a0.1, pooled-a0.1, fedmho-{ce,sd}-a{0.1,0.3,0.5}, fedmho-pooled-a0.5), or any name with
# your own options (REUSE=ROW to reuse that row's clients).
# The run directory is runs/bench/ROW (rerun to resume); the raw outputs worth keeping (results.json,
# the server report, the /usr/bin/time log, the pseudo-image grid) are copied to benchmarks/results/ROW/.
# Environment: DATA_ROOT (default ../shared/datasets), JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
row=${1:?usage: benchmarks/run_mnist.sh ROW [simulate options]}
shift
DATA_ROOT=${DATA_ROOT:-../shared/datasets}
JOBS=${JOBS:-2}
PROFILES=${PROFILES:-laptop-cpu,jetson-nano-4gb,android-midrange,raspberry-pi-4-4gb,jetson-orin-nano-8gb}
SEED=${SEED:-0}

case "$row" in
  pso-a0.1) opts=(--alpha 0.1) ;;
  pso-a0.3) opts=(--alpha 0.3) ;;
  pso-a0.5) opts=(--alpha 0.5) ;;
  # every client on laptop-cpu: CNN1 (21 MFLOPs) does not fit the Raspberry Pi budget (10 MFLOPs), whose
  # clients would otherwise train a CVAE instead (role auto)
  fixed-a0.5) opts=(--alpha 0.5 --strategy fixed --fixed-arch C32k5-P-C64k5-P-F10); PROFILES=laptop-cpu ;;
  randompool-a0.5) opts=(--alpha 0.5 --strategy random-pool) ;;
  # Server-only rows reuse the clients of pso-a0.5 (copied, so only the server differs):
  nozskd-a0.5) opts=(--alpha 0.5 --hard-labels); reuse=pso-a0.5 ;;          # Table 5: w/o ZSKD
  generator-a0.5) opts=(--alpha 0.5 --synth generator); reuse=pso-a0.5 ;;
  pooled-a0.5) opts=(--alpha 0.5 --synth inversion,generator); reuse=pso-a0.5 ;;
  labelweighted-a0.5) opts=(--alpha 0.5 --labels-rule label-weighted --no-labels-drop-mismatch --no-verify-claims); reuse=pso-a0.5 ;;
  generator-a0.1) opts=(--alpha 0.1 --synth generator); reuse=pso-a0.1 ;;
  inversion-a0.1) opts=(--alpha 0.1 --synth inversion --inversion-samples-per-teacher 200 --inversion-bn-weight 1); reuse=pso-a0.1 ;;
  pooled-a0.1) opts=(--alpha 0.1 --synth inversion,generator); reuse=pso-a0.1 ;;
  # FedMHO: classifier and CVAE devices alternate; decoders sampled (6,000), filtered (R_th 0.8), fused
  fedmho-md-a0.1|fedmho-md-a0.3|fedmho-md-a0.5)
    opts=(--alpha "${row##*-a}" --synth decoder --fusion-mode md --cvae-preset mnist); PROFILES=laptop-cpu,wearable ;;
  fedmho-ce-a0.1|fedmho-sd-a0.1|fedmho-ce-a0.3|fedmho-sd-a0.3|fedmho-ce-a0.5|fedmho-sd-a0.5)
    mode=${row#fedmho-}; mode=${mode%%-*}
    opts=(--alpha "${row##*-a}" --synth decoder --fusion-mode "$mode" --cvae-preset mnist); PROFILES=laptop-cpu,wearable
    reuse=fedmho-md-a${row##*-a} ;;
  fedmho-pooled-a0.5)  # inversion + decoder samples, consensus labels of the classifier teachers
    opts=(--alpha 0.5 --synth inversion,decoder --cvae-preset mnist); PROFILES=laptop-cpu,wearable
    reuse=fedmho-md-a0.5 ;;
  *) opts=() ;;
esac
reuse=${REUSE:-${reuse:-}}
if [ -n "$reuse" ] && [ ! -d "runs/bench/$row/clients" ]; then
  mkdir -p "runs/bench/$row"
  cp -r "runs/bench/$reuse/clients" "runs/bench/$reuse/data" "runs/bench/$row/"
fi

run_dir="runs/bench/$row"
keep="benchmarks/results/$row"
mkdir -p "$run_dir" "$keep"
cmd=(.venv/bin/server-kit simulate --dataset mnist --data-root "$DATA_ROOT" --num-clients 10 --seed "$SEED"
     --profiles "$PROFILES" --jobs "$JOBS" --out "$run_dir" --quiet "${opts[@]}" "$@")
printf '%q ' "${cmd[@]}" > "$keep/command.txt"
echo >> "$keep/command.txt"
/usr/bin/time -v -o "$keep/time.txt" "${cmd[@]}" | tee "$keep/stdout.txt"
cp "$run_dir/results.json" "$keep/results.json"
cp "$run_dir/server/report.json" "$keep/server_report.json"
cp "$run_dir/server/pseudo_images.png" "$keep/pseudo_images.png" 2>/dev/null || true
for f in "$run_dir"/clients/*.report.json; do
  mkdir -p "$keep/clients" && cp "$f" "$keep/clients/"
done
