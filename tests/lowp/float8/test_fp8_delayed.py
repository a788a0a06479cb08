"""Delayed scaling against a hand-written reference of Transformer Engine's rule, over
many steps: history length, max or most-recent amax, margin, and the previous scale
kept when an amax is zero or not finite."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from amped.lowp import Float8Config, Float8Linear
from amped.lowp.float8.cast import quantize
from amped.lowp.float8.config import CastRule, DelayedScaling
from amped.lowp.float8.delayed import update_delayed_scaling
from amped.lowp.float8.gemm import scaled_mm

FP8_MAX = (448.0, 448.0, 57344.0)  # e4m3 input, e4m3 weight, e5m2 grad_output


def f32(value: float) -> float:
    """``value`` rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", value))[0]


class Reference:
    """TE's DelayedScaling, written out in Python floats (float64, scales rounded to f32)."""

    def __init__(self, rule: DelayedScaling) -> None:
        self.rule = rule
        self.history = [[0.0] * rule.history_len for _ in range(3)]
        self.scale = [1.0, 1.0, 1.0]
        self.started = False

    def _from(self, amax: float, role: int) -> float:
        if amax > 0 and math.isfinite(amax):
            return f32(FP8_MAX[role] / max(amax, 1e-12) / 2.0**self.rule.margin)
        return self.scale[role]

    def scale_for(self, role: int, amax_now: float) -> float:
        return self.scale[role] if self.started else self._from(amax_now, role)

    def update(self, amaxes: list[float]) -> None:
        for role, amax_now in enumerate(amaxes):
            self.history[role] = [amax_now, *self.history[role][:-1]]
            recent = self.history[role]
            amax = max(recent) if self.rule.amax_compute == "max" else recent[0]
            self.scale[role] = self._from(amax, role)
        self.started = True


def _amplitudes(steps: int) -> list[tuple[float, float]]:
    """Input and grad amplitudes per step: growth, decay, an all-zero input, an inf grad."""
    plan = [(2.0**k, 10.0 ** (-k % 5)) for k in range(steps)]
    plan[4] = (0.0, 1.0)  # zero input amax: keep the scale
    plan[7] = (1.0, math.inf)  # inf in grad_output: keep the scale
    return plan


@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("amax_compute", ["max", "most_recent"])
@pytest.mark.parametrize("history_len", [1, 4])
def test_scales_follow_the_reference_over_many_steps(history_len, amax_compute, margin):
    rule = DelayedScaling(history_len, amax_compute, margin)  # type: ignore[arg-type]
    torch.manual_seed(0)
    layer = Float8Linear.convert_(torch.nn.Linear(32, 48, bias=False), Float8Config(delayed=rule))
    ref = Reference(rule)
    for step, (x_amp, g_amp) in enumerate(_amplitudes(14)):
        x = torch.randn(8, 32) * x_amp
        grad = torch.randn(8, 48)
        grad[0, 0] = g_amp if math.isinf(g_amp) else grad[0, 0]
        grad = grad * (g_amp if math.isfinite(g_amp) else 1.0)
        amaxes = [x.abs().max().item(), layer.weight.abs().max().item(), grad.abs().max().item()]
        s_in, s_w = ref.scale_for(0, amaxes[0]), ref.scale_for(1, amaxes[1])

        out = layer(x)
        expected = scaled_mm(
            quantize(x, torch.float8_e4m3fn, scale=torch.tensor(s_in)),
            quantize(layer.weight, torch.float8_e4m3fn, scale=torch.tensor(s_w)).t(),
            torch.float32,
            emulate=layer.fp8_emulate,
        )
        assert torch.equal(out, expected), step
        out.backward(grad)
        with torch.no_grad():
            layer.weight -= 0.05 * layer.weight.grad.nan_to_num()
        layer.weight.grad = None

        assert layer.fp8_pending.tolist() == [f32(a) for a in amaxes], step
        layer_updates = int(layer.fp8_updates)
        update_delayed_scaling([layer])
        ref.update([f32(a) for a in amaxes])
        assert int(layer.fp8_updates) == layer_updates + 1
        assert layer.fp8_amax_history.tolist() == ref.history, step
        assert layer.fp8_scale.tolist() == ref.scale, step
        assert layer.fp8_pending.tolist() == [0.0, 0.0, 0.0]


def test_the_grad_output_cast_uses_the_delayed_scale():
    rule = DelayedScaling(2)
    layer = Float8Linear.convert_(torch.nn.Linear(16, 16, bias=False), Float8Config(delayed=rule))
    x = torch.randn(4, 16)
    layer(x).backward(torch.ones(4, 16))
    update_delayed_scaling([layer])
    scale_go = layer.fp8_scale[2].item()
    assert scale_go == f32(57344.0 / 1.0)
    big = torch.full((4, 16), 4.0)  # amax 4 > 1: saturates at the old scale
    x2 = x.clone().requires_grad_()
    layer(x2).backward(big)
    go = quantize(big, torch.float8_e5m2, scale=torch.tensor(scale_go))
    assert go.data.float().abs().max().item() == 57344.0  # saturated, not inf
    w = quantize(layer.weight, torch.float8_e4m3fn, scale=layer.fp8_scale[1]).t().t()
    expected = scaled_mm(go, w, torch.float32, emulate=True)
    assert torch.equal(x2.grad, expected)


def test_delayed_needs_tensorwise_rules_and_sane_settings():
    with pytest.raises(ValueError, match="tensorwise"):
        Float8Config(input=CastRule(granularity="rowwise"), delayed=DelayedScaling())
    with pytest.raises(ValueError, match="history_len"):
        DelayedScaling(0)
    with pytest.raises(ValueError, match="amax_compute"):
        DelayedScaling(4, "mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="margin"):
        DelayedScaling(4, "max", -1)


def test_eval_mode_casts_with_the_current_scales_and_records_nothing():
    layer = Float8Linear.convert_(torch.nn.Linear(16, 16), Float8Config(delayed=DelayedScaling(2)))
    layer(torch.randn(4, 16)).sum().backward()
    update_delayed_scaling([layer])
    history = layer.fp8_amax_history.clone()
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(4, 16) * 1e3)
    assert layer.fp8_pending.tolist() == [0.0, 0.0, 0.0]
    update_delayed_scaling([layer])  # an update after evaluation only records zeros
    assert layer.fp8_amax_history[:, 1].tolist() == history[:, 0].tolist()
