"""The figures of ``report.html`` (server_kit.report.html), each drawn from values checked first: a figure
function returns None when its values are absent, malformed or too many to draw, and the page says so.

Figures are ``matplotlib.figure.Figure`` objects on the Agg canvas, never made through ``pyplot``: no global
figure registry, no backend switch. The caller draws them under mathtext off (``text.parse_math``), so a
``$`` in a name read from a run stays a ``$``.
"""

from __future__ import annotations

import base64
import io
import math
import struct
from typing import Any

import matplotlib.image
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

from common.checks import is_number
from server_kit.report.grid import GRID_PADDING

__all__ = [
    "MAX_DRAWN_CLASSES", "MAX_DRAWN_CLIENTS", "MAX_NAMED_LINES", "Line", "class_labels", "client_figure",
    "clients_curve_figure", "curve_figure", "grid_figure", "lookup", "number", "numbers", "partition_figure",
    "per_class_figure", "personal_figure", "phase_figure", "png_uri", "series",
]  # fmt: skip

MAX_GRID_PIXELS = 4_000_000  # read from the PNG header before anything is decoded
MAX_DRAWN_CLIENTS = 200  # beyond these a figure would be unreadable (and huge): a note instead
MAX_DRAWN_CLASSES = 100
# a curve figure draws up to these clients as lines named in its legend; beyond, the median over the
# clients and the bands of their middle half and range (100 named lines are a tangle nobody can read)
MAX_NAMED_LINES = 10
LOG_SCALE_RATIO = 20.0  # a panel whose positive values span this factor or more gets a log y axis
# class names of the datasets that have them beyond their index (edge_sdk.data.DATASETS)
CLASS_NAMES = {
    "fashionmnist": ("T-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                     "boot"),
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"),
}  # fmt: skip
PHASE_TOTALS = ("total", "server_total")  # sums of other phases: stated in the title, not drawn as bars
DPI = 100


MAX_DRAWN = 1e15  # |value| of anything drawn or printed: past it matplotlib's axis maths and time
# conversions overflow (1e308 is a finite float), and no count, loss or time of a run comes near it


def number(value: Any) -> float | None:
    """A finite int or float of at most :data:`MAX_DRAWN` in size as float, else None (a bool is no
    number here; nor is an int past float range, which ``float`` would raise on)."""
    if not is_number(value) or not -MAX_DRAWN <= value <= MAX_DRAWN:
        return None
    return float(value)


def numbers(value: Any) -> list[float] | None:
    """A non-empty list of finite numbers, or None."""
    if not isinstance(value, list) or not value:
        return None
    checked = [number(v) for v in value]
    return None if any(v is None for v in checked) else checked  # type: ignore[return-value]


def series(value: Any) -> dict[str, list[float]]:
    """Named curves from a report's loss record: a list of numbers, a list of dicts of numbers (one curve
    per key) or a dict of lists; {} when it is none of these."""
    if numbers(value) is not None:
        return {"loss": numbers(value)}  # type: ignore[dict-item]
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        keys = sorted(set.intersection(*(set(v) for v in value)))
        columns = {str(k): numbers([v[k] for v in value]) for k in keys}
        return {k: c for k, c in columns.items() if c is not None}
    if isinstance(value, dict):
        columns = {str(k): numbers(v) for k, v in sorted(value.items())}
        return {k: c for k, c in columns.items() if c is not None}
    return {}


def lookup(data: dict[str, Any] | None, *keys: str) -> Any:
    """``data[k1][k2]...``, or None where a level is missing or no dict (a run's files may be partial)."""
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def class_labels(dataset: Any, num_classes: int) -> list[str]:
    """Row and tick labels: the index, and the class name for the datasets whose names are not indices."""
    names = CLASS_NAMES.get(str(dataset).lower())
    if names is not None and len(names) == num_classes:
        return [f"{c} {name}" for c, name in enumerate(names)]
    return [str(c) for c in range(num_classes)]


def png_uri(fig: Figure) -> str:
    """The figure as a base64 PNG data URI (no software metadata: the same run gives the same bytes)."""
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    fig.clear()
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def partition_figure(counts: Any, labels: list[str]) -> Figure | None:
    """Heatmap of examples per client (rows) and class (columns), counts written in small ones."""
    ok = isinstance(counts, list) and 0 < len(counts) <= MAX_DRAWN_CLIENTS
    rows = [numbers(r) for r in counts] if ok else None
    if not rows or any(r is None or len(r) != len(labels) for r in rows):
        return None
    fig = Figure(figsize=(max(4.0, 0.5 * len(labels) + 2), max(2.5, 0.35 * len(rows) + 1.5)))
    ax = fig.add_subplot()
    image = ax.imshow(rows, aspect="auto", cmap="Blues")
    fig.colorbar(image, ax=ax, label="examples")
    ax.set_xticks(range(len(labels)), labels, rotation=45 if len(labels[0]) > 2 else 0, ha="right")
    ax.set_yticks(range(len(rows)), [str(k) for k in range(len(rows))])
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    if len(rows) * len(labels) <= 400:
        peak = max(max(r) for r in rows) or 1.0  # type: ignore[type-var]
        for k, row in enumerate(rows):
            for c, n in enumerate(row):  # type: ignore[arg-type]
                color = "white" if n > 0.6 * peak else "black"
                ax.text(c, k, f"{n:g}", ha="center", va="center", fontsize=7, color=color)
    return fig


def client_figure(rows: Any, lines: dict[str, Any]) -> Figure | None:
    """Each classifier client's test accuracy (results.json's rows), with ``lines`` (name -> accuracy)."""
    scored = []
    for row in rows if isinstance(rows, list) else []:
        client, accuracy = number(lookup(row, "client")), number(lookup(row, "test_accuracy"))
        if client is not None and accuracy is not None:
            scored.append((int(client), accuracy))
    if not scored or len(scored) > MAX_DRAWN_CLIENTS:
        return None
    fig = Figure(figsize=(max(4.0, 0.45 * len(scored) + 2), 3.2))
    ax = fig.add_subplot()
    ax.bar([str(k) for k, _ in scored], [a for _, a in scored], color="#8aa9c9", label="client's own model")
    for (name, value), style in zip(lines.items(), ("-", ":", "--"), strict=False):
        if number(value) is not None:
            ax.axhline(value, color="#c0392b", linestyle=style, label=name)
    ax.set_ylim(0, 1)
    ax.set_xlabel("client")
    ax.set_ylabel("test accuracy")
    ax.legend(loc="lower right", fontsize=8)
    return fig


def per_class_figure(per_class: Any, overall: Any, labels: list[str]) -> Figure | None:
    """The global model's accuracy per class, with its overall accuracy as a line."""
    accuracy = numbers(per_class)
    if accuracy is None or len(accuracy) != len(labels):
        return None
    fig = Figure(figsize=(max(4.0, 0.45 * len(labels) + 2), 3.0))
    ax = fig.add_subplot()
    ax.bar(labels, accuracy, color="#6c9a6c")
    overall = number(overall)
    if overall is not None:
        ax.axhline(overall, color="#c0392b", label=f"overall {overall:.3f}")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.tick_params(axis="x", rotation=45 if len(labels[0]) > 2 else 0)
    ax.set_xlabel("class")
    ax.set_ylabel("global model's test accuracy")
    return fig


def curve_figure(curves: dict[str, list[float]], xlabel: str) -> Figure:
    fig = Figure(figsize=(6.0, 3.0))
    ax = fig.add_subplot()
    for name, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, label=name, linewidth=1.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss")
    if len(curves) > 1:
        ax.legend(fontsize=7, ncol=2)
    return fig


Line = tuple[str, list[float], list[float]]  # (legend name, epochs, values; NaN where not recorded)


def clients_curve_figure(panels: dict[str, list[Line]]) -> Figure | None:
    """Per-epoch curves of many clients, one panel per term (keyed by its y label): a named line per client
    up to :data:`MAX_NAMED_LINES` (the same color for a client in every panel, one legend), beyond them
    the median over the clients at each epoch with the bands of their middle half and of their range.
    None when no panel has a line, or a panel has more than :data:`MAX_DRAWN_CLIENTS`."""
    panels = {label: lines for label, lines in panels.items() if lines}
    if not panels or any(len(lines) > MAX_DRAWN_CLIENTS for lines in panels.values()):
        return None
    named = max(len(lines) for lines in panels.values()) <= MAX_NAMED_LINES
    fig = Figure(figsize=(3.6 * len(panels) + 1.8, 3.0), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (ylabel, lines) in zip(axes, panels.items(), strict=True):
        if named:
            for name, epochs, values in lines:
                ax.plot(epochs, values, label=name, linewidth=1.2, marker="o" if len(epochs) <= 3 else None,
                        markersize=3)  # fmt: skip
        else:
            _bands(ax, lines)
        finite = [v for _, _, values in lines for v in values if math.isfinite(v)]
        if finite and min(finite) > 0 and max(finite) >= LOG_SCALE_RATIO * min(finite):
            ax.set_yscale("log")  # ticks as plain numbers: the default's are mathtext, which is off
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        epochs = sorted({e for _, x, _ in lines for e in x})
        if len(epochs) == 1:  # one epoch: a tick at it, not a range of fractions around it
            ax.set_xlim(epochs[0] - 1, epochs[0] + 1)
            ax.set_xticks(epochs)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), frameon=False)
    return fig


