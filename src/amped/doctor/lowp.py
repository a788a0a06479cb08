"""``amped.doctor.diagnose_low_precision``: what an FP8 or block recipe (mxfp8, mxfp4,
nvfp4) costs each Linear (or transformers Conv1D) layer of a model.

Each layer is run alone on the input and output gradient it saw in a float32 step, so
its SQNR measures its own error, not its inputs'; docs/fp8.md, "What the doctor says".
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from amped._internal.errors import value_error
from amped.autocast_mode import autocast
from amped.doctor.lowp_report import (
    CastStat,
    LowPrecisionLayerStat,
    LowPrecisionReport,
    LowPrecisionSuggestion,
)
from amped.doctor.runs import model_output
from amped.lowp.conv1d import is_conv1d, is_linear_like, linear_dims
from amped.lowp.convert import (
    LowPrecisionConfig,
    ModuleFilter,
    convert_layers,
    no_layer_error,
    plan_low_precision,
)
from amped.lowp.float8.blockwise import ACTIVATION_TILE, WEIGHT_TILE, quantize_blockwise
from amped.lowp.float8.cast import Granularity, quantize, sqnr
from amped.lowp.float8.config import CastRule
from amped.lowp.mx.block_cast import quantize_block
from amped.lowp.mx.block_config import BlockConfig
from amped.policy import Policy
from amped.recipes.lowp import recipe_config, ruled_modules
from amped.recipes.registry import resolve_recipe
from amped.tasks.task import call_model

__all__ = ["diagnose_low_precision"]

DEFAULT_THRESHOLD_DB = 20.0
"""torchao's gate for an FP8 linear layer (10% L2 error); the recipes' tests use it too."""
FP4_THRESHOLD_DB = 10.0
"""The gate for E2M1 (FP4) recipes: a healthy FP4 layer measures 14-18 dB on each GEMM
(E2M1 keeps 2 significant bits), so 20 dB would name every layer; 10 dB names a
layer that FP4 breaks (an outlier flushing its block measures 2-3 dB)."""

Captured = dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer -> (input, grad_output)


def _capture(
    model: torch.nn.Module, names: list[str], inputs: Any, loss_fn: Callable
) -> tuple[Captured, torch.Tensor | None]:
    """Inputs and output gradients of the ``names`` layers in one float32 step."""
    reference = copy.deepcopy(model)
    modules = dict(reference.named_modules())
    seen_in: dict[str, torch.Tensor] = {}
    seen_grad: dict[str, torch.Tensor] = {}
    handles = []
    for name in names:

        def forward_hook(mod: Any, args: Any, out: Any, name: str = name) -> None:
            seen_in[name] = args[0].detach().clone()
            out.register_hook(lambda g, name=name: seen_grad.__setitem__(name, g.detach().clone()))

        handles.append(modules[name].register_forward_hook(forward_hook))
    output = call_model(reference, inputs)
    loss_fn(output).backward()
    for handle in handles:
        handle.remove()
    missing = [n for n in names if n not in seen_grad]
    if missing:
        raise ValueError(
            f"Layers {missing} were not called, or no gradient reached them, in the step; "
            "the doctor needs every layer it checks in the loss. Received: that model and loss"
        )
    out = model_output(output)
    return {n: (seen_in[n], seen_grad[n]) for n in names}, None if out is None else out.detach()


def _local_run(
    linear: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, low: bool
) -> dict[str, torch.Tensor]:
    """Output, grad-input and grad-weight of a copy of ``linear`` on ``x`` and ``grad``."""
    layer = copy.deepcopy(linear)
    x = x.clone().requires_grad_()
    with autocast(x.device.type, dtype=torch.bfloat16, enabled=low):
        out = layer(x)
    out.backward(grad.to(out.dtype))
    weight = layer.weight
    if not isinstance(weight, torch.Tensor) or weight.grad is None or x.grad is None:
        raise RuntimeError(f"No gradient reached the copy of {type(linear).__name__}")
    return {"output": out.detach(), "grad_input": x.grad, "grad_weight": weight.grad}


def _block_cast_stats(
    config: BlockConfig, tensors: tuple[tuple[str, torch.Tensor], ...]
) -> tuple[CastStat, ...]:
    """Per operand: amax, headroom of the fullest block (element max over its largest
    element), elements at the element max, nonzero inputs cast to zero."""
    stats = []
    for role, tensor in tensors:
        flat = tensor.detach().reshape(-1, tensor.shape[-1]).float()
        elements = quantize_block(flat, config.format, config.scale_mode).elements.float()
        top = config.format.elem_max
        peak = float(elements.abs().max())
        nonzero = flat != 0
        stats.append(
            CastStat(
                role=role,
                dtype=config.format.name,
                amax=float(flat.abs().max()),
                headroom=top / peak if peak > 0 else float("inf"),
                saturated=float((elements.abs() == top).float().mean()),
                underflow=float(((elements == 0) & nonzero).sum() / nonzero.sum().clamp(min=1)),
            )
        )
    return tuple(stats)


def _cast(
    flat: torch.Tensor, rule: CastRule, role: str, power_of_2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 values (float32) of ``flat`` cast by ``rule`` as the layer's forward casts
    it, and the scale of each element (or of each row, or of the tensor)."""
    if rule.granularity == "blockwise":
        tile = WEIGHT_TILE if role == "weight" else ACTIVATION_TILE
        bq = quantize_blockwise(flat, tile, dtype=rule.dtype, power_of_2=power_of_2)
        return bq.data.float(), 1.0 / bq.scale_inv_per_element()
    granularity: Granularity = "rowwise" if rule.granularity == "rowwise" else "tensorwise"
    q = quantize(flat, rule.dtype, granularity, -1, power_of_2)
    return q.data.float(), q.scale


