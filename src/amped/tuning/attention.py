"""Attention roles for ``amped.tune(..., attention=...)`` (docs/tune.md, "Attention roles").

Each role the given config casts (``s``, ``o``, ``dv``, ``dp``, ``dq``, ``dk``) is
measured alone on the model's own attention calls, recorded as the doctor records them
(:func:`amped.doctor.attention.capture_attention`: one float32 step per measured batch):

- ``sqnr``: per output (``out``, ``dq``, ``dk``, ``dv``) the SQNR in dB against the same
  attention with every role off, pooled over the batches, the worst over the attention
  modules (:func:`amped.doctor.attention.diagnose_attention`'s figure);
- the loss-change estimate of a Linear layer's measurement
  (:mod:`amped.tuning.measure`), with the attention output as the layer's output: per
  query token (row) ``d_row = dO_row . e_row`` over heads and head dims, ``e`` the
  output's error; coherent plus second-order part, each module a layer, summed over the
  modules. A backward role leaves the output as it is: its estimate is 0, as a Linear
  layer's gradient errors are not in its estimate, and training judges it;
- ``flops``: the role's matmul, ``2 * batch * heads * q_len * k_len * head_dim``
  (``head_dim`` of V for ``o``, ``dv``, ``dp``), summed over the modules, per measured
  batch: dense GEMM FLOPs, as for the Linear layers (a causal mask's skipped half is
  counted, for every role alike).

:func:`role_path` orders the roles, the most accurate first, and gives the plans that
lower the first k of them on top of a Linear plan; the tuner verifies them by the same
rounds as the Linear plans (:func:`amped.tuning.search.search_path`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from amped._internal.errors import value_error
from amped.doctor.attention import OUTPUTS, AttentionCall, attention_outputs, capture_attention
from amped.lowp.attention_config import ATTENTION_CONFIGS, ROLES, AttentionCast, AttentionConfig
from amped.tuning.choose import Choice, speedups
from amped.tuning.measure import decibels

__all__ = ["RoleMeasurement", "attention_speedup", "measure_attention", "role_order", "role_path"]

_V_ROLES = ("o", "dv", "dp")  # their inner or outer dim is V's head dim


@dataclass(frozen=True)
class RoleMeasurement:
    """What casting one attention role costs the model's attention.

    Attributes:
        role: one of :data:`amped.lowp.attention_config.ROLES`.
        rule: the rule tried, spelled (``"e4m3/head,grad=e5m2"``).
        flops: the role's matmul FLOPs per measured batch, over every attention module.
        sqnr: ``out``, ``dq``, ``dk``, ``dv`` -> dB, the worst over modules (inf: unchanged).
        loss_change_estimate: ``loss_change_coherent + loss_change_second_order``.
        loss_change_coherent: summed over modules, ``|mean over batches of sum over
            rows d_row|`` (module doc).
        loss_change_second_order: summed over modules, ``mean over batches of (N / 2) *
            sum over rows d_row^2`` (N: the module's rows in the batch).
    """

    role: str
    rule: str
    flops: int
    sqnr: dict[str, float]
    loss_change_estimate: float
    loss_change_coherent: float
    loss_change_second_order: float

    @property
    def worst_sqnr(self) -> float:
        """The lowest of :attr:`sqnr`: what orders the roles (:func:`role_path`)."""
        return min(self.sqnr.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "flops": self.flops,
            "sqnr": dict(self.sqnr),
            "loss_change_estimate": self.loss_change_estimate,
            "loss_change_coherent": self.loss_change_coherent,
            "loss_change_second_order": self.loss_change_second_order,
        }


def attention_speedup(rule: AttentionCast, target: str) -> float:
    """The GEMM speed-up of ``rule`` over bfloat16 on ``target``: the FP8 formats' for
    ``e4m3``/``e5m2``, MXFP8's for the MX formats; the slower of its two formats."""
    speed = speedups(target)
    family = {"e4m3": "fp8-tensorwise", "e5m2": "fp8-tensorwise"}
    return min(speed[family.get(fmt, "mxfp8")] for fmt in (rule.format, rule.grad))


def _rows(product: torch.Tensor) -> torch.Tensor:
    """``d_row`` per query token: ``[batch, heads, seq, dim]`` (or no batch) summed over
    heads and dims."""
    return product.sum((1, 3)) if product.dim() == 4 else product.sum((0, 2))


def _flops(call: AttentionCall, role: str) -> int:
    q, k, v = call.qkv
    batch = q.shape[0] if q.dim() == 4 else 1
    dim = v.shape[-1] if role in _V_ROLES else q.shape[-1]
    return 2 * batch * q.shape[-3] * q.shape[-2] * k.shape[-2] * dim


Outputs = tuple[torch.Tensor, ...]  # out, dQ, dK, dV


def _measure_role(
    role: str,
    config: AttentionConfig,
    batches: list[dict[str, AttentionCall]],
    references: list[dict[str, Outputs]],
) -> RoleMeasurement:
    alone = ATTENTION_CONFIGS["bf16"].replace(**{role: config.rule(role)},
                                              causal_safe=config.causal_safe,
                                              block_size=config.block_size)  # fmt: skip
    modules = list(batches[0])
    signal = {m: dict.fromkeys(OUTPUTS, 0.0) for m in modules}
    noise = {m: dict.fromkeys(OUTPUTS, 0.0) for m in modules}
    sums: dict[str, list[float]] = {m: [] for m in modules}  # per batch: sum of d_row
    squares: dict[str, list[float]] = {m: [] for m in modules}  # (N / 2) * sum of d_row^2
    flops = 0
    for calls, reference in zip(batches, references, strict=True):
        for name in modules:
            call, off = calls[name], reference[name]
            low = attention_outputs(call, alone)
            for key, ref, got in zip(OUTPUTS, off, low, strict=True):
                signal[name][key] += float(ref.double().square().sum())
                noise[name][key] += float((got.double() - ref.double()).square().sum())
            rows = _rows((low[0].double() - off[0].double()) * call.grad_out.double())
            sums[name].append(float(rows.sum()))
            squares[name].append(rows.numel() / 2 * float(rows.square().sum()))
            flops += _flops(call, role)
    sqnr = {key: min(decibels(signal[m][key], noise[m][key]) for m in modules) for key in OUTPUTS}
    coherent = sum(abs(sum(sums[m]) / len(batches)) for m in modules)
    second = sum(sum(squares[m]) / len(batches) for m in modules)
    rule = config.rule(role)
    return RoleMeasurement(
        role, str(rule), flops // len(batches), sqnr, coherent + second, coherent, second
    )


def _loss_on(loss_fn: Callable[[Any, Any], torch.Tensor], targets: Any) -> Callable[[Any], Any]:
    return lambda output: loss_fn(output, targets)


def measure_attention(
    model: torch.nn.Module,
    batches: list[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    config: AttentionConfig,
) -> tuple[list[RoleMeasurement], list[tuple[str, str]]]:
    """Measure each role ``config`` casts on ``batches`` (module doc), in
    :data:`~amped.lowp.attention_config.ROLES` order; also the attention modules that
    did not convert, ``(name, reason)``.

    Raises:
        ValueError: ``config`` casts no role, or the model has no attention amped's
            ``prepare(..., attention=...)`` converts that got a gradient in the step.
    """
    if not config.rules():
        raise value_error(
            "amped.tune's attention is the format to try in each role: a config that casts "
            "at least one role (e.g. 'fp8' or 'mxfp8')",
            "attention",
            str(config),
        )
    recorded: list[dict[str, AttentionCall]] = []
    not_converted: list[tuple[str, str]] = []
    for inputs, targets in batches:
        calls, not_converted = capture_attention(model, inputs, _loss_on(loss_fn, targets))
        recorded.append(calls)
    if not recorded[0]:
        raise value_error(
            "amped.tune(attention=...) measures the attention amped.prepare(..., "
            "attention=...) converts (nn.MultiheadAttention, a transformers model's "
            "attention), called with a gradient in the training step; this model has none",
            "not converted",
            not_converted or "no attention module called",
        )
    off = ATTENTION_CONFIGS["bf16"]
    references = [{n: attention_outputs(c, off) for n, c in calls.items()} for calls in recorded]
    measured = [_measure_role(r, config, recorded, references) for r in config.rules()]
    return measured, not_converted


def role_order(measured: list[RoleMeasurement]) -> list[RoleMeasurement]:
    """The roles' order: the highest :attr:`~RoleMeasurement.worst_sqnr` first (ties:
    :data:`~amped.lowp.attention_config.ROLES` order)."""
    return sorted(measured, key=lambda m: (-m.worst_sqnr, ROLES.index(m.role)))


def role_path(
    measured: list[RoleMeasurement], config: AttentionConfig, base: Choice, target: str
) -> list[Choice]:
    """The plans that lower the first k roles of the roles' order on top of ``base``
    (a Linear plan), k = 0 (``base`` itself, attention None) up to every role with a
    speed-up on ``target``, in :func:`role_order`. Each plan's estimate and saving are ``base``'s
    plus its roles' (saving: ``flops * (1 - 1 / speedup)``)."""
    order = [m for m in role_order(measured)
             if attention_speedup(_rule(config, m.role), target) > 1]  # fmt: skip
    path = [base]
    for count in range(1, len(order) + 1):
        kept = {m.role for m in order[:count]}
        cfg = config.replace(**{r: None for r in ROLES if r not in kept})
        estimate = base.estimate + sum(m.loss_change_estimate for m in order[:count])
        saving = base.saving + sum(
            m.flops * (1 - 1 / attention_speedup(_rule(config, m.role), target))
            for m in order[:count]
        )
        path.append(Choice(dict(base.layers), estimate, saving, attention=cfg))
    return path


def _rule(config: AttentionConfig, role: str) -> AttentionCast:
    rule = config.rule(role)
    assert rule is not None  # measured roles are the config's cast roles
    return rule
