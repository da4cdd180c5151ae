"""The ``towers`` command line: ``python -m towers <command>`` (the commands: :data:`COMMANDS`).

Each command is a module with ``add_arguments(parser)``, ``run(args) -> exit code`` and
maybe ``usage_problem(args) -> str | None``; its docstring is its ``--help``. Usage errors
answer before TensorFlow is imported: one line naming the option, exit status 2; so does a
``ValueError``, ``TypeError`` or ``RuntimeError`` a command raises (``--verbose``: raised).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from typing import NoReturn

from towers.cli.arguments import Named, did_you_mean

__all__ = ["COMMANDS", "main", "parsers", "quiet_tensorflow"]

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("towers.cli.train", "train a CNN on digits over simulated towers"),
    "trace": ("towers.cli.trace", "run one all-reduce, print its tick table and draw it"),
    "check": ("towers.cli.check", "check an all-reduce against the contract with Hypothesis"),
    "timeline": ("towers.cli.timeline", "write one training step as a chrome://tracing timeline"),
    "bench": ("towers.cli.bench", "benchmark all-reduce and training steps against tf.distribute"),
    "launch": ("towers.cli.launch", "run a command once per task of a localhost cluster"),
    "invariance": ("towers.cli.invariance", "check training is the same on 1, 2, 4, 8 towers"),
    "bisect": ("towers.cli.compare", "find the first step and variable where two setups part"),
    "compare": ("towers.cli.compare", "compare two training steps, yours or towers', per step"),
    "study": ("towers.cli.study", "compare reducers and codecs: loss vs bytes and predicted time"),
}

_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<word>[^']*)' \(choose from (?P<known>.*)\)$")


class _Parser(argparse.ArgumentParser):
    """A usage error is one line and exit status 2; an invalid choice names the nearest."""

    def error(self, message: str) -> NoReturn:
        choice = _INVALID_CHOICE.search(message)
        if choice:
            known = [name.strip(" '") for name in choice["known"].split(",")]
            message += did_you_mean(choice["word"], known)
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """The module's docstring as written, and every option's default in its help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS)
                or not (action.option_strings or action.nargs in ("?", "*"))):
            return text
        return f"{text} (default: %(default)s)"


def parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``towers`` parser and each command's."""
    commands: dict[str, argparse.ArgumentParser] = {}
    top = _Parser(prog="towers",
                  description="Exact, teachable data-parallel training in TensorFlow.")
    sub = top.add_subparsers(dest="towers_command", required=True, metavar="COMMAND",
                             parser_class=_Parser)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=module.__doc__,
                                 epilog=getattr(module, "EPILOG", None), formatter_class=_Formatter)
        module.add_arguments(command)
        command.add_argument("--verbose", action="store_true",
                             help="show TensorFlow's own log lines (hidden by default)")
        command.set_defaults(func=module.run,
                             usage_problem=getattr(module, "usage_problem", None))
        commands[name] = command
    return top, commands


def quiet_tensorflow(verbose: bool) -> None:
    """Import TensorFlow with its C++ log quiet unless ``verbose`` (shown if the import fails)."""
    if verbose:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
        return
    if os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3") in ("", "0"):
        return  # the user asked for every line
    if "tensorflow" not in sys.modules:
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as log:
            os.dup2(log.fileno(), 2)
            try:
                import tensorflow  # noqa: F401
            except BaseException:
                os.dup2(saved, 2)
                log.seek(0)
                sys.stderr.write(log.read().decode(errors="replace"))
                raise
            finally:
                os.dup2(saved, 2)
                os.close(saved)
    import absl.logging

    absl.logging.set_verbosity(absl.logging.ERROR)


def _load_named(command: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Import and check what every ``module:NAME`` option names (a usage error if it fails)."""
    for action in command._actions:
        value = getattr(args, action.dest, None)
        if isinstance(action.type, Named) and value is not None:
            try:
                action.type.load(value)
            except argparse.ArgumentTypeError as err:
                name = "/".join(action.option_strings) or action.metavar or action.dest
                command.error(f"argument {name}: {err}")


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (a usage error exits 2 before TensorFlow loads) and run the command."""
    top, commands = parsers()
    args, extra = top.parse_known_args(argv)
    command = commands[args.towers_command]
    if extra:  # argparse's message, with the nearest option
        known = [s for action in command._actions for s in action.option_strings]
        hints = "".join(did_you_mean(w.split("=", 1)[0], known) for w in extra if w[:2] == "--")
        command.error(f"unrecognized arguments: {' '.join(extra)}{hints}")
    try:
        problem = args.usage_problem and args.usage_problem(args)
        if problem:  # between options: found before TensorFlow loads
            raise ValueError(problem)
        quiet_tensorflow(args.verbose)
        _load_named(command, args)
        return int(args.func(args))
    except (ValueError, TypeError, RuntimeError) as err:  # one line and exit status 2
        if args.verbose:
            raise
        print(f"{command.prog}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
