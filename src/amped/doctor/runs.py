"""One traced training step (forward, loss, backward) on a private copy of the model."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from amped._internal.errors import value_error
from amped.autocast_mode import Path, autocast
from amped.autocast_mode.engine import forced_path
from amped.doctor.trace import OpCall, Tracer, float_tensors
from amped.policy import Policy
from amped.tasks.task import call_model

__all__ = ["StepResult", "model_output", "run_step"]


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


_LOSS_RULE = "loss_fn must return a scalar floating tensor (one element) from the model's output"


def _check_loss(loss: object) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise value_error(_LOSS_RULE, "loss_fn(output)", loss)
    if loss.numel() != 1 or not loss.is_floating_point():
        dtype = str(loss.dtype).removeprefix("torch.")
        raise value_error(f"{_LOSS_RULE}; it returned {dtype}", "loss_fn(output).shape", loss.shape)
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
        # The tracer, below amped's mode, must see each op after its casts: so the mode
        # applies even torch's own rules, which torch's C++ autocast would apply unseen.
        with tracer, forced_path(Path.MODE), region:
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
    out_tensor = model_output(output)
    for call in tracer.calls:
        call.live_output = None
    return StepResult(
        calls=tracer.calls,
        loss=loss.detach().float(),
        output=out_tensor.detach() if out_tensor is not None else None,
        grads=grads,
        grad_order=order,
    )


def model_output(output: Any) -> torch.Tensor | None:
    """The tensor to compare across runs: the first non-scalar floating tensor the model
    returned (for a transformers ModelOutput, the logits rather than the loss), else the
    first floating one."""
    found = float_tensors(dict(output) if isinstance(output, Mapping) else output)
    return next((t for t in found if t.dim() > 0), found[0] if found else None)


def _grad_hook(index: int, order: list[tuple[int, bool]]) -> Callable[[torch.Tensor], None]:
    def hook(grad: torch.Tensor) -> None:
        order.append((index, bool(torch.isfinite(grad).all())))

    return hook
