"""amped.monitor's counters, sampling, audit and its check of non-FP8 setups.

The counters are checked against a hand computation with amped.lowp.float8.cast.quantize (the
cast the layer runs): underflow = non-zero elements the cast made zero, elements and
amax of both forward operands, summed over the sampled steps only.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import amped
from amped.lowp.float8.cast import quantize
from amped.lowp.health import ROLES, STATS, record_gemm


def _setup(recipe: str = "fp8-tensorwise", every: int = 2, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 16))
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), recipe)
    return setup, amped.monitor(setup, every=every, **kwargs)


def _step(setup, x: torch.Tensor) -> bool:
    loss = setup.model(x).float().pow(2).mean()  # float32 input: the layer casts it as is
    setup.backward(loss)
    taken = setup.step()
    setup.zero_grad()
    return taken


def _expected_forward(x: torch.Tensor, weight: torch.Tensor) -> dict[str, float]:
    stats = dict.fromkeys(STATS, 0.0)
    for tensor in (x, weight):
        data = quantize(tensor.detach(), torch.float8_e4m3fn).data.float()
        stats["underflow"] += float(((data == 0) & (tensor != 0)).sum())
        stats["nonzero"] += float((tensor != 0).sum())
        stats["elements"] += tensor.numel()
        stats["amax"] = max(stats["amax"], float(tensor.abs().max()))
    return stats


def test_forward_counters_match_a_hand_computation_on_sampled_steps_only():
    setup, health = _setup(every=2)
    generator = torch.Generator().manual_seed(0)
    expected = dict.fromkeys(STATS, 0.0)
    for step in range(4):
        x = torch.randn(32, 64, generator=generator)
        x[0, :8] = 1e-6  # below e4m3's smallest subnormal at this scale: underflows
        x[1, 0] = 50.0  # the amax
        if step % 2 == 0:
            hand = _expected_forward(x, setup.model[0].weight)
            for key in ("underflow", "nonzero", "elements"):
                expected[key] += hand[key]
            expected["amax"] = max(expected["amax"], hand["amax"])
        assert _step(setup, x)
    forward = health.read()["0"]["forward"]
    for key in ("underflow", "nonzero", "elements", "amax"):
        assert forward[key] == pytest.approx(expected[key], rel=1e-6), key
    assert forward["underflow"] >= 16  # the planted tiny values, on two sampled steps
    assert forward["nonfinite"] == 0 and forward["saturated"] == 0  # dynamic scaling
    assert forward["underflow_fraction"] == forward["underflow"] / forward["nonzero"]
    assert health.sampled_steps == 2 and health.step == 4
    assert list(health.read()["0"]) == [r for r in ROLES if r != "grad_input"]


def test_delayed_scaling_saturation_is_counted():
    setup, health = _setup("fp8-delayed", every=1)
    generator = torch.Generator().manual_seed(0)
    _step(setup, torch.randn(32, 64, generator=generator))
    big = torch.randn(32, 64, generator=generator) * 1000  # past the delayed scale's range
    _step(setup, big)
    forward = health.read()["0"]["forward"]
    assert forward["saturated"] > 0 and 0 < forward["saturation_fraction"] < 1


def test_audit_reports_a_layer_replaced_after_prepare_and_strict_raises():
    setup, health = _setup(every=1)
    _step(setup, torch.randn(8, 64))
    assert health.audit == []
    setup.model[0] = nn.Linear(64, 64)  # swapped after prepare: silently bf16 now
    _step(setup, torch.randn(8, 64))
    assert health.audit == ["'0' was replaced after prepare: it no longer runs FP8"]
    strict_setup, _ = _setup(every=1, strict=True)
    strict_setup.model[0] = nn.Linear(64, 64)
    with pytest.raises(RuntimeError, match=r"audit \(strict=True\): '0' was replaced"):
        _step(strict_setup, torch.randn(8, 64))


def test_a_setup_without_fp8_layers_checks_its_gradients():
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16-mixed")
    health = amped.monitor(setup, on_nonfinite="skip")
    before = model.weight.detach().clone()
    with pytest.warns(RuntimeWarning, match="step 0: the gradients"):
        setup.backward(model(torch.randn(2, 8)).sum() * math.nan)
        assert not setup.step()
    setup.zero_grad()
    assert torch.equal(model.weight, before)
    assert health.first_nonfinite.module is None and health.first_nonfinite.tensor == "gradients"
    assert health.read() == {}


def test_detach_and_bad_arguments():
    setup, health = _setup()
    health.detach()
    assert setup.monitor is None and setup.model[0].fp8_observer is None
    assert _step(setup, torch.randn(8, 64)) and health.step == 0
    with pytest.raises(ValueError, match="every is an int >= 1"):
        amped.monitor(setup, every=0)
    with pytest.raises(ValueError, match="on_nonfinite is 'skip', 'warn' or 'raise'"):
        amped.monitor(setup, on_nonfinite="ignore")


def test_summary_is_json_ready():
    import json

    setup, health = _setup(every=1)
    _step(setup, torch.randn(8, 64))
    summary = json.loads(json.dumps(health.summary()))
    assert summary["steps"] == 1 and summary["first_nonfinite"] is None
    assert set(summary["gemms"]["0"]["forward"]) >= set(STATS)


class _ThreeLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(64, 64), nn.Linear(64, 64)
        self.head = nn.Linear(64, 16)  # the plan keeps the head out of FP8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.first(x).relu()
        hidden = self.second(hidden).relu()  # the line the report must point at
        return self.head(hidden)


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "mxfp8"])
def test_first_non_finite_names_the_users_source_line(recipe):
    torch.manual_seed(0)
    model = _ThreeLayers()
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), recipe)
    health = amped.monitor(setup, every=50, on_nonfinite="raise")
    assert _step(setup, torch.randn(8, 64))
    with torch.no_grad():
        setup.model.second.weight[3, 5] = math.nan
    with pytest.raises(amped.recipes.NonFiniteError, match=r"self\.second\(hidden\)"):
        _step(setup, torch.randn(8, 64))
    first = health.first_nonfinite
    assert (first.step, first.module, first.role, first.tensor) == (
        1,
        "second",
        "forward",
        "weight",
    )
    path, rest = first.source.split(":", 1)
    assert path.endswith("test_monitor.py")
    assert rest.endswith(
        "(hidden = self.second(hidden).relu()  # the line the report must point at)"
    )


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-rowwise", "mxfp8", "nvfp4"])
def test_nonfinite_counter_counts_each_inf_and_nan_of_a_sampled_step(recipe):
    # The counter reads each operand and the output once (x * 0 is NaN exactly at an
    # inf or NaN): the input's planted ones plus those the output holds.
    setup, health = _setup(recipe, every=1)
    outputs = []
    setup.model[0].register_forward_hook(lambda _m, _i, out: outputs.append(out.detach()))
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    x[3, 5], x[7, 9], x[8, 1] = math.inf, -math.inf, math.nan
    with pytest.warns(RuntimeWarning, match="non-finite"):
        assert not _step(setup, x)
    forward = health.read()["0"]["forward"]
    in_output = int((~torch.isfinite(outputs[0])).sum())
    assert in_output > 0 and forward["nonfinite"] == 3 + in_output
    assert math.isnan(forward["amax"]) or math.isinf(forward["amax"])


class _Sampler:
    """A GemmObserver that samples every GEMM and keeps its counters."""

    sampling = True

    def __init__(self) -> None:
        self.stats: list[torch.Tensor] = []

    def observe(self, layer, role, probes, stats) -> None:
        self.stats.append(stats)


@pytest.mark.parametrize("dim", [-1, 0], ids=["scale-per-row", "scale-per-column"])
@pytest.mark.parametrize("boost", [1.0, 4.0], ids=["dynamic", "scale-x4"])
def test_saturation_count_matches_a_hand_count_for_any_scale_layout(dim, boost):
    """Saturated = elements whose ``|x| * scale`` passes the FP8 largest value, for rowwise
    scales along either dim: a dynamic scale at most a slice's largest element (where
    ``amax * (largest / amax)`` rounds past ``largest``), a scale made 4x larger (as a
    stale delayed one can be) many more."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(32, 64, generator=generator)
    x[5, :] *= 100.0  # one row (and so every column) with larger values
    scale = quantize(x, torch.float8_e4m3fn, "rowwise", dim=dim).scale * boost
    quantized = quantize(x, torch.float8_e4m3fn, "rowwise", dim=dim, scale=scale)
    layer, sampler = nn.Linear(1, 1), _Sampler()
    layer.fp8_observer = sampler
    record_gemm(layer, "forward", "output", torch.ones(4), {"x": (x, quantized)})
    (row,) = sampler.stats
    stats = dict(zip(STATS, row.tolist(), strict=True))
    largest = torch.finfo(torch.float8_e4m3fn).max
    hand = int((x.abs() * scale > largest).sum())
    assert stats["saturated"] == hand
    assert hand > 64 if boost > 1.0 else hand <= 64
    assert stats["amax"] == float(x.abs().max()) and stats["elements"] == x.numel()
