"""amped.monitor on the block recipes (mxfp8, mxfp4, nvfp4): counters and audit.

The forward counters are checked against a hand computation with
amped.lowp.mx.block_cast.quantize_block (the cast the layer runs): underflow = non-zero
elements the cast made zero; saturated = elements whose magnitude exceeds what their
block reads back at most (the format's largest element times the block's scale, times
NVFP4's tensor scale), counted on both forward operands of the sampled steps.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amped
from amped.lowp.health import STATS
from amped.lowp.mx.block_cast import quantize_block
from amped.lowp.mx.block_config import BLOCK_CONFIGS


def _setup(recipe: str, every: int = 2, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 16))
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), recipe)
    return setup, amped.monitor(setup, every=every, **kwargs)


def _step(setup, x: torch.Tensor) -> bool:
    loss = setup.model(x).float().pow(2).mean()
    setup.backward(loss)
    taken = setup.step()
    setup.zero_grad()
    return taken


def _expected_forward(recipe: str, x: torch.Tensor, weight: torch.Tensor) -> dict[str, float]:
    cfg = BLOCK_CONFIGS[recipe]
    fmt = cfg.format
    stats = dict.fromkeys(STATS, 0.0)
    for tensor, tile in ((x, False), (weight.detach(), cfg.weight_2d)):
        q = quantize_block(tensor, fmt, cfg.scale_mode, tile_2d=tile)
        reads_back = q.dequantize(torch.float32).abs()
        scale = q.block_scale() * (1.0 if q.tensor_scale is None else q.tensor_scale)
        largest = (scale * fmt.elem_max).repeat_interleave(fmt.block_size, dim=-1)
        stats["underflow"] += float(((reads_back == 0) & (tensor != 0)).sum())
        stats["nonzero"] += float((tensor != 0).sum())
        stats["saturated"] += float((tensor.abs() > largest).sum())
        stats["elements"] += tensor.numel()
        stats["amax"] = max(stats["amax"], float(tensor.abs().max()))
    return stats


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4", "nvfp4"])
def test_block_forward_counters_match_a_hand_computation(recipe):
    setup, health = _setup(recipe, every=2)
    generator = torch.Generator().manual_seed(0)
    expected = dict.fromkeys(STATS, 0.0)
    for step in range(3):
        x = torch.randn(32, 64, generator=generator)
        x[0, :8] = 1e-6  # beside larger values in their block: underflows in every format
        x[1, 0] = 50.0
        if step % 2 == 0:
            hand = _expected_forward(recipe, x, setup.model[0].weight)
            for key in ("underflow", "nonzero", "saturated", "elements"):
                expected[key] += hand[key]
            expected["amax"] = max(expected["amax"], hand["amax"])
        assert _step(setup, x)
    forward = health.read()["0"]["forward"]
    for key in ("underflow", "nonzero", "saturated", "elements", "amax"):
        assert forward[key] == pytest.approx(expected[key], rel=1e-6), key
    assert forward["underflow"] >= 16 and forward["nonfinite"] == 0
    assert set(health.read()["0"]) == {"forward", "grad_weight"}  # layer 0: no grad_input
    assert health.sampled_steps == 2


def test_block_audit_reports_a_layer_replaced_after_prepare():
    setup, health = _setup("mxfp8", every=1)
    _step(setup, torch.randn(8, 64))
    assert health.audit == []
    setup.model[0] = nn.Linear(64, 64)
    _step(setup, torch.randn(8, 64))
    assert health.audit == ["'0' was replaced after prepare: it no longer runs FP8"]
