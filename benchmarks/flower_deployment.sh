#!/usr/bin/env bash
# The Flower app on the deployment engine, on localhost, with real processes (issue #21): one SuperLink and
# two SuperNodes (insecure mode, each its own partition of digits), then `flwr run` submits the app (a FAB
# built from this checkout) and streams its logs until the one-shot round is done; the round must write
# global.onnx and each device must keep the personalization package of the second message. Also runs the same app on the simulation engine through a SuperLink started with
# --simulation (`flwr run ... --federation-config num-supernodes=2`) and compares the two global models.
#
#   benchmarks/flower_deployment.sh [output directory]      (default: a fresh temporary directory)
#
# ENGINES="deployment" runs the first part only (tests/server_kit/test_flower.py does, with smaller knobs
# in EXTRA_RUN_CONFIG, e.g. "search.final_epochs=2 pke.train_epochs=1"), appended to both runs' --run-config.
#
# Needs the [flower] extra (flwr, ray). Nothing is read from or written to ~/.flwr: FLWR_HOME is a directory
# of the run; ports are free ones picked at start. Every process it starts is stopped on exit (by its
# process group). Output recorded in benchmarks/results/flower_deployment.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-$(dirname "$(command -v flwr || echo .venv/bin/flwr)")}
PY=${PY:-$BIN/python}
OUT=$(realpath -m "${1:-$(mktemp -d -t flower-deploy-XXXXXX)}")
mkdir -p "$OUT"
export PATH="$BIN:$PATH"
export FLWR_HOME="$OUT/flwr-home"
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 RAY_USAGE_STATS_ENABLED=0
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1  # the app runs in this environment: install nothing
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
ENGINES=${ENGINES:-deployment simulation}
EXTRA_RUN_CONFIG=${EXTRA_RUN_CONFIG:-}
mkdir -p "$FLWR_HOME"

# 4 free ports: the SuperLink's (Flower 1.42 serves its Fleet, Control and Runtime APIs over one HTTP
# port), the 2 SuperNodes' runtime APIs, the simulation SuperLink's
read -r -a PORTS <<<"$("$PY" -c '
import socket
socks = [socket.socket() for _ in range(4)]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
')"
LINK=${PORTS[0]} NODE0=${PORTS[1]} NODE1=${PORTS[2]} SIM_LINK=${PORTS[3]}

cat >"$FLWR_HOME/config.toml" <<EOF
[superlink]
default = "localhost"

[superlink.localhost]
address = "127.0.0.1:$LINK"
insecure = true

[superlink.localsim]
address = "127.0.0.1:$SIM_LINK"
insecure = true
EOF

PGIDS=()
start() {  # start "$@" in its own process group, logging to $OUT/<name>.log
  local name=$1
  shift
  setsid "$@" >"$OUT/$name.log" 2>&1 &
  PGIDS+=($!)
}
stop_all() {
  for pgid in "${PGIDS[@]}"; do kill -TERM -- "-$pgid" 2>/dev/null || true; done
  sleep 2
  for pgid in "${PGIDS[@]}"; do kill -KILL -- "-$pgid" 2>/dev/null || true; done
}
trap stop_all EXIT

wait_port() {  # wait_port PORT NAME: until something listens on 127.0.0.1:PORT (60 s at most)
  for _ in $(seq 120); do
    "$PY" -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', $1)))" && return 0
    sleep 0.5
  done
  echo "$2 did not listen on port $1 within 60 s; see $OUT/$2.log" >&2
  exit 1
}

t0=$(date +%s.%N)
echo "== deployment engine: SuperLink + 2 SuperNodes on localhost (insecure), out $OUT/deploy"
start superlink flower-superlink --insecure --isolation subprocess --database "$OUT/superlink.db" \
  --host 127.0.0.1 --port "$LINK" --disable-runtime-dependency-installation
wait_port "$LINK" superlink
for k in 0 1; do
  port_var=NODE$k
  mkdir -p "$OUT/node$k"
  start "supernode$k" flower-supernode --insecure --superlink "127.0.0.1:$LINK" --isolation subprocess \
    --host 127.0.0.1 --port "${!port_var}" --node-config "partition-id=$k num-partitions=2 work-dir='$OUT/node$k'"
done
flwr run . localhost --stream \
  --run-config "num_clients=2 out_dir='$OUT/deploy' wait_nodes_s=120.0 personalize=true $EXTRA_RUN_CONFIG" \
  2>&1 | tee "$OUT/flwr_run_deploy.log"
t1=$(date +%s.%N)
test -s "$OUT/deploy/server/global.onnx" || { echo "the round wrote no global.onnx" >&2; exit 1; }
for k in 0 1; do  # the second message: each device checked its package and kept it in its work-dir
  test -s "$OUT/node$k/personalization.package" || { echo "node $k kept no package" >&2; exit 1; }
done
echo "personalization packages kept by the devices: $(ls "$OUT"/node*/personalization.package | tr '\n' ' ')"
echo "deployment round: $("$PY" -c "print(round($t1 - $t0, 1))") s from the first process to the end of the stream"
"$PY" -c "
import json; r = json.load(open('$OUT/deploy/flower_results.json'))
print('global accuracy', r['global_accuracy'], '| clients', [c['name'] for c in r['clients']], '| refused', r['refused'], '| packages', r['packages'])
print('seconds', r['seconds'])"
[[ " $ENGINES " == *" simulation "* ]] || exit 0

echo "== simulation engine: SuperLink --simulation, 2 virtual SuperNodes, out $OUT/simulation"
t2=$(date +%s.%N)
start superlink_sim flower-superlink --insecure --simulation --isolation subprocess --database "$OUT/superlink_sim.db" \
  --host 127.0.0.1 --port "$SIM_LINK" --disable-runtime-dependency-installation
wait_port "$SIM_LINK" superlink_sim
flwr run . localsim --stream --run-config "num_clients=2 out_dir='$OUT/simulation' $EXTRA_RUN_CONFIG" \
  --federation-config "num-supernodes=2" 2>&1 | tee "$OUT/flwr_run_simulation.log"
t3=$(date +%s.%N)
test -s "$OUT/simulation/server/global.onnx" || { echo "the simulation wrote no global.onnx" >&2; exit 1; }
echo "simulation round: $("$PY" -c "print(round($t3 - $t2, 1))") s from the SuperLink start to the end of the stream"
if cmp -s "$OUT/deploy/server/global.onnx" "$OUT/simulation/server/global.onnx"; then
  echo "deployment and simulation global.onnx: byte-identical"
else
  echo "deployment and simulation global.onnx: DIFFER" >&2
  exit 1
fi
