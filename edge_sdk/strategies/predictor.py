"""Evolution's accuracy predictor (HAPFNAS section 5.1) and the rank correlation that measures it."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["predictor", "rank_correlation"]


def predictor(seed: int) -> Any:
    """The unfitted accuracy predictor: a random forest with HAPFNAS's settings (section 5.1: 100 trees,
    max depth 15). One place, so the search and the benchmarks that check it fit the same model."""
    from sklearn.ensemble import RandomForestRegressor

    return RandomForestRegressor(n_estimators=100, max_depth=15, random_state=seed)


def rank_correlation(pred: np.ndarray, true: np.ndarray) -> dict[str, float | None]:
    """Spearman and Kendall of predictions against the truth (None when fewer than 3 or constant)."""
    from scipy.stats import kendalltau, spearmanr

    if len(pred) < 3 or np.ptp(true) == 0 or np.ptp(pred) == 0:
        return {"spearman": None, "kendall": None, "n": len(pred)}  # type: ignore[dict-item]
    return {
        "spearman": float(spearmanr(pred, true).statistic),
        "kendall": float(kendalltau(pred, true).statistic),
        "n": len(pred),  # type: ignore[dict-item]
    }
