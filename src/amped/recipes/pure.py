"""The pure-bf16 recipes, ``bf16-pure`` (Kahan) and ``bf16-pure-sr`` (stochastic rounding).

Every weight, gradient and optimizer state is bfloat16 and no float32 copy exists:
the user's SGD, Adam or AdamW is replaced by its compensated twin from
:mod:`amped.optim.compensated`, with the same parameter groups and
hyper-parameters. Modules the policy explicitly keeps in float32 keep float32
weights (updated plainly); by default there are none.

Build learning-rate schedulers on ``setup.optimizer``: it is a new optimizer.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from amped._internal.errors import received, type_error, value_error
from amped.optim.adamw8bit import CompensatedAdamW8bit
from amped.optim.compensated import CompensatedAdamW, CompensatedSGD
from amped.optim.rounding import Compensation
from amped.optim.shards import reshard
from amped.recipes.setup import TrainSetup
from amped.recipes.weights import lower_model_, set_params_data_

__all__ = ["PureSetup", "build_pure_setup", "compensated_twin"]

_SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "maximize")


class PureSetup(TrainSetup):
    """A :class:`~amped.recipes.TrainSetup` with bfloat16 weights and a compensated optimizer."""

    def fp32_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict in float32, each weight plus its Kahan compensation.

        The compensation holds what rounding to bfloat16 lost, so the sum is closer to
        the weight an fp32 run would have than the bfloat16 weight alone.
        """
        state = self.optimizer.state
        out: dict[str, torch.Tensor] = {}
        for key, value in self.model.state_dict(keep_vars=True).items():
            tensor = value.detach()
            if tensor.is_floating_point():
                tensor = tensor.to(torch.float32, copy=True)
                compensation = state[value].get("compensation") if value in state else None
                if compensation is not None:
                    tensor.add_(compensation)
            out[key] = tensor
        return out

    def _restore_weights(self) -> None:
        lowering = self.installed
        if lowering is None:
            return
        reshard(self.model)
        state = self.optimizer.state
        values = {}
        with torch.no_grad():
            for param in lowering.params:
                value = param.detach().to(torch.float32, copy=True)
                compensation = state[param].get("compensation") if param in state else None
                if compensation is not None:
                    value.add_(compensation)
                values[param] = value
                param.grad = None
        set_params_data_(self.model, values)


def compensated_twin(
    optimizer: torch.optim.Optimizer, compensation: Compensation, quantized_state: bool = False
) -> CompensatedSGD | CompensatedAdamW | CompensatedAdamW8bit:
    """The compensated optimizer with ``optimizer``'s parameter groups and hyper-parameters;
    with ``quantized_state``, Adam and AdamW become :class:`CompensatedAdamW8bit` (SGD's
    one momentum buffer stays in bfloat16: :class:`CompensatedSGD`).

    Raises:
        TypeError: ``optimizer`` is not SGD, Adam or AdamW (or their compensated twins).
        ValueError: a setting the twin does not have (AMSGrad, differentiable), or an
            optimizer that has stepped already.
    """
    if isinstance(optimizer, (*_TWINS, CompensatedAdamW8bit)):
        return optimizer
    kind = type(optimizer)
    if kind not in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW):
        raise type_error(
            f"bf16-pure replaces the optimizer by a compensated bfloat16 one, which exists "
            f"for SGD, Adam and AdamW; {kind.__name__} has none, and stepping bfloat16 "
            "weights plainly rounds small updates away. Use recipe='bf16-master' (float32 "
            "masters, any optimizer)",
            "type(optimizer)",
            kind,
        )
    _check_fresh(optimizer)
    groups = [_twin_group(group, kind) for group in optimizer.param_groups]
    # The user's defaults become the twin's, so a group added later with
    # add_param_group() gets the user's hyper-parameters, not the twin class's own.
    defaults = _twin_group({**optimizer.defaults, "params": []}, kind)
    del defaults["params"]
    if quantized_state and kind is not torch.optim.SGD:
        return CompensatedAdamW8bit(groups, **defaults, compensation=compensation)
    twin_class = CompensatedSGD if kind is torch.optim.SGD else CompensatedAdamW
    return twin_class(groups, **defaults, compensation=compensation)


_TWINS = (CompensatedSGD, CompensatedAdamW)


def _check_fresh(optimizer: torch.optim.Optimizer) -> None:
    if any(optimizer.state.values()):
        raise value_error(
            "bf16-pure starts a new bfloat16 optimizer state; this optimizer has stepped "
            "already and its float32 state would be dropped. Call prepare() before the "
            "first step",
            "len(optimizer.state)",
            len(optimizer.state),
        )


def _twin_group(group: dict[str, Any], kind: type) -> dict[str, Any]:
    for flag in ("amsgrad", "differentiable"):
        if group.get(flag):
            raise value_error(
                f"Use recipe='bf16-master' for {flag}: the compensated {kind.__name__} has "
                f"no {flag} mode",
                flag,
                group[flag],
            )
    keys = _SGD_KEYS if kind is torch.optim.SGD else _ADAM_KEYS
    twin: dict[str, Any] = {"params": group["params"]}
    for key in keys:
        value = group[key]
        twin[key] = tuple(float(v) for v in value) if key == "betas" else _plain(value)
    if kind is not torch.optim.SGD:
        # torch >= 2.6 spells AdamW as Adam(decoupled_weight_decay=True); older torch
        # has a separate AdamW class and no such key.
        twin["decoupled_weight_decay"] = kind is torch.optim.AdamW or bool(
            group.get("decoupled_weight_decay", False)
        )
    return twin


def _plain(value: Any) -> Any:
    """torch allows tensor learning rates; the twin works with Python numbers."""
    return value.item() if isinstance(value, torch.Tensor) else value


def build_pure_setup(plain: TrainSetup) -> PureSetup:
    """Lower ``plain.model`` in place and replace its optimizer by the compensated twin."""
    recipe = plain.recipe
    assert recipe.dtype is not None and recipe.compensation is not None  # Recipe checks
    # Before the model is touched:
    twin = compensated_twin(plain.optimizer, recipe.compensation, recipe.quantized_state)
    if plain.scaler.is_enabled():
        warnings.warn(
            f"Recipe {recipe.name!r} needs no loss scaling: bfloat16 has float32's exponent "
            "range, so gradients do not underflow, and scaling only adds work and skipped "
            "steps. Pass no scaler (prepare() then uses a disabled one). "
            + received("scaler.is_enabled()", True),
            UserWarning,
            stacklevel=4,  # prepare()'s caller
        )
    lower_model_(plain.model, recipe.dtype, plain.policy)
    return PureSetup(recipe, plain.model, twin, plain.scaler, plain.device_type, plain.policy)
