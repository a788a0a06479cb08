"""Per-layer, per-format measurement by shadow computations (docs/tune.md, "What it measures").

One bfloat16-mixed forward and backward of the model on a few real batches records each
eligible layer's input and output gradient (hooks). Each layer is then re-run alone on
those tensors: once as the bfloat16 layer (the reference), once per candidate format as
amped's FP8 or block ``Linear``, forward and backward. Comparing the two gives the
output, grad_input and grad_weight SQNR, the first-order loss change and the range
statistics. The cost is one forward and backward per format over the layers' recorded
calls (and one for the reference), whatever the number of layers; :class:`PassCount`
counts them.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from amped.autocast_mode import autocast
from amped.lowp.conv1d import is_conv1d, linear_dims
from amped.lowp.convert import convert_layers
from amped.lowp.float8.cast import quantize
from amped.lowp.mx.block_cast import quantize_block
from amped.lowp.mx.block_config import BlockConfig
from amped.recipes.plan import format_config, layer_ineligibility
from amped.tasks.task import call_model

__all__ = [
    "FormatMeasurement",
    "LayerMeasurement",
    "PassCount",
    "decibels",
    "eligible_layers",
    "measure",
]

Calls = list[list[tuple[torch.Tensor, torch.Tensor]]]  # per batch, per call: (input, grad_out)
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class FormatMeasurement:
    """What one format costs one layer, against the bfloat16 layer on the same tensors.

    Attributes:
        sqnr_output: forward output SQNR in dB (inf: identical).
        sqnr_grad_input: grad_input SQNR in dB.
        sqnr_grad_weight: grad_weight SQNR in dB.
        loss_change_estimate: the expected loss change of the output's quantization
            error e against the output gradient g, ``loss_change_coherent +
            loss_change_second_order``; both parts add over layers (docs/tune.md says why).
        loss_change_coherent: the first-order change the batches agree on, ``|mean over
            batches of sum over rows g_row . e_row|``.
        loss_change_second_order: the expected second-order change with the empirical
            Fisher as the curvature, ``mean over batches of (N / 2) * sum over rows
            (g_row . e_row)^2`` (N: the layer's rows in the batch; the loss is a mean over
            rows, so each row's gradient carries a 1 / N).
        underflow: the largest fraction, over the three GEMM operands (input, weight,
            grad_output), of nonzero elements the cast flushes to zero.
        saturation: the largest fraction, over the operands, of elements cast to the
            format's largest magnitude.
    """

    sqnr_output: float
    sqnr_grad_input: float
    sqnr_grad_weight: float
    loss_change_estimate: float
    loss_change_coherent: float
    loss_change_second_order: float
    underflow: float
    saturation: float

    def to_dict(self) -> dict[str, float]:
        return {
            "sqnr_output": self.sqnr_output,
            "sqnr_grad_input": self.sqnr_grad_input,
            "sqnr_grad_weight": self.sqnr_grad_weight,
            "loss_change_estimate": self.loss_change_estimate,
            "loss_change_coherent": self.loss_change_coherent,
            "loss_change_second_order": self.loss_change_second_order,
            "underflow": self.underflow,
            "saturation": self.saturation,
        }


@dataclass(frozen=True)
class LayerMeasurement:
    """One eligible layer: its GEMM FLOPs per training step and each format it can run.

    Attributes:
        name: the qualified module name.
        flops: the three GEMMs' FLOPs (forward, grad_input, grad_weight: ``6 * rows *
            in * out`` per call) per measured batch.
        formats: format -> :class:`FormatMeasurement`, for the formats the layer can run.
    """

    name: str
    flops: int
    formats: dict[str, FormatMeasurement]

    def to_dict(self) -> dict[str, Any]:
        return {"flops": self.flops, "formats": {f: m.to_dict() for f, m in self.formats.items()}}


@dataclass
class PassCount:
    """Forward+backward passes the measurement made, in units of one pass of the model
    over the measured batches: ``capture`` counts model passes; ``reference`` and
    ``formats`` count layer calls divided by the layers' calls in one model pass."""

    batches: int = 0
    capture: int = 0
    layer_calls: int = 0
    reference_calls: int = 0
    format_calls: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        per = max(self.layer_calls, 1)
        formats = {f: n / per for f, n in self.format_calls.items()}
        extra = (self.reference_calls / per + sum(formats.values())) / max(len(formats), 1)
        return {
            "batches": self.batches,
            "capture": self.capture / max(self.batches, 1),
            "reference": self.reference_calls / per,
            "formats": formats,
            "extra_per_format": extra,
            "target_extra_per_format": 2,
        }


