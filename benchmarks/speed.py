"""Speed and memory of a whole command (issue #17): wall, CPU, peak PSS of the process tree, per phase.

    .venv/bin/python benchmarks/speed.py --out FILE.json [--busy-core N] -- COMMAND [ARG ...]

Runs COMMAND (typically `server-kit simulate ...` or `server-kit aggregate ...`), samples every process of
its tree from /proc every ``--interval`` seconds (PSS from ``smaps_rollup``: pages shared between the
workers, torch's libraries above all, are counted once, split among the processes that map them; RSS
summed too, which counts them once per process) and writes:

- ``wall_s``, ``cpu_s`` (user + system of the whole tree, from the kernel's rusage), ``peak_pss_mb`` and
  ``peak_rss_sum_mb`` (the largest per-sample sums over the tree), ``max_rss_mb`` (the largest single
  process, the number ``/usr/bin/time -v`` prints);
- ``phases``: when the command wrote a ``results.json`` (simulate) or ``report.json`` (aggregate) with a
  ``timeline`` (phase, start and end, Unix seconds), each phase's seconds, CPU seconds of the tree and
  peak PSS, and for the phases whose work is counted (``flop`` in the timeline) the achieved GFLOP/s
  and its fraction of the machine's measured peak in the precision the phase ran in: float32
  (``edge_sdk.profiling.measure_device``, the number `edge-sdk profile` writes) or bfloat16 (the same
  micro-benchmarks under autocast, :func:`edge_sdk.profiling.measure_throughput`), both taken before
  the command with all cores.

``--busy-core N`` starts a single-threaded busy loop pinned to core N for the duration of the command
(the issue's "shared machine" condition); ``--peak-gflops`` (and ``--peak-bf16-gflops``) skip the peak
measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from edge_sdk.data import client_name
from export.atomic import atomic_write_json

PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as fh:
                out += [int(p) for p in fh.read().split()]
    except OSError:
        pass
    return out


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants alive now."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += _children(p)
    return found


def _memory_kb(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in kB; (0, 0) when it is gone."""
    pss = rss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1])
    except (OSError, ValueError):
        return 0, 0
    return pss, rss


def _cpu_s(pid: int) -> float:
    """User + system seconds of one live process (its own threads, not its reaped children)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class Sampler(threading.Thread):
    """Samples the tree of ``pid``: (unix time, PSS kB, RSS kB, max single RSS kB, CPU s of live procs)."""

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int, int, int]] = []
        self.cpu: dict[int, float] = {}  # last CPU seconds seen per pid (a finished worker keeps its last)
        self.cpu_series: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            now = time.time()
            pids = tree(self.pid)
            mem = [_memory_kb(p) for p in pids]
            for p in pids:
                self.cpu[p] = max(self.cpu.get(p, 0.0), _cpu_s(p))
            self.samples.append(
                (now, sum(m[0] for m in mem), sum(m[1] for m in mem), max((m[1] for m in mem), default=0))
            )
            self.cpu_series.append((now, sum(self.cpu.values())))
            self.stop.wait(self.interval)


def _busy(core: int) -> subprocess.Popen[bytes]:
    code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def peak_gflops() -> dict[str, Any]:
    """The machine's measured peak with all its cores: float32 (what `edge-sdk profile` writes) and, where
    the CPU computes bfloat16 natively, the same micro-benchmarks in bfloat16 autocast (the peak of a run
    whose forward passes run in bf16, the ``auto`` default there)."""
    import torch

    from edge_sdk.precision import native_bf16
    from edge_sdk.profiling import measure_device, measure_throughput

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    profile = measure_device(seconds=4.0)
    bf16 = None
    if native_bf16("cpu"):
        measured = measure_throughput(seconds=4.0, precision="bf16")
        bf16 = round(min(measured["conv"], measured["matmul"]), 3)
    return {
        "gflops": profile.gflops,
        "bf16_gflops": bf16,
        "source": profile.gflops_source,
        "threads": torch.get_num_threads(),
    }


# the order the server runs its phases in, for reports written before they recorded it ("phase_order")
SERVER_ORDER = (
    "load", "inversion", "claims", "decoder", "generator", "labels", "distill", "adversarial", "fusion",
    "export", "evaluate",
)  # fmt: skip


def _windows(
    started: float, data: dict[str, Any], order: tuple[str, ...], prefix: str = ""
) -> list[dict[str, Any]]:
    """Consecutive phases from the start time and each phase's seconds (the toolkit runs them in order)."""
    seconds = data["seconds"]
    names = data.get("phase_order") or [name for name in order if name in seconds]
    rows, t = [], started
    for name in names:
        if name == "total" or name not in seconds:
            continue
        rows.append({"phase": prefix + name, "start": t, "end": t + float(seconds[name])})
        t += float(seconds[name])
    return rows


