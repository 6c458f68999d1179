"""Turn the raw benchmark outputs under benchmarks/results/ROW/ into the markdown rows of RESULTS.md.

    .venv/bin/python benchmarks/summarize.py [ROW ...]

Every number printed is read from a file a run wrote (results.json, the /usr/bin/time -v log); nothing
is typed in by hand.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def time_log(path: Path) -> dict[str, float]:
    """Wall seconds and peak RSS (MB) from a `/usr/bin/time -v` log."""
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    out: dict[str, float] = {}
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", text)
    if wall:
        parts = [float(p) for p in wall.group(1).split(":")]
        out["wall_s"] = sum(v * 60**i for i, v in enumerate(reversed(parts)))
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if rss:
        out["peak_rss_mb"] = int(rss.group(1)) / 1024
    return out


def row(name: str) -> str:
    folder = RESULTS / name
    results = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    timing = time_log(folder / "time.txt")
    sec = results["seconds"]
    cfg = results["config"]
    clients = results["clients"]
    cand = sum(c["candidate_epochs"] for c in clients)
    server = sum(v for k, v in sec.items() if k.startswith("server_") and k != "server_total")
    report_path = folder / "server_report.json"
    report = json.loads(report_path.read_text(encoding="utf-8")) if report_path.is_file() else {}
    consensus = cfg["aggregate"].get("consensus", "mean")
    training = "hard labels" if cfg["aggregate"]["hard_labels"] else f"consensus KD ({consensus})"
    if report.get("training", "").startswith("FedMHO"):
        training = f"{report['training']} (init: {report['init']})"
    kinds = [c.get("kind", "classifier") for c in clients]
    mix = f"{kinds.count('classifier')}+{kinds.count('cvae_decoder')}"
    synth_min = sum(sec.get(f"server_{k}", 0) for k in ("inversion", "generator", "decoder")) / 60
    train_min = (sec.get("server_distill", 0) + sec.get("server_fusion", 0)) / 60
    return (
        f"| {name} | {cfg['alpha']} | {cfg['search']['strategy']} | {mix} | "
        f"{'+'.join(cfg['aggregate']['synth'])} ({results['synthetic_size']}) | {training} | "
        f"{100 * results['global_accuracy']:.2f} | "
        f"{100 * results['mean_client_test_accuracy']:.2f} | {cand} | {sec['clients'] / 60:.1f} | "
        f"{synth_min:.1f} | {train_min:.1f} | {server / 60:.1f} | "
        f"{timing.get('wall_s', float('nan')) / 60:.1f} | {timing.get('peak_rss_mb', float('nan')):.0f} |"
    )


HEADER = (
    "| row | alpha | strategy | classifier+CVAE clients | synthesis (size) | server training | "
    "global top-1 % | mean classifier-client top-1 % | candidate-epochs (all clients) | "
    "clients min | synthesis min | distill+fusion min | server min | wall min | peak RSS MB |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def personal_rows() -> None:
    """The personalization tables from results/personalize_*.json (benchmarks/personalize_mnist.py)."""
    files = sorted(RESULTS.glob("personalize_*.json"))
    if not files:
        return
    print(
        "\n| run | clients | local-only | global | finetune | pkt | kdg | "
        "seconds (finetune / pkt / kdg, all clients) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    sizes = []
    for path in files:
        data = json.loads(path.read_text(encoding="utf-8"))
        s, methods = data["summary"], ("finetune", "pkt", "kdg")
        cells = " | ".join(f"{100 * s[m]['deploy']:.2f}" for m in methods)
        secs = " / ".join(f"{s[m]['seconds_total']:.0f}" for m in methods)
        print(
            f"| {path.stem} | {len(data['clients'])} | {100 * s['local_only']:.2f} | "
            f"{100 * s['global']:.2f} | {cells} | {secs} |"
        )
        for client in data["clients"]:
            for m in methods:
                r = client[m]
                sizes.append((path.stem, client["client"], m, r))
    print(
        "\n| run | client | method | fp32 top-1 % | int8 top-1 % | kept | fp32 KB | int8 KB | "
        "fp32 ms (b1 / b64) | int8 ms (b1 / b64) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run, client, m, r in sizes:
        lat = r["latency"]
        print(
            f"| {run} | {client} | {m} | {100 * r['fp32']:.2f} | {100 * r['int8']:.2f} | {r['kept']} | "
            f"{r['size_bytes']['fp32'] / 1024:.0f} | {r['size_bytes']['int8'] / 1024:.0f} | "
            f"{lat['fp32']['batch_1_ms']:.2f} / {lat['fp32']['batch_64_ms']:.1f} | "
            f"{lat['int8']['batch_1_ms']:.2f} / {lat['int8']['batch_64_ms']:.1f} |"
        )


def main(argv: list[str]) -> None:
    names = argv or sorted(p.name for p in RESULTS.iterdir() if (p / "results.json").is_file())
    print(HEADER)
    for name in names:
        print(row(name))
    if not argv:
        personal_rows()


if __name__ == "__main__":
    main(sys.argv[1:])
