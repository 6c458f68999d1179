"""``report.html``: one self-contained page a person opens to see what a simulated federation did.

It is rebuilt from the files a run wrote (``results.json``, ``server/report.json``, ``data/partition.json``,
the clients' ``*.report.json``, the server's PNG grids, personalization reports under ``personal/``), never
from live objects, so ``server-kit report RUN_DIR`` redraws any finished run, one made elsewhere included.
A run directory can come from anyone: every string read from it is HTML-escaped, every number is checked
before it is drawn, grids are read only under their fixed names, and the page has no script and no
reference outside itself (figures are base64 PNG data URIs, the CSS is inline). A figure whose data the
run did not record is replaced by a one-line note, never drawn empty. The devices' reports are bounded in
size before they are read, and each loss curve in them (:mod:`edge_sdk.curves`) is checked before it is
drawn: a malformed one is skipped and named in a note, the other clients' curves are drawn.

The figures are :mod:`server_kit.report.figures`, drawn here with mathtext off (a ``$`` in a name stays
a ``$``).
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib.figure import Figure

from common.checks import load_json, read_regular_file
from common.configs import MAX_CONFIG_BYTES
from common.errors import DataError
from edge_sdk.curves import check_curve
from export.atomic import atomic_write_text
from server_kit.report.figures import (
    MAX_DRAWN_CLASSES,
    MAX_DRAWN_CLIENTS,
    MAX_NAMED_LINES,
    Line,
    class_labels,
    client_figure,
    clients_curve_figure,
    curve_figure,
    grid_figure,
    lookup,
    number,
    partition_figure,
    per_class_figure,
    personal_figure,
    phase_figure,
    png_uri,
    series,
)

__all__ = [
    "DEVICE_CURVES",
    "GRIDS",
    "REPORT_FILE",
    "Run",
    "device_curves",
    "read_run",
    "render_report",
    "write_report",
]

REPORT_FILE = "report.html"
# the server's PNG grids (server_kit.report.grid, one row per class) the page embeds, by fixed name only
GRIDS = {
    "pseudo_images.png": "The synthetic set the student learned from (rows: the teachers' consensus class)",
    "decoder_samples.png": "Decoder samples before the centroid filter (rows: the class they were drawn for)",
    "decoder_samples_filtered.png": "Decoder samples the centroid filter kept",
}
MAX_GRID_BYTES = 8 << 20  # a grid larger than this is not a grid the server wrote: skipped with a note
MAX_DEVICE_REPORT_BYTES = 4 << 20  # a client's or a personalization's report (tens of KB): read no more
MAX_RUN_JSON_BYTES = MAX_CONFIG_BYTES  # results.json (replayable as a --config), the server's report
# the device phases' curves (edge_sdk.curves) the page draws: phase -> (title, {term: its panel's y label});
# personalization's terms depend on its method, so its one panel is their sum, the loss it trained on
DEVICE_CURVES = {
    "search": ("Search: the best candidate's training", {"train_loss": "train loss"}),
    "classifier": ("Classifier: final training", {"train_loss": "train loss"}),
    "cvae": ("CVAE training", {"recon": "reconstruction (BCE)", "kl": "KL"}),
    "personalize": ("Personalization: on-device training", {}),
}
_YEAR_10000 = 253_402_300_800  # seconds since 1970: the first timestamp datetime cannot show
MAX_LISTED_SKIPS = 5  # malformed curves named in a note; the rest are counted

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
    results = _read_json(run_dir, run_dir / "results.json", required=True) or {}
    clients: dict[int, dict[str, Any]] = {}
    for path in sorted((run_dir / "clients").glob("client_*.bundle.report.json")):
        index = path.name.removeprefix("client_").split(".", 1)[0]
        report = _read_json(run_dir, path, limit=MAX_DEVICE_REPORT_BYTES)
        if index.isdigit() and report is not None:
            clients[int(index)] = report
    personal = []
    for path in sorted((run_dir / "personal").glob("client_*/*/report.json")):
        index = path.parent.parent.name.removeprefix("client_")
        report = _read_json(run_dir, path, limit=MAX_DEVICE_REPORT_BYTES)
        if index.isdigit() and report is not None:
            personal.append((int(index), path.parent.name, report))
    grids = {}
    for name in GRIDS:
        try:  # a grid larger than any the server writes, or a link, is not drawn
            grid = _read_file(run_dir, run_dir / "server" / name, MAX_GRID_BYTES)
        except DataError:
            grid = None
        if grid is not None:
            grids[name] = grid
    return Run(
        results=results,
        server=_read_json(run_dir, run_dir / "server" / "report.json"),
        partition=_read_json(run_dir, run_dir / "data" / "partition.json"),
        clients=clients,
        personal=personal,
        grids=grids,
    )


def _inside(run_dir: Path, path: Path) -> bool:
    """Whether ``path`` lies in ``run_dir`` with no symbolic link on the way (the run directory itself
    is the user's to give; a link inside it could point anywhere on the machine)."""
    current = run_dir
    for part in path.relative_to(run_dir).parts:
        current = current / part
        if current.is_symlink():
            return False
    return True


def _read_file(run_dir: Path, path: Path, limit: int) -> bytes | None:
    """The bytes of a regular file of at most ``limit`` bytes reached without links, None when absent;
    DataError for a link, a special file or a larger file (checked before anything is read)."""
    if not _inside(run_dir, path):
        raise DataError(
            f"expected {path} to be a regular file inside the run directory, got a symbolic link on its "
            "path; fix: replace the link by the file, the report follows no links"
        )
    if not path.exists():
        return None
    return read_regular_file(path, max_bytes=limit, what="run file", follow_links=False, error=DataError)


def _read_json(
    run_dir: Path, path: Path, *, required: bool = False, limit: int = MAX_RUN_JSON_BYTES
) -> dict[str, Any] | None:
    """A JSON object, or None when the file is absent (a DataError when ``required``, malformed, larger
    than ``limit`` bytes or not a regular file inside the run: checked before it is read)."""
    data = _read_file(run_dir, path, limit)
    if data is None:
        if required:
            raise DataError(
                f"expected the run's {path.name} at {path}, got no such file; fix: pass the output directory "
                "of a finished `server-kit simulate` run (results.json is written when it ends)"
            )
        return None
    try:
        obj = load_json(data, str(path), max_bytes=limit, error=DataError)
    except DataError as err:
        raise DataError(f"expected JSON in {path}, got {err}; fix: rerun the step that wrote it") from None
    if not isinstance(obj, dict):
        raise DataError(f"expected a JSON object in {path}, got {type(obj).__name__}; fix: rerun the run")
    return obj


# --- the page -----------------------------------------------------------------------------------------------


def _esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any, digits: int = 4) -> str:
    checked = number(value)
    if checked is None:
        return "" if value is None else _esc(value)
    return f"{checked:.{digits}f}" if isinstance(value, float) else f"{int(value):,}"


