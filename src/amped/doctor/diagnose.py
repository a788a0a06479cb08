"""``amped.doctor.diagnose``: find the op that overflows or underflows, and prove a fix."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from amped._internal.errors import type_error, value_error
from amped.doctor.gradients import GradientCheck, check_gradient, recommended_scale
from amped.doctor.report import (
    UNDERFLOW_WARN,
    Culprit,
    OpStat,
    Report,
    Suggestion,
    policy_expression,
    scale_code,
)
from amped.doctor.runs import StepResult, run_step
from amped.doctor.scaler_check import scaler_skips
from amped.doctor.stats import measure_error, summarize
from amped.policy import Cast, Policy
from amped.policy.policy import LOW_DTYPES
from amped.tasks.task import input_tensors

__all__ = ["diagnose"]


def _check_args(model: object, inputs: Any, device_type: str, dtype: object) -> None:
    if not isinstance(model, torch.nn.Module):
        raise type_error("model must be a torch.nn.Module", "model", model)
    if dtype not in LOW_DTYPES:
        raise value_error(
            "The doctor checks a low-precision dtype against float32: dtype must be "
            "torch.float16 or torch.bfloat16",
            "dtype",
            dtype,
        )
    devices = {p.device.type for p in model.parameters()}
    if devices and devices != {device_type}:
        raise value_error(
            f"The model's parameters are on {sorted(devices)} but device_type is "
            f"{device_type!r}; pass the model's device type",
            "device_type",
            device_type,
        )
    for value in input_tensors(inputs):
        if value.device.type != device_type:
            raise value_error(
                f"An input tensor is on {value.device.type!r} but the model runs on "
                f"{device_type!r}; move the inputs with .to({device_type!r})",
                "input.device",
                value.device,
            )


def _op_stats(target: StepResult, reference: StepResult) -> list[OpStat]:
    ref_by_key = {c.key: c for c in reference.calls}
    stats = []
    for call in target.calls:
        ref = ref_by_key.get(call.key)
        cmp = measure_error(call.output, ref.output) if ref is not None else None
        summary = summarize(call.output)
        stats.append(
            OpStat(
                index=call.index,
                module=call.module,
                op=call.op,
                dtype=str(call.output.dtype).replace("torch.", ""),
                amax=summary.amax,
                amin=summary.amin,
                n_inf=summary.n_inf,
                n_nan=summary.n_nan,
                underflow=cmp.underflow if cmp else None,
                rel_error=cmp.rel_error if cmp else None,
                sqnr_db=cmp.sqnr_db if cmp else None,
            )
        )
    return stats


def _forward_culprit(target: StepResult) -> Culprit | None:
    for call in target.calls:
        if not call.inputs_finite:
            continue
        summary = summarize(call.output)
        if summary.n_inf or summary.n_nan:
            detail = f"{summary.n_inf} inf and {summary.n_nan} NaN from finite inputs"
            return Culprit("forward", call.module, call.op, call.index, call.source, detail)
    return None


def _backward_culprit(target: StepResult) -> Culprit | None:
    finite = dict(target.grad_order)
    for index, ok in target.grad_order:  # backward order: the first non-finite gradient
        if ok:
            continue
        call = target.calls[index]
        consumers = [c for c in target.calls if index in c.producers and finite.get(c.index, True)]
        culprit = consumers[0] if consumers else call
        detail = (
            f"the gradient of {call.op!r} in {call.module or '<root>'!r} became non-finite in "
            f"the backward of {culprit.op!r}"
        )
        return Culprit(
            "backward", culprit.module, culprit.op, culprit.index, culprit.source, detail
        )
    return None


def _healthy(result: StepResult) -> bool:
    grads_ok = all(bool(torch.isfinite(g).all()) for g in result.grads.values())
    return bool(torch.isfinite(result.loss).all()) and grads_ok


def _finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _sqnr(result: StepResult, reference: StepResult) -> float:
    if result.output is None or reference.output is None:
        return math.nan
    cmp = measure_error(result.output, reference.output)
    return cmp.sqnr_db if cmp else math.nan


def _candidates(culprit: Culprit, policy: Policy) -> list[tuple[Policy, str, str]]:
    """(policy, what it does, the Python that builds it) for each fix worth a re-run."""
    base = policy_expression(policy)
    module_fix = (
        (
            policy.with_module(culprit.module, "fp32"),
            f"keep module {culprit.module!r} in float32",
            f"{base}.with_module({culprit.module!r}, 'fp32')",
        )
        if culprit.module
        else None
    )
    try:
        op_fix = (
            policy.with_ops(fp32=[culprit.op]),
            f"run op {culprit.op!r} in float32",
            f"{base}.with_ops(fp32=[{culprit.op!r}])",
        )
    except (ValueError, TypeError):
        op_fix = None
    heavy = policy.rules.get(culprit.op) is Cast.LOWER  # matmul-like: keep the rest low
    ordered = [module_fix, op_fix] if heavy else [op_fix, module_fix]
    return [c for c in ordered if c is not None]


def diagnose(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    device_type: str = "cpu",
    dtype: torch.dtype = torch.float16,
    policy: Policy | str | None = None,
    scaler: Any = None,
    loss_scale: float | None = None,
    seed: int = 0,
) -> Report:
    """Run one training step in float32 and in ``dtype``; report where precision breaks.

    The model is deep-copied for every run: its parameters, gradients, buffers, training
    mode and the global RNG are left as they were.

    Args:
        model: the model, on ``device_type``.
        inputs: what to call it with: a tensor, a tuple of positional arguments, or a
            dict of keyword arguments.
        loss_fn: maps the model's output to a scalar loss (close over the targets).
        device_type: ``"cpu"`` or ``"cuda"``.
        dtype: the low dtype to check, ``torch.float16`` (default) or ``torch.bfloat16``.
        policy: the autocast policy to check (default: torch's).
        scaler: a GradScaler whose current scale to check (``get_scale()``).
        loss_scale: the loss scale to check instead (default: 2**16 for float16, the
            GradScaler default, and 1 for bfloat16).
        seed: seeds dropout and other randomness identically in every run.

    Returns:
        A :class:`~amped.doctor.report.Report`: per-op statistics, the first op that produced a
        non-finite value (forward or backward), per-parameter gradient underflow, and a
        verified :class:`~amped.doctor.report.Suggestion`.
    """
    _check_args(model, inputs, device_type, dtype)
    policy = (
        Policy.preset(policy or "torch", device_type) if not isinstance(policy, Policy) else policy
    )
    if loss_scale is None:
        loss_scale = (
            float(scaler.get_scale())
            if scaler is not None
            else (2.0**16 if dtype is torch.float16 else 1.0)
        )
    common: dict[str, Any] = dict(
        model=model, inputs=inputs, loss_fn=loss_fn, device_type=device_type, seed=seed
    )
    reference = run_step(dtype=None, policy=None, loss_scale=1.0, **common)
    target = run_step(dtype=dtype, policy=policy, loss_scale=loss_scale, **common)
    checks = [check_gradient(n, g, loss_scale, dtype) for n, g in reference.grads.items()]
    report = Report(
        device_type=device_type,
        dtype=str(dtype).replace("torch.", ""),
        loss_scale=loss_scale,
        policy=policy,
        ops=_op_stats(target, reference),
        forward_culprit=_forward_culprit(target),
        backward_culprit=_backward_culprit(target),
        gradients=checks,
        nonfinite_grads={n: int((~torch.isfinite(g)).sum()) for n, g in target.grads.items()},
        recommended_scale=recommended_scale(checks, dtype),
        loss_reference=float(reference.loss),
        loss_target=float(target.loss),
        sqnr_db=_sqnr(target, reference),
    )
    report.suggestion = _suggest(report, reference, dtype=dtype, **common)
    return report


def _suggest(
    report: Report, reference: StepResult, *, dtype: torch.dtype, **common: Any
) -> Suggestion | None:
    """A fix, re-run and verified: a policy for a forward culprit, else a loss scale."""
    if report.forward_culprit is not None:
        return _suggest_policy(report, report.forward_culprit, reference, dtype, common)
    return _suggest_scale(report, reference, dtype, common)


def _suggest_policy(
    report: Report,
    culprit: Culprit,
    reference: StepResult,
    dtype: torch.dtype,
    common: dict[str, Any],
) -> Suggestion:
    # Gradients overflowing at a large scale are routine (GradScaler backs off), so a
    # policy is judged at the largest safe scale, not at the one that was checked.
    scale = min(report.loss_scale, report.recommended_scale or report.loss_scale)
    for candidate, what, code in _candidates(culprit, report.policy):
        result = run_step(dtype=dtype, policy=candidate, loss_scale=scale, **common)
        if _healthy(result) and all(_finite(c.output) for c in result.calls):
            return Suggestion(what, candidate, scale, True, _sqnr(result, reference), code)
    return Suggestion(
        "no single-op or single-module fix removed the non-finite values; try policy "
        "'strict' or bfloat16",
        None,
        None,
        False,
        math.nan,
    )


def _suggest_scale(
    report: Report, reference: StepResult, dtype: torch.dtype, common: dict[str, Any]
) -> Suggestion | None:
    """The largest safe scale, verified by the GradScaler the suggestion prints: it must
    skip no step on the diagnosed batch, and where the scale is raised against
    underflow, leave no gradient above :data:`UNDERFLOW_WARN` underflow."""
    scale = report.recommended_scale
    lossy = any(c.underflow > UNDERFLOW_WARN for c in report.gradients)
    overflow = report.backward_culprit is not None or any(c.overflows for c in report.gradients)
    if scale is None or not (lossy or overflow) or scale == report.loss_scale:
        return None
    result = run_step(dtype=dtype, policy=report.policy, loss_scale=scale, **common)
    checks = [check_gradient(n, g, scale, dtype) for n, g in reference.grads.items()]
    why = _scale_failure(report, result, checks, scale, dtype, common)
    what = f"scale the loss by {scale:g} (GradScaler(init_scale={scale:g}))"
    lossy_then = [c for c in checks if c.underflow > UNDERFLOW_WARN]
    if why is None and lossy_then:  # no skipped step, at a cost the user should know
        worst = max(lossy_then, key=lambda c: c.underflow)
        what += f", where {worst.name} loses {worst.underflow:.1%} of its gradient to underflow"
    code = scale_code(report.device_type, scale)
    sqnr = _sqnr(result, reference)
    absorbed = overflow and why is None and scale < report.loss_scale
    return Suggestion(what, None, scale, why is None, sqnr, code, why, absorbed)


def _scale_failure(
    report: Report,
    result: StepResult,
    checks: list[GradientCheck],
    scale: float,
    dtype: torch.dtype,
    common: dict[str, Any],
) -> str | None:
    """Why ``scale`` is no fix (None: it is one), in words."""
    if not _healthy(result) or scaler_skips(
        dtype=dtype, policy=report.policy, scale=scale, **common
    ):
        return f"at scale {scale:g} the backward still overflows, so GradScaler skips the step"
    if scale > report.loss_scale:  # raised against underflow: it must cure it
        lossy = [c for c in checks if c.underflow > UNDERFLOW_WARN]
        if lossy:
            worst = max(lossy, key=lambda c: c.underflow)
            return (
                f"at scale {scale:g}, the largest without overflow, gradient {worst.name} "
                f"still loses {worst.underflow:.1%} of its values to underflow"
            )
    return None
