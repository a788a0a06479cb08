"""Formats off, amped's attention is torch's SDPA (math backend) up to float32
reassociation: forward and every gradient within the bound derived in
tests/helpers/attention_helpers.py, for float32 and bfloat16 inputs, causal and padding masks,
float masks, GQA and a row that sees no key."""

from __future__ import annotations

import math

import pytest
import torch
from attention_helpers import assert_within, reassociation_bound, run, sdpa_math

import amped

OFF = amped.lowp.AttentionConfig(block_size=32)  # every role off; tiles of 32 rows


def _inputs(b, h, hkv, tq, tk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g)
    k = torch.randn(b, hkv, tk, d, generator=g)
    v = torch.randn(b, hkv, tk, d, generator=g)
    return q, k, v


def _padding_mask(b, tq, tk):
    lengths = torch.tensor([tk, tk - 29][:b])
    return (torch.arange(tk) < lengths[:, None]).reshape(b, 1, 1, tk).expand(b, 1, tq, tk)


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "padding": dict(mask="padding"),
    "float-mask": dict(mask="float"),
    "gqa-causal": dict(is_causal=True, gqa=True),
    "empty-row": dict(mask="empty-row"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_formats_off_equal_sdpa_math_within_reassociation(case, dtype):
    spec = CASES[case]
    b, h, tq, tk, d = 2, 4, 70, 70, 16
    q, k, v = _inputs(b, h, 2 if spec.get("gqa") else h, tq, tk, d)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    mask = None
    if spec.get("mask") == "padding":
        mask = _padding_mask(b, tq, tk)
    elif spec.get("mask") == "float":
        mask = torch.zeros(b, 1, tq, tk).masked_fill(~_padding_mask(b, tq, tk), -math.inf)
        mask = (mask + 0.25 * torch.randn(tq, tk, generator=torch.Generator())).to(dtype)
    elif spec.get("mask") == "empty-row":
        mask = torch.ones(tq, tk, dtype=torch.bool)
        mask[5] = False
    kwargs = dict(attn_mask=mask, is_causal=spec.get("is_causal", False))
    kwargs["enable_gqa"] = bool(spec.get("gqa"))
    grad = torch.randn(b, h, tq, d, generator=torch.Generator().manual_seed(3)).to(dtype)
    ours = run(amped.scaled_dot_product_attention, q, k, v, grad, config=OFF, **kwargs)
    ref = sdpa_math(q, k, v, grad, **kwargs)
    for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref, strict=True):
        assert a.dtype == r.dtype == dtype and a.shape == r.shape, name
    bounds = reassociation_bound(
        q, k, v, grad, mask, kwargs["is_causal"], ref if dtype == torch.bfloat16 else None
    )
    for name, a, r, bound in zip(("out", "dq", "dk", "dv"), ours, ref, bounds, strict=True):
        assert_within(a, r, bound, f"{case}/{name}")


def test_the_bound_is_far_below_a_bfloat16_rounding():
    # The bound is worst-case (a few hundred float32 ulps here), yet 8x below one
    # bfloat16 rounding (2**-9 relative): a matmul or softmax that ran in bfloat16, or
    # an FP8 cast left on, would exceed it.
    q, k, v = _inputs(1, 2, 2, 64, 64, 16)
    grad = torch.randn(1, 2, 64, 16)
    ref = sdpa_math(q, k, v, grad)
    out_bound = reassociation_bound(q, k, v, grad)[0]
    assert bool((out_bound < 2.0**-12 * ref[0].abs().amax()).all())


def test_tiles_change_nothing_but_reassociation():
    q, k, v = _inputs(1, 2, 2, 100, 100, 32)
    grad = torch.randn(1, 2, 100, 32)
    one = run(amped.scaled_dot_product_attention, q, k, v, grad, config=OFF, is_causal=True)
    cfg = OFF.replace(block_size=128)
    many = run(amped.scaled_dot_product_attention, q, k, v, grad, config=cfg, is_causal=True)
    torch.testing.assert_close(one, many, rtol=1e-5, atol=1e-6)
