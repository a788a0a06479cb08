"""The ``amped`` command line: ``amped compare``, ``amped doctor``, ``amped tune``,
``amped verify`` and ``amped export`` (also ``python -m amped``).

User mistakes are one line on stderr, without a traceback; the exit codes are in
:mod:`amped.cli.errors` and docs/robustness.md.
"""

from __future__ import annotations

import signal
import sys
import threading
import traceback
from collections.abc import Sequence

from amped.cli import out_dir
from amped.cli.arguments import build_parser
from amped.cli.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, RunError, UsageError
from amped.cli.width import wrap
from amped.comparison import interrupt

__all__ = ["main", "version_line"]


def _say_error(message: str) -> None:
    line = " ".join(str(message).split())
    print(wrap(f"amped: error: {line}"), file=sys.stderr, flush=True)


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
            "missing). Install them from amped's clone with: pip install -e '.[cli]'"
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
        out_dir.release_all()


def _main(arguments: list[str]) -> int:
    try:
        args = build_parser().parse_args(arguments)
        if args.version:
            print(version_line())
            return EXIT_OK
        if args.command not in ("compare", "doctor", "tune", "verify", "export"):
            raise UsageError(
                "name a command: amped compare, amped doctor, amped tune, amped verify or "
                "amped export "
                "(see amped --help)"
            )
        if args.command == "export":  # plain text: no need for the extra
            from amped.cli.export.command import run_export

            return run_export(args)
        _check_extra(args.command)
        if args.command == "doctor":
            from amped.cli.doctor.command import (
                run_doctor,  # needs the extra: imported after the check
            )

            return run_doctor(args)
        if args.command == "verify":
            from amped.cli.verify.command import run_verify  # needs the extra: after the check

            return run_verify(args)
        if args.command == "tune":
            from amped.cli.tune.command import run_tune  # needs the extra: imported after the check

            return run_tune(args, ["amped", *arguments])
        from amped.cli.compare.command import (
            run_compare,  # needs the extra: imported after the check
        )

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
