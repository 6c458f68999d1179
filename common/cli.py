"""The plumbing both command lines share: the root parser, dispatch with errors as one line and their exit
codes, logging, ``--format``, argparse types that check output paths at parse time, and the small printers.

`edge-sdk` and `server-kit` are thin: each sub-command builds a config, calls one library function and
returns an :class:`Output`. What is left is here, once, so both CLIs word their errors, exit codes,
``--debug``, ``--format`` and ``--verbose`` / ``--quiet`` alike. Stdlib only (no torch): the top-level
``--help`` stays instant; a sub-command's options, generated from its config classes
(:mod:`common.config_args`), are built only when that command is parsed, which imports its library.

Exit codes: 0 success; 2 a usage error (argparse, or a ``ConfigError``: an option, a preset, a profile or a
config file the command cannot take, nothing ran); 1 a runtime error (any other ``ToolkitError``, an
``OSError``, a third-party package the install lacks (the line names the extra that brings it), or an
unexpected exception: "internal error"); 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from common.checks import check_output_dir, check_output_file
from common.errors import ConfigError, ToolkitError

__all__ = [
    "EXIT_RUNTIME",
    "EXIT_USAGE",
    "MODULE_EXTRAS",
    "PACKAGES",
    "Output",
    "cli_main",
    "configure_logging",
    "expert",
    "json_text",
    "missing_extra",
    "one_line",
    "out_dir",
    "out_file",
    "print_json",
    "print_skipped",
    "renamed_option",
    "root_parser",
]

EXIT_RUNTIME = 1  # the command ran and failed: bad data or bundle, an I/O error, a bug
EXIT_USAGE = 2  # the command cannot run as given: fix the options (argparse's own code for its errors)
# the toolkit's packages: each logs to logging.getLogger(<package>), configured once by cli_main
PACKAGES = ("common", "profiles", "export", "edge_sdk", "server_kit")

_logger = logging.getLogger("common")


@dataclass(frozen=True)
class Output:
    """A command's result: ``data`` (JSON-able; printed by ``--format json`` as one object, sorted keys)
    and ``text`` (today's human lines, ``--format text``). Commands return it instead of printing so
    both formats carry the same facts and nothing reaches stdout before the command has succeeded."""

    data: Mapping[str, Any]
    text: Sequence[str]


# ``command(name, func, help, build)``: adds one sub-command that runs ``func(args)``; ``build(parser)``
# adds its options when the command is parsed (or its help shown), not before: a command's options come
# from its config classes, whose modules import torch. A command returns its Output (or None)
Command = Callable[[argparse.Namespace], "Output | None"]
Build = Callable[[argparse.ArgumentParser], None]
AddCommand = Callable[..., argparse.ArgumentParser]


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines of onnxruntime or torch messages) as one space."""
    return " ".join(str(text).split())


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler on the ``sys.stderr`` of the moment, not the one at configuration time (pytest's capsys
    swaps it per test; an embedding program may too)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ assigns it; the property wins
        pass


def configure_logging(prog: str, level: int) -> None:
    """Every toolkit package logs through one stderr handler as ``prog: message`` at ``level``.

    Idempotent (a second call replaces the handler), so calling ``main(argv)`` twice in one process does
    not print each line twice. The root logger is left alone: torch's and onnx's loggers are theirs.
    """
    formatter = logging.Formatter(f"{prog}: %(message)s")
    for name in PACKAGES:
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
            logger.removeHandler(handler)
        handler = _StderrHandler()
        handler.setFormatter(formatter)
        logger.addHandler(handler)
        logger.setLevel(level)


def _level(args: argparse.Namespace) -> int:
    if getattr(args, "verbose", False):
        return logging.DEBUG
    return logging.WARNING if getattr(args, "quiet", False) else logging.INFO


def _emit(output: Output, fmt: str) -> None:
    if fmt == "json":
        print_json(output.data)
    else:
        for line in output.text:
            print(line)


# third-party module -> (its distribution, the pyproject.toml extras that install it; () for the core): a
# command that meets one missing names the extra to install (tests/common/test_extras.py holds this table
# equal to what the packages import and to pyproject.toml)
MODULE_EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "msgpack": ("msgpack", ()),
    "tomli": ("tomli", ()),
    "jsonargparse": ("jsonargparse", ()),
    "yaml": ("pyyaml", ()),
    "torch": ("torch", ("device",)),
    "numpy": ("numpy", ("device",)),
    "onnx": ("onnx", ("device",)),
    "google": ("protobuf", ("device",)),
    "onnxruntime": ("onnxruntime", ("device",)),
    "safetensors": ("safetensors", ("device",)),
    "tqdm": ("tqdm", ("device",)),
    "PIL": ("pillow", ("device",)),
    "sklearn": ("scikit-learn", ("evolution",)),
    "scipy": ("scipy", ("evolution",)),
    "torchvision": ("torchvision", ("server",)),
    "matplotlib": ("matplotlib", ("server",)),
    "flwr": ("flwr", ("flower",)),
    "executorch": ("executorch", ("mobile",)),
    "coremltools": ("coremltools", ("mobile",)),
    "litert_torch": ("litert-torch", ("tflite",)),
    "ai_edge_litert": ("ai-edge-litert", ("tflite",)),
}


