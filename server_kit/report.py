"""``report.html``: one self-contained page a person opens to see what a simulated federation did.

It is rebuilt from the files a run wrote (``results.json``, ``server/report.json``, ``data/partition.json``,
the clients' ``*.report.json``, the server's PNG grids, personalization reports under ``personal/``), never
from live objects, so ``server-kit report RUN_DIR`` redraws any finished run, one made elsewhere included.
A run directory can come from anyone: every string read from it is HTML-escaped, every number is checked
before it is drawn, grids are read only under their fixed names, and the page has no script and no
reference outside itself (figures are base64 PNG data URIs, the CSS is inline). A figure whose data the
run did not record is replaced by a one-line note, never drawn empty.

Figures are made on ``matplotlib.figure.Figure`` with the Agg canvas, never through ``pyplot``: no global
figure registry, no backend switch; text is drawn with mathtext off (``$`` in a name stays a ``$``).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.image
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from common.errors import DataError
from export.atomic import atomic_write_text
from server_kit.grid import GRID_PADDING

__all__ = ["GRIDS", "REPORT_FILE", "Run", "read_run", "render_report", "write_report"]

REPORT_FILE = "report.html"
# the server's PNG grids (server_kit.grid, one row per class) the page embeds, by fixed name only
GRIDS = {
    "pseudo_images.png": "The synthetic set the student learned from (rows: the teachers' consensus class)",
    "decoder_samples.png": "Decoder samples before the centroid filter (rows: the class they were drawn for)",
    "decoder_samples_filtered.png": "Decoder samples the centroid filter kept",
}
MAX_GRID_BYTES = 8 << 20  # a grid larger than this is not a grid the server wrote: skipped with a note
MAX_GRID_PIXELS = 4_000_000  # read from the PNG header before anything is decoded
MAX_DRAWN_CLIENTS = 200  # beyond these a figure would be unreadable (and huge): a note instead
MAX_DRAWN_CLASSES = 100
# class names of the datasets that have them beyond their index (edge_sdk.data.DATASETS)
CLASS_NAMES = {
    "fashionmnist": ("T-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                     "boot"),
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"),
}  # fmt: skip
PHASE_TOTALS = ("total", "server_total")  # sums of other phases: stated in the title, not drawn as bars
DPI = 100

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
td, th { border: 1px solid #ddd; padding: 0.2em 0.6em; text-align: left; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1em 0; } figcaption { font-size: 0.9em; color: #555; }
img { max-width: 100%; } p.note { color: #777; font-style: italic; }
pre { background: #f8f8f8; padding: 0.8em; overflow: auto; font-size: 0.8em; }
"""


@dataclass(frozen=True, kw_only=True)
class Run:
    """The files of one run directory, parsed (``None`` where a file is absent)."""

    results: dict[str, Any]
    server: dict[str, Any] | None
    partition: dict[str, Any] | None
    clients: dict[int, dict[str, Any]]  # client index -> its bundle report
    personal: list[tuple[int, str, dict[str, Any]]]  # (client, method, personalization report)
    grids: dict[str, bytes]  # GRIDS name -> PNG bytes


def write_report(run_dir: str | Path) -> Path:
    """Write ``run_dir/report.html`` from the files the run wrote; returns its path."""
    run_dir = Path(run_dir)
    return atomic_write_text(run_dir / REPORT_FILE, render_report(read_run(run_dir)))


def read_run(run_dir: Path) -> Run:
    """Parse the run's files; ``results.json`` is required, the rest is drawn where present."""
    results = _read_json(run_dir / "results.json", required=True) or {}
    clients: dict[int, dict[str, Any]] = {}
    for path in sorted((run_dir / "clients").glob("client_*.bundle.report.json")):
        index = path.name.removeprefix("client_").split(".", 1)[0]
        report = _read_json(path)
        if index.isdigit() and report is not None:
            clients[int(index)] = report
    personal = []
    for path in sorted((run_dir / "personal").glob("client_*/*/report.json")):
        index = path.parent.parent.name.removeprefix("client_")
        report = _read_json(path)
        if index.isdigit() and report is not None:
            personal.append((int(index), path.parent.name, report))
    grids = {}
    for name in GRIDS:
        path = run_dir / "server" / name
        if path.is_file() and path.stat().st_size <= MAX_GRID_BYTES:
            grids[name] = path.read_bytes()
    return Run(
        results=results,
        server=_read_json(run_dir / "server" / "report.json"),
        partition=_read_json(run_dir / "data" / "partition.json"),
        clients=clients,
        personal=personal,
        grids=grids,
    )


