"""``amped.doctor.attention.diagnose_attention``: what each attention role's format costs a model's
attention, measured on the model's own activations.

One float32 step of a copy of the model, its attention converted with every role off
(``"bf16"``: torch's SDPA up to float32 reassociation), records each attention
module's Q, K, V, mask and output gradient dO. Then, per module, each role the config
casts is cast alone, and all of them together, on those tensors: the SQNR (dB) of the
attention output and of dQ, dK, dV against the same attention with every role off
(``inf``: bitwise unchanged). A role's number is its own error, not its inputs'.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from amped.lowp.attention import scaled_dot_product_attention
from amped.lowp.attention_config import ATTENTION_CONFIGS, AttentionConfig, resolve_config
from amped.lowp.float8.cast import sqnr
from amped.recipes.attention import attention_modules, convert_model_attention
from amped.tasks.task import call_model

__all__ = [
    "AttentionCall",
    "AttentionReport",
    "attention_outputs",
    "capture_attention",
    "diagnose_attention",
]

OUTPUTS = ("out", "dq", "dk", "dv")


@dataclass(frozen=True)
class AttentionCall:
    """One attention module's call in the recorded step: its float32 Q, K, V, the SDPA
    arguments (``attn_mask``, ``is_causal``, ...; ``dropout_p`` as called) and the
    output gradient dO."""

    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    arguments: dict[str, Any]
    grad_out: torch.Tensor


@dataclass
class AttentionReport:
    """Per attention module, per role: SQNR in dB of (out, dQ, dK, dV) against float32.

    Attributes:
        config: the attention config measured (its spelling).
        sqnr: module name -> role (``"s"``, ``"o"``, ..., ``"all"``) -> output
            (``"out"``, ``"dq"``, ``"dk"``, ``"dv"``) -> dB (``inf``: unchanged).
        not_converted: ``(module name, reason)`` of attention the doctor could not
            reach (it is not measured).
    """

    config: str
    sqnr: dict[str, dict[str, dict[str, float]]]
    not_converted: list[tuple[str, str]]

    def table(self) -> str:
        """A plain-text table: a row per module and role, ``out / dq / dk / dv`` dB."""
        lines = [f"attention {self.config}: SQNR (dB) against float32, out / dQ / dK / dV"]
        for module, roles in self.sqnr.items():
            for role, values in roles.items():
                cells = " / ".join(f"{values[o]:.1f}" for o in OUTPUTS)
                lines.append(f"{module or '(model)'}  {role:>4}  {cells}")
        lines += [
            f"not converted: {name or 'the model'}: {why}" for name, why in self.not_converted
        ]
        return "\n".join(lines)


def diagnose_attention(
    model: torch.nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    config: str | AttentionConfig = "fp8",
) -> AttentionReport:
    """Measure what ``config`` costs each role of ``model``'s attention (module doc).

    ``model`` is not changed (the doctor works on a copy). Its attention must be one
    ``amped.prepare(..., attention=...)`` converts (``nn.MultiheadAttention``, a
    transformers model's); attention dropout is off during the step (``eval()``).

    Example:
        >>> import torch
        >>> from amped.doctor.attention import diagnose_attention
        >>> layer = torch.nn.TransformerEncoderLayer(64, 2, 128, dropout=0.0, batch_first=True)
        >>> report = diagnose_attention(layer, torch.randn(2, 64, 64),
        ...                             lambda y: y.square().mean(), "fp8")
        >>> sorted(report.sqnr["self_attn"])
        ['all', 'dk', 'dp', 'dq', 'dv', 'o', 's']
    """
    cfg = resolve_config(config)
    calls, not_converted = capture_attention(model, inputs, loss_fn)
    sqnr_by_module = {name: _role_sqnr(cfg, call) for name, call in calls.items()}
    return AttentionReport(str(cfg), sqnr_by_module, not_converted)


def capture_attention(
    model: torch.nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor]
) -> tuple[dict[str, AttentionCall], list[tuple[str, str]]]:
    """Each attention module's call in one float32 step of a copy of ``model`` in
    ``eval()`` mode, its attention converted with every role off (module doc), and the
    attention modules that did not convert, ``(name, reason)``. A module called more
    than once keeps its last call; one that got no output gradient is left out."""
    reference = copy.deepcopy(model).eval()
    conversion = convert_model_attention(reference, ATTENTION_CONFIGS["bf16"])
    captured: dict[str, tuple[tuple[torch.Tensor, ...], dict[str, Any], list[torch.Tensor]]] = {}
    names = {id(m): n for n, m in attention_modules(reference).items()}

    def record(
        layer: Any, qkv: tuple[torch.Tensor, ...], arguments: dict[str, Any], out: Any
    ) -> None:
        grads: list[torch.Tensor] = []
        if out.requires_grad:
            out.register_hook(lambda g: grads.append(g.detach().clone()))
        tensors = tuple(x.detach().float().clone() for x in qkv)
        captured[names[id(layer)]] = (tensors, arguments, grads)

    for module in attention_modules(reference).values():
        module.attention_recorder = record  # type: ignore[assignment]
    loss_fn(call_model(reference, inputs)).backward()
    calls = {
        name: AttentionCall(tensors, arguments, grads[0])  # type: ignore[arg-type]
        for name, (tensors, arguments, grads) in captured.items()
        if grads
    }
    return calls, list(conversion.not_converted)


def _role_sqnr(cfg: AttentionConfig, call: AttentionCall) -> dict[str, dict[str, float]]:
    """Each cast role of ``cfg`` alone, then all: SQNR of (out, dq, dk, dv)."""
    off = attention_outputs(call, ATTENTION_CONFIGS["bf16"])
    every_off = {r: None for r in cfg.rules()}
    configs = {role: cfg.replace(**{**every_off, role: rule}) for role, rule in cfg.rules().items()}
    configs["all"] = cfg
    out = {}
    for role, one in configs.items():
        ran = attention_outputs(call, one)
        out[role] = {
            name: math.inf if torch.equal(a, b) else float(sqnr(b, a))
            for name, a, b in zip(OUTPUTS, ran, off, strict=True)
        }
    return out


def attention_outputs(call: AttentionCall, cfg: AttentionConfig) -> tuple[torch.Tensor, ...]:
    """``(out, dQ, dK, dV)`` of ``call`` re-run in ``cfg``, without dropout."""
    q, k, v = (x.clone().requires_grad_() for x in call.qkv)
    kwargs = {**call.arguments, "dropout_p": 0.0}
    out = scaled_dot_product_attention(q, k, v, **kwargs, config=cfg)
    out.backward(call.grad_out.to(out.dtype))
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return out.detach(), q.grad, k.grad, v.grad
