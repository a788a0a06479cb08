"""Choose the Linear layers that run in FP8 or a block format, and convert them in place.

Low precision pays where a GEMM is large and its error averages out; it hurts where a
layer is small or feeds the loss directly. :func:`default_module_filter` therefore
converts an ``nn.Linear`` or a transformers ``Conv1D`` (GPT-2's projections) when

- both of its dims are multiples of 16 (what FP8 tensor-core GEMMs need; 32 for MX
  formats, whose blocks are 32 long),
- it has at least ``min_weights`` weights (64 x 64 by default), and
- it is not the model's output head, taken to be the last such layer registered.

Subclasses of ``nn.Linear`` (such as ``nn.MultiheadAttention``'s ``out_proj``, which
its owner never calls) are never converted. A block config's ``bf16_last`` then keeps
the last chosen layers out (NVFP4's recipe keeps its last layers in bfloat16).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from amped._internal.errors import type_error, value_error
from amped.lowp.conv1d import is_linear_like, linear_dims
from amped.lowp.float8.config import FLOAT8_CONFIGS, Float8Config
from amped.lowp.float8.delayed import update_delayed_scaling
from amped.lowp.float8.linear import Float8Linear
from amped.lowp.mx.block_config import BLOCK_CONFIGS, BlockConfig
from amped.lowp.mx.block_linear import BlockLinear

__all__ = [
    "CONFIGS",
    "LowPrecisionConfig",
    "LowPrecisionLayers",
    "ModuleFilter",
    "convert_layers",
    "convert_to_low_precision",
    "default_filter",
    "default_module_filter",
    "explain_layers",
    "no_layer_error",
    "plan_low_precision",
]

ModuleFilter = Callable[[torch.nn.Module, str], bool]
"""``filter(layer, qualified_name) -> bool``: whether to convert this Linear or Conv1D."""

LowPrecisionConfig = Float8Config | BlockConfig
"""A Float8 config (per-tensor or rowwise scales) or a block config (MX, NVFP4)."""

CONFIGS: dict[str, LowPrecisionConfig] = {**FLOAT8_CONFIGS, **BLOCK_CONFIGS}
"""Every named config, one mapping for every format: ``"tensorwise"``, ``"rowwise"``,
``"rowwise-gw-hp"`` and ``"delayed"`` (Float8, from
:data:`~amped.lowp.float8.config.FLOAT8_CONFIGS`), ``"mxfp8"``, ``"mxfp4"`` and
``"nvfp4"`` (block, from :data:`~amped.lowp.mx.block_config.BLOCK_CONFIGS`)."""


def _multiple(config: LowPrecisionConfig | None) -> int:
    if isinstance(config, BlockConfig):
        return math.lcm(16, config.format.block_size)
    return 16


def _head(model: torch.nn.Module) -> str | None:
    names = [name for name, m in model.named_modules() if is_linear_like(m)]
    return names[-1] if names else None


def _default_reason(
    layer: torch.nn.Module, name: str, head: str | None, multiple: int, min_weights: int
) -> str | None:
    """Why the default filter keeps ``layer`` out, or None when it converts it."""
    fan_in, fan_out = linear_dims(layer)
    if name == head:
        return "the output head (the last Linear/Conv1D)"
    if fan_in % multiple or fan_out % multiple:
        return f"dims not multiples of {multiple}"
    if fan_in * fan_out < min_weights:
        return f"under {min_weights} weights"
    return None


def default_module_filter(
    model: torch.nn.Module, multiple: int = 16, min_weights: int = 64 * 64
) -> ModuleFilter:
    """The default filter for ``model`` (rules in :mod:`amped.lowp.convert`)."""
    head = _head(model)

    def keep(layer: torch.nn.Module, name: str) -> bool:
        return _default_reason(layer, name, head, multiple, min_weights) is None

    return keep


def default_filter(model: torch.nn.Module, config: LowPrecisionConfig) -> ModuleFilter:
    """The filter :func:`plan_low_precision` uses for ``config`` when given none (its dim multiple:
    16, or the block size for a block config)."""
    return default_module_filter(model, _multiple(config))


def plan_low_precision(
    model: torch.nn.Module,
    module_filter: ModuleFilter | None = None,
    exclude: set[str] = frozenset(),  # type: ignore[assignment]
    config: LowPrecisionConfig | None = None,
) -> list[str]:
    """Qualified names of the ``nn.Linear``/``Conv1D`` layers of ``model`` that would convert.

    ``exclude`` names modules kept out whatever the filter says (the policy's float32
    and skip module rules). ``config`` sets the default filter's dim multiple and, for
    a block config, drops its ``bf16_last`` fraction of the chosen layers (rounded up,
    leaving at least one).
    """
    chosen = module_filter or default_module_filter(model, _multiple(config))
    names = [
        name
        for name, m in model.named_modules()
        if is_linear_like(m) and name not in exclude and chosen(m, name)
    ]
    if isinstance(config, BlockConfig) and config.bf16_last and len(names) > 1:
        kept = min(math.ceil(config.bf16_last * len(names)), len(names) - 1)
        names = names[: len(names) - kept]
    return names


def explain_layers(
    model: torch.nn.Module,
    module_filter: ModuleFilter | None = None,
    exclude: set[str] = frozenset(),  # type: ignore[assignment]
    config: LowPrecisionConfig | None = None,
) -> dict[str, str | None]:
    """Every ``nn.Linear`` and Conv1D of ``model`` by qualified name: None for those
    :func:`plan_low_precision` converts with the same arguments, else why it keeps one out."""
    chosen = set(plan_low_precision(model, module_filter, exclude, config))
    head, multiple = _head(model), _multiple(config)
    reasons: dict[str, str | None] = {}
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) and not is_linear_like(m):
            continue
        if name in chosen:
            reasons[name] = None
        elif not is_linear_like(m):
            reasons[name] = "a subclass of nn.Linear (its owner may not call forward)"
        elif name in exclude:
            reasons[name] = "excluded"
        elif module_filter is not None and not module_filter(m, name):
            reasons[name] = "not chosen by the module filter"
        else:
            default = _default_reason(m, name, head, multiple, 64 * 64)
            reasons[name] = default or "kept in bfloat16 (the config's last layers)"
    return reasons


def no_layer_error(
    model: torch.nn.Module,
    module_filter: ModuleFilter | None,
    exclude: set[str],
    config: LowPrecisionConfig | None,
) -> ValueError:
    """The "no layer to convert" error: every Linear-like module and why it stayed out
    (raised when :func:`plan_low_precision` chooses none)."""
    head, multiple = _head(model), _multiple(config)
    seen = []
    for name, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) and not is_linear_like(m):
            continue
        fan_in, fan_out = linear_dims(m)
        label = f"{type(m).__name__} {name or '<model>'} ({fan_in}x{fan_out})"
        if not is_linear_like(m):
            reason: str | None = "a subclass of nn.Linear (its owner may not call forward)"
        elif name in exclude:
            reason = "kept out by a policy module rule"
        elif module_filter is not None:
            reason = "rejected by module_filter"
        else:
            reason = _default_reason(m, name, head, multiple, 64 * 64)
        seen.append(f"{label}: {reason}")
    return value_error(
        "Low precision found no nn.Linear or Conv1D layer to convert: by default it "
        f"converts layers whose dims are multiples of {multiple} with at least 64x64 "
        "weights, except the output head (the last such layer) and those a policy "
        "module rule names; pass module_filter to choose",
        "layers seen",
        seen,
    )


@dataclass
class LowPrecisionLayers:
    """The converted layers of a model, by qualified name, and their per-step update."""

    layers: dict[str, Float8Linear | BlockLinear]
    config: LowPrecisionConfig

    def update(self) -> None:
        """Advance delayed scaling by one step (no-op for dynamic and block scaling)."""
        if isinstance(self.config, Float8Config) and self.config.delayed is not None:
            update_delayed_scaling(list(self.layers.values()))

    def names(self) -> list[str]:
        return list(self.layers)


def convert_to_low_precision(
    model: torch.nn.Module,
    config: LowPrecisionConfig,
    *,
    module_filter_fn: ModuleFilter | None = None,
    emulate: bool | None = None,
) -> LowPrecisionLayers:
    """Convert the chosen layers of ``model``, in place, to the low-precision layer of
    ``config``'s format: :class:`~amped.lowp.Float8Linear` for a
    :class:`~amped.lowp.Float8Config`, :class:`~amped.lowp.BlockLinear` for a
    :class:`~amped.lowp.BlockConfig` (MXFP8, MXFP4, NVFP4).

    As torchao's ``convert_to_float8_training``, one selector chooses the layers:
    ``module_filter_fn(layer, qualified_name) -> bool``, asked of every ``nn.Linear``
    and transformers ``Conv1D``. Without it, the default rules of
    :mod:`amped.lowp.convert` apply (dims multiples of 16, or of the block size; at
    least 64x64 weights; not the output head); a block config's ``bf16_last`` then
    keeps its last chosen layers out, whichever selector chose them.

    Args:
        model: the model (it may itself be an ``nn.Linear``).
        config: the format and its cast rules (:data:`amped.lowp.CONFIGS` has the
            named ones).
        module_filter_fn: which layers convert (default:
            :func:`default_module_filter`).
        emulate: see :meth:`Float8Linear.convert_`.

    Raises:
        TypeError: ``config`` is not a Float8Config or a BlockConfig.
        ValueError: no layer to convert (the message lists each layer and why).

    Example:
        >>> import torch
        >>> from amped.lowp import CONFIGS, convert_to_low_precision
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 10))
        >>> convert_to_low_precision(model, CONFIGS["tensorwise"]).names()
        ['0']
    """
    _check_config(config)
    names = plan_low_precision(model, module_filter_fn, config=config)
    if not names:
        raise no_layer_error(model, module_filter_fn, set(), config)
    return convert_layers(model, config, names, emulate=emulate)


def _check_config(config: object) -> None:
    if not isinstance(config, Float8Config | BlockConfig):
        raise type_error("config is a Float8Config or a BlockConfig", "config", config)


def convert_layers(
    model: torch.nn.Module,
    config: LowPrecisionConfig,
    names: list[str],
    *,
    emulate: bool | None = None,
) -> LowPrecisionLayers:
    """Convert exactly the layers of ``model`` named in ``names`` (qualified names, in
    that order: a block config's seeds follow it), in place; what
    :func:`convert_to_low_precision` does once it has chosen them, and what the
    recipes do with the layers they planned (:func:`plan_low_precision`).

    Raises:
        TypeError: ``config`` is not a Float8Config or a BlockConfig, or a named module
            is not an ``nn.Linear`` or ``Conv1D``.
        ValueError: ``names`` is empty (the message lists each layer and why).
    """
    _check_config(config)
    if not names:
        raise no_layer_error(model, None, set(), config)
    modules = dict(model.named_modules())
    layers: dict[str, Float8Linear | BlockLinear] = {}
    for index, name in enumerate(names):
        layer = modules[name]
        if not is_linear_like(layer):
            raise type_error(
                f"Low precision converts nn.Linear and Conv1D layers; {name!r} is not one",
                f"type({name})",
                type(layer),
            )
        if isinstance(config, BlockConfig):
            layers[name] = BlockLinear.convert_(layer, config, emulate, seed=index)
        else:
            layers[name] = Float8Linear.convert_(layer, config, emulate)
    return LowPrecisionLayers(layers, config)