def eligible_layers(
    model: torch.nn.Module, formats: list[str], ruled: set[str]
) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Per Linear/Conv1D layer, the ``formats`` it can run (in their order), and for
    those that can run none, why."""
    eligible: dict[str, list[str]] = {}
    refused: dict[str, str] = {}
    for name, module in model.named_modules():
        if layer_ineligibility(module, "bf16") is not None:
            continue  # not a Linear/Conv1D at all
        if name in ruled:
            refused[name] = "a module rule of the policy keeps it out of low precision"
            continue
        fits = [f for f in formats if layer_ineligibility(module, f) is None]
        if fits:
            eligible[name] = fits
        else:
            refused[name] = str(layer_ineligibility(module, formats[0]))
    return eligible, refused


def _capture(
    model: torch.nn.Module, names: list[str], batches: list[Any], loss_fn: Callable
) -> dict[str, Calls]:
    """Each layer's (input, output gradient) per call, per batch, in bfloat16-mixed
    steps of a copy of ``model``."""
    reference = copy.deepcopy(model)
    modules = dict(reference.named_modules())
    calls: dict[str, Calls] = {name: [] for name in names}

    def hook(name: str) -> Callable[..., None]:
        def record(module: Any, args: Any, out: torch.Tensor) -> None:
            batch = calls[name][-1]
            index = len(batch)
            batch.append((args[0].detach(), torch.empty(0)))

            def grad_hook(g: torch.Tensor) -> None:
                batch[index] = (batch[index][0], g.detach())

            out.register_hook(grad_hook)

        return record

    handles = [modules[name].register_forward_hook(hook(name)) for name in names]
    try:
        for inputs, targets in batches:
            for name in names:
                calls[name].append([])
            device_type = next(reference.parameters()).device.type
            with autocast(device_type, dtype=torch.bfloat16):
                loss = loss_fn(call_model(reference, inputs), targets)
            loss.backward()
            reference.zero_grad(set_to_none=True)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def _run(layer: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Output, grad_input and grad_weight of ``layer`` on ``x`` and output gradient ``g``,
    under bfloat16 autocast (as the model ran)."""
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with autocast(x.device.type, dtype=torch.bfloat16):
        out = layer(x)
    out.backward(g.to(out.dtype))
    weight = layer.weight
    assert isinstance(weight, torch.Tensor) and weight.grad is not None and x.grad is not None
    return {"output": out.detach(), "grad_input": x.grad, "grad_weight": weight.grad}


def _range_stats(config: Any, tensors: list[torch.Tensor]) -> tuple[float, float]:
    """(underflow, saturation): the largest fractions over the operands (see
    :class:`FormatMeasurement`)."""
    underflow = saturation = 0.0
    for role, tensor in zip(("input", "weight", "grad_output"), tensors, strict=True):
        flat = tensor.detach().reshape(-1, tensor.shape[-1]).float()
        if isinstance(config, BlockConfig):
            elements = quantize_block(flat, config.format, config.scale_mode).elements.float()
            top = config.format.elem_max
        else:
            rule = getattr(config, role)
            q = quantize(flat, rule.dtype, rule.granularity, -1, config.power_of_2)
            elements, top = q.data.float(), torch.finfo(rule.dtype).max
        nonzero = flat != 0
        flushed = float(((elements == 0) & nonzero).sum() / nonzero.sum().clamp(min=1))
        underflow = max(underflow, flushed)
        saturation = max(saturation, float((elements.abs() == top).float().mean()))
    return underflow, saturation