def _bands(ax: Axes, lines: list[Line]) -> None:
    """The median of the clients' values at each epoch, the band of their middle half and of their range."""
    at: dict[float, list[float]] = {}
    for _, epochs, values in lines:
        for epoch, value in zip(epochs, values, strict=True):
            if math.isfinite(value):
                at.setdefault(epoch, []).append(value)
    epochs = sorted(at)
    if not epochs:
        return
    low, q1, median, q3, high = np.array([np.quantile(at[e], [0, 0.25, 0.5, 0.75, 1]) for e in epochs]).T
    color = "#4c72b0"
    if len(epochs) == 1:  # a band of one epoch has no width: drawn as bars across the values
        ax.vlines(epochs, low, high, color=color, alpha=0.3, linewidth=8, label="range")
        ax.vlines(epochs, q1, q3, color=color, alpha=0.6, linewidth=8, label="middle half")
    else:
        ax.fill_between(epochs, low, high, color=color, alpha=0.15, linewidth=0, label="range")
        ax.fill_between(epochs, q1, q3, color=color, alpha=0.35, linewidth=0, label="middle half")
    marker = "o" if len(epochs) <= 3 else None
    ax.plot(epochs, median, color=color, linewidth=1.4, marker=marker, markersize=4,
            label=f"median of {len(lines)} clients")  # fmt: skip