def _cast_stats(
    config: LowPrecisionConfig, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor
) -> tuple[CastStat, ...]:
    if isinstance(config, BlockConfig):
        return _block_cast_stats(config, (("input", x), ("weight", weight), ("grad_output", grad)))
    stats = []
    for role, tensor, rule in (
        ("input", x, config.input),
        ("weight", weight, config.weight),
        ("grad_output", grad, config.grad_output),
    ):
        flat = tensor.detach().reshape(-1, tensor.shape[-1]).float()
        data, scale = _cast(flat, rule, role, config.power_of_2)
        fp8_max = torch.finfo(rule.dtype).max
        nonzero = flat != 0
        peak = float((flat.abs() * scale).max())
        stats.append(
            CastStat(
                role=role,
                dtype=str(rule.dtype).removeprefix("torch."),
                amax=float(flat.abs().max()),
                headroom=fp8_max / peak if peak > 0 else float("inf"),
                saturated=float((data.abs() == fp8_max).float().mean()),
                underflow=float(((data == 0) & nonzero).sum() / nonzero.sum().clamp(min=1)),
            )
        )
    return tuple(stats)


def _layer_stat(
    name: str,
    linear: torch.nn.Module,
    config: LowPrecisionConfig,
    x: torch.Tensor,
    grad: torch.Tensor,
    threshold: float,
) -> LowPrecisionLayerStat:
    exact = _local_run(linear, x, grad, low=False)
    bf16 = _local_run(linear, x, grad, low=True)
    fp8_layer = copy.deepcopy(torch.nn.Sequential(linear))
    convert_layers(fp8_layer, config, ["0"])
    fp8 = _local_run(fp8_layer[0], x, grad, low=True)
    sqnr_fp8 = {k: sqnr(exact[k], fp8[k]) for k in exact}
    in_features, out_features = linear_dims(linear)
    weight = linear.weight
    assert isinstance(weight, torch.Tensor)
    return LowPrecisionLayerStat(
        name=name,
        in_features=in_features,
        out_features=out_features,
        sqnr_fp8=sqnr_fp8,
        sqnr_bf16={k: sqnr(exact[k], bf16[k]) for k in exact},
        casts=_cast_stats(config, x, weight.t() if is_conv1d(linear) else weight, grad),
        keep_in_bf16=min(sqnr_fp8.values()) < threshold,
    )


def _model_sqnr(
    model: torch.nn.Module,
    inputs: Any,
    reference: torch.Tensor | None,
    config: LowPrecisionConfig | None,
    names: list[str],
    policy: Policy | None,
) -> float:
    """Output SQNR against float32 of a copy of ``model``: FP8 on ``names`` (None: bf16 only)."""
    if reference is None:
        return float("nan")
    trial = copy.deepcopy(model)
    if config is not None and names:
        convert_layers(trial, config, names)
    device_type = reference.device.type
    with torch.no_grad(), autocast(device_type, dtype=torch.bfloat16, policy=policy):
        out = model_output(call_model(trial, inputs))
    return sqnr(reference, out) if out is not None else float("nan")