def decibels(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)``: inf without noise, -inf without signal."""
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def _measure_format(
    layer: torch.nn.Module,
    fmt: str,
    calls: Calls,
    references: list[list[dict[str, torch.Tensor]]],
    count: PassCount,
) -> FormatMeasurement:
    config = format_config(fmt)
    low = copy.deepcopy(torch.nn.Sequential(layer))
    convert_layers(low, config, ["0"])
    signal = dict.fromkeys(("output", "grad_input", "grad_weight"), 0.0)
    noise = dict(signal)
    coherent, second_order = [], []
    for batch, refs in zip(calls, references, strict=True):
        batch_sum = batch_square = 0.0
        rows_seen = 0
        for (x, g), ref in zip(batch, refs, strict=True):
            got = _run(low[0], x, g)
            count.format_calls[fmt] = count.format_calls.get(fmt, 0) + 1
            for key in signal:
                r = ref[key].double()
                signal[key] += float(r.square().sum())
                noise[key] += float((got[key].double() - r).square().sum())
            error = got["output"].double() - ref["output"].double()
            rows = (error * g.double()).reshape(-1, error.shape[-1]).sum(-1)
            batch_sum += float(rows.sum())
            batch_square += float(rows.square().sum())
            rows_seen += rows.numel()
        coherent.append(batch_sum)
        second_order.append(rows_seen / 2 * batch_square)
    x_all = torch.cat([x.reshape(-1, x.shape[-1]) for batch in calls for x, _ in batch])
    g_all = torch.cat([g.reshape(-1, g.shape[-1]) for batch in calls for _, g in batch])
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    weight = weight.t() if is_conv1d(layer) else weight
    underflow, saturation = _range_stats(config, [x_all, weight, g_all])
    return FormatMeasurement(
        sqnr_output=decibels(signal["output"], noise["output"]),
        sqnr_grad_input=decibels(signal["grad_input"], noise["grad_input"]),
        sqnr_grad_weight=decibels(signal["grad_weight"], noise["grad_weight"]),
        loss_change_estimate=abs(sum(coherent) / len(calls)) + sum(second_order) / len(calls),
        loss_change_coherent=abs(sum(coherent) / len(calls)),
        loss_change_second_order=sum(second_order) / len(calls),
        underflow=underflow,
        saturation=saturation,
    )


def measure(
    model: torch.nn.Module,
    eligible: dict[str, list[str]],
    batches: list[Any],
    loss_fn: Callable,
    progress: Progress | None = None,
) -> tuple[list[LayerMeasurement], PassCount]:
    """Measure every eligible layer in every format it can run (model order).

    Raises:
        ValueError: an eligible layer was not called, or got no gradient, in the step.
    """
    names = list(eligible)
    captured = _capture(model, names, batches, loss_fn)
    count = PassCount(batches=len(batches), capture=len(batches))
    missing = [n for n in names if any(g.numel() == 0 for b in captured[n] for _, g in b)]
    unused = [n for n in names if not any(captured[n])]
    if missing or unused:
        raise ValueError(
            "amped.tune measures each eligible layer on the input and output gradient it "
            "saw in a training step; these layers were not called, or no gradient reached "
            "them: " + ", ".join(unused + missing) + ". Keep them out with a policy module "
            "rule ('fp32' or 'skip'), or make the loss depend on them. "
            f"Received: {len(unused + missing)} layer(s) without a gradient"
        )
    modules = dict(model.named_modules())
    total, done = sum(len(f) for f in eligible.values()), 0
    measured = []
    for name in names:
        layer, calls = modules[name], captured[name]
        count.layer_calls += sum(len(b) for b in calls)
        bf16 = copy.deepcopy(layer)
        references = [[_run(bf16, x, g) for x, g in batch] for batch in calls]
        count.reference_calls += sum(len(b) for b in calls)
        formats = {}
        for fmt in eligible[name]:
            formats[fmt] = _measure_format(layer, fmt, calls, references, count)
            done += 1
            if progress is not None:
                progress("measure", done, total)
        fan_in, fan_out = linear_dims(layer)
        rows = sum(x.numel() // x.shape[-1] for batch in calls for x, _ in batch)
        flops = 6 * rows * fan_in * fan_out // len(calls)
        measured.append(LayerMeasurement(name, flops, formats))
    return measured, count
