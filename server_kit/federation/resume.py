"""What a rerun of `simulate` into the same output directory may reuse, and why not: finished clients (their
recorded resume key), the partition (its recorded settings) and the server's inversion chunks (the record of
their inputs). Each check gives a :class:`Verdict`; ``--resume strict`` refuses one whose settings differ."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.checks import differences
from common.errors import BundleError, ConfigError
from edge_sdk.artifacts import decoder_bundle_path
from export.atomic import atomic_write_json
from export.bundle import read_bundle

__all__ = [
    "Verdict",
    "client_verdict",
    "first_line",
    "named",
    "partition_verdict",
    "prepare_server",
    "refuse",
    "server_verdict",
    "uploads_of",
]

log = logging.getLogger(
    "server_kit.federation.simulate"
)  # the decisions are simulate's: logged under its name


@dataclass(frozen=True)
class Verdict:
    """Whether earlier files can be reused; if not, why (``differs``: the recorded settings that differ,
    which ``resume="strict"`` refuses; a missing or unreadable file is simply redone)."""

    reuse: bool
    reason: str = ""
    differs: tuple[str, ...] = ()


def client_verdict(bundle_path: Path, wanted: dict[str, Any]) -> Verdict:
    """A client is reused when its report (written last, atomically) records the resume key ``wanted``
    (:func:`edge_sdk.client.resume_key`, as JSON) and every bundle it names reads back cleanly."""

    report_path = bundle_path.with_name(bundle_path.name + ".report.json")
    if not report_path.is_file():
        return Verdict(False, "no finished bundle")
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
        recorded = {key: report.get(key) for key in wanted}
    except (OSError, ValueError, AttributeError) as err:
        return Verdict(False, f"unreadable report ({first_line(err)})")
    differs = differences(recorded, wanted)
    if differs:
        return Verdict(False, f"made with other settings (differs in: {named(differs)})", tuple(differs))
    paths = [bundle_path] + ([decoder_bundle_path(bundle_path)] if report.get("role") == "both" else [])
    try:
        for path in paths:
            read_bundle(path)
    except (BundleError, OSError, ValueError) as err:
        return Verdict(False, f"unreadable bundle ({first_line(err)})")
    return Verdict(True)


def named(differs: Sequence[str], shown: int = 6) -> str:
    """The differing keys for a one-line message: all of them up to ``shown``, then how many more."""
    if len(differs) <= shown:
        return str(list(differs))
    return f"{list(differs[: shown - 1])} and {len(differs) - shown + 1} more"


def first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def refuse(what: Path, verdict: Verdict) -> None:
    raise ConfigError(
        f"{what} was made with other settings (differs in: {named(verdict.differs)}), --resume strict "
        "reuses only matching files; fix: simulate into another --out, or --resume auto to redo it"
    )


def uploads_of(bundle_path: Path) -> list[Path]:
    """The bundles one finished client uploads: its classifier or decoder, and the decoder of ``both``."""
    decoder = decoder_bundle_path(bundle_path)
    report = json.loads(bundle_path.with_name(bundle_path.name + ".report.json").read_text(encoding="utf-8"))
    return [bundle_path, decoder] if report.get("role") == "both" else [bundle_path]


def partition_verdict(data_dir: Path, wanted: dict[str, Any], names: Sequence[str], resume: str) -> Verdict:
    """``data_dir`` is reused when ``partition.json`` records the partition settings ``wanted`` and every
    file of ``names`` is there; ``resume="off"`` partitions again."""

    manifest = data_dir / "partition.json"
    if resume == "off":
        return Verdict(False, "--resume off")
    if not manifest.is_file():
        return Verdict(False, "no earlier partition")
    try:
        recorded = json.loads(manifest.read_text(encoding="utf-8"))
        differs = differences({key: recorded.get(key) for key in wanted}, wanted)
    except (OSError, ValueError, AttributeError) as err:
        return Verdict(False, f"unreadable manifest ({first_line(err)})")
    if differs:
        return Verdict(False, f"made with other settings (differs in: {named(differs)})", tuple(differs))
    missing = [name for name in names if not (data_dir / name).is_file()]
    return Verdict(False, f"missing {missing}") if missing else Verdict(True)


def server_verdict(record: Path, key: dict[str, Any], resume: str) -> Verdict:
    """Whether the inversion chunks beside ``record`` were made from ``key``. Other uploads are not a
    setting ``strict`` refuses: the clients passed their own check, so they are clients this run redid."""
    if resume == "off":
        return Verdict(False, "--resume off")
    try:
        recorded = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        return Verdict(False, f"no readable record of its inputs ({first_line(err)})")
    differs = differences(recorded, key)
    if not differs:
        return Verdict(True)
    settings = tuple(d for d in differs if d.split(".")[0] != "uploads")
    return Verdict(False, f"made from other inputs (differs in: {named(differs)})", settings)


def prepare_server(server_dir: Path, key: dict[str, Any], resume: str) -> None:
    """Keep ``server_dir/synthetic/`` only when ``server_dir/inputs.json`` records ``key``; otherwise redo
    it, or with ``strict`` refuse it when its settings differ (chunks without a record, from older code,
    ``strict`` leaves to the inversion's own check). The record is written before the server runs, so the
    chunks a killed server leaves behind are those of the inputs it names."""

    work, record = server_dir / "synthetic", server_dir / "inputs.json"
    if work.exists() and resume == "strict" and not record.exists():
        log.info(
            "server: kept the inversion chunks in %s (no record of their inputs): the inversion checks", work
        )
    elif work.exists():
        verdict = server_verdict(record, key, resume)
        if verdict.reuse:
            log.info("server: reused the inversion chunks in %s (same inputs)", work)
        elif resume == "strict" and verdict.differs:
            refuse(work, verdict)
        else:
            log.info("server: redone the inversion chunks in %s: %s", work, verdict.reason)
            shutil.rmtree(work)
    server_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(record, key)
