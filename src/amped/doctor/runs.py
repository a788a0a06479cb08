"""One traced training step (forward, loss, backward) on a private copy of the model."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from amped.autocast_mode import autocast, engine_always
from amped.doctor.trace import OpCall, Tracer, _first_float_tensor
from amped.policy import Policy

__all__ = ["StepResult", "run_step"]


@dataclass
class StepResult:
    """What one step computed: every op call, the loss, the output and the gradients."""

    calls: list[OpCall]
    loss: torch.Tensor
    output: torch.Tensor | None
    grads: dict[str, torch.Tensor]  # unscaled, float32, by parameter name
    grad_order: list[tuple[int, bool]] = field(
        default_factory=list
    )  # (call, finite) in backward order


def call_model(model: torch.nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _check_loss(loss: object) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else None
        raise ValueError(
            "loss_fn must return a scalar floating tensor (one element) computed from the "
            f"model's output. Received: loss of type {type(loss).__name__}, shape {shape}"
        )
    return loss


def run_step(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    device_type: str,
    dtype: torch.dtype | None,
    policy: Policy | None,
    loss_scale: float,
    seed: int,
) -> StepResult:
    """One step on a deep copy of ``model``: float32 when ``dtype`` is None, else under
    ``amped.autocast(device_type, dtype, policy=policy)``. The caller's model, RNG and
    autocast state are left as they were."""
    private = copy.deepcopy(model)
    private.zero_grad(set_to_none=True)
    tracer = Tracer(private, keep_live=True)
    region: contextlib.AbstractContextManager[Any] = (
        contextlib.nullcontext()
        if dtype is None
        else autocast(device_type, dtype=dtype, policy=policy)
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # The tracer sits below amped's mode and must see each op after its casts, so
        # the mode runs even for torch's own rules (which torch's C++ autocast would
        # otherwise apply, below the tracer).
        with tracer, engine_always(), region:
            output = call_model(private, inputs)
            loss = _check_loss(loss_fn(output))
        order: list[tuple[int, bool]] = []
        handles = [
            call.live_output.register_hook(_grad_hook(call.index, order))
            for call in tracer.calls
            if call.live_output is not None
        ]
        try:
            if loss.requires_grad:
                (loss.float() * loss_scale).backward()
        finally:
            for handle in handles:
                handle.remove()
    grads = {
        name: (p.grad.detach().float() / loss_scale)
        for name, p in private.named_parameters()
        if p.grad is not None
    }
    out_tensor = _model_output(output)
    for call in tracer.calls:
        call.live_output = None
    return StepResult(
        calls=tracer.calls,
        loss=loss.detach().float(),
        output=out_tensor.detach() if out_tensor is not None else None,
        grads=grads,
        grad_order=order,
    )


def _model_output(output: Any) -> torch.Tensor | None:
    """The tensor to compare across runs: the first non-scalar floating tensor the model
    returned (for a transformers ModelOutput, the logits rather than the loss)."""
    values = output.values() if isinstance(output, Mapping) else [output]
    for value in values:
        found = _first_float_tensor(value)
        if found is not None and found.dim() > 0:
            return found
    return _first_float_tensor(output)


def _grad_hook(index: int, order: list[tuple[int, bool]]) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        order.append((index, bool(torch.isfinite(grad).all())))

    return hook
