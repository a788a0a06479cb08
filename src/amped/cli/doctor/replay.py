"""``amped doctor --replay BUNDLE``: :func:`amped.doctor.replay` from the command line.

Prints the replay's summary (or its JSON with ``--json``) and writes nothing. Exit
status: 0 when the bundle replayed as recorded (the same first non-finite value or
total underflow, or none) and any such event has a verified fix;
:data:`~amped.cli.errors.EXIT_UNFIXED` (3) otherwise; 2 (a ``UsageError``) for a bundle
refused, with the reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from amped.checkpoint.bundle import BundleError
from amped.cli.errors import EXIT_OK, EXIT_UNFIXED, RunError, UsageError
from amped.doctor import replay
from amped.doctor.replay import ReplayResult
from amped.tasks.factory import load_factory

__all__ = ["replay_exit", "run_replay"]

CPU = torch.device("cpu")  # a replay runs on the CPU; the model is only compared


def replay_exit(result: ReplayResult) -> int:
    """The exit status of a replay (see the module)."""
    nonfinite = result.replayed is not None or result.recorded is not None
    if not result.reproduced or (nonfinite and result.fix is None):
        return EXIT_UNFIXED
    return EXIT_OK


def run_replay(args: argparse.Namespace) -> int:
    """Run ``amped doctor --replay``; returns the exit code (raises UsageError / RunError)."""
    model = None
    if args.model is not None:  # only its layers' names and shapes are compared
        factory = load_factory(args.model)
        task = factory.check(batch_size=args.batch_size, seed=args.seed, device=CPU)
        model = task.model
    try:
        result = replay(args.replay, recipe=args.recipe, model=model)
    except (BundleError, ValueError, TypeError) as error:
        raise UsageError(f"amped doctor --replay {args.replay}: {error}") from error
    except Exception as error:
        raise RunError(f"The replay failed: {type(error).__name__}: {error}") from error
    if args.json:
        sys.stdout.write(json.dumps(dataclasses.asdict(result), indent=1) + "\n")
    else:
        print(result.summary(), flush=True)
    return replay_exit(result)
