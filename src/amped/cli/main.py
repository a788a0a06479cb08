"""The ``amped`` command line: ``amped compare`` and ``amped doctor`` (also ``python -m amped``).

Exit codes: 0 success; 1 a failed run (a recipe raised, the report could not be
written, the CLI extra is missing); 2 bad arguments, an unwritable ``--out`` or a task
that breaks the factory contract; 3 the numerics failed: ``amped compare``, a recipe
diverged (non-finite losses; the report is written), ``amped doctor``, a non-finite value
it could not fix; 130 interrupted by Ctrl-C (SIGINT) and 143 by SIGTERM, after writing
the partial results once training had started. User mistakes are reported in one line
on stderr, without a traceback. See docs/robustness.md.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import NoReturn

from amped.cli import interrupt
from amped.cli.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, RunError, UsageError
from amped.recipes import recipe_names

__all__ = ["main", "version_line"]

DEFAULT_STEPS = 200
DEFAULT_MAX_TIME = 120.0
DEFAULT_OUT = "amped-report"


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as one-line UsageErrors."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected seconds (0 for no limit), got {text!r}"
        ) from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds (0 for no limit), got {text!r}")
    return value


def _parser() -> _Parser:
    parser = _Parser(prog="amped", description="Mixed-precision training for PyTorch.")
    parser.add_argument("--version", action="store_true", help="print amped's version and exit")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    compare = commands.add_parser(
        "compare",
        help="measure what mixed precision buys a model",
        description=(
            "Train one task once per precision recipe (fp32 first) and compare speed, "
            "memory and loss; print a table and write report.html and results.json."
        ),
    )
    add = compare.add_argument
    add("--model", default=None, metavar="MODULE:FACTORY",
        help="task factory returning (model, batches, loss_fn); a module or path/to/file.py "
        "(default: the built-in tiny GPT on Python's own source)")  # fmt: skip
    add(
        "--recipes",
        default="all",
        help=f"comma-separated recipes or aliases (default: all: {', '.join(recipe_names())})",
    )
    add(
        "--steps",
        type=_positive_int,
        default=DEFAULT_STEPS,
        help=f"train steps per recipe (default: {DEFAULT_STEPS})",
    )
    add("--batch-size", type=_positive_int, default=None, help="passed to the factory")
    add("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    add("--seed", type=int, default=0, help="seed for weights and data (default: 0)")
    add("--out", default=DEFAULT_OUT, help=f"report folder (default: {DEFAULT_OUT}/)")
    add("--max-time", type=_seconds, default=DEFAULT_MAX_TIME, metavar="SECONDS",
        help="fit the comparison's training into about SECONDS: time a few steps of each "
        "recipe, then train all for as many steps as fit, at most --steps "
        f"(default: {DEFAULT_MAX_TIME:g}; 0: no limit)")  # fmt: skip
    add("--threads", type=_positive_int, default=None,
        help="CPU threads for torch, the same for every recipe (default: the task's "
        "choice, else torch's; the built-in task uses 1)")  # fmt: skip
    add("--peak-memory", choices=["own-process", "in-process"], default="own-process",
        help="on a CPU, measure each recipe's peak memory in a process of its own (default; "
        "a few seconds per recipe, and its ordering follows the state each recipe holds) "
        "or in this process (quicker, but noise at small sizes)")  # fmt: skip
    add("--json", action="store_true", help="print only the results JSON on stdout")
    add("--no-progress", action="store_true", help="no progress bars (a line per recipe)")
    add("--traceback", action="store_true", help="print the traceback of failed recipes")
    from amped.cli.doctor_args import add_doctor_parser

    add_doctor_parser(commands)
    return parser


def _say_error(message: str) -> None:
    line = " ".join(str(message).split())
    print(f"amped: error: {line}", file=sys.stderr, flush=True)


def version_line() -> str:
    """``amped --version``: amped's version, and torch's (the one thing it depends on)."""
    import torch

    import amped

    return f"amped {amped.__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})"


def _check_extra(command: str) -> None:
    missing = []
    for name in ("rich", "matplotlib"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise RunError(
            f"amped {command} needs the optional 'cli' dependencies ({', '.join(missing)} "
            "missing). Install them with: pip install 'amped[cli]'"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``amped`` command line with ``argv`` (default: ``sys.argv[1:]``).

    SIGTERM is handled like SIGINT from here on. Called as the program (``argv`` None),
    SIGINT and SIGTERM are then held back from the return until the process exits:
    Python restores the default handlers while it shuts down, and a signal then would
    kill the process after its work was done, replacing its exit code. Called with
    ``argv`` (in process), the previous handlers are restored on return.
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    handlers = {number: signal.getsignal(number) for number in interrupt.SIGNALS}
    interrupt.immediate_interrupts()  # SIGTERM now raises KeyboardInterrupt, as SIGINT does
    try:
        return _main(arguments)
    finally:
        if threading.current_thread() is not threading.main_thread():
            pass
        elif argv is None and hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_BLOCK, set(interrupt.SIGNALS))
        elif argv is not None:
            for number, handler in handlers.items():
                if handler is not None:  # None: installed outside Python, left as it is
                    signal.signal(number, handler)


def _main(arguments: list[str]) -> int:
    try:
        args = _parser().parse_args(arguments)
        if args.version:
            print(version_line())
            return EXIT_OK
        if args.command not in ("compare", "doctor"):
            raise UsageError("name a command: amped compare or amped doctor (see amped --help)")
        _check_extra(args.command)
        if args.command == "doctor":
            from amped.cli.doctor import run_doctor  # needs the extra: imported after the check

            return run_doctor(args)
        from amped.cli.command import run_compare  # needs the extra: imported after the check

        return run_compare(args, ["amped", *arguments])
    except UsageError as error:
        _say_error(str(error))
        return EXIT_USAGE
    except KeyboardInterrupt:
        _say_error("interrupted")
        return interrupt.exit_code()
    except RunError as error:
        if "--traceback" in arguments and error.__cause__ is not None:
            traceback.print_exception(error.__cause__)
        _say_error(str(error))
        return EXIT_FAILED
