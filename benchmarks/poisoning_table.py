"""The colluding-devices table of benchmarks/poisoning.sh from its rows (benchmarks/label_ablation.py's JSON).

    .venv/bin/python benchmarks/poisoning_table.py benchmarks/results/collude_{honest7,colluding3}.json

One markdown line a row: the global model's top-1 and lowest class on the real test set, the points it
loses against the first row, and the claims the checks refused (classifier and decoder claims, hostile
and honest apart; a bundle is hostile when it lies under a ``hostile*`` folder).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def refused(row: dict, kind: str) -> tuple[int, int, int, int]:
    """(hostile refused, hostile claimed, honest refused, honest claimed) for ``kind`` (classifier or
    decoder) claims: (bundle, class) pairs with a count above 0, refused by the server's checks."""
    decoders = kind == "decoder"
    paths = [p for p in row["bundles"] if p.endswith(".decoder.bundle") == decoders]
    check = row["decoder_claims" if decoders else "claims"] or {"rejected": [], "scores": []}
    hostile = [any(part.startswith("hostile") for part in Path(p).parts) for p in paths]
    out = [0, 0, 0, 0]
    for i, scores in enumerate(check["scores"]):
        base = 0 if hostile[i] else 2
        out[base + 1] += sum(score is not None for score in scores)
    for i, _ in check["rejected"]:
        out[0 if hostile[i] else 2] += 1
    return tuple(out)  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("rows", nargs="+", help="label_ablation.py outputs, the honest row first")
    args = parser.parse_args()
    print(
        "| uploads | global top-1 % | vs honest | lowest class % | classifier claims refused: hostile, "
        "honest | decoder claims refused: hostile, honest |"
    )
    print("|---|---|---|---|---|---|")
    base = None
    for path in args.rows:
        row = json.loads(Path(path).read_text(encoding="utf-8"))["default"]
        acc = 100 * row["accuracy"]
        base = acc if base is None else base
        cells = []
        for kind in ("classifier", "decoder"):
            bad, bad_all, good, good_all = refused(row, kind)
            cells.append(f"{bad}/{bad_all}, {good}/{good_all}")
        name = Path(path).stem.rsplit("_", 1)[-1]
        print(
            f"| {name} | {acc:.2f} | {acc - base:+.2f} | {100 * row['min_class_accuracy']:.1f} | "
            f"{cells[0]} | {cells[1]} |"
        )


if __name__ == "__main__":
    main()