def _cell(value: Any) -> str:
    return f'<td class="num">{_fmt(value)}</td>' if number(value) is not None else f"<td>{_esc(value)}</td>"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _section(key: str, title: str, fig: Figure | None, caption: str, missing: str) -> str:
    """A figure (id ``fig-<key>``), or the one-line note of why there is none (id ``note-<key>``)."""
    if fig is None:
        return f'<h2>{_esc(title)}</h2><p class="note" id="note-{key}">{_esc(missing)}</p>'
    return (
        f'<h2>{_esc(title)}</h2><figure id="fig-{key}"><img alt="{_esc(title)}" src="{png_uri(fig)}">'
        f"<figcaption>{_esc(caption)}</figcaption></figure>"
    )


def _loss_sections(run: Run) -> Iterator[str]:
    server = run.server
    phases = (
        ("distill", "Distillation loss", series(lookup(server, "distill_loss")), "epoch"),
        ("fusion", "Fusion loss (FedMHO)", series(lookup(server, "fusion_loss")), "epoch"),
        ("generator", "Generator loss", series(lookup(server, "generator_loss")), "recorded step"),
        ("adversarial", "Adversarial rounds", series(lookup(server, "adversarial")), "round"),
    )
    for key, title, curves, xlabel in phases:
        fig = curve_figure(curves, xlabel) if curves else None
        yield _section(f"loss-{key}", title, fig, f"per {xlabel}", f"no {title.lower()} recorded in this run")


def device_curves(run: Run, phase: str) -> tuple[list[tuple[str, dict[str, list[float]]]], list[str]]:
    """(legend name, checked record) of each client report (personalization: each client and method) that
    records the phase's curve, and why each malformed one was skipped."""
    if phase == "personalize":
        sources = [(f"client {k} {str(method)[:24]}", report) for k, method, report in run.personal]
    else:
        sources = [(f"client {k} ({str(r.get('role'))[:24]})", r) for k, r in sorted(run.clients.items())]
    drawn, skipped = [], []
    for name, report in sources:
        curves = report.get("curves")
        if curves is None or (isinstance(curves, dict) and phase not in curves):
            continue  # the phase did not run there, or a report of an SDK before the curves
        try:
            if not isinstance(curves, dict):
                raise DataError(f"{name}: curves must be a dict of phases, got {type(curves).__name__}")
            drawn.append((name, check_curve(curves[phase], f"{name}: curves.{phase}")))
        except DataError as err:
            skipped.append(str(err))
    return drawn, skipped