def _read_json(path: Path, *, required: bool = False) -> dict[str, Any] | None:
    """A JSON object, or None when the file is absent (a DataError when ``required`` or malformed)."""
    if not path.is_file():
        if required:
            raise DataError(
                f"expected the run's {path.name} at {path}, got no such file; fix: pass the output directory "
                "of a finished `server-kit simulate` run (results.json is written when it ends)"
            )
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise DataError(f"expected JSON in {path}, got {err}; fix: rerun the step that wrote it") from err
    if not isinstance(data, dict):
        raise DataError(f"expected a JSON object in {path}, got {type(data).__name__}; fix: rerun the run")
    return data


# --- values checked before they are drawn -------------------------------------------------------------------


def _number(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _numbers(value: Any) -> list[float] | None:
    """A non-empty list of finite numbers, or None."""
    if not isinstance(value, list) or not value:
        return None
    numbers = [_number(v) for v in value]
    return None if any(v is None for v in numbers) else numbers  # type: ignore[return-value]


def _series(value: Any) -> dict[str, list[float]]:
    """Named curves from a report's loss record: a list of numbers, a list of dicts of numbers (one curve
    per key) or a dict of lists; {} when it is none of these."""
    if _numbers(value) is not None:
        return {"loss": _numbers(value)}  # type: ignore[dict-item]
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        keys = sorted(set.intersection(*(set(v) for v in value)))
        columns = {str(k): _numbers([v[k] for v in value]) for k in keys}
        return {k: c for k, c in columns.items() if c is not None}
    if isinstance(value, dict):
        columns = {str(k): _numbers(v) for k, v in sorted(value.items())}
        return {k: c for k, c in columns.items() if c is not None}
    return {}


def _get(data: dict[str, Any] | None, *keys: str) -> Any:
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _class_labels(dataset: Any, num_classes: int) -> list[str]:
    names = CLASS_NAMES.get(str(dataset).lower())
    if names is not None and len(names) == num_classes:
        return [f"{c} {name}" for c, name in enumerate(names)]
    return [str(c) for c in range(num_classes)]


# --- figures ------------------------------------------------------------------------------------------------


def _png(fig: Figure) -> str:
    """The figure as a base64 PNG data URI (no software metadata: the same run gives the same bytes)."""
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    fig.clear()
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _partition_figure(run: Run, labels: list[str]) -> Figure | None:
    counts = _get(run.partition, "label_histogram")
    ok = isinstance(counts, list) and 0 < len(counts) <= MAX_DRAWN_CLIENTS
    rows = [_numbers(r) for r in counts] if ok else None
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


def _client_figure(run: Run) -> Figure | None:
    rows = run.results.get("clients")
    scored = []
    for row in rows if isinstance(rows, list) else []:
        client, accuracy = _number(_get(row, "client")), _number(_get(row, "test_accuracy"))
        if client is not None and accuracy is not None:
            scored.append((int(client), accuracy))
    if not scored or len(scored) > MAX_DRAWN_CLIENTS:
        return None
    fig = Figure(figsize=(max(4.0, 0.45 * len(scored) + 2), 3.2))
    ax = fig.add_subplot()
    ax.bar([str(k) for k, _ in scored], [a for _, a in scored], color="#8aa9c9", label="client's own model")
    for key, style, name in (
        ("global_accuracy", "-", "global model"),
        ("mean_client_test_accuracy", ":", ""),
    ):
        value = _number(run.results.get(key))
        if value is not None:
            ax.axhline(value, color="#c0392b", linestyle=style, label=name or "mean client")
    ax.set_ylim(0, 1)
    ax.set_xlabel("client")
    ax.set_ylabel("test accuracy")
    ax.legend(loc="lower right", fontsize=8)
    return fig


def _per_class_figure(run: Run, labels: list[str]) -> Figure | None:
    accuracy = _numbers(_get(run.server, "per_class_accuracy"))
    if accuracy is None or len(accuracy) != len(labels):
        return None
    fig = Figure(figsize=(max(4.0, 0.45 * len(labels) + 2), 3.0))
    ax = fig.add_subplot()
    ax.bar(labels, accuracy, color="#6c9a6c")
    overall = _number(_get(run.server, "accuracy"))
    if overall is not None:
        ax.axhline(overall, color="#c0392b", label=f"overall {overall:.3f}")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.tick_params(axis="x", rotation=45 if len(labels[0]) > 2 else 0)
    ax.set_xlabel("class")
    ax.set_ylabel("global model's test accuracy")
    return fig


def _curve_figure(curves: dict[str, list[float]], xlabel: str) -> Figure:
    fig = Figure(figsize=(6.0, 3.0))
    ax = fig.add_subplot()
    for name, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, label=name, linewidth=1.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss")
    if len(curves) > 1:
        ax.legend(fontsize=7, ncol=2)
    return fig


def _grid_figure(png: bytes, labels: list[str]) -> Figure | None:
    """The grid with its rows labelled by class, or None when it does not decode or does not have one row
    per class (the layout of server_kit.grid: rows of equal height split by GRID_PADDING pixels)."""
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


def _phase_figure(run: Run) -> Figure | None:
    seconds = run.results.get("seconds")
    order = run.results.get("phase_order")
    if not isinstance(seconds, dict):
        return None
    names = [n for n in order if isinstance(n, str) and n in seconds] if isinstance(order, list) else seconds
    bars = [(n, _number(seconds[n])) for n in names if n not in PHASE_TOTALS]
    bars = [(n, s) for n, s in bars if s is not None]
    if not bars or len(bars) > MAX_DRAWN_CLIENTS:
        return None
    fig = Figure(figsize=(6.0, 0.3 * len(bars) + 1.2))
    ax = fig.add_subplot()
    ax.barh([n for n, _ in bars][::-1], [s for _, s in bars][::-1], color="#b08fc7")
    ax.set_xlabel("seconds")
    total = _number(seconds.get("total"))
    if total is not None:
        ax.set_title(f"wall time {total:.1f} s", fontsize=9)
    return fig


def _personal_figure(run: Run) -> Figure | None:
    rows = []
    for client, method, report in run.personal:
        own = _number(_get(report, "val_accuracy_before", "own_model"))
        glob = _number(_get(report, "val_accuracy_before", "global_model"))
        after = _number(_get(report, "val_accuracy", str(report.get("kept"))))
        if own is not None and glob is not None and after is not None:
            rows.append((f"{client} {method}", own, glob, after))
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


# --- the page -----------------------------------------------------------------------------------------------


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any, digits: int = 4) -> str:
    number = _number(value)
    if number is None:
        return "" if value is None else _esc(value)
    return f"{number:.{digits}f}" if isinstance(value, float) else f"{int(value):,}"


