"""Causal-safe scaling: no masked key or value can change a visible output bit.

For random Q, K, V and K', V' equal to them at every position a row sees (key positions
<= t under a causal mask; the unpadded keys of each batch item under a padding mask) and
very different elsewhere, every output row and dQ row that sees no difference is
bitwise equal, under every safe format and scaling granularity; the unsafe variant
(scales over whole regions, as other stacks compute them) fails the same test. The
differing keys are 2**30 times larger: past the dynamic range of every format (e5m2
spans 2**-16 to 2**15.8 of its scale), so a scale that saw them would push visible
values into underflow."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import run

import amped
from amped.lowp.attention_config import AttentionCast

BLOCK = 64  # tiles of 64 query rows: t = 37 and 100 fall inside a tile and a 32-key block

RULES = {
    "e4m3-tensorwise": AttentionCast("e4m3", "tensorwise"),
    "e4m3-head": AttentionCast("e4m3", "head"),
    "e4m3-block": AttentionCast("e4m3", "block"),
    "e5m2-head": AttentionCast("e5m2", "head"),
    "hybrid-block": AttentionCast("e4m3", "block", grad_format="e5m2"),
    "mxfp8": AttentionCast("mxfp8"),
    "mxfp8-e5m2": AttentionCast("mxfp8-e5m2"),
}


def _config(rule, safe):
    every = dict.fromkeys(("s", "o", "dv", "dp", "dq", "dk"), rule)
    return amped.lowp.AttentionConfig(**every, causal_safe=safe, block_size=BLOCK)


T = 128


def _visible_rows_equal(rule, safe, kind, t):
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 2, 2, T, 32, generator=g).unbind(0)
    if kind == "causal":
        kwargs = dict(is_causal=True)
        hidden = (torch.arange(T) > t).expand(2, T)  # keys > t: masked for rows <= t
    else:  # padding: item 0 has t + 1 keys, item 1 has t + 21; every row compared
        lengths = torch.tensor([t + 1, t + 21])
        hidden = torch.arange(T) >= lengths[:, None]
        kwargs = dict(attn_mask=(~hidden).reshape(2, 1, 1, T))
        if kind == "float-padding":  # masked as older transformers do: the dtype's min
            low = torch.finfo(torch.float32).min
            kwargs = dict(attn_mask=torch.where(hidden, low, 0.0).reshape(2, 1, 1, T))
    where = hidden.reshape(2, 1, T, 1)
    k2, v2 = (torch.where(where, 2.0**30 * torch.randn(x.shape, generator=g), x) for x in (k, v))
    grad = torch.randn(2, 2, T, 32, generator=g)
    cfg = _config(rule, safe)
    a = run(amped.scaled_dot_product_attention, q, k, v, grad, config=cfg, **kwargs)
    b = run(amped.scaled_dot_product_attention, q, k2, v2, grad, config=cfg, **kwargs)
    rows = slice(0, t + 1) if kind == "causal" else slice(None)
    return all(torch.equal(x[:, :, rows], y[:, :, rows]) for x, y in zip(a[:2], b[:2], strict=True))


@pytest.mark.parametrize("kind", ["causal", "padding", "float-padding"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_safe_scales_leave_visible_outputs_and_dq_bitwise_equal(rule, kind):
    assert _visible_rows_equal(RULES[rule], True, kind, 100)


@pytest.mark.slow
@pytest.mark.parametrize("t", [0, 37, 63, 64, 126])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_safe_scales_hold_at_every_kind_of_boundary(rule, t):
    # first row, inside a tile and a 32-key block, a tile's last row, a tile's first.
    assert _visible_rows_equal(RULES[rule], True, "causal", t)


@pytest.mark.parametrize("kind", ["causal", "padding"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_unsafe_scales_let_masked_keys_move_visible_outputs(rule, kind):
    assert not _visible_rows_equal(RULES[rule], False, kind, 100)


def test_the_safe_outputs_are_low_precision_not_a_fallback():
    # Safe scales still cast: the output differs from the formats-off one.
    q, k, v = torch.randn(3, 1, 2, T, 32, generator=torch.Generator().manual_seed(0)).unbind(0)
    off = amped.scaled_dot_product_attention(q, k, v, is_causal=True, config="bf16")
    for rule in RULES.values():
        on = amped.scaled_dot_product_attention(q, k, v, is_causal=True, config=_config(rule, True))
        assert not torch.equal(on, off)
