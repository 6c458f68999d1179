"""Fuzzing every reader with mutated bundles, packages, supernets and weights files (issue #16), and
issue #34's boundaries: hostile but well-formed wire maps, config files, shared initial weights, Flower
task fields and run directories (:mod:`tests.fuzz.hostile`).

A few hundred cases (``FUZZ_CASES``, default 264 = 2 per kind x mutator pair; ``FUZZ_SEED``, ``FUZZ_JOBS``)
run in forked children; no case may crash outside ToolkitError, hang past 10 s, go over 2x the honest
peak RSS, touch the planted secret, or be accepted when it must be refused. Failures name the case id:
replay one with ``python benchmarks/fuzz.py --replay <id>``. The harness is tested first, so a quiet
fuzz run means the readers held, not that the harness saw nothing.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

from common.errors import BundleError
from export.bundle import bundle_from_bytes
from export.package import package_from_bytes
from tests.fuzz import consumers as consumers_module
from tests.fuzz.cases import FAILURES, Case, Result, format_table, plan
from tests.fuzz.mutators import MUTATORS, make_mutant, rewrite
from tests.fuzz.onnx_mutators import SECRET_NAME
from tests.fuzz.runner import Runner
from tests.fuzz.seeds import KINDS
from tests.fuzz.wire import encode_map

CASES = int(os.environ.get("FUZZ_CASES", "264"))
SEED = int(os.environ.get("FUZZ_SEED", "0"))
JOBS = int(os.environ.get("FUZZ_JOBS", "2"))


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    fuzz = Runner(tmp_path_factory.mktemp("fuzz"))
    fuzz.calibrate()
    return fuzz


@pytest.fixture(scope="module")
def results(runner: Runner) -> list[Result]:
    started = time.monotonic()
    out = list(runner.run(plan(CASES, SEED), jobs=JOBS))
    print(f"\n{len(out)} fuzz cases in {time.monotonic() - started:.0f} s\n{format_table(out)}")
    return out


# ------------------------------------------------------------------------------ the harness itself


def test_mutants_are_deterministic_and_distinct(runner: Runner, tmp_path: Path) -> None:
    for name, mutator in MUTATORS.items():
        seed_file = runner.seed_files[mutator.kinds[0]]
        first = make_mutant(seed_file, name, 7, 0, tmp_path)
        assert make_mutant(seed_file, name, 7, 0, tmp_path) == first, name
        others = {make_mutant(seed_file, name, 7, i, tmp_path).data for i in range(1, 6)}
        assert others - {first.data}, f"{name}: five more indices gave the same file"


def test_rewritten_files_read_as_valid(runner: Runner) -> None:
    """Both re-encoding paths (public writer, raw map + detected hash) give files the readers accept:
    otherwise every field mutant would be refused at the hash check and test nothing behind it."""
    for kind, read in (("classifier", bundle_from_bytes), ("package", package_from_bytes)):
        seed_file = runner.seed_files[kind]
        assert rewrite(seed_file, {("seed",): 5}) != seed_file.data
        assert read(rewrite(seed_file, {("seed",): 5})).seed == 5
        assert read(encode_map({**seed_file.wire, "seed": 6}, seed_file.scheme)).seed == 6
        with pytest.raises(BundleError):  # and a stale hash is still caught: the scheme is not vacuous
            read(encode_map({**seed_file.wire, "seed": 6}, type(seed_file.scheme)(())))


def _probe(kind: str) -> consumers_module.Consumer:
    """Consumers that misbehave on purpose, one per outcome the runner must tell apart."""

    def consume(path: Path, seeds: object, workdir: Path) -> list[bytes]:
        if kind == "hang":  # a hang burns CPU; a sleeping one is caught by the wall backstop
            while True:
                pass
        if kind == "crash":
            raise KeyError("not a ToolkitError")
        if kind == "memory":
            return [bytes(1 << 40)]  # 1 TiB: over any cap
        if kind == "leak":
            return [(workdir / SECRET_NAME).read_bytes()]
        if kind == "signal":
            os.kill(os.getpid(), 11)
        raise BundleError("refused on purpose")

    return consume


def test_runner_tells_every_outcome_apart(runner: Runner, monkeypatch: pytest.MonkeyPatch) -> None:
    probes = ["hang", "crash", "memory", "leak", "signal", "refused"]
    monkeypatch.setattr(runner, "timeout_s", 1.0)
    got = {}
    for probe in probes:
        monkeypatch.setitem(consumers_module.CONSUMERS, "weights", _probe(probe))
        (result,) = runner.run([Case("weights", "truncate", 0, 0)])
        got[probe] = result.outcome
    assert got == {p: p for p in probes}


# --------------------------------------------------------------------------------------- the fuzzing


def _causes(failed: list[Result]) -> str:
    """One line per cause (outcome, error type, raising frame) with its count and one replayable id."""
    groups: dict[tuple[str, str, str], list[Result]] = defaultdict(list)
    for r in failed:
        groups[(r.outcome, r.error_type, r.where)].append(r)
    lines = []
    for (outcome, error, where), rs in sorted(groups.items(), key=lambda item: -len(item[1])):
        first = rs[0]
        lines.append(
            f"{len(rs):4d} x {outcome} {error} at {where or '?'}: {first.message[:160]!r} "
            f"(e.g. {first.case}: {first.note})"
        )
    return "\n".join(lines)


@pytest.mark.parametrize("kind", KINDS)
def test_no_reader_crashes_hangs_bloats_or_leaks(results: list[Result], kind: str) -> None:
    mine = [r for r in results if r.kind == kind]
    assert mine, f"no {kind} cases were planned"
    failed = [r for r in mine if r.outcome in FAILURES]
    assert not failed, f"{len(failed)} of {len(mine)} {kind} cases failed:\n{_causes(failed)}"


def test_external_data_is_refused_in_every_form(results: list[Result]) -> None:
    external = [r for r in results if r.mutator == "onnx_external_data"]
    assert len(external) >= 6, "too few external-data cases to cover the location forms"
    bad = [r for r in external if r.outcome != "refused"]
    assert not bad, f"{len(bad)} of {len(external)} external-data mutants not refused:\n{_causes(bad)}"


def test_honest_peak_memory_is_measured(runner: Runner) -> None:
    """The cap is only meaningful if the honest runs were measured (a consumer that imports nothing
    still holds the parent's pages, > 50 MB with torch loaded)."""
    assert set(runner.budgets) == set(KINDS)
    assert all(b.rss_cap_kb > 2 * 50 * 1024 for b in runner.budgets.values())