def _cell(value: Any) -> str:
    return f'<td class="num">{_fmt(value)}</td>' if _number(value) is not None else f"<td>{_esc(value)}</td>"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _section(key: str, title: str, fig: Figure | None, caption: str, missing: str) -> str:
    """A figure (id ``fig-<key>``), or the one-line note of why there is none (id ``note-<key>``)."""
    if fig is None:
        return f'<h2>{_esc(title)}</h2><p class="note" id="note-{key}">{_esc(missing)}</p>'
    return (
        f'<h2>{_esc(title)}</h2><figure id="fig-{key}"><img alt="{_esc(title)}" src="{_png(fig)}">'
        f"<figcaption>{_esc(caption)}</figcaption></figure>"
    )


def _loss_sections(run: Run) -> Iterator[str]:
    server = run.server
    phases = (
        ("distill", "Distillation loss", _series(_get(server, "distill_loss")), "epoch"),
        ("fusion", "Fusion loss (FedMHO)", _series(_get(server, "fusion_loss")), "epoch"),
        ("generator", "Generator loss", _series(_get(server, "generator_loss")), "recorded step"),
        ("adversarial", "Adversarial rounds", _series(_get(server, "adversarial")), "round"),
    )
    for key, title, curves, xlabel in phases:
        fig = _curve_figure(curves, xlabel) if curves else None
        yield _section(f"loss-{key}", title, fig, f"per {xlabel}", f"no {title.lower()} recorded in this run")
    yield (
        '<p class="note" id="note-loss-clients">client training and CVAE: the client reports record '
        "the final losses only (the clients table), no curve</p>"
    )


