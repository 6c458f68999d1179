"""The README stays a manual: short, plain sentences, nothing outside the repository, and the two commands a
newcomer runs first (CI runs the same test command, and the Python example binds to the real signatures)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 200
MAX_SENTENCE_WORDS = 60
DEMO, TEST = "./run demo", "./run test"


def _text() -> str:
    return README.read_text(encoding="utf-8")


def _fenced(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def _prose_units(text: str) -> list[str]:
    """Paragraphs, bullets, table rows and headings outside code blocks, each a run of joined lines."""
    prose = re.sub(r"^```.*?^```", "\n", text, flags=re.MULTILINE | re.DOTALL)
    units: list[str] = []
    current: list[str] = []
    for line in prose.splitlines():
        stripped = line.strip()
        starts_unit = not stripped or stripped.startswith(("#", "|", "- ", "* ", "!["))
        if starts_unit and current:
            units.append(" ".join(current))
            current = []
        if stripped.startswith(("#", "|", "![")):
            units.append(stripped)
        elif stripped:
            current.append(stripped)
    if current:
        units.append(" ".join(current))
    return units


def sentences(text: str) -> list[str]:
    """The README's sentences: each prose unit split after ".", "!" or "?" followed by a space."""
    return [s for unit in _prose_units(text) for s in re.split(r"(?<=[.!?])\s+", unit) if s.strip()]


def test_readme_is_at_most_200_lines() -> None:
    lines = _text().count("\n")
    assert lines <= MAX_LINES, f"README.md has {lines} lines, expected <= {MAX_LINES}: move detail to docs/"


def test_no_sentence_is_over_60_words() -> None:
    long = [s for s in sentences(_text()) if len(s.split()) > MAX_SENTENCE_WORDS]
    assert not long, f"sentences over {MAX_SENTENCE_WORDS} words (split them): {long}"


def test_sentence_splitter_sees_a_long_sentence() -> None:
    # the check above would pass on anything if the splitter cut too eagerly
    text = "Intro line.\n\n" + " ".join(["word"] * 61) + ".\n\n```bash\n" + " ".join(["x"] * 80) + "\n```\n"
    assert [len(s.split()) for s in sentences(text)] == [2, 61]


def test_no_path_outside_the_repository() -> None:
    found = re.findall(r"\.\./\S*", _text())
    assert not found, f"paths outside the repository in README.md: {found}; use a path inside it"


def test_the_two_commands_come_first_and_ci_runs_the_test_command() -> None:
    head = "\n".join(_text().splitlines()[:12])
    assert DEMO in head and TEST in head, f"README.md must open with `{DEMO}` and `{TEST}`"
    assert TEST in (ROOT / ".ci" / "run").read_text(encoding="utf-8"), f".ci/run must call `{TEST}`"
    run = (ROOT / "run").read_text(encoding="utf-8")
    assert "\n  demo)" in run and "\n  test)" in run, "./run must handle demo and test"


def _python_example() -> ast.Module:
    blocks = [body for lang, body in _fenced(_text()) if lang == "python"]
    assert len(blocks) == 1, f"expected one python block in README.md, got {len(blocks)}"
    code = blocks[0]
    assert len([line for line in code.splitlines() if line.strip()]) <= 10, (
        "the Python API example is ten lines"
    )
    return ast.parse(code)


def test_python_example_binds_to_the_real_functions() -> None:
    """Every imported name exists and every call of one binds to its signature (running the example is a
    whole federation: too slow for a unit test; the report records the run)."""
    tree = _python_example()
    imported = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module or "")
            for alias in node.names:
                imported[alias.asname or alias.name] = getattr(module, alias.name)
    assert imported, "the example imports nothing"
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    checked = 0
    for call in calls:
        target = imported.get(call.func.id)
        if target is None:
            continue
        signature = inspect.signature(target)
        signature.bind(*[None] * len(call.args), **{kw.arg: None for kw in call.keywords if kw.arg})
        checked += 1
    assert checked >= 5, f"expected the example to call the toolkit at least five times, got {checked}"
