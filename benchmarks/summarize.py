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


def _label_rule(aggregate: dict) -> str:
    """The label rule of an aggregate config (older results recorded only ``consensus``)."""
    if "labels" not in aggregate:
        return aggregate.get("consensus", "mean")
    labels = aggregate["labels"]
    extras = [name for name in ("mask", "drop_mismatch") if labels.get(name)]
    return "+".join([labels["rule"], *extras])


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
    rule = _label_rule(cfg["aggregate"])
    training = "hard labels" if cfg["aggregate"]["hard_labels"] else f"consensus KD ({rule})"
    if report.get("training", "").startswith("FedMHO"):
        training = f"{report['training']} (init: {report['init']})"
    kinds = [c.get("kind", "classifier") for c in clients]
    mix = f"{kinds.count('classifier')}+{kinds.count('cvae_decoder')}"
    synth_min = sum(sec.get(f"server_{k}", 0) for k in ("inversion", "generator", "decoder")) / 60
    train_min = (sec.get("server_distill", 0) + sec.get("server_fusion", 0)) / 60
    # synth None (the default since the decoders): the sources the server report says it ran
    synth = cfg["aggregate"]["synth"] or list(report.get("synthetic_sources", {})) or ["auto"]
    return (
        f"| {name} | {cfg['alpha']} | {cfg['search']['strategy']} | {mix} | "
        f"{'+'.join(synth)} ({results['synthetic_size']}) | {training} | "
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
    methods = ("finetune", "pkt", "kdg")
    print(
        "\n| run | clients | local-only | global | finetune | pkt | kdg | "
        "seconds per client (finetune / pkt / kdg) | PKE seconds (all clients) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    runs = []
    for path in files:
        data = json.loads(path.read_text(encoding="utf-8"))
        s, n = data["summary"], len(data["clients"])
        cells = " | ".join(f"{100 * s[m]['deploy']:.2f}" for m in methods)
        secs = " / ".join(f"{s[m]['seconds_total'] / n:.0f}" for m in methods)
        print(
            f"| {path.stem} | {n} | {100 * s['local_only']:.2f} | {100 * s['global']:.2f} | {cells} | "
            f"{secs} | {data['pke_seconds']:.0f} |"
        )
        runs.append((path.stem, data["clients"]))
    print(
        "\n| run | method | fp32 top-1 % | int8 top-1 % | int8 kept | fp32 KB | int8 KB | "
        "fp32 ms (batch 1 / 64) | int8 ms (batch 1 / 64) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for run, clients in runs:
        for m in methods:
            rs = [c[m] for c in clients]

            def mean(get, rs=rs) -> float:
                return sum(get(r) for r in rs) / len(rs)

            print(
                f"| {run} | {m} | {100 * mean(lambda r: r['fp32']):.2f} | "
                f"{100 * mean(lambda r: r['int8']):.2f} | "
                f"{sum(r['kept'] == 'int8' for r in rs)}/{len(rs)} | "
                f"{mean(lambda r: r['size_bytes']['fp32']) / 1024:.0f} | "
                f"{mean(lambda r: r['size_bytes']['int8']) / 1024:.0f} | "
                f"{mean(lambda r: r['latency']['fp32']['batch_1_ms']):.2f} / "
                f"{mean(lambda r: r['latency']['fp32']['batch_64_ms']):.1f} | "
                f"{mean(lambda r: r['latency']['int8']['batch_1_ms']):.2f} / "
                f"{mean(lambda r: r['latency']['int8']['batch_64_ms']):.1f} |"
            )


# FedMHO Table 4, MNIST, 10 clients (5 classifier + 5 CVAE): FedMHO (ce), FedMHO-MD, FedMHO-SD
FEDMHO_PAPER = {
    "0.1": {"ce": 88.48, "md": 91.22, "sd": 91.55},
    "0.3": {"ce": 92.43, "md": 93.98, "sd": 94.25},
    "0.5": {"ce": 93.45, "md": 95.71, "sd": 95.67},
}


def fedmho_rows() -> None:
    """Ours beside FedMHO's Table 4 for every fedmho-{ce,md,sd}-aX row that has results."""
    print("\n| alpha | FedMHO (ce): ours / paper | FedMHO-MD: ours / paper | FedMHO-SD: ours / paper |")
    print("|---|---|---|---|")
    for alpha, paper in FEDMHO_PAPER.items():
        cells = []
        for mode in ("ce", "md", "sd"):
            path = RESULTS / f"fedmho-{mode}-a{alpha}" / "results.json"
            ours = (
                f"{100 * json.loads(path.read_text(encoding='utf-8'))['global_accuracy']:.2f}"
                if path.is_file()
                else "not run"
            )
            cells.append(f"{ours} / {paper[mode]:.2f}")
        print(f"| {alpha} | " + " | ".join(cells) + " |")


def edge_rows() -> None:
    """Searched model vs CNN1 per client, from results/edge_vs_fixed_*final*.json (finalists shown)."""
    rows = []
    for path in sorted(RESULTS.glob("edge_vs_fixed_*final*.json")):
        rows += json.loads(path.read_text(encoding="utf-8"))["clients"]
    if not rows:
        return
    print(
        "\n| client | profile | CNN1 fits | finalists (val top-1 %, * = bundled) | searched top-1 % | "
        "CNN1 top-1 % | MFLOPs | candidate-epochs | final-training epochs | search s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: r["client"]):
        s, f = r["searched"], r["fixed_cnn1"]
        finals = "<br>".join(
            f"`{x['arch']}` {100 * x['val_accuracy']:.2f}{' *' if x['chosen'] else ''}"
            for x in s["finalists"]
        )
        print(
            f"| {r['client']} | {r['profile']} | {'yes' if r['cnn1_fits'] else 'no'} | {finals} | "
            f"{100 * s['accuracy']:.2f} | {100 * f['accuracy']:.2f} | {s['flops'] / 1e6:.1f} | "
            f"{s['candidate_epochs']} | {s['final_training_epochs']} | {s['search_seconds']:.0f} |"
        )
    fit = [r for r in rows if r["cnn1_fits"]]
    for name, group in (("all clients", rows), ("clients where CNN1 fits", fit)):
        searched = sum(r["searched"]["accuracy"] for r in group) / len(group)
        fixed = sum(r["fixed_cnn1"]["accuracy"] for r in group) / len(group)
        better = sum(r["searched"]["accuracy"] > r["fixed_cnn1"]["accuracy"] for r in group)
        worse = sum(r["searched"]["accuracy"] < r["fixed_cnn1"]["accuracy"] for r in group)
        print(
            f"\n{name} ({len(group)}): searched {100 * searched:.2f} % vs CNN1 {100 * fixed:.2f} %; "
            f"searched better on {better}, worse on {worse}, equal on {len(group) - better - worse}"
        )


def hapfnas_rows() -> None:
    """Proxy-vs-scratch rank correlation and evolution-vs-PSO rows from results/hapfnas_*.json."""
    for path in sorted(RESULTS.glob("hapfnas_*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        sn = data["supernet"]
        print(
            f"\n{path.stem}: supernet {sn['steps']} steps on {sn.get('data', 'synthetic')} "
            f"({sn['inputs']} images) in {sn['seconds']:.0f} s"
        )
        pvs = data.get("proxy_vs_scratch")
        if pvs:
            print(
                f"\nproxy vs scratch ({len(pvs['subnets'])} subnets, client {pvs['client']}, "
                f"{pvs['scratch_epochs']} scratch epochs): Spearman {pvs['spearman']:.3f}, "
                f"Kendall {pvs['kendall']:.3f}\n"
            )
            print("| subnet | MFLOPs | proxy top-1 % | proxy s | scratch top-1 % | scratch s |")
            print("|---|---|---|---|---|---|")
            for r in pvs["subnets"]:
                print(
                    f"| `{r['spec']}` | {r['flops'] / 1e6:.1f} | {100 * r['proxy_accuracy']:.2f} | "
                    f"{r['proxy_seconds']:.1f} | {100 * r['scratch_accuracy']:.2f} | "
                    f"{r['scratch_seconds']:.0f} |"
                )
        pred = data.get("predictor")
        if pred:
            print(
                f"\npredictor (random forest, 100 trees, depth 15), {pred['folds']}-fold out-of-fold on "
                f"{pred['specs']} proxy-scored subnets of client {pred['client']}: Spearman "
                f"{pred['spearman']:.3f}, Kendall {pred['kendall']:.3f} ({pred['seconds']:.0f} s)"
            )
        rows = data.get("evolution_vs_pso", [])
        if rows:
            print(
                "\n| client | profile | PSO arch | PSO top-1 % | PSO cand-epochs | PSO search s | "
                "evolution arch | evolution top-1 % | evolution cand-epochs | evolution search s | "
                "evolution device s (search + final training) | evolution MFLOPs | "
                "predictor held-out Spearman / Kendall |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
            for r in rows:
                pso, evo = r["pso"], r["evolution"]
                held = evo.get("predictor_heldout") or {}
                corr = (
                    f"{held['spearman']:.3f} / {held['kendall']:.3f} (n={held['n']})"
                    if held.get("spearman") is not None
                    else "n/a"
                )
                print(
                    f"| {r['client']} | {r['profile']} | `{pso['arch']}` | {100 * pso['accuracy']:.2f} | "
                    f"{pso['candidate_epochs']} | {pso['search_seconds']:.0f} | `{evo['arch']}` | "
                    f"{100 * evo['accuracy']:.2f} | {evo['candidate_epochs']} | "
                    f"{evo['search_seconds']:.0f} | {evo['seconds']:.0f} | "
                    f"{evo['flops'] / 1e6:.1f} | {corr} |"
                )


def label_rows() -> None:
    """The label-skew ablation tables from results/label_ablation_*.json and poisoning_*.json
    (benchmarks/label_ablation.py): one row per variant, with the teacher ensemble's ceilings."""
    files = sorted(RESULTS.glob("label_ablation_*.json")) + sorted(RESULTS.glob("poisoning_*.json"))
    if not files:
        return
    print(
        "\n| file | variant | global top-1 % | lowest class % | per-class % | kept / made | "
        "claims rejected | ceilings: mean / label-weighted / oracle % | seconds (synthesis, labels, "
        "distill, adversarial) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for path in files:
        data = json.loads(path.read_text(encoding="utf-8"))
        ceil = data.get("ceilings", {})
        ceilings = " / ".join(
            f"{100 * ceil[k]:.2f}" for k in ("mean", "label_weighted", "oracle") if k in ceil
        )
        for name, r in data.items():
            if name == "ceilings":
                continue
            per_class = " ".join(f"{100 * a:.0f}" for a in r["per_class_accuracy"])
            labels = r["labels"]
            made = sum(labels.get("made_per_class", [])) or "-"
            claims = r.get("claims")
            rejected = "off" if claims is None else str(len(claims["rejected"]))
            sec = r["seconds"]
            secs = ", ".join(
                f"{sec.get(k, 0):.0f}" for k in ("synthesis", "labels", "distill", "adversarial")
            )
            print(
                f"| {path.stem} | {name} | {100 * r['accuracy']:.2f} | {100 * r['min_class_accuracy']:.1f} | "
                f"{per_class} | {labels.get('kept', '-')} / {made} | {rejected} | {ceilings} | {secs} |"
            )


def main(argv: list[str]) -> None:
    names = argv or sorted(p.name for p in RESULTS.iterdir() if (p / "results.json").is_file())
    print(HEADER)
    for name in names:
        print(row(name))
    if not argv:
        fedmho_rows()
        personal_rows()
        edge_rows()
        hapfnas_rows()
        label_rows()


if __name__ == "__main__":
    main(sys.argv[1:])