def _arch_flops(arch: str, input_shape: tuple[int, int, int]) -> int:
    from edge_sdk.models.arch import parse_arch

    return int(parse_arch(arch).cost(input_shape)[0])


def _client_flop(run_dir: Path, results: dict[str, Any], shape: tuple[int, int, int]) -> tuple[float, str]:
    """Training FLOPs of the client phase: every candidate and finalist epoch (3 x forward per sample
    trained: forward, input gradients, weight gradients), plus one forward per validation image; and the
    precision the clients trained in (``mixed`` when they differ; fp32 for reports that do not say)."""
    total = 0.0
    precisions: set[str] = set()
    for row in results["clients"]:
        name = client_name(row["client"], results["config"]["num_clients"])
        path = run_dir / "clients" / f"{name}.bundle.report.json"
        report = json.loads(path.read_text(encoding="utf-8"))
        if report.get("search") is None:
            continue  # a CVAE-only client: its small model is left out
        n_train = row["num_examples"]
        cfg = report["config"]["search"]
        n_val = round(n_train * report["config"]["val_fraction"] / (1 - report["config"]["val_fraction"]))
        subset = min(n_train, cfg["max_train_samples"] or n_train)
        precisions.add(report["config"].get("precision", "fp32"))
        for e in report["search"]["evaluations"]:
            if e["epochs"]:
                total += e["flops"] * (3 * subset * e["epochs"] + n_val)
        for f in report["finalists"]:
            flops = _arch_flops(f["arch"], shape)
            epochs = f.get("final_epochs", f.get("epochs", cfg["final_epochs"]))
            total += flops * (3 * n_train * epochs + n_val * (2 if "final_epochs" in f else 1))
    return total, (precisions.pop() if len(precisions) == 1 else "mixed")


def _server_flop(report: dict[str, Any]) -> dict[str, float]:
    """FLOPs of the counted server phases: inversion (forward + gradient to the input, 2 x forward per
    image per step), labels (every teacher's forward on every synthetic image) and distillation (3 x the
    student's forward per image per epoch)."""
    shape = tuple(report["student"]["input_shape"])
    teachers = [_arch_flops(t["arch"], shape) for t in report["teachers"]]
    cfg = report["config"]
    out = {}
    inv = cfg["inversion"]
    if report.get("synthetic_sources", {}).get("inversion"):
        out["inversion"] = 2.0 * sum(teachers) * inv["samples_per_teacher"] * inv["steps"]
    out["labels"] = float(sum(teachers)) * report["synthetic_size"]
    out["distill"] = (
        3.0
        * _arch_flops(report["student"]["arch"], shape)
        * report["distilled_samples"]
        * (cfg["distill"]["epochs"])
    )
    return out


def timeline(paths: list[Path]) -> list[dict[str, Any]]:
    """Phases (name, start, end, counted FLOPs) from a simulate ``results.json`` (with its server report)
    or an aggregate ``report.json``."""
    for path in paths:
        if not path.is_file():
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        # outputs of versions before the start time was recorded: it is when the file was written
        # minus the run's total (the results are written last)
        start = data.get("started_at", path.stat().st_mtime - data["seconds"]["total"])
        if "clients" in data:  # simulate
            run_dir = path.parent
            report = json.loads((run_dir / data["server_report"]).read_text(encoding="utf-8"))
            sec = data["seconds"]
            rows = _windows(
                start, {"seconds": {k: sec[k] for k in ("partition", "clients")}}, ("partition", "clients")
            )
            shape = tuple(report["student"]["input_shape"])
            rows[-1]["flop"], rows[-1]["precision"] = _client_flop(run_dir, data, shape)
            server_start = report.get("started_at", rows[-1]["end"])
            server = _windows(server_start, report, SERVER_ORDER, "server_")
            end = server_start + report["seconds"]["total"]
            rows += [
                *server,
                {"phase": "evaluate_clients", "start": end, "end": end + sec["evaluate_clients"]},
            ]
        else:
            report = data
            rows = server = _windows(start, report, SERVER_ORDER, "server_")
        flop = _server_flop(report)
        precision = report["config"].get("precision", "fp32")  # resolved; older reports: float32
        for row in server:
            if row["phase"].removeprefix("server_") in flop:
                row["flop"] = flop[row["phase"].removeprefix("server_")]
                row["precision"] = precision
        return rows
    return []


def _window(series: list[tuple[float, ...]], start: float, end: float) -> list[tuple[float, ...]]:
    return [s for s in series if start <= s[0] <= end]


