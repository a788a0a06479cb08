"""What ``amped.tune`` trains: a task of :mod:`amped.tasks`, its batches fixed up front.

The factory contract is the one of ``amped compare`` and ``amped doctor``
(:mod:`amped.tasks.task`): ``factory`` declares any of ``batch_size``, ``seed`` and
``device`` (tune offers ``seed`` alone), is called after ``torch.manual_seed(seed)`` and
returns ``(model, batches, loss_fn)``, an :class:`amped.tasks.Task` or an object with
those three attributes (and optionally ``optimizer(model)``). A finite
``batches`` shorter than a run is cycled.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from amped._internal.errors import value_error
from amped.tasks.factory import as_factory

__all__ = ["TuneTask", "build_task"]


@dataclass
class TuneTask:
    """A built task: the float32 model, the first ``count`` batches, the loss and the
    optimizer factory."""

    model: torch.nn.Module
    batches: list[Any]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]


def build_task(factory: Callable[..., Any], seed: int, count: int) -> TuneTask:
    """Call ``factory`` for ``seed`` and keep its first ``count`` batches (cycled).

    Raises:
        TypeError: the factory is not callable (a model, say), or returned something
            else than the contract (module docstring) allows.
        ValueError: the model is not float32, or the batches are empty.
    """
    if isinstance(factory, str) or factory is None:
        raise TypeError(
            "amped.tune takes the factory function itself; load a 'module:function' spec "
            f"with amped compare's --model, or import it. Received: factory={factory!r}"
        )
    task = as_factory(factory).build(batch_size=None, seed=seed, device=None)
    taken = list(itertools.islice(task.batches, count))
    if not taken:
        raise value_error("The factory's batches are empty; give at least one", "batches", [])
    cycled = list(itertools.islice(itertools.cycle(taken), count))
    return TuneTask(task.model, cycled, task.loss_fn, task.optimizer)
