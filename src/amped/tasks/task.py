"""What compare, tune and the doctor train: a model, its batches and its loss, checked
against the one factory contract (``--model module:factory``)::

    def factory(batch_size=..., seed=..., device=...):   # declare any of the three
        ...
        return model, batches, loss_fn                     # or an amped.tasks.Task

(or any object with ``model``, ``batches`` and ``loss_fn`` attributes and, optionally,
an ``optimizer(model)`` method), where

- ``model``: a ``torch.nn.Module`` with floating-point parameters, in float32. The CLI
  moves it to ``--device``.
- ``batches``: an iterable of ``(inputs, targets)`` pairs; ``inputs`` is a tensor, a
  tuple of tensors (``model(*inputs)``) or a dict of them (``model(**inputs)``). The
  first dimension of the first input tensor counts the samples. It may be infinite;
  a finite one ends the recipe's run early.
- ``loss_fn(outputs, targets)``: returns a scalar tensor.

The factory is called once per recipe, after ``torch.manual_seed(seed)``, so each
recipe starts from the same weights and sees the same batches if the factory is
deterministic given ``seed``. A :class:`Task` adds an optimizer factory (default
``AdamW(lr=1e-3)``), an ``evaluate`` function for held-out metrics, a name and details.
"""

from __future__ import annotations

import itertools
import json
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from amped._internal.errors import received
from amped._internal.trees import iter_tensors
from amped.tasks.errors import TaskTypeError, UsageError

__all__ = [
    "Task",
    "as_task",
    "call_model",
    "check_loss",
    "count_samples",
    "input_tensors",
    "to_device",
]

DEFAULT_LEARNING_RATE = 1e-3
_CONTRACT = (
    "(model, batches, loss_fn), an amped.tasks.Task, or an object with model, batches and "
    "loss_fn attributes"
)
_ATTRIBUTES = ("model", "batches", "loss_fn")


@dataclass
class Task:
    """A model to train, its data and loss, and optional extras.

    Attributes:
        model: the float32 model.
        batches: an iterable of ``(inputs, targets)``.
        loss_fn: ``loss_fn(outputs, targets) -> scalar tensor``.
        make_optimizer: builds the optimizer over a model (default AdamW, lr 1e-3).
        evaluate: ``evaluate(predict) -> {"loss": ..., "accuracy": ...}`` on held-out
            data, where ``predict(inputs)`` runs the trained model under the recipe's
            autocast, in eval mode and without gradients. Either key may be left out.
        name: a short name for reports (default: the factory's, e.g. ``"tasks:build"``).
        description: one line for reports.
        details: anything JSON-serialisable worth recording in ``results.json``.
        threads: CPU threads the task runs best with (``torch.set_num_threads``);
            ``--threads`` overrides it. None: torch's default.
    """

    model: torch.nn.Module
    batches: Iterable[Any]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None
    evaluate: Callable[[Callable[[Any], Any]], dict[str, float]] | None = None
    name: str = ""
    description: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    threads: int | None = None

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        if self.make_optimizer is None:
            return torch.optim.AdamW(model.parameters(), lr=DEFAULT_LEARNING_RATE)
        return self.make_optimizer(model)


def as_task(obj: object, source: str) -> Task:
    """``obj`` (a factory's return value) as a checked :class:`Task`; UsageError if it is not."""
    if isinstance(obj, Task):
        task = obj
    elif isinstance(obj, tuple | list) and len(obj) == 3:
        task = Task(*obj)
    elif all(hasattr(obj, name) for name in _ATTRIBUTES):
        model, batches, loss_fn = (getattr(obj, name) for name in _ATTRIBUTES)
        task = Task(model, batches, loss_fn, make_optimizer=getattr(obj, "optimizer", None))
    else:
        raise TaskTypeError(
            f"The factory {source} must return {_CONTRACT}. "
            f"Received: {_describe(obj)} (of type {type(obj).__name__})"
        )
    _check_model(task.model, source)
    if isinstance(task.batches, torch.Tensor) or not isinstance(task.batches, Iterable):
        raise TaskTypeError(
            f"The factory {source} must return an iterable of (inputs, targets) batches "
            f"as its second item. Received: batches of type {type(task.batches).__name__}"
        )
    if not callable(task.loss_fn):
        raise TaskTypeError(
            f"The factory {source} must return a callable loss_fn(outputs, targets) as its "
            f"third item. Received: loss_fn of type {type(task.loss_fn).__name__}"
        )
    _check_details(task, source)
    _check_threads(task.threads, source)
    task.batches = _peek_checked(task.batches, source)
    return task


