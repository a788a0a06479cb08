"""``--model module:factory``: find the user's task factory and call it by the contract.

Spellings of the spec::

    package.module:factory     imported by name (the working directory is on the path)
    path/to/file.py:factory    loaded from the file
    module:Outer.factory       a dotted attribute path after the colon

The factory is called with the keyword arguments it declares among ``batch_size``,
``seed`` and ``device`` (all three if it takes ``**kwargs``); see
:mod:`amped.tasks.task` for what it must return.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from amped._internal.errors import type_error
from amped.tasks.errors import RunError, UsageError
from amped.tasks.task import Task, as_task, call_model, check_loss, to_device

__all__ = ["DEFAULT_FACTORY", "TaskFactory", "as_factory", "load_factory"]

DEFAULT_FACTORY = "amped.tasks.tiny_gpt:build"
_EXAMPLE = "--model examples/compare_factory.py:build or --model mypackage.tasks:build"


class TaskFactory:
    """A loaded factory; :meth:`build` makes a fresh, checked :class:`Task`."""

    def __init__(self, spec: str, function: Callable[..., Any]) -> None:
        self.spec = spec
        self.function = function
        self._parameters = _parameters(function)

    def build(self, *, batch_size: int | None, seed: int, device: torch.device | None) -> Task:
        """Seed torch, call the factory and check what it returned (``device`` None:
        none is offered, and the factory keeps its own default)."""
        offered: dict[str, Any] = {"seed": seed}
        if device is not None:
            offered["device"] = device
        if batch_size is not None:
            offered["batch_size"] = batch_size
        if batch_size is not None and not self._accepts("batch_size"):
            raise UsageError(
                f"--batch-size was given, but the factory {self.spec} takes no batch_size "
                f"argument. Add one, or leave out --batch-size. Received: batch_size={batch_size}"
            )
        kwargs = {k: v for k, v in offered.items() if self._accepts(k)}
        torch.manual_seed(seed)
        try:
            built = self.function(**kwargs)
        except SystemExit as error:
            raise UsageError(
                f"The factory {self.spec} called sys.exit() (SystemExit({error.code!r})) "
                "instead of returning a task; it must return (model, batches, loss_fn) or "
                f"an amped.tasks.Task. Received: SystemExit({error.code!r})"
            ) from None
        task = as_task(built, self.spec)
        task.name = task.name or self.label
        return task

    def check(self, *, batch_size: int | None, seed: int, device: torch.device) -> Task:
        """Build the task once and run one forward pass and loss on its first batch
        (float32, no gradients), so a broken contract is reported before any training."""
        try:
            task = self.build(batch_size=batch_size, seed=seed, device=device)
            model = task.model.to(device)
            inputs, targets = to_device(next(iter(task.batches)), device)
            with torch.no_grad():
                check_loss(task.loss_fn(call_model(model, inputs), targets), self.spec)
            return task
        except (UsageError, KeyboardInterrupt):
            raise
        except (Exception, SystemExit) as error:
            text = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise RunError(
                f"The task from {self.spec} failed before training, in float32: "
                f"{type(error).__name__}: {text} (rerun with --traceback for details)"
            ) from error

    @property
    def reloadable(self) -> bool:
        """Whether another process can load this factory by its spec (the own-process
        memory probe does): a module-level function of a module imported from a file,
        not a lambda, a nested function or one defined in ``__main__``."""
        module = self.spec.rpartition(":")[0]
        if module == "__main__" or "<" in self.spec:
            return False
        if module.endswith(".py") or os.sep in module or "/" in module:
            return True  # a file: loaded from its path
        return getattr(sys.modules.get(module), "__file__", None) is not None

    @property
    def label(self) -> str:
        """A short name: ``file:factory`` without the folders and ``.py``."""
        module, _, attribute = self.spec.rpartition(":")
        return f"{Path(module).stem if module.endswith('.py') else module}:{attribute}"

    def _accepts(self, name: str) -> bool:
        return self._parameters is None or name in self._parameters


def _parameters(function: Callable[..., Any]) -> set[str] | None:
    """Keyword parameters ``function`` takes; None when it takes ``**kwargs``."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    kinds = {p.kind for p in signature.parameters.values()}
    if inspect.Parameter.VAR_KEYWORD in kinds:
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in signature.parameters.values() if p.kind in keyword}


def as_factory(model: str | Callable[..., Any] | None) -> TaskFactory:
    """``model`` as a factory: a ``module:function`` spec (:func:`load_factory`), the
    factory function itself, or None for the built-in task.

    Raises:
        TypeError: ``model`` is a ``torch.nn.Module`` or another object that is not a
            factory (a fresh model is built per recipe and seed).
        UsageError: a spec that does not resolve.
    """
    if model is None:
        return load_factory(DEFAULT_FACTORY)
    if isinstance(model, str):
        return load_factory(model)
    if isinstance(model, torch.nn.Module) or not callable(model):
        raise type_error(
            "The task is a factory returning (model, batches, loss_fn), called once per "
            "run to build a fresh model, so pass the function that builds it, not a "
            "model; or a 'module:function' spec, or None for the built-in task",
            "model",
            model,
        )
    module = getattr(model, "__module__", None) or "<unknown>"
    name = getattr(model, "__qualname__", None) or type(model).__name__
    return TaskFactory(f"{module}:{name}", model)


def load_factory(spec: str) -> TaskFactory:
    """The factory that ``spec`` names; UsageError for a spec that does not resolve."""
    module_part, sep, attribute = spec.rpartition(":")
    if not sep or not module_part or not attribute:
        raise UsageError(
            f"--model takes module:factory, e.g. {_EXAMPLE}. Received: --model {spec!r}"
        )
    module = _import(module_part, spec)
    target: Any = module
    for name in attribute.split("."):
        if not hasattr(target, name):
            raise UsageError(
                f"{module_part} has no attribute {attribute!r}; name the function that "
                f"builds the task. Received: --model {spec!r}"
            )
        target = getattr(target, name)
    if not callable(target):
        raise UsageError(
            f"--model must name a callable factory, but {attribute} is a "
            f"{type(target).__name__}. Received: --model {spec!r}"
        )
    return TaskFactory(spec, target)


def _import(module_part: str, spec: str) -> ModuleType:
    if module_part.endswith(".py") or os.sep in module_part or "/" in module_part:
        return _import_file(Path(module_part), spec)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: local modules resolve
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as error:
        if error.name is not None and module_part.startswith(error.name):
            raise UsageError(
                f"No module named {module_part!r} (looked in the working directory and on "
                f"sys.path). Give a module or a .py file. Received: --model {spec!r}"
            ) from None
        raise UsageError(_failed_import(module_part, error, spec)) from None
    except (Exception, SystemExit) as error:
        raise UsageError(_failed_import(module_part, error, spec)) from None


def _import_file(path: Path, spec: str) -> ModuleType:
    if not path.is_file():
        raise UsageError(f"No file {str(path)!r} for --model. Received: --model {spec!r}")
    name = f"amped_user_task_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UsageError(f"Cannot load {str(path)!r} as Python. Received: --model {spec!r}")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:  # a script that exits when imported
        del sys.modules[name]
        raise UsageError(_failed_import(str(path), error, spec)) from None
    return module


def _failed_import(where: str, error: BaseException, spec: str) -> str:
    message = str(error).splitlines()[0] if str(error) else ""
    return (
        f"Importing {where} failed with {type(error).__name__}: {message}. "
        f"Received: --model {spec!r}"
    )
