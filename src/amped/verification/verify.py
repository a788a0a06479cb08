"""``amped.verify``: run one training step through a backend and check every
low-precision GEMM against amped's exact reference for the recipe said to be running."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from amped._internal.errors import value_error
from amped.lowp.convert import plan_low_precision
from amped.tasks.task import call_model
from amped.verification.backends import Backend, resolve_backend
from amped.verification.capture import capture, eager_casts
from amped.verification.checks import check_layer
from amped.verification.reference import recipe_config
from amped.verification.report import VerifyReport

__all__ = ["RECIPES", "verify"]

RECIPES = ("fp8-tensorwise", "fp8-rowwise", "fp8-rowwise-gw-hp", "mxfp8", "mxfp4", "nvfp4")
"""The recipes a step is verified against (``fp8-delayed`` scales from an amax history
of earlier steps, which one step does not show; ``fp8-blockwise``'s 128-tile casts have
no reference here yet)."""


def _cast_inputs(inputs: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return inputs
    if isinstance(inputs, torch.Tensor):
        return inputs.to(dtype) if inputs.is_floating_point() else inputs
    if isinstance(inputs, tuple | list):
        return type(inputs)(_cast_inputs(x, dtype) for x in inputs)
    if isinstance(inputs, dict):
        return {k: _cast_inputs(v, dtype) for k, v in inputs.items()}
    return inputs


def _mean_square(outputs: Any, targets: Any) -> torch.Tensor:
    """The default loss: a grad_output that varies per element (a sum would make it
    constant, which every cast represents exactly)."""
    if not isinstance(outputs, torch.Tensor):
        raise TypeError(
            "the model returned no tensor, so verify needs a loss_fn(outputs, targets) "
            f"and a batch of (inputs, targets). Received: outputs of type {type(outputs)}"
        )
    return outputs.float().square().mean()


def verify(
    model: torch.nn.Module,
    batch: Any,
    *,
    recipe: str,
    backend: str | Backend = "amped",
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> VerifyReport:
    """Run one training step of ``model`` through ``backend`` and check it against
    amped's reference for ``recipe``.

    Hooks read every GEMM of the layers ``recipe`` converts (amped's plan: its default
    filter) without changing a number: the high-precision input, weight and
    grad_output, each GEMM's quantized operands and its output. Each cast is recomputed
    by amped (bitwise torchao's) and must match bit for bit; each output must lie within
    the bound of float32 accumulation around the exact product of its operands
    (docs/verify.md derives it). Anything else is a flag naming the layer and role.

    Args:
        model: the model, unconverted, in float32; a deep copy is converted and run,
            so ``model`` is left as it is.
        batch: the inputs (``model(inputs)``, a tuple or dict as in
            ``amped.tasks``), or ``(inputs, targets)`` with ``loss_fn``.
        recipe: an amped recipe name (:data:`RECIPES`); with ``backend="torchao"``,
            torchao's own configuration of it.
        backend: ``"amped"``, ``"torchao"`` or ``"te"`` (Transformer Engine), or an
            object with ``name`` and ``prepare(model, recipe, layers)``
            (:mod:`amped.verification.backends`).
        loss_fn: ``loss_fn(outputs, targets)``; default: the outputs' mean square.

    Returns:
        A :class:`~amped.verification.report.VerifyReport`; ``report.ok`` when nothing
        is flagged.

    Raises:
        ValueError: a recipe it cannot verify, or one the backend does not train.
        RuntimeError: a backend that cannot run here (Transformer Engine not installed).

    Example:
        >>> import torch, amped
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        >>> report = amped.verify(model, torch.randn(32, 64), recipe="fp8-rowwise")
        >>> report.ok, report.layers
        (True, ('0',))
    """
    if recipe not in RECIPES:
        raise value_error(
            f"verify checks the recipes {', '.join(RECIPES)} (one step shows no delayed "
            "scaling history; fp8-blockwise has no reference yet)",
            "recipe",
            recipe,
        )
    chosen = resolve_backend(backend)
    config = recipe_config(recipe)
    model = copy.deepcopy(model)
    layers = plan_low_precision(model, config=config)
    prepared = chosen.prepare(model, recipe, layers)
    run = prepared.model
    inputs, targets = batch if loss_fn is not None else (batch, None)
    for parameter in run.parameters():
        parameter.grad = None
    with capture(run, layers) as records:
        with prepared.autocast():
            outputs = call_model(run, _cast_inputs(inputs, prepared.input_dtype))
            loss = (loss_fn or _mean_square)(outputs, targets)
        loss.backward()
    gemms, flags = [], []
    with eager_casts():
        for name in layers:
            results, found = check_layer(records[name], config)
            gemms += results
            flags += found
    return VerifyReport(chosen.name, recipe, tuple(layers), tuple(gemms), tuple(flags))