def _device_section(run: Run, phase: str) -> str:
    """A device phase's figure (one line per client, or their median and bands), and a note naming the
    curves skipped as malformed."""
    title, terms = DEVICE_CURVES[phase]
    drawn, skipped = device_curves(run, phase)
    panels: dict[str, list[Line]] = {label: [] for label in terms.values()} or {"loss (sum of its terms)": []}
    for name, record in drawn:
        columns = {label: record[term] for term, label in terms.items() if term in record}
        if not terms:  # the loss personalization stepped on: the sum of its terms (NaN where one is)
            parts = [values for key, values in record.items() if key != "epoch"]
            columns = {"loss (sum of its terms)": [sum(v) for v in zip(*parts, strict=True)]}
        for label, values in columns.items():
            panels[label].append((name, record["epoch"], values))
    section = _section(
        f"loss-{phase}", title, clients_curve_figure(panels),
        f"per epoch, one line per {'client and method' if phase == 'personalize' else 'client (its role)'} "
        f"up to {MAX_NAMED_LINES}, beyond them the median over them with the bands of their middle half and "
        "range (the curves of the clients' reports)",
        f"no client report records a {phase} curve (of at most {MAX_DRAWN_CLIENTS} clients)",
    )  # fmt: skip
    if skipped:
        listed = "; ".join(skipped[:MAX_LISTED_SKIPS])
        more = f"; and {len(skipped) - MAX_LISTED_SKIPS} more" if len(skipped) > MAX_LISTED_SKIPS else ""
        section += (
            f'<p class="note" id="note-skipped-{phase}">skipped {len(skipped)} malformed {phase} '
            f"curve(s): {_esc(listed + more)}</p>"
        )
    return section


def _header(run: Run) -> str:
    results, config = run.results, run.results.get("config")
    config = config if isinstance(config, dict) else {}
    seconds = results.get("seconds") if isinstance(results.get("seconds"), dict) else {}
    started = number(results.get("started_at"))
    rows = [
        ["dataset", config.get("dataset")],
        ["clients", config.get("num_clients")],
        ["alpha", config.get("alpha")],
        ["seed", results.get("seed")],
        ["global accuracy", results.get("global_accuracy")],
        ["teachers' vote: mean / label-weighted / oracle", _ceilings(results)],
        ["retention (global / label-weighted vote)", lookup(results, "teachers", "retention")],
        ["mean client accuracy", results.get("mean_client_test_accuracy")],
        ["synthetic samples", results.get("synthetic_size")],
        ["server training", lookup(run.server, "training")],
        ["wall time (s)", seconds.get("total")],
        ["resumed clients", results.get("resumed_clients")],
        [
            "started (UTC)",
            datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds")
            if started is not None and 0 < started < _YEAR_10000
            else "",
        ],
    ]
    config_json = json.dumps(config, indent=2, sort_keys=True, default=str)
    return (
        f"<h1>Federation report: {_esc(config.get('dataset', '?'))}</h1>"
        + _table(["", ""], rows)
        + f"<details><summary>config (results.json)</summary><pre>{_esc(config_json)}</pre></details>"
    )


def _ceilings(results: dict[str, Any]) -> str | None:
    """The teachers' three ceilings as one cell, or None where the run measured none."""
    values = [number(lookup(results, "teachers", rule)) for rule in ("mean", "label_weighted", "oracle")]
    return None if any(v is None for v in values) else " / ".join(_fmt(v) for v in values)


def _teachers_table(run: Run, labels: list[str]) -> str:
    """Per class: the global model beside the teachers' label-weighted vote and oracle on the same test
    images, and what the server lost of the vote (a class the vote holds and the global model does not
    was lost by the server; one the vote does not hold, by the devices)."""
    teachers = lookup(run.results, "teachers")
    glob = lookup(teachers, "global_per_class")
    vote = lookup(teachers, "per_class", "label_weighted")
    oracle = lookup(teachers, "per_class", "oracle")
    if not (isinstance(glob, list) and isinstance(vote, list) and isinstance(oracle, list)):
        return ""
    rows = []
    per_class = zip(glob[:MAX_DRAWN_CLASSES], vote, oracle, strict=False)  # a class a row, as the figures
    for c, (g, v, o) in enumerate(per_class):
        g, v = number(g), number(v)
        lost = None if g is None or v is None else v - g
        rows.append([labels[c] if c < len(labels) else c, g, v, number(o), lost])
    header = ["class", "global", "label-weighted vote", "oracle", "vote - global"]
    return "<h2>Where the points go: the teachers' vote per class</h2>" + _table(header, rows)