def phase_table(sampler: Sampler, rows: list[dict[str, Any]], peak: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per phase: seconds, CPU seconds, peak PSS and, for the counted phases, GFLOP/s and the
    fraction of the measured peak of the precision the phase ran in (bf16 or fp32)."""
    table = []
    for entry in rows:
        start, end = float(entry["start"]), float(entry["end"])
        inside = _window(sampler.samples, start, end) or [
            min(sampler.samples, key=lambda s: abs(s[0] - (start + end) / 2))
        ]
        cpu = _window(sampler.cpu_series, start - sampler.interval, end + sampler.interval)
        row: dict[str, Any] = {
            "phase": entry["phase"],
            "seconds": round(end - start, 2),
            "cpu_s": round(cpu[-1][1] - cpu[0][1], 1) if len(cpu) > 1 else None,
            "peak_pss_mb": round(max(s[1] for s in inside) / 1024, 1),
        }
        if entry.get("flop"):
            gflops = entry["flop"] / max(end - start, 1e-9) / 1e9
            row["gflop"] = round(entry["flop"] / 1e9, 1)
            row["gflops"] = round(gflops, 2)
            row["precision"] = entry.get("precision", "fp32")
            top = peak.get("bf16_gflops") if row["precision"] == "bf16" else peak.get("gflops")
            if top:
                row["fraction_of_peak"] = round(gflops / top, 3)
        table.append(row)
    return table


def _decimate(sampler: Sampler) -> list[list[float]]:
    out: list[list[float]] = []
    for (t, pss, _rss, _max), (_, cpu) in zip(sampler.samples, sampler.cpu_series, strict=True):
        if not out or t - out[-1][0] >= 1.0:
            out.append([round(t, 2), round(pss / 1024, 1), round(cpu, 1)])
    return out


def markdown(path: Path, peak: dict[str, Any] | None = None) -> str:
    """The phase table of a written measurement as Markdown rows (phase | s | CPU s | peak PSS MB |
    GFLOP | GFLOP/s | precision | fraction of that precision's peak); ``peak`` overrides the recorded one
    (a file measured before the bf16 peak was taken)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    peak = peak or data["peak"]
    lines = []
    for row in data["phases"]:
        precision = row.get("precision", "fp32")
        top = peak.get("bf16_gflops") if precision == "bf16" else peak.get("gflops")
        counted = "gflops" in row
        cells = [
            row["phase"],
            f"{row['seconds']:.1f}",
            "" if row["cpu_s"] is None else f"{row['cpu_s']:.1f}",
            f"{row['peak_pss_mb']:,.0f}",
            f"{row['gflop']:,.0f}" if counted else "",
            f"{row['gflops']:.1f}" if counted else "",
            precision if counted else "",
            f"{row['gflops'] / top:.2f}" if counted and top else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    whole = f"{data['wall_s']:.1f} | {data['cpu_s']:.1f} | {data['peak_pss_mb']:,.0f}"
    total = f"| whole command | {whole} | | | | |"
    return "\n".join([*lines, total])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="measurement JSON to write (required unless --table)")
    parser.add_argument("--interval", type=float, default=0.25)
    parser.add_argument("--busy-core", type=int, default=None)
    parser.add_argument("--peak-gflops", type=float, default=None, help="fp32 peak: skip measuring the peak")
    parser.add_argument("--peak-bf16-gflops", type=float, default=None, help="bf16 peak (with --peak-gflops)")
    parser.add_argument(
        "--results", type=Path, action="append", default=[], help="results.json / report.json with a timeline"
    )
    parser.add_argument(
        "--table", type=Path, help="print the phase table of this written measurement as Markdown and exit"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.table is not None:
        given = {"gflops": args.peak_gflops, "bf16_gflops": args.peak_bf16_gflops}
        print(markdown(args.table, given if args.peak_gflops else None))
        return
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.out is None:
        parser.error("give --out and the command to measure after --")
    peak = (
        {"gflops": args.peak_gflops, "bf16_gflops": args.peak_bf16_gflops, "source": "given"}
        if args.peak_gflops
        else peak_gflops()
    )
    busy = _busy(args.busy_core) if args.busy_core is not None else None
    try:
        start = time.time()
        proc = subprocess.Popen(command)
        sampler = Sampler(proc.pid, args.interval)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.time() - start
        sampler.stop.set()
        sampler.join()
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    rc = os.waitstatus_to_exitcode(status)
    rows = timeline(args.results)
    result = {
        "command": command,
        "returncode": rc,
        "busy_core": args.busy_core,
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
        "peak_pss_mb": round(max(s[1] for s in sampler.samples) / 1024, 1),
        "peak_rss_sum_mb": round(max(s[2] for s in sampler.samples) / 1024, 1),
        "max_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "peak": peak,
        "phases": phase_table(sampler, rows, peak),
        "samples": len(sampler.samples),
        # one sample a second (unix time, tree PSS MB, tree CPU s): enough to recompute the table
        "series": _decimate(sampler),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("phases", "series")}, indent=2))
    for row in result["phases"]:
        print(row)
    sys.exit(rc)


if __name__ == "__main__":
    main()