def diagnose_low_precision(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    recipe: str = "fp8-tensorwise",
    *,
    policy: Policy | None = None,
    module_filter: ModuleFilter | None = None,
    threshold_db: float | None = None,
) -> LowPrecisionReport:
    """Measure what ``recipe`` costs each Linear layer of ``model`` and name those to keep out.

    ``model`` is not changed (the doctor works on copies). Layers are chosen as
    :func:`amped.prepare` would for ``recipe`` with ``policy`` and ``module_filter``.

    Args:
        model: a float32 model.
        inputs: what ``model`` is called with (a tensor, a tuple of positional
            arguments or a dict of keyword arguments).
        loss_fn: ``loss_fn(output) -> scalar tensor``.
        recipe: an FP8 or block recipe name (``fp8-tensorwise``, ``fp8-rowwise``,
            ``mxfp8``, ``nvfp4``, ...).
        policy: the autocast policy the run would use (default: torch's).
        module_filter: as for :func:`amped.prepare`.
        threshold_db: a layer whose output, grad-input or grad-weight SQNR against
            float32 falls below this is named to stay in bfloat16 (default: 20 dB,
            :data:`FP4_THRESHOLD_DB` for the FP4 recipes mxfp4 and nvfp4).

    Raises:
        ValueError: not an FP8 recipe, or no layer to convert.

    Example:
        >>> import torch, amped
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
        >>> x = torch.randn(8, 64)
        >>> report = amped.doctor.diagnose_low_precision(model, x, lambda y: y.sum())
        >>> [layer.name for layer in report.layers], report.healthy
        (['0'], True)
    """
    chosen = resolve_recipe(recipe)
    if chosen.fp8 is None:
        raise value_error(
            "diagnose_low_precision checks an FP8 or block recipe: fp8-tensorwise, fp8-rowwise, "
            "fp8-rowwise-gw-hp, fp8-delayed, fp8-blockwise, mxfp8, mxfp4 or nvfp4",
            "recipe",
            recipe,
        )
    config = recipe_config(chosen)
    if threshold_db is None:
        fp4 = isinstance(config, BlockConfig) and config.format.is_fp4
        threshold_db = FP4_THRESHOLD_DB if fp4 else DEFAULT_THRESHOLD_DB
    linears = [n for n, m in model.named_modules() if is_linear_like(m)]
    ruled = ruled_modules(model, policy)
    names = plan_low_precision(model, module_filter, ruled, config)
    if not names:  # no layer to convert: each layer and why it stays out
        raise no_layer_error(model, module_filter, ruled, config)
    captured, reference = _capture(model, names, inputs, loss_fn)
    modules = dict(model.named_modules())
    layers = [_layer_stat(n, modules[n], config, *captured[n], threshold_db) for n in names]
    model_sqnr = _model_sqnr(model, inputs, reference, config, names, policy)
    report = LowPrecisionReport(
        recipe=chosen.name,
        threshold_db=threshold_db,
        layers=layers,
        not_converted=[n for n in linears if n not in names],
        model_sqnr=model_sqnr,
        model_sqnr_bf16=_model_sqnr(model, inputs, reference, None, [], policy),
        suggestion=None,
    )
    keep = tuple(s.name for s in layers if s.keep_in_bf16)
    if keep:
        report.suggestion = _suggest(
            model, inputs, reference, config, keep, policy, module_filter, model_sqnr
        )
    return report


def _suggest(
    model: torch.nn.Module,
    inputs: Any,
    reference: torch.Tensor | None,
    config: LowPrecisionConfig,
    keep: tuple[str, ...],
    policy: Policy | None,
    module_filter: ModuleFilter | None,
    before: float,
) -> LowPrecisionSuggestion:
    device_type = next(model.parameters()).device.type
    fixed = policy or Policy.preset("torch", device_type)
    for name in keep:
        fixed = fixed.with_module(name, "low")
    names = plan_low_precision(model, module_filter, ruled_modules(model, fixed), config)
    after = _model_sqnr(model, inputs, reference, config, names, fixed)
    verified = not set(keep) & set(names) and not after < before
    return LowPrecisionSuggestion(keep=keep, policy=fixed, model_sqnr=after, verified=verified)