def grid_figure(png: bytes, labels: list[str]) -> Figure | None:
    """The grid with its rows labelled by class, or None when it does not decode or does not have one row
    per class (the layout of server_kit.report.grid: rows of equal height split by GRID_PADDING pixels)."""
    if not png.startswith(b"\x89PNG\r\n\x1a\n") or len(png) < 24:
        return None
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk comes first
    if width * height > MAX_GRID_PIXELS:
        return None
    try:
        image = matplotlib.image.imread(io.BytesIO(png), format="png")
    except (OSError, ValueError, SyntaxError):
        return None
    height, width = image.shape[:2]
    if (height - GRID_PADDING) % len(labels) != 0:
        return None
    pitch = (height - GRID_PADDING) / len(labels)  # one class row plus its padding
    scale = max(1.0, 360 / height)
    fig = Figure(figsize=(width * scale / DPI + 1.2, height * scale / DPI + 0.3))
    ax = fig.add_subplot()
    ax.imshow(image, interpolation="nearest")
    ax.set_yticks([GRID_PADDING / 2 + (c + 0.5) * pitch for c in range(len(labels))], labels, fontsize=8)
    ax.set_xticks([])
    return fig


def phase_figure(seconds: Any, order: Any) -> Figure | None:
    """Seconds per phase in the order they ran (results.json's ``seconds`` and ``phase_order``)."""
    if not isinstance(seconds, dict):
        return None
    names = [n for n in order if isinstance(n, str) and n in seconds] if isinstance(order, list) else seconds
    bars = [(n, number(seconds[n])) for n in names if n not in PHASE_TOTALS]
    bars = [(n, s) for n, s in bars if s is not None]
    if not bars or len(bars) > MAX_DRAWN_CLIENTS:
        return None
    fig = Figure(figsize=(6.0, 0.3 * len(bars) + 1.2))
    ax = fig.add_subplot()
    ax.barh([n for n, _ in bars][::-1], [s for _, s in bars][::-1], color="#b08fc7")
    ax.set_xlabel("seconds")
    total = number(seconds.get("total"))
    if total is not None:
        ax.set_title(f"wall time {total:.1f} s", fontsize=9)
    return fig


def personal_figure(reports: list[tuple[int, str, dict[str, Any]]]) -> Figure | None:
    """Local validation accuracy before (own model, global model) and after, per (client, method) report."""
    rows = []
    for client, method, report in reports:
        own = number(lookup(report, "val_accuracy_before", "own_model"))
        glob = number(lookup(report, "val_accuracy_before", "global_model"))
        after = number(lookup(report, "val_accuracy", str(report.get("kept"))))
        if own is not None and glob is not None and after is not None:
            rows.append((f"client {client} {method}", own, glob, after))
    if not rows or len(rows) > MAX_DRAWN_CLIENTS:
        return None
    fig = Figure(figsize=(max(4.0, 0.8 * len(rows) + 2), 3.2))
    ax = fig.add_subplot()
    width = 0.27
    for i, (name, color) in enumerate(
        (("own model", "#8aa9c9"), ("global", "#c9a78a"), ("personal", "#6c9a6c"))
    ):
        ax.bar([x + (i - 1) * width for x in range(len(rows))], [r[i + 1] for r in rows], width, label=name,
               color=color)  # fmt: skip
    ax.set_xticks(range(len(rows)), [r[0] for r in rows], rotation=30, ha="right")
    ax.set_ylim(0, 1)
    ax.set_ylabel("local validation accuracy")
    ax.legend(fontsize=8, loc="lower right")
    return fig
