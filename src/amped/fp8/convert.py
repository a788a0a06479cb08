"""Choose the Linear layers that run in FP8, and convert them in place.

FP8 pays where a GEMM is large and its error averages out; it hurts where a layer is
small or feeds the loss directly. :func:`default_module_filter` therefore converts an
``nn.Linear`` when

- both of its dims are multiples of 16 (what FP8 tensor-core GEMMs need),
- it has at least ``min_weights`` weights (64 x 64 by default), and
- it is not the model's output head, taken to be the last ``nn.Linear`` registered.

Subclasses of ``nn.Linear`` (such as ``nn.MultiheadAttention``'s ``out_proj``, which
its owner never calls) are never converted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from amped._internal.errors import type_error, value_error
from amped.fp8.config import Fp8Config
from amped.fp8.delayed import update_delayed_scaling
from amped.fp8.linear import Float8Linear

__all__ = ["Fp8Layers", "ModuleFilter", "convert_to_fp8", "default_module_filter", "plan_fp8"]

ModuleFilter = Callable[[torch.nn.Linear, str], bool]
"""``filter(linear, qualified_name) -> bool``: whether to convert this layer."""


def default_module_filter(
    model: torch.nn.Module, multiple: int = 16, min_weights: int = 64 * 64
) -> ModuleFilter:
    """The default filter for ``model`` (rules in :mod:`amped.fp8.convert`)."""
    linears = [name for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    head = linears[-1] if linears else None

    def keep(linear: torch.nn.Linear, name: str) -> bool:
        dims_ok = linear.in_features % multiple == 0 and linear.out_features % multiple == 0
        big = linear.in_features * linear.out_features >= min_weights
        return dims_ok and big and name != head

    return keep


def plan_fp8(
    model: torch.nn.Module,
    module_filter: ModuleFilter | None = None,
    exclude: set[str] = frozenset(),  # type: ignore[assignment]
) -> list[str]:
    """Qualified names of the ``nn.Linear`` layers of ``model`` that would convert.

    ``exclude`` names modules kept out whatever the filter says (the policy's float32
    and skip module rules).
    """
    chosen = module_filter or default_module_filter(model)
    return [
        name
        for name, m in model.named_modules()
        if type(m) is torch.nn.Linear and name not in exclude and chosen(m, name)
    ]


@dataclass
class Fp8Layers:
    """The converted layers of a model, by qualified name, and their per-step update."""

    layers: dict[str, Float8Linear]
    config: Fp8Config

    def update(self) -> None:
        """Advance delayed scaling by one step (no-op for dynamic scaling)."""
        if self.config.delayed is not None:
            update_delayed_scaling(list(self.layers.values()))

    def names(self) -> list[str]:
        return list(self.layers)


def convert_to_fp8(
    model: torch.nn.Module,
    config: Fp8Config,
    names: list[str] | None = None,
    *,
    module_filter: ModuleFilter | None = None,
    emulate: bool | None = None,
) -> Fp8Layers:
    """Convert the chosen ``nn.Linear`` layers of ``model`` to :class:`Float8Linear`, in place.

    Args:
        model: the model (it may itself be an ``nn.Linear``).
        config: the cast rules (:data:`amped.fp8.FP8_CONFIGS` has the named ones).
        names: the layers to convert (default: :func:`plan_fp8` with ``module_filter``).
        module_filter: used when ``names`` is None.
        emulate: see :meth:`Float8Linear.convert_`.

    Raises:
        ValueError: no layer to convert.

    Example:
        >>> import torch
        >>> from amped.fp8 import FP8_CONFIGS, convert_to_fp8
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 10))
        >>> convert_to_fp8(model, FP8_CONFIGS["tensorwise"]).names()
        ['0']
    """
    if names is None:
        names = plan_fp8(model, module_filter)
    if not names:
        sizes = [
            f"{n or '<model>'} ({m.in_features}x{m.out_features})"
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)
        ]
        raise value_error(
            "FP8 found no nn.Linear layer to convert: it converts layers whose dims are "
            "multiples of 16 with at least 64x64 weights, except the output head (the last "
            "Linear) and those a policy module rule names; pass module_filter to choose",
            "Linear layers",
            sizes,
        )
    modules = dict(model.named_modules())
    layers = {}
    for name in names:
        linear = modules[name]
        if not isinstance(linear, torch.nn.Linear):
            raise type_error(
                f"convert_to_fp8 converts nn.Linear layers; {name!r} is not one",
                f"type({name})",
                type(linear),
            )
        layers[name] = Float8Linear.convert_(linear, config, emulate)
    return Fp8Layers(layers, config)