def _check_details(task: Task, source: str) -> None:
    """``name``, ``description`` and ``details`` go into results.json: check them now,
    not after the whole run."""
    for name in ("name", "description"):
        value = getattr(task, name)
        if not isinstance(value, str):
            raise UsageError(f"Task.{name} from {source} must be a string. {received(name, value)}")
    if not isinstance(task.details, dict):
        raise UsageError(
            f"Task.details from {source} must be a dict. "
            f"Received: details of type {type(task.details).__name__}"
        )
    try:
        json.dumps(task.details, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise UsageError(
            f"Task.details from {source} must be JSON-serialisable (strings, numbers, "
            "booleans, None, lists and dicts with string keys; no NaN or infinity), since "
            f"it is written to results.json. Received: details={_short(task.details)} "
            f"({error})"
        ) from None


def _check_threads(threads: object, source: str) -> None:
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads < 1:
        raise UsageError(
            f"Task.threads from {source} must be None (torch's default) or an int >= 1. "
            + received("threads", threads)
        )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(obj: object) -> str:
    if isinstance(obj, tuple | list):
        return f"a {type(obj).__name__} of {len(obj)} items"
    return repr(obj)[:80]


def _check_model(model: object, source: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TaskTypeError(
            f"The factory {source} must return a torch.nn.Module as its first item. "
            f"Received: model of type {type(model).__name__}"
        )
    floating = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
    if not floating:
        raise UsageError(
            f"The model from {source} has no floating-point parameters to train. "
            f"Received: model of type {type(model).__name__}"
        )
    other = [(n, p.dtype) for n, p in floating if p.dtype != torch.float32]
    if other:
        name, dtype = other[0]
        raise UsageError(
            f"The model from {source} must be float32: every recipe, fp32 included, starts "
            f"from float32 weights and casts them itself. Return the model without "
            f".half()/.to(dtype). Received: {len(other)} parameter(s) not float32, e.g. "
            f"{name} of dtype {str(dtype).removeprefix('torch.')}"
        )


def _peek_checked(batches: Iterable[Any], source: str) -> Iterable[Any]:
    """The batches, with the first one checked to be an ``(inputs, targets)`` pair."""
    iterator = iter(batches)
    first = next(iterator, None)
    if first is None:
        raise UsageError(f"The batches from {source} are empty. Received: no batches")
    if not (isinstance(first, tuple | list) and len(first) == 2):
        raise UsageError(
            f"Each batch from {source} must be an (inputs, targets) pair. "
            f"Received: a batch of type {type(first).__name__}"
        )
    if count_samples(first[0]) is None:
        raise UsageError(
            f"The inputs of each batch from {source} must be a tensor, a tuple of tensors "
            f"or a dict of tensors. Received: inputs of type {type(first[0]).__name__}"
        )
    return itertools.chain([first], iterator)


def call_model(model: torch.nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a mapping, ``model(*inputs)`` for a tuple or list, else
    ``model(inputs)``: the one rule, for compare, doctor and tune."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def input_tensors(inputs: Any) -> list[torch.Tensor]:
    """Every tensor in what :func:`call_model` passes (any mapping, e.g. a BatchEncoding)."""
    return list(iter_tensors(dict(inputs) if isinstance(inputs, Mapping) else inputs))


def count_samples(inputs: Any) -> int | None:
    """The first dimension of the first tensor in ``inputs`` (None if there is none)."""
    first = next(iter(input_tensors(inputs)), None)
    return None if first is None else (int(first.shape[0]) if first.dim() else 1)


def to_device(data: Any, device: torch.device) -> Any:
    """Tensors in ``data`` (nested tuples, lists, dicts) moved to ``device``."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=True)
    if isinstance(data, Mapping):
        return {k: to_device(v, device) for k, v in data.items()}
    if isinstance(data, tuple | list):
        return type(data)(to_device(v, device) for v in data)
    return data


def check_loss(loss: object, source: str) -> torch.Tensor:
    """``loss`` if it is a scalar tensor; UsageError naming the contract otherwise."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else None
        raise UsageError(
            f"loss_fn from {source} must return a scalar tensor. "
            f"Received: {type(loss).__name__}" + (f" of shape {shape}" if shape else "")
        )
    return loss