def _header(run: Run) -> str:
    results, config = run.results, run.results.get("config")
    config = config if isinstance(config, dict) else {}
    seconds = results.get("seconds") if isinstance(results.get("seconds"), dict) else {}
    started = _number(results.get("started_at"))
    rows = [
        ["dataset", config.get("dataset")],
        ["clients", config.get("num_clients")],
        ["alpha", config.get("alpha")],
        ["seed", results.get("seed")],
        ["global accuracy", results.get("global_accuracy")],
        ["mean client accuracy", results.get("mean_client_test_accuracy")],
        ["synthetic samples", results.get("synthetic_size")],
        ["server training", _get(run.server, "training")],
        ["wall time (s)", seconds.get("total")],
        ["resumed clients", results.get("resumed_clients")],
        [
            "started (UTC)",
            datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds") if started else "",
        ],
    ]
    config_json = json.dumps(config, indent=2, sort_keys=True, default=str)
    return (
        f"<h1>Federation report: {_esc(config.get('dataset', '?'))}</h1>"
        + _table(["", ""], rows)
        + f"<details><summary>config (results.json)</summary><pre>{_esc(config_json)}</pre></details>"
    )


def _clients_table(run: Run) -> str:
    rows = run.results.get("clients")
    out = []
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict):
            continue
        report = run.clients.get(row.get("client")) if isinstance(row.get("client"), int) else None
        final = _get(report, "metrics")
        cvae = _get(report, "decoder", "metrics") or (final if row.get("kind") != "classifier" else None)
        seconds = row.get("seconds")
        total = (
            sum(v for v in seconds.values() if _number(v) is not None) if isinstance(seconds, dict) else None
        )
        out.append([
            row.get("client"), row.get("profile"), row.get("kind"), row.get("arch"), row.get("num_examples"),
            row.get("val_accuracy"), row.get("test_accuracy"),
            _get(final, "train_loss") if row.get("kind") == "classifier" else None,
            _get(cvae, "val_loss"), row.get("flops"), row.get("params"), total,
        ])  # fmt: skip
    header = ["client", "profile", "kind", "arch", "examples", "val acc", "test acc", "final train loss",
              "CVAE val loss", "FLOPs", "params", "seconds"]  # fmt: skip
    return _table(header, out)


def render_report(run: Run) -> str:
    """The HTML page of a parsed run."""
    dataset = _get(run.results, "config", "dataset")
    num_classes = _number(_get(run.partition, "num_classes")) or _number(
        _get(run.server, "student", "num_classes")
    )
    drawn = num_classes is not None and 0 < num_classes <= MAX_DRAWN_CLASSES
    labels = _class_labels(dataset, int(num_classes)) if drawn else []  # type: ignore[arg-type]
    parts = [_header(run), "<h2>Clients</h2>", _clients_table(run)]
    with matplotlib.rc_context({"text.parse_math": False, "font.size": 9}):
        parts += [
            _section("partition", "Partition", _partition_figure(run, labels) if labels else None,
                     "training examples per client and class (data/partition.json)",
                     "no partition manifest (data/partition.json) with one count per class "
                     f"(of at most {MAX_DRAWN_CLASSES} classes, {MAX_DRAWN_CLIENTS} clients)"),
            _section("clients", "Accuracy per client", _client_figure(run),
                     "each classifier client's own model on the test split, against the global model",
                     "no classifier client has a test accuracy (CVAE clients only)"),
            _section("per-class", "Global model per class",
                     _per_class_figure(run, labels) if labels else None,
                     "the global model's accuracy on each class of the test split (server/report.json)",
                     "the server report has no per-class accuracy (no evaluation set)"),
            *_loss_sections(run),
            "<h2>Synthetic samples</h2>",
        ]  # fmt: skip
        for name, caption in GRIDS.items():
            fig = _grid_figure(run.grids[name], labels) if name in run.grids and labels else None
            key = "grid-" + name.removesuffix(".png").replace("_", "-")
            parts.append(_section(key, name, fig, caption, f"no {name} with one row per class in server/"))
        parts += [
            _section("phases", "Time per phase", _phase_figure(run),
                     "seconds per phase, in the order they ran",
                     "results.json records no seconds per phase"),
            _section("personal", "Personalization", _personal_figure(run),
                     "local validation accuracy before (own model, global model) and after personalization",
                     "no personalization reports (personal/client_XX/METHOD/report.json)"),
        ]  # fmt: skip
    sources = _get(run.server, "synthetic_sources")
    if isinstance(sources, dict):
        parts += ["<h2>Synthetic sources</h2>", _table(["source", "samples"], sorted(sources.items()))]
    body = "\n".join(parts)
    title = f"Federation report: {_esc(dataset)}"
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{CSS}</style></head>\n<body>\n{body}\n</body></html>\n"
    )
