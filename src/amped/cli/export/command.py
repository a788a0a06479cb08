"""``amped export``: a model factory and a checkpoint saved with
:func:`amped.checkpoint.save_checkpoint`, written in the inference format of a recipe.

The factory builds the model as training did (``--model``, the contract of
:mod:`amped.tasks.task`); :func:`amped.prepare` converts it for ``--recipe``; the
checkpoint's model state (``--key``, default ``model``) is loaded into it; then
:func:`amped.export` writes the folder and, unless ``--no-check``, checks it on two
held-out batches (the factory's batches for ``--seed + 1``, which training never saw).

Exit codes: 0 written (and checked); 3 the check failed (nothing written); 2 bad
arguments, a folder that exists without ``--force``, a format the recipe did not train
in without ``--requantize``, or a layer the format cannot hold; 1 anything else failed.
"""

from __future__ import annotations

import argparse
import itertools
import warnings
from pathlib import Path
from typing import Any

import torch

from amped.checkpoint import CheckpointError, load_checkpoint
from amped.cli.errors import EXIT_OK, RunError, UsageError
from amped.comparison.environment import resolve_device
from amped.exporting import export
from amped.exporting.check import ExportCheckError
from amped.exporting.grid import low_precision_layers
from amped.recipes import TrainSetup, prepare
from amped.tasks.factory import TaskFactory, as_factory
from amped.tasks.task import to_device

__all__ = ["EXIT_CHECK_FAILED", "run_export"]

EXIT_CHECK_FAILED = 3  # the numerics failed: the file does not read back as trained
_HELD_OUT_BATCHES = 2


def _setup(args: argparse.Namespace, device: torch.device) -> tuple[TrainSetup, TaskFactory]:
    factory = as_factory(args.model)
    task = factory.build(batch_size=None, seed=args.seed, device=device)
    model = task.model.to(device)
    try:
        setup = prepare(model, torch.optim.SGD(model.parameters()), args.recipe)
    except (ValueError, TypeError) as error:
        raise UsageError(f"--recipe {args.recipe}: {error}") from error
    try:
        state = load_checkpoint(args.checkpoint, map_location=device)
    except (CheckpointError, OSError) as error:
        raise UsageError(f"--checkpoint {args.checkpoint}: {error}") from error
    if args.key not in state:
        raise UsageError(
            f"The checkpoint {args.checkpoint} holds no {args.key!r} entry (it holds "
            f"{sorted(state)}); name the model's entry with --key"
        )
    try:
        setup.model.load_state_dict(state[args.key])
    except RuntimeError as error:
        first = str(error).splitlines()[0]
        raise UsageError(
            f"The checkpoint's {args.key!r} state does not fit the model --model builds "
            f"prepared for --recipe {args.recipe} (save setup.model.state_dict() of that "
            f"recipe): {first}"
        ) from error
    return setup, factory


def _held_out(factory: TaskFactory, seed: int, device: torch.device) -> list[Any]:
    task = factory.build(batch_size=None, seed=seed + 1, device=device)
    batches = itertools.islice(task.batches, _HELD_OUT_BATCHES)
    return [to_device(batch, device)[0] for batch in batches]


def run_export(args: argparse.Namespace) -> int:
    """Run ``amped export``; returns the exit code (raises UsageError / RunError)."""
    device = resolve_device(args.device or "cpu")
    setup, factory = _setup(args, device)
    inputs = None if args.no_check else _held_out(factory, args.seed, device)
    out = Path(args.out)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            folder = export(
                setup,
                out,
                args.format,
                check=not args.no_check,
                requantize=args.requantize,
                force=args.force,
                inputs=inputs,
            )
        except ExportCheckError as error:
            print(f"amped export: check failed: {error}")
            return EXIT_CHECK_FAILED
        except (ValueError, FileExistsError, NotADirectoryError) as error:
            raise UsageError(str(error)) from error
        except ImportError as error:
            raise RunError(
                f"--check reads the file with compressed-tensors ({error}); install it "
                "(pip install compressed-tensors) or pass --no-check"
            ) from error
        except Exception as error:
            raise RunError(f"export failed: {type(error).__name__}: {error}") from error
    for warning in caught:
        print(f"amped export: warning: {warning.message}")
    layers = low_precision_layers(setup.model)
    checked = "not checked (--no-check)" if args.no_check else "checked bit for bit"
    print(f"wrote {folder}/ ({len(layers)} low-precision layers, {checked})")
    return EXIT_OK
