"""How the Flower app scales on the simulation engine (issue #21): wall time and peak memory of one
one-shot round at 10, 50 and 100 digits clients, through `flwr run` on a SuperLink started with
``--simulation`` (the path a user takes), the same tiny knobs at every size.

    python benchmarks/flower_scaling.py [--clients 10 50 100] [--out DIR] [--num-cpus 2]

Knobs (every size): digits, Dirichlet alpha 1.0, min_size 5 (100 clients of 1,347 training images),
seed 0, every client a laptop-cpu with the fixed arch C8k3-P-F10 from shared initial weights, 2 final
epochs, no decoders; server: inversion 20 samples x 5 steps per teacher, 2 distillation epochs, the default
student. Ray client resources: 1 CPU per client, ``--num-cpus`` CPUs in all (2: this machine's cores).

Wall: from `flwr run` to the end of its log stream (the SuperLink is up before; Ray starts inside the run).
Memory: the SuperLink's process tree (the SuperLink, the simulation process, Ray's daemons and workers),
sampled every 0.5 s: the peak of the summed PSS (shared pages counted once, split among the processes that
share them) and of the summed RSS (shared pages counted in every process). Each run's ServerApp results
(accuracy, phase seconds) are read from its flower_results.json. Prints one JSON line per size and writes
them to ``--out``/scaling.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

RUN_CONFIG = (
    "dataset='digits' alpha=1.0 min_size=5 seed=0 profiles='laptop-cpu' decoders=false "
    "search.strategy='fixed' search.fixed_arch='C8k3-P-F10' search.final_epochs=2 "
    "aggregate.synth='inversion' aggregate.inversion.samples_per_teacher=20 aggregate.inversion.steps=5 "
    "aggregate.inversion.batch_size=20 aggregate.distill.epochs=2 personalize=false"
)


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (by parent id, from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _memory_kb(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in kB, (0, 0) when it is gone."""
    pss = rss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="utf-8") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1])
    except OSError:
        pass
    return pss, rss


class Sampler(threading.Thread):
    """Peak summed PSS / RSS of a process tree, every ``period`` seconds until stopped."""

    def __init__(self, root: int, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.root, self.period = root, period
        self.peak_pss_kb = self.peak_rss_kb = self.peak_processes = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            pids = _descendants(self.root)
            memory = [_memory_kb(pid) for pid in pids]
            self.peak_pss_kb = max(self.peak_pss_kb, sum(m[0] for m in memory))
            self.peak_rss_kb = max(self.peak_rss_kb, sum(m[1] for m in memory))
            self.peak_processes = max(self.peak_processes, len(pids))
            self.done.wait(self.period)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--num-cpus", type=int, default=2)
    args = parser.parse_args(argv)
    out = (args.out or Path(tempfile.mkdtemp(prefix="flower-scaling-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.update(
        FLWR_HOME=str(out / "flwr-home"),
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1",
        RAY_USAGE_STATS_ENABLED="0",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    port = _free_port()
    Path(env["FLWR_HOME"]).mkdir(parents=True, exist_ok=True)
    connection = f'[superlink.localsim]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    (Path(env["FLWR_HOME"]) / "config.toml").write_text(f'[superlink]\ndefault = "localsim"\n\n{connection}')
    log = open(out / "superlink.log", "w")  # noqa: SIM115 (open for the SuperLink's whole life)
    link = subprocess.Popen(
        [BIN / "flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess",
         "--database", str(out / "superlink.db"), "--host", "127.0.0.1", "--port", str(port),
         "--disable-runtime-dependency-installation"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    rows = []
    try:
        for _ in range(120):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.5)
        for n in args.clients:
            run_dir = out / f"clients_{n}"
            shutil.rmtree(run_dir, ignore_errors=True)
            sampler = Sampler(link.pid)
            sampler.start()
            start = time.perf_counter()
            federation = (  # the fields of Flower's SimulationConfig, `-` for `_`
                f"num-supernodes={n} client-resources-num-cpus=1 client-resources-num-gpus=0.0 "
                f"init-args-num-cpus={args.num_cpus}"
            )
            done = subprocess.run(
                [BIN / "flwr", "run", str(ROOT), "localsim", "--stream",
                 "--run-config", f"{RUN_CONFIG} num_clients={n} out_dir='{run_dir}'",
                 "--federation-config", federation],
                env=env, capture_output=True, text=True, check=False,
            )  # fmt: skip
            wall = time.perf_counter() - start
            sampler.done.set()
            sampler.join()
            (out / f"flwr_run_{n}.log").write_text(done.stdout + done.stderr)
            results_path = run_dir / "flower_results.json"
            if done.returncode != 0 or not results_path.is_file():
                raise SystemExit(
                    f"{n} clients: the run failed (rc {done.returncode}); see {out}/flwr_run_{n}.log"
                )
            results = json.loads(results_path.read_text())
            row = {
                "clients": n,
                "accepted": len(results["clients"]),
                "refused": len(results["refused"]),
                "wall_s": round(wall, 1),
                "peak_pss_mb": round(sampler.peak_pss_kb / 1024),
                "peak_rss_sum_mb": round(sampler.peak_rss_kb / 1024),
                "peak_processes": sampler.peak_processes,
                "global_accuracy": results["global_accuracy"],
                "seconds": results["seconds"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        os.killpg(link.pid, signal.SIGTERM)
        try:
            link.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(link.pid, signal.SIGKILL)
        log.close()
    (out / "scaling.json").write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
