"""What ``amped.tune`` trains: the factory contract of ``amped compare``, on the library side.

``factory(seed=...)`` (or ``factory()`` when it takes no ``seed``) is called after
``torch.manual_seed(seed)`` and returns ``(model, batches, loss_fn)``, or an object
with ``model``, ``batches`` and ``loss_fn`` attributes and optionally an
``optimizer(model)`` method (an ``amped.cli.task.Task`` is one). ``batches`` yields
``(inputs, targets)``; ``loss_fn(model(inputs), targets)`` is a scalar. A finite
``batches`` shorter than a run is cycled.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from amped._internal.errors import type_error, value_error

__all__ = ["DEFAULT_LEARNING_RATE", "TuneTask", "build_task"]

DEFAULT_LEARNING_RATE = 1e-3
"""AdamW's learning rate when the task brings no optimizer (as ``amped compare``)."""

_CONTRACT = (
    "a factory(seed=...) returning (model, batches, loss_fn), or an object with model, "
    "batches and loss_fn attributes (such as amped.cli.task.Task)"
)


@dataclass
class TuneTask:
    """A built task: the float32 model, the first ``count`` batches, the loss and the
    optimizer factory."""

    model: torch.nn.Module
    batches: list[Any]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]


def _default_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=DEFAULT_LEARNING_RATE)


def _call(factory: Callable[..., Any], seed: int) -> Any:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        parameters = ()  # type: ignore[assignment]
    takes_seed = any(
        p.name == "seed" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters
    )
    torch.manual_seed(seed)
    return factory(seed=seed) if takes_seed else factory()


def build_task(factory: Callable[..., Any], seed: int, count: int) -> TuneTask:
    """Call ``factory`` for ``seed`` and keep its first ``count`` batches (cycled).

    Raises:
        TypeError: the factory is not callable, or returned something else than the
            contract (module docstring) allows.
        ValueError: the model is not float32, or the batches are empty.
    """
    if not callable(factory) or isinstance(factory, torch.nn.Module):
        raise type_error(
            f"amped.tune takes {_CONTRACT}; it builds a fresh model per seed, so pass the "
            "function that builds it, not a model",
            "factory",
            factory,
        )
    built = _call(factory, seed)
    if isinstance(built, tuple | list) and len(built) == 3:
        model, batches, loss_fn = built
        make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] = _default_optimizer
    elif all(hasattr(built, a) for a in ("model", "batches", "loss_fn")):
        model, batches, loss_fn = built.model, built.batches, built.loss_fn
        make_optimizer = getattr(built, "optimizer", _default_optimizer)
    else:
        raise type_error(f"The factory must return {_CONTRACT}", "factory()", built)
    if not isinstance(model, torch.nn.Module):
        raise type_error("The factory's model is a torch.nn.Module", "model", model)
    if not isinstance(batches, Iterable) or isinstance(batches, torch.Tensor):
        raise type_error(
            "The factory's batches are an iterable of (inputs, targets)", "batches", batches
        )
    if not callable(loss_fn):
        raise type_error("The factory's loss_fn is a callable", "loss_fn", loss_fn)
    other = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if other:
        raise value_error(
            "amped.tune starts every run from float32 weights (each recipe casts them "
            "itself); return the model without .half()/.to(dtype)",
            "parameters not float32",
            other[:3],
        )
    taken = list(itertools.islice(batches, count))
    if not taken:
        raise value_error("The factory's batches are empty; give at least one", "batches", batches)
    cycled = list(itertools.islice(itertools.cycle(taken), count))
    return TuneTask(model, cycled, loss_fn, make_optimizer)
