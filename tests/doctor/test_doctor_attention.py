"""``amped.doctor.attention.diagnose_attention``: per attention module and role, the SQNR of the
attention's output and gradients against float32, on the model's own activations."""

from __future__ import annotations

import math

import torch

from amped.doctor.attention import diagnose_attention


def _model():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def test_each_role_is_measured_alone_and_all_together():
    model = _model()
    x = torch.randn(2, 64, 32)
    report = diagnose_attention(model, x, lambda y: y.square().mean(), "fp8-forward")
    assert sorted(report.sqnr) == ["layers.0.self_attn", "layers.1.self_attn"]
    for roles in report.sqnr.values():
        assert list(roles) == ["s", "o", "all"]  # the roles fp8-forward casts, then all
        # o casts P and V for O = P·V only: the backward's matmuls see no cast, so dQ,
        # dK and dV are bitwise the float32 ones; s casts Q and K, moving everything
        assert roles["o"]["out"] < math.inf
        assert [roles["o"][g] for g in ("dq", "dk", "dv")] == [math.inf] * 3
        assert all(15 < roles["s"][o] < math.inf for o in ("out", "dq", "dk", "dv"))
        # a sanity floor (e4m3 keeps 2**-4 relative per value: about 25 dB and up)
        assert all(roles["all"][o] > 15 for o in ("out", "dq", "dk", "dv"))
    assert report.not_converted == []
    assert "layers.0.self_attn" in report.table()


def test_the_model_is_left_as_it_was():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    diagnose_attention(model, torch.randn(2, 32, 32), lambda y: y.sum(), "fp8")
    assert all(type(m) is torch.nn.MultiheadAttention
               for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention))  # fmt: skip
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
