"""Score rules for choosing among the finalists on the curves of ``finalist_curves.py`` (issue #31).

    .venv/bin/python benchmarks/finalist_rules.py CURVES.json [CURVES.json ...]

Each rule runs the halving's rungs on the recorded validation numbers (three finalists, the best half
going on after each decision epoch) and keeps one finalist; its score is that finalist's accuracy on the
client's test distribution after the whole training, against CNN1 trained alone as ``--strategy fixed``
trains it. The rules: ``flops`` (the one-standard-error rule, cheapest FLOPs first: the rule before the
incumbent), ``incumbent`` (:func:`edge_sdk.halving.rank_finalists` with the warm start, today's),
``accuracy`` (no standard error, the most accurate), each deciding after the epochs of today's rungs and
after twice as many. "both fit": the clients whose profile admits CNN1 as it is.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from edge_sdk.data import load_client_data
from edge_sdk.halving import halving_rungs, rank_finalists
from edge_sdk.models.arch import build_model
from edge_sdk.models.zoo import CNN1
from edge_sdk.profiling import fits, profile_model
from edge_sdk.strategies.pso import PSOConfig
from profiles import load_profile

RULES = ("flops", "incumbent", "accuracy")


def _rows(finalists: list[dict[str, Any]], alive: list[int], epoch: int) -> list[dict[str, Any]]:
    return [
        {
            "val_loss": finalists[i]["val"][epoch - 1][0],
            "val_accuracy": finalists[i]["val"][epoch - 1][1],
            "flops": finalists[i]["flops"],
            "params": finalists[i]["params"],
            "train_memory_bytes": finalists[i]["train_memory_bytes"],
        }
        for i in alive
    ]


def choose(rule: str, client: dict[str, Any], decisions: list[int]) -> int:
    """The finalist ``rule`` keeps, deciding after each epoch of ``decisions`` (the last one final)."""
    finalists = client["finalists"]
    warm = client.get("incumbent")
    alive = list(range(len(finalists)))
    # how many go on after each decision: the halving's own rung sizes, one at the end
    rungs = halving_rungs(len(finalists), len(decisions), PSOConfig().finalist_keep)
    goes_on = [n for n, _ in rungs[1:]] + [1]
    assert len(goes_on) == len(decisions), (len(finalists), decisions)
    for epoch, keep in zip(decisions, goes_on, strict=True):
        rows = _rows(finalists, alive, epoch)
        if rule == "accuracy":
            order = sorted(range(len(rows)), key=lambda i: (-rows[i]["val_accuracy"], rows[i]["val_loss"], i))
        else:
            inc = alive.index(warm) if rule == "incumbent" and warm in alive else None
            order = rank_finalists(rows, client["n_val"], inc)
        alive = [alive[j] for j in order][:keep]
    return alive[0]


def _incumbent(client: dict[str, Any]) -> int | None:
    """The warm start among the finalists: CNN1, or CNN1 with its widths halved (the search's narrowing)."""
    for i, f in enumerate(client["finalists"]):
        layers = f["arch"].split("-")
        if len(layers) == 5 and layers[1::2] == ["P", "P"] and layers[4] == "F10":
            c1, c2 = layers[0], layers[2]
            if c1.endswith("k5") and c2.endswith("k5") and 2 * int(c1[1:-2]) == int(c2[1:-2]):
                return i
    return None


def _shape(run_dir: str) -> tuple[int, int, int]:
    return load_client_data(Path(run_dir) / "data" / "test.npz").input_shape


def _cnn1_fits(profile: str, shape: tuple[int, int, int]) -> bool:
    """Whether the client's profile admits CNN1 as it is (the table's "both fit")."""
    return fits(profile_model(build_model(CNN1, shape, 10), shape), load_profile(profile)) is None


def _with_memory(client: dict[str, Any], shape: tuple[int, int, int]) -> dict[str, Any]:
    """The client with each finalist's training memory (the rule's third cost; curves recorded before it
    was a finalist row's field do not hold it)."""
    finalists = [
        f | {"train_memory_bytes": profile_model(build_model(f["arch"], shape, 10), shape).train_memory_bytes}
        for f in client["finalists"]
    ]
    return client | {"finalists": finalists}


def main(argv: list[str]) -> None:
    clients = []
    for path in argv:
        curves = json.loads(Path(path).read_text())
        shape = _shape(curves["run_dir"])
        clients += [
            _with_memory(c, shape) | {"cnn1_fits": _cnn1_fits(c["profile"], shape)} for c in curves["clients"]
        ]
    clients.sort(key=lambda c: c["client"])
    plans = {"today's rungs": [3, 5], "twice as late": [5, 10]}
    table: dict[tuple[str, str], list[tuple[float, bool]]] = {}
    for c in clients:
        c["incumbent"] = _incumbent(c)
        fixed = c["cnn1"]["test"][-1][1]
        both = c["cnn1_fits"]
        for plan, decisions in plans.items():
            for rule in RULES:
                kept = c["finalists"][choose(rule, c, decisions)]
                table.setdefault((plan, rule), []).append((kept["test"][-1][1] - fixed, both))
                accuracy = kept["test"][-1][1]
                print(f"client {c['client']:02d} {plan:14s} {rule:9s} {kept['arch']:45s} {accuracy:.4f}")
    for (plan, rule), diffs in table.items():
        fit = [d for d, both in diffs if both]
        print(
            f"{plan:14s} {rule:9s} vs CNN1: all {100 * sum(d for d, _ in diffs) / len(diffs):+.2f} points, "
            f"both fit {100 * sum(fit) / max(1, len(fit)):+.2f} ({len(fit)} clients)"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