def _clients_table(run: Run) -> str:
    rows = run.results.get("clients")
    out = []
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict):
            continue
        report = run.clients.get(row.get("client")) if isinstance(row.get("client"), int) else None
        final = lookup(report, "metrics")
        cvae = lookup(report, "decoder", "metrics") or (final if row.get("kind") != "classifier" else None)
        seconds = row.get("seconds")
        total = (
            sum(v for v in seconds.values() if number(v) is not None) if isinstance(seconds, dict) else None
        )
        out.append([
            row.get("client"), row.get("profile"), row.get("kind"), row.get("arch"), row.get("num_examples"),
            row.get("val_accuracy"), row.get("test_accuracy"),
            lookup(final, "train_loss") if row.get("kind") == "classifier" else None,
            lookup(cvae, "val_loss"), row.get("flops"), row.get("params"), total,
        ])  # fmt: skip
    header = ["client", "profile", "kind", "arch", "examples", "val acc", "test acc", "final train loss",
              "CVAE val loss", "FLOPs", "params", "seconds"]  # fmt: skip
    return _table(header, out)


def render_report(run: Run) -> str:
    """The HTML page of a parsed run."""
    results, server = run.results, run.server
    dataset = lookup(results, "config", "dataset")
    num_classes = number(lookup(run.partition, "num_classes")) or number(
        lookup(server, "student", "num_classes")
    )
    drawn = num_classes is not None and 0 < num_classes <= MAX_DRAWN_CLASSES
    labels = class_labels(dataset, int(num_classes)) if drawn else []  # type: ignore[arg-type]
    lines = {
        "global model": results.get("global_accuracy"),
        "mean client": results.get("mean_client_test_accuracy"),
    }
    parts = [_header(run), _teachers_table(run, labels), "<h2>Clients</h2>", _clients_table(run)]
    with matplotlib.rc_context({"text.parse_math": False, "font.size": 9}):
        partition = partition_figure(lookup(run.partition, "label_histogram"), labels) if labels else None
        per_class = per_class_figure(lookup(server, "per_class_accuracy"), lookup(server, "accuracy"), labels)
        phases = phase_figure(results.get("seconds"), results.get("phase_order"))
        parts += [
            _section("partition", "Partition", partition,
                     "training examples per client and class (data/partition.json)",
                     "no partition manifest (data/partition.json) with one count per class "
                     f"(of at most {MAX_DRAWN_CLASSES} classes, {MAX_DRAWN_CLIENTS} clients)"),
            _section("clients", "Accuracy per client", client_figure(results.get("clients"), lines),
                     "each classifier client's own model on the test split, against the global model",
                     "no classifier client has a test accuracy (CVAE clients only)"),
            _section("per-class", "Global model per class", per_class if labels else None,
                     "the global model's accuracy on each class of the test split (server/report.json)",
                     "the server report has no per-class accuracy (no evaluation set)"),
            *(_device_section(run, phase) for phase in ("search", "classifier", "cvae")),
            *_loss_sections(run),
            "<h2>Synthetic samples</h2>",
        ]  # fmt: skip
        for name, caption in GRIDS.items():
            fig = grid_figure(run.grids[name], labels) if name in run.grids and labels else None
            key = "grid-" + name.removesuffix(".png").replace("_", "-")
            parts.append(_section(key, name, fig, caption, f"no {name} with one row per class in server/"))
        parts += [
            _section("phases", "Time per phase", phases,
                     "seconds per phase, in the order they ran", "results.json records no seconds per phase"),
            _section("personal", "Personalization", personal_figure(run.personal),
                     "local validation accuracy before (own model, global model) and after personalization",
                     "no personalization reports (personal/client_XX/METHOD/report.json)"),
            _device_section(run, "personalize"),
        ]  # fmt: skip
    sources = lookup(server, "synthetic_sources")
    if isinstance(sources, dict):
        parts += ["<h2>Synthetic sources</h2>", _table(["source", "samples"], sorted(sources.items()))]
    body = "\n".join(parts)
    title = f"Federation report: {_esc(dataset)}"
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{CSS}</style></head>\n<body>\n{body}\n</body></html>\n"
    )
