#!/usr/bin/env bash
# One hostile teacher among honest uploads (issue #34): `server-kit aggregate --on-error skip` on RUN's
# client bundles (classifier and decoder each) but client CLIENT's classifier (the honest round), then with
# that device uploading a bundle of benchmarks/hostile_teachers.py in its place (slow: 48 convolutions on
# one shared weight; nan: its own classifier, finite on noise and NaN on image-like inputs), each measured
# with /usr/bin/time -v. Prints accuracy, server seconds and what was skipped, one line a row.
#
#   benchmarks/hostile_round.sh RUN [CLIENT]     (CLIENT: the hostile device; default 9)
#
# Writes RUN/hostile_round/{honest,slow,nan}/ (report.json, time.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
run=${1:?usage: benchmarks/hostile_round.sh RUN [CLIENT]}
client=${2:-9}
py=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code, whatever the interpreter has installed
work="$run/hostile_round"
mkdir -p "$work"
for mode in slow nan; do
  [ -f "$work/$mode.bundle" ] || $py benchmarks/hostile_teachers.py "$run" --client "$client" --mode $mode \
    --out "$work/$mode.bundle"
done
honest=()
for path in "$run"/clients/*.bundle; do
  [ "$(basename "$path")" = "$(printf 'client_%02d.bundle' "$client")" ] || honest+=("$path")
done
for row in honest slow nan; do
  extra=()
  [ "$row" = honest ] || extra=("$work/$row.bundle")
  rm -rf "$work/$row"
  mkdir -p "$work/$row"
  /usr/bin/time -v -o "$work/$row.time.txt" $py -m server_kit.cli aggregate "${honest[@]}" "${extra[@]}" \
    --out "$work/$row" --eval "$run/data/test.npz" --on-error skip --quiet || true
  $py - "$work/$row" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
report = json.loads((out / "report.json").read_text())
wall = [line for line in (out.parent / f"{out.name}.time.txt").read_text().splitlines() if "Elapsed" in line]
print(out.name, f"accuracy {100 * report['accuracy']:.2f} %", f"server {report['seconds']['total']:.1f} s",
      f"budget {report['seconds'].get('budget', 0):.1f} s", wall[0].split(": ", 1)[1] if wall else "",
      "skipped", [(Path(s["file"]).name, s["reason"][:90]) for s in report["skipped"]])
PY
done
