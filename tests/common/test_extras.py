"""Installs: every third-party module the packages import is declared in pyproject.toml, in the extra
`common.cli.MODULE_EXTRAS` names, and nothing is declared that no package imports; a command that meets a
package its install lacks says which extra brings it."""

import ast
import re
import sys
from pathlib import Path

import pytest

from common import toml
from common.cli import MODULE_EXTRAS, PACKAGES, cli_main, missing_extra, root_parser

ROOT = Path(__file__).resolve().parents[2]
SELF = "oneshot-fl-edge"
STDLIB = sys.stdlib_module_names | {"tomllib"}  # stdlib from 3.11, where common.toml imports it


def _imported_modules() -> dict[str, str]:
    """Top-level third-party module -> one file importing it, over the toolkit's packages (not tests)."""
    found: dict[str, str] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in STDLIB and top not in PACKAGES:
                        found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def _names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9._-]+", r).group(0).lower() for r in requirements}  # type: ignore[union-attr]


def _project() -> dict:
    return toml.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def test_every_import_is_declared_where_the_table_says() -> None:
    imported = _imported_modules()
    assert set(imported) == set(MODULE_EXTRAS), (
        f"imported but not in MODULE_EXTRAS: {sorted(set(imported) - set(MODULE_EXTRAS))}; "
        f"in MODULE_EXTRAS but imported nowhere: {sorted(set(MODULE_EXTRAS) - set(imported))}"
    )
    project = _project()
    extras = project["optional-dependencies"]
    for module, (dist, where) in MODULE_EXTRAS.items():
        for extra in where or (None,):
            declared = _names(project["dependencies"] if extra is None else extras[extra])
            assert dist in declared, f"{module} ({imported[module]}) needs {dist} in {extra or 'core'}"


def test_nothing_is_declared_that_no_package_imports() -> None:
    project = _project()
    extras = project["optional-dependencies"]
    shipped = _names(project["dependencies"]) | _names(
        [r for k, v in extras.items() if k != "dev" for r in v]
    )
    assert shipped - {SELF} == {dist for dist, _ in MODULE_EXTRAS.values()}  # e.g. no onnxscript
    # server = device + evolution + its own: it runs the device pipeline for simulate
    assert {f"{SELF}[device]", f"{SELF}[evolution]"} <= set(extras["server"])


def test_a_missing_package_names_its_extra(capsys: pytest.CaptureFixture[str]) -> None:
    def needs_torchvision(_args: object) -> None:
        raise ModuleNotFoundError("No module named 'torchvision'", name="torchvision")

    parser, command = root_parser("tool", "a test CLI", version="0")
    command("grid", needs_torchvision, "draws a grid")
    assert cli_main("tool", parser, ["grid"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "tool: error: this command needs torchvision (module 'torchvision'), which this install does not "
        "have; fix: pip install 'oneshot-fl-edge[server]' ([server] brings every extra but dev)\n"
    )
    # a module of the toolkit itself missing is a packaging bug, not an install choice
    assert missing_extra(ModuleNotFoundError("x", name="edge_sdk.models")) is None
    assert "[evolution]" in str(missing_extra(ModuleNotFoundError("x", name="scipy.stats")))
