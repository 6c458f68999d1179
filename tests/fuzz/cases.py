"""What a fuzz case is and what came out of it: case ids, the plan of a run, results and their table.

A case is (file kind, mutator, seed, index); its id ``kind:mutator:seed:index`` rebuilds the same mutant
anywhere (``benchmarks/fuzz.py --replay ID``). Outcomes: ``ok`` (accepted), ``refused`` (a
ToolkitError), and the failures :data:`FAILURES` (see :mod:`tests.fuzz.runner`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from tests.fuzz import seeds as seeds_module
from tests.fuzz.mutators import MUTATORS

__all__ = ["FAILURES", "OUTCOMES", "Case", "Result", "as_dict", "format_table", "plan"]

FAILURES = ("crash", "hang", "memory", "signal", "leak", "unrefused", "harness")
OUTCOMES = ("ok", "refused", *FAILURES)


@dataclass(frozen=True)
class Case:
    kind: str
    mutator: str
    seed: int
    index: int

    @property
    def id(self) -> str:
        return f"{self.kind}:{self.mutator}:{self.seed}:{self.index}"

    @classmethod
    def parse(cls, text: str) -> Case:
        kind, mutator, seed, index = text.split(":")
        return cls(kind, mutator, int(seed), int(index))


def plan(count: int, seed: int, kinds: Iterable[str] = seeds_module.KINDS) -> list[Case]:
    """``count`` cases, round-robin over every (kind, mutator) pair: balanced, and case ids do not depend
    on ``count`` (a longer run extends a shorter one)."""
    pairs = [(k, m.name) for m in MUTATORS.values() for k in kinds if k in m.kinds]
    return [Case(*pairs[i % len(pairs)], seed, i // len(pairs)) for i in range(count)]


@dataclass
class Result:
    case: str
    kind: str
    mutator: str
    outcome: str
    note: str = ""
    error_type: str = ""
    message: str = ""
    where: str = ""  # last traceback line: the frame that raised
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    secret_opened: bool = False
    secret_in_output: bool = False
    must_refuse: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def format_table(results: list[Result], by: str = "mutator") -> str:
    """Plain-text outcome counts: one row per ``by`` value ("mutator", "kind" or "pair" = kind:mutator)."""
    rows: dict[str, dict[str, int]] = {}
    for r in results:
        key = f"{r.kind}:{r.mutator}" if by == "pair" else str(getattr(r, by))
        rows.setdefault(key, dict.fromkeys(OUTCOMES, 0))[r.outcome] += 1
    width = max([len(by), 5, *map(len, rows)])
    short = [o[:9] for o in OUTCOMES]
    lines = [f"{by:<{width}} " + " ".join(f"{o:>9}" for o in short)]
    for name in sorted(rows):
        lines.append(f"{name:<{width}} " + " ".join(f"{rows[name][o]:>9}" for o in OUTCOMES))
    totals = {o: sum(row[o] for row in rows.values()) for o in OUTCOMES}
    lines.append(f"{'total':<{width}} " + " ".join(f"{totals[o]:>9}" for o in OUTCOMES))
    return "\n".join(lines)


def as_dict(result: Result) -> dict[str, Any]:
    return asdict(result)