def missing_extra(err: BaseException) -> str | None:
    """One line for a third-party package this install lacks (what is missing, the extra to install), or
    None when ``err`` is not that (a missing module of the toolkit itself is a bug, not an install)."""
    if not isinstance(err, ModuleNotFoundError) or not err.name:
        return None
    module = err.name.split(".")[0]
    if module not in MODULE_EXTRAS:
        return None
    dist, extras = MODULE_EXTRAS[module]
    if not extras:
        fix = "reinstall oneshot-fl-edge (it is a core dependency)"
    else:
        fix = f"pip install 'oneshot-fl-edge[{extras[0]}]' ([server] brings every extra but dev)"
    return f"this command needs {dist} (module {module!r}), which this install does not have; fix: {fix}"


def cli_main(prog: str, parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    """Parse, dispatch to ``args.func``, print its :class:`Output` in ``--format``, and turn every error
    into one stderr line and an exit code (see the module docstring); ``--debug`` re-raises instead so
    the traceback is shown.

    Shared by both CLIs. A ``ConfigError`` is a usage error wherever it is raised: configs validate when
    they are built, before any work, and a profile or config file named on the command line is part of
    the command.
    """
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return EXIT_USAGE
    configure_logging(prog, _level(args))
    try:
        output = args.func(args)
    except ConfigError as err:
        if args.debug:
            raise
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except (ToolkitError, OSError) as err:  # OSError: a full disk, a path that is a file, a permission
        if args.debug:
            raise
        print(f"{prog}: error: {one_line(err)}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; rerun the same command to resume where supported", file=sys.stderr)
        return 130
    except Exception as err:  # a bug: one line that says how to see more, never a bare traceback
        if args.debug:
            raise
        missing = missing_extra(err)
        if missing is not None:
            print(f"{prog}: error: {missing}", file=sys.stderr)
            return EXIT_RUNTIME
        detail = f"{type(err).__name__}: {one_line(err)}"
        print(f"{prog}: internal error: {detail}; rerun with --debug for the traceback", file=sys.stderr)
        return EXIT_RUNTIME
    if output is not None:
        _emit(output, args.format)
    return 0


def expert(action: argparse.Action) -> argparse.Action:
    """Marks an option as one for experts: ``--help-all`` lists it, ``--help`` does not (a command
    generated from its configs has a hundred options, which buried the ten most people need)."""
    action.expert = True  # type: ignore[attr-defined]  # read by _Parser.format_help
    return action


class _Renamed(argparse.Action):
    """An option that was renamed: refused with one line naming the new one (hidden from the help)."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str, **kwargs: Any) -> None:
        super().__init__(
            option_strings,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            nargs="?",
            help=argparse.SUPPRESS,
        )
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        old = "/".join(self.option_strings)
        parser.error(f"{old} was renamed: expected {self.new}, got {old}; fix: use {self.new}")


def renamed_option(parser: Any, old: str, new: str) -> argparse.Action:
    """Adds ``old``, an option renamed ``new``, to ``parser`` (or an argument group): given, it is
    refused with one line naming ``new`` (one name per meaning across both CLIs)."""
    return parser.add_argument(old, action=_Renamed, new=new)  # type: ignore[no-any-return]


class _HelpAll(argparse.Action):
    """``--help-all``: the help with the expert options too."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        assert isinstance(parser, _Parser)
        parser.print_help(every=True)
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line that points at ``--help``: `server-kit aggregate`'s usage alone is 30+
    lines, which buried "the following arguments are required: bundles" at the bottom.

    A sub-command's options are added by its ``build`` the first time it parses or shows its help, so
    ``server-kit --help`` and the other commands do not import the config classes (and torch)."""

    build: Build | None = None

    def complete(self) -> argparse.ArgumentParser:
        """This parser with its options added (``build`` run once)."""
        build, self.build = self.build, None
        if build is not None:
            build(self)
            if self.usage is None:  # one option per config field: too many for the usage line
                words = [
                    f"{a.dest} [{a.dest} ...]" if a.nargs == "+" else a.dest
                    for a in self._actions
                    if not a.option_strings and a.dest != argparse.SUPPRESS
                ]
                self.usage = " ".join(["%(prog)s [options]", *words])
        return self

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        return super(_Parser, self.complete()).parse_known_args(args, namespace)

    def format_help(self, every: bool = False) -> str:
        """The help; options marked :func:`expert` only when ``every`` (``--help-all``)."""
        self.complete()
        hidden = [] if every else [a for a in self._actions if getattr(a, "expert", False)]
        shown = [(action, action.help) for action in hidden]
        epilog = self.epilog
        if hidden:
            self.epilog = f"--help-all also lists {len(hidden)} options for experts."
        for action in hidden:
            action.help = argparse.SUPPRESS
        try:
            return super().format_help()
        finally:
            self.epilog = epilog
            for action, text in shown:
                action.help = text

    def print_help(self, file: Any = None, every: bool = False) -> None:
        self._print_message(self.format_help(every), sys.stdout if file is None else file)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see {self.prog} --help\n")


class _HelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each option's default where it has one of its own; a ``None`` default means "the
    preset's value", which the option's help already says (argparse's ArgumentDefaultsHelpFormatter
    would print "(default: None)")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            action.option_strings
            and not any(default is v for v in (None, False, argparse.SUPPRESS))  # 0 == False: `is`
            and "default" not in text
            and not isinstance(action, argparse._VersionAction | argparse._HelpAction)
        ):
            text += " (default: %(default)s)"
        return text


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


def print_skipped(skipped: Iterable[Mapping[str, str]]) -> None:
    """One warning line on stderr per bundle a run dropped (``--on-error skip``, or a kind the command
    ignores): shown under ``--quiet`` too, since the result was made without it."""
    for row in skipped:
        reason = one_line(row["reason"])
        named = reason if reason.startswith(row["file"]) else f"{row['file']}: {reason}"
        _logger.warning("skipped %s", named)


def _add_common(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``--debug``, ``--format``, ``--verbose`` / ``--quiet``, on the root and on every sub-command.

    Sub-commands default to SUPPRESS so ``prog --debug cmd`` is not reset by the sub-parser's default.
    """

    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS

    parser.add_argument("--help-all", action=_HelpAll, help="show every option, the expert ones too")
    parser.add_argument(
        "--debug", action="store_true", default=default(False), help="show the full traceback on errors"
    )
    parser.add_argument(
        "--format",
        choices=["text", "json"],
        default=default("text"),
        help="stdout: text lines, or the result as one JSON object with sorted keys (default: text)",
    )
    loud = parser.add_mutually_exclusive_group()
    loud.add_argument(
        "--verbose", action="store_true", default=default(False), help="log debug lines on stderr too"
    )
    loud.add_argument(
        "--quiet",
        action="store_true",
        default=default(False),
        help="stderr: warnings and errors only, no progress lines or bars",
    )


def json_text(obj: Any) -> str:
    """Machine-readable text: sorted keys, two-space indent (as the files we write), no trailing newline."""
    return json.dumps(obj, sort_keys=True, indent=2)


def print_json(obj: Any) -> None:
    """Machine-readable output on stdout (:func:`json_text`)."""
    print(json_text(obj))


def root_parser(prog: str, description: str, *, version: str) -> tuple[argparse.ArgumentParser, AddCommand]:
    """The top-level parser of a CLI and a ``command(name, func, help)`` that adds one sub-command.

    Shared by `edge-sdk` and `server-kit` so both get ``--version``, ``--debug``, ``--format``,
    ``--verbose`` / ``--quiet``, defaults in ``--help`` and the same dispatch.
    """
    parser = _Parser(prog=prog, description=description, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version}")
    _add_common(parser, top=True)
    sub = parser.add_subparsers(title="commands")

    def command(
        name: str, func: Command, help_text: str, build: Build | None = None
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_HelpFormatter)
        _add_common(p)
        p.set_defaults(func=func)
        p.build = build
        return p

    return parser, command
