"""The classifier pipeline of `run_client`: the search's finalists are trained and the best is bundled."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from edge_sdk.client import ClientConfig, run_client
from edge_sdk.data import load_dataset
from edge_sdk.search import SearchConfig
from export.bundle import read_bundle
from profiles import load_profile


def test_run_client_keeps_the_most_accurate_finalist(tmp_path: Path) -> None:
    data = load_dataset("digits").subset(np.arange(600))
    search = SearchConfig(particles=3, iterations=1, max_depth=5, max_train_samples=100, final_epochs=2)
    config = ClientConfig(search=search, seed=3, role="classifier")
    result = run_client(data, profile=load_profile("laptop-cpu"), config=config, out=tmp_path / "c.bundle")
    report = json.loads(result.report_path.read_text())
    rows = report["finalists"]
    assert result.search is not None and [r["arch"] for r in rows] == list(result.search.finalists)
    assert len(rows) == 3 and sum(r["chosen"] for r in rows) == 1
    chosen = next(r for r in rows if r["chosen"])
    assert chosen["val_accuracy"] == max(r["val_accuracy"] for r in rows)
    bundle = read_bundle(result.bundle_path)
    assert bundle.arch == result.arch == chosen["arch"]
    assert bundle.metrics["val_accuracy"] == chosen["val_accuracy"] and bundle.metrics["finalists"] == 3
