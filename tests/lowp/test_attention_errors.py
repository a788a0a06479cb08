"""Bad input to amped's attention: torch's SDPA's own error where SDPA refuses it, a
clear error naming the fix where only the emulation does, and non-finite input loud
(non-finite output where SDPA's is), never silently finite."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import amped
from amped.lowp.attention_config import AttentionCast


def _qkv(h=2, t=16, d=32, hkv=None):
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(1, h, t, d, generator=g),
        torch.randn(1, hkv or h, t, d, generator=g),
        torch.randn(1, hkv or h, t, d, generator=g),
    )


def _torch_error(**kwargs):
    q, k, v = kwargs.pop("qkv")
    with pytest.raises(Exception) as torch_error:
        F.scaled_dot_product_attention(q, k, v, **kwargs)
    return torch_error.type


@pytest.mark.parametrize("config", ["bf16", "fp8", "mxfp8"])
def test_a_mask_sdpa_rejects_raises_the_same_error_type_naming_the_shape(config):
    qkv = _qkv()
    mask = torch.ones(3, 16, dtype=torch.bool)  # 3 query rows for 16
    expected = _torch_error(qkv=qkv, attn_mask=mask)
    with pytest.raises(expected, match=r"does not broadcast to .*\(1, 2, 16, 16\)"):
        amped.scaled_dot_product_attention(*qkv, attn_mask=mask, config=config)


@pytest.mark.parametrize(
    "case",
    ["gqa-not-enabled", "head-dim-mismatch", "dtype-mismatch"],
)
def test_what_sdpa_refuses_raises_sdpas_own_error(case):
    q, k, v = _qkv()
    kwargs: dict = {}
    if case == "gqa-not-enabled":
        q = torch.randn(1, 4, 16, 32)
        k, v = k[:, :3], v[:, :3]
    elif case == "head-dim-mismatch":
        k = torch.randn(1, 2, 16, 16)
    else:
        v = v.double()
    with pytest.raises(Exception) as torch_error:
        F.scaled_dot_product_attention(q, k, v, **kwargs)
    with pytest.raises(torch_error.type) as ours:
        amped.scaled_dot_product_attention(q, k, v, **kwargs, config="fp8")
    assert str(ours.value) == str(torch_error.value)


@pytest.mark.parametrize("config", ["bf16", "fp8"])
def test_a_causal_flag_and_a_mask_mask_what_either_masks(config):
    # torch's default CPU backend combines them (its math backend refuses the pair)
    q, k, v = _qkv()
    mask = torch.rand(16, 16, generator=torch.Generator().manual_seed(2)) < 0.7
    both = amped.scaled_dot_product_attention(q, k, v, mask, is_causal=True, config=config)
    combined = mask & torch.ones(16, 16, dtype=torch.bool).tril()
    assert torch.equal(both, amped.scaled_dot_product_attention(q, k, v, combined, config=config))
    torch_both = F.scaled_dot_product_attention(q, k, v, mask, is_causal=True)
    torch.testing.assert_close(torch_both, F.scaled_dot_product_attention(q, k, v, combined))


@pytest.mark.parametrize("role", ["s", "dp"])
def test_a_head_dim_not_divisible_by_the_mx_block_names_the_fix(role):
    q, k, v = _qkv(d=40)
    cfg = amped.lowp.AttentionConfig(**{role: AttentionCast("mxfp8")})
    with pytest.raises(ValueError, match=r"multiple of 32.*use an FP8 format.*pad the head dim"):
        amped.scaled_dot_product_attention(q, k, v, config=cfg)
    # the other roles multiply over sequence dims, which are padded: head dim 40 is fine
    other = amped.lowp.AttentionConfig(o=AttentionCast("mxfp8"), dq=AttentionCast("mxfp8"))
    assert amped.scaled_dot_product_attention(q, k, v, config=other).shape == q.shape


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_a_dropout_outside_0_to_1_is_refused(p):
    with pytest.raises(RuntimeError, match=r"dropout probability has to be between 0 and 1"):
        amped.scaled_dot_product_attention(*_qkv(), dropout_p=p)


@pytest.mark.parametrize("bad", ["name", "type", "block_size", "format", "scaling"])
def test_a_bad_config_names_what_is_allowed(bad):
    q, k, v = _qkv()
    with pytest.raises((ValueError, TypeError), match="Received"):
        if bad == "name":
            amped.scaled_dot_product_attention(q, k, v, config="fp9")
        elif bad == "type":
            amped.scaled_dot_product_attention(q, k, v, config=8)  # type: ignore[arg-type]
        elif bad == "block_size":
            amped.lowp.AttentionConfig(block_size=48)
        elif bad == "format":
            amped.lowp.AttentionConfig(s="e3m4")
        else:
            AttentionCast("e4m3", "rowwise")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("where", ["query", "key", "value"])
def test_non_finite_input_gives_non_finite_output_where_sdpa_does(where, value):
    q, k, v = _qkv()
    x = {"query": q, "key": k, "value": v}[where]
    x[0, 1, 5, 3] = value
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    off = amped.scaled_dot_product_attention(q, k, v, is_causal=True, config="bf16")
    assert torch.equal(off.isfinite(), ref.isfinite())
    # Every row SDPA makes non-finite that sees the bad position (a query row sees its
    # own Q, rows >= 5 see key 5) is non-finite here too.
    # (SDPA also spreads a bad V to rows that cannot see it, as 0 * nan; safe scales
    # keep those rows finite: no masked value changes a visible output.)
    seen = torch.arange(16) == 5 if where == "query" else torch.arange(16) >= 5
    for preset in ("fp8", "mxfp8"):
        out = amped.scaled_dot_product_attention(q, k, v, is_causal=True, config=preset)
        bad_rows = (~out.isfinite()).any(dim=-1)[0, 1]
        torch_bad = (~ref.isfinite()).any(dim=-1)[0, 1]
        assert bool(bad_rows[seen & torch_bad].all()), preset
        assert bool(bad_rows.any()), preset
