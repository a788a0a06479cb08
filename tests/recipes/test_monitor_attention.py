"""``amped.monitor`` on ``prepare(..., attention=...)``: each attention module reports its
roles' health as FP8 Linears report their GEMMs, and a non-finite value in attention is
named by module and role."""

from __future__ import annotations

import math

import pytest
import torch

import amped
from amped.lowp.attention_config import ROLES

ATTN_ROLES = [f"attn.{role}" for role in ROLES]


def _encoder():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _step(setup, x):
    mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
    with setup.autocast():
        loss = setup.model(x, mask=mask, is_causal=True).float().pow(2).mean()
    setup.backward(loss)
    return setup.step()


def test_each_attention_role_reports_its_counters():
    model = _encoder()
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), "fp32",
                          attention="fp8")  # fmt: skip
    health = amped.monitor(setup, every=1)
    assert _step(setup, torch.randn(2, 64, 32))
    read = health.read()
    assert sorted(read) == ["layers.0.self_attn", "layers.1.self_attn"]
    for roles in read.values():
        assert list(roles) == ATTN_ROLES  # every role, in the order a step runs them
        for role, entry in roles.items():
            assert entry["nonfinite"] == 0, role
            assert entry["elements"] > 0, role
            assert 0 <= entry["underflow_fraction"] < 1, role
            assert entry["saturated"] == 0, role  # scales from each region's own amax
            assert math.isfinite(entry["amax"]) and entry["amax"] > 0, role


def test_a_nonfinite_in_attention_is_named_by_module_and_role():
    model = _encoder()
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), "fp32",
                          attention="fp8")  # fmt: skip
    health = amped.monitor(setup, every=1, on_nonfinite="skip")
    with torch.no_grad():  # a NaN in layer 1's query projection only
        model.layers[1].self_attn.in_proj_weight[0, 0] = math.nan
    with pytest.warns(RuntimeWarning, match="attn.s"):
        assert not _step(setup, torch.randn(2, 64, 32))
    first = health.first_nonfinite
    assert (first.module, first.role, first.tensor) == ("layers.1.self_attn", "attn.s", "output")
