"""The plumbing both command lines share: the root parser, dispatch with errors as one line, argparse
types that check output paths at parse time, and the small printers.

`edge-sdk` and `server-kit` are thin: each sub-command builds a config and calls one library function.
What is left is here, once, so both CLIs word their errors, exit codes and ``--debug`` alike. Stdlib
only (no torch): ``--help`` and a usage error stay instant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NoReturn, TypeVar

from common.checks import check_output_dir, check_output_file
from common.errors import ConfigError, ToolkitError

__all__ = [
    "cli_main",
    "one_line",
    "out_dir",
    "out_file",
    "overrides",
    "print_json",
    "print_skipped",
    "root_parser",
    "with_knobs",
]

T = TypeVar("T")

# ``command(name, func, help)``: adds one sub-command that runs ``func(args)`` and returns its parser
AddCommand = Callable[[str, Callable[[argparse.Namespace], None], str], argparse.ArgumentParser]


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines of onnxruntime or torch messages) as one space."""
    return " ".join(str(text).split())


def cli_main(prog: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse, dispatch to ``args.func``, and turn toolkit and file-system errors into one line + exit
    code 2.

    Shared by both CLIs. ``--debug`` re-raises so the traceback is shown.
    """
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        args.func(args)
    except (ToolkitError, OSError) as err:  # OSError: a full disk, a path that is a file, a permission
        if args.debug:
            raise
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; rerun the same command to resume where supported", file=sys.stderr)
        return 130
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line that points at ``--help``: `server-kit aggregate`'s usage alone is 30+
    lines, which buried "the following arguments are required: bundles" at the bottom."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def out_dir(text: str) -> str:
    """argparse ``type`` of an output-directory option: checked at parse time, before any work."""
    try:
        check_output_dir(text, what="")
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err).strip()) from err
    return text


def out_file(text: str) -> str:
    """argparse ``type`` of an output-file option: checked at parse time, before any work."""
    try:
        check_output_file(text, what="")
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err).strip()) from err
    return text


def print_skipped(prog: str, skipped: Iterable[Mapping[str, str]]) -> None:
    """One stderr line per bundle a run dropped (``--on-error skip``, or a kind the command ignores)."""
    for row in skipped:
        reason = one_line(row["reason"])
        named = reason if reason.startswith(row["file"]) else f"{row['file']}: {reason}"
        print(f"{prog}: skipped {named}", file=sys.stderr)


def _add_debug(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    # Sub-commands use SUPPRESS so `prog --debug cmd` is not reset to False by the sub-parser's default.
    default = False if top else argparse.SUPPRESS
    parser.add_argument(
        "--debug", action="store_true", default=default, help="show the full traceback on errors"
    )


def print_json(obj: Any) -> None:
    """Machine-readable output on stdout: sorted keys, two-space indent (as the files we write)."""
    print(json.dumps(obj, sort_keys=True, indent=2))


def overrides(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The options the user actually gave (None means 'keep the preset's value')."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def with_knobs(config: T, args: argparse.Namespace, knobs: Mapping[str, str]) -> T:
    """``config`` (a dataclass) with every field of ``knobs`` (flag dest -> field) given on the command
    line; an option left out keeps the preset's value."""
    given = {field: getattr(args, dest) for dest, field in knobs.items() if getattr(args, dest) is not None}
    return dataclasses.replace(config, **given)  # type: ignore[type-var]


def root_parser(prog: str, description: str, *, version: str) -> tuple[argparse.ArgumentParser, AddCommand]:
    """The top-level parser of a CLI and a ``command(name, func, help)`` that adds one sub-command.

    Shared by `edge-sdk` and `server-kit` so both get ``--version``, ``--debug`` and the same dispatch.
    """
    parser = _Parser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version}")
    _add_debug(parser, top=True)
    sub = parser.add_subparsers(title="commands")

    def command(
        name: str, func: Callable[[argparse.Namespace], None], help_text: str
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        _add_debug(p)
        p.set_defaults(func=func)
        return p

    return parser, command
