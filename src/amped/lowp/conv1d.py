"""transformers' ``Conv1D`` (GPT-2's projections): a Linear with its weight transposed.

``transformers.pytorch_utils.Conv1D`` computes ``x @ weight + bias`` with ``weight``
stored ``[in_features, out_features]``. The low-precision layers convert it as they
convert ``nn.Linear``: :func:`low_precision_class` gives a subclass of both the
converted class (Float8Linear, BlockLinear) and Conv1D, whose GEMMs take
``weight.t()``; parameters, state_dict keys and the optimizer's references stay.
transformers is imported by nobody here: a module is recognised by its class.
"""

from __future__ import annotations

from typing import Any

import torch

from amped.autocast_mode import autocast

__all__ = [
    "is_conv1d",
    "is_linear_like",
    "linear_dims",
    "linear_forward",
    "low_precision_class",
]


def is_conv1d(module: torch.nn.Module) -> bool:
    """Whether ``module`` is exactly transformers' ``Conv1D``."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"


def is_linear_like(module: torch.nn.Module) -> bool:
    """Exactly ``nn.Linear`` or transformers' ``Conv1D`` (not a subclass of either)."""
    return type(module) is torch.nn.Linear or is_conv1d(module)


def linear_dims(module: torch.nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a ``Conv1D``."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    if is_conv1d(module):
        return weight.shape[0], weight.shape[1]
    return weight.shape[1], weight.shape[0]


_CLASSES: dict[tuple[type, type], type] = {}


def low_precision_class(linear_cls: type, conv1d_cls: type) -> type:
    """A class computing as ``linear_cls`` (a converted nn.Linear) that is a ``conv1d_cls``,
    its weight used transposed (one class per pair, made on first use)."""
    key = (linear_cls, conv1d_cls)
    if key not in _CLASSES:
        name = linear_cls.__name__.replace("Linear", "Conv1D")
        _CLASSES[key] = type(name, key, {"weight_transposed": True})
    return _CLASSES[key]


def linear_forward(layer: Any, function: Any, input: torch.Tensor) -> torch.Tensor:
    """The forward of both low-precision layers: the input in autocast's dtype where a
    region is on, then ``function`` (their autograd Function) with autocast off, the
    weight as ``(out, in)`` (a Conv1D twin stores it transposed), and the bias added."""
    device_type = input.device.type
    if torch.is_autocast_enabled(device_type) and input.is_floating_point():
        input = input.to(torch.get_autocast_dtype(device_type))
    with autocast(device_type, enabled=False):
        weight = layer.weight.t() if layer.weight_transposed else layer.weight
        out = function.apply(input, weight, layer)
        if layer.bias is not None:
            out = out + layer.bias.to(out.dtype)
    return out
