"""Each format on each role: the operand casts are bitwise amped's own FP8 and MX casts
(:func:`amped.lowp.float8.cast.quantize`, :func:`amped.lowp.mx.block_cast.quantize_block`) of the
same operand, and each role's matmul is within float32 accumulation of the exact
product of those casts.

The bound: products of two FP8 or MX values (at most 4 significant bits each) are exact
in float32, so a role's matmul differs from the float64 product of its cast operands by
its float32 sums alone, ``γ(K)·(|a|·|b|)`` for an inner dim K (Higham §3.1). One cast
element off by one FP8 step (2**-4 relative or more) moves a sum by far more than that.
"""

from __future__ import annotations

import pytest
import torch
from attention_helpers import gamma

import amped
from amped.lowp.attention_cast import fp8_key_groups, mx_keys_inner_matmul, operand_cast
from amped.lowp.attention_config import AttentionCast
from amped.lowp.attention_roles import Roles, Tile
from amped.lowp.float8.cast import quantize
from amped.lowp.mx.block_cast import quantize_block
from amped.lowp.mx.block_format import BLOCK_FORMATS

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
BLOCK = 32


def _amped_fp8(x, fmt):
    """amped's own cast of ``x`` by its own amax, power-of-two scale, as values."""
    q = quantize(x, FP8[fmt], power_of_2=True, values_dtype=torch.float32)
    assert q.dequantized  # values already divided by the (power-of-two) scale
    return q.values


def reference_cast(x, fmt, scaling="head", per_row=False):
    """``x`` ([B, H, R, K]) cast region by region by amped's own casts."""
    if fmt.startswith("mx"):
        k = x.shape[-1]
        padded = torch.nn.functional.pad(x, (0, -k % 32))
        return quantize_block(padded, BLOCK_FORMATS[fmt]).block_values()[..., :k]
    if scaling == "tensorwise" and not per_row:
        return _amped_fp8(x, fmt)
    out = torch.empty_like(x)
    b, h, r, k = x.shape
    row_step = 1 if per_row else (BLOCK if scaling == "block" else r)
    col_step = BLOCK if scaling == "block" else k
    for i in range(b):
        for j in range(h):
            for r0 in range(0, r, row_step):
                for c0 in range(0, k, col_step):
                    tile = (i, j, slice(r0, r0 + row_step), slice(c0, c0 + col_step))
                    out[tile] = _amped_fp8(x[tile], fmt)
    if scaling == "tensorwise":  # per_row over every batch item and head
        for r0 in range(r):
            out[:, :, r0] = _amped_fp8(x[:, :, r0], fmt)
    return out


CASTS = [("e4m3", "tensorwise"), ("e4m3", "head"), ("e4m3", "block"), ("e5m2", "head"),
         ("e5m2", "block"), ("mxfp8", "head"), ("mxfp8-e5m2", "head")]  # fmt: skip


def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a wide range, so that scales matter: magnitudes over 2**-12 .. 2**4
    return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-12, 4, shape, generator=g))


@pytest.mark.parametrize("per_row", [False, True], ids=["region", "per-row"])
@pytest.mark.parametrize("fmt,scaling", CASTS, ids=[f"{f}-{s}" for f, s in CASTS])
def test_operand_casts_are_ampeds_own_bitwise(fmt, scaling, per_row):
    x = _x(2, 3, 70, 80)
    ours = operand_cast(x, fmt, scaling, BLOCK, per_row)
    assert torch.equal(ours, reference_cast(x, fmt, scaling, per_row))


@pytest.mark.parametrize("scaling", ["tensorwise", "head", "block"])
def test_safe_key_casts_are_ampeds_cast_of_the_visible_keys(scaling):
    keys = _x(2, 2, 96, 32)
    visible = torch.rand(2, 2, 40, 96, generator=torch.Generator().manual_seed(1)) < 0.6
    visible[:, :, :20] = torch.ones(96, 96, dtype=torch.bool).tril()[40:60]  # causal rows too
    seen_rows = 0
    for rows, cast in fp8_key_groups(keys, visible, "e4m3", scaling, BLOCK):
        for t in rows.tolist():
            mine = visible[:, :, t].unsqueeze(-1)
            expected = reference_cast(torch.where(mine, keys, 0), "e4m3", scaling)
            assert torch.equal(torch.where(mine, cast, 0), expected), (scaling, t)
            seen_rows += 1
    assert seen_rows == 40


def test_safe_mx_keys_matmul_is_each_rows_own_cast_of_its_visible_keys():
    keys, a = _x(1, 2, 100, 64), _x(1, 2, 50, 100, seed=1)
    visible = torch.ones(100, 100, dtype=torch.bool).tril()[50:].expand(1, 2, 50, 100)
    a = torch.where(visible, a, 0)
    common = reference_cast(keys.mT, "mxfp8")
    out = mx_keys_inner_matmul(a, keys, common, visible, "mxfp8")
    for t in range(50):
        seen = torch.where(visible[:, :, t].unsqueeze(-1), keys, 0)
        cast = reference_cast(seen.mT, "mxfp8")  # [1, 2, D, Tk]
        exact = a[:, :, t : t + 1].double() @ cast.mT.double()
        bound = gamma(100) * (a[:, :, t : t + 1].abs().double() @ cast.mT.abs().double())
        assert bool(((out[:, :, t : t + 1] - exact).abs() <= bound).all()), t


RULES = {
    "e4m3-tensorwise": AttentionCast("e4m3", "tensorwise"),
    "e4m3-head": AttentionCast("e4m3", "head"),
    "e4m3-block-grad-e5m2": AttentionCast("e4m3", "block", grad_format="e5m2"),
    "e5m2-head": AttentionCast("e5m2", "head"),
    "mxfp8": AttentionCast("mxfp8"),
    "mxfp8-grad-e5m2": AttentionCast("mxfp8", grad_format="mxfp8-e5m2"),
}


def _within_accumulation(actual, a, b, what):
    exact = a.double() @ b.double()
    bound = gamma(a.shape[-1]) * (a.abs().double() @ b.abs().double())
    assert bool(((actual.double() - exact).abs() <= bound).all()), what


@pytest.mark.parametrize("role", ["s", "o", "dv", "dp", "dq", "dk"])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_role_matmul_is_the_product_of_ampeds_casts(role, rule):
    r = RULES[rule]
    fmt, grad, sc = r.format, r.grad, r.scaling
    # the second 32 positions 2**-10 smaller, so that block scales differ from head ones
    small = torch.exp2(-10.0 * (torch.arange(64) >= 32))
    q, k, v, do = (_x(1, 2, 64, 32, seed=s) * small[:, None] for s in range(4))
    scores = _x(1, 2, 32, 64, seed=5) * small  # P or dS of the tile: rows 32..63
    cfg = amped.lowp.AttentionConfig(block_size=BLOCK, **{role: r})
    roles = Roles(q, k, v, cfg)
    head_amax = scores.abs().amax(dim=(2, 3), keepdim=True)  # as the whole P / dS
    roles.score_amax.update(P=head_amax, dS=head_amax)
    tile, rows = Tile(32, 64, None), slice(32, 64)

    def whole(x, f):  # a whole input cast, then the tile's rows
        return reference_cast(x, f, sc)[:, :, rows]

    def score(f, per_head=True):
        if sc == "tensorwise" and not f.startswith("mx"):
            return _amped_fp8(scores, f)
        return reference_cast(scores, f, sc)

    if role == "s":
        _within_accumulation(roles.s(tile), whole(q, fmt), reference_cast(k, fmt, sc).mT, role)
    elif role == "o":
        vt = reference_cast(v.mT, fmt, sc)
        _within_accumulation(roles.o(scores, tile), score(fmt), vt.mT, role)
    elif role == "dp":
        _within_accumulation(
            roles.dp(do, tile), whole(do, grad), reference_cast(v, fmt, sc).mT, role
        )
    elif role == "dq":
        kt = reference_cast(k.mT, fmt, sc)
        _within_accumulation(roles.dq(scores, tile), score(grad), kt.mT, role)
    elif role == "dv":
        pt = reference_cast(scores.mT, fmt, sc)
        dot = reference_cast(do.mT, grad, sc)[..., rows]
        _within_accumulation(roles.dv(scores, do, tile), pt, dot.mT, role)
    else:
        dst = reference_cast(scores.mT, grad, sc)
        qt = reference_cast(q.mT, fmt, sc)[..., rows]
        _within_accumulation(roles.dk(scores, tile), dst, qt.mT, role)


@pytest.mark.parametrize("preset", ["fp8", "fp8-forward", "fp8-all-but-ds", "mxfp8"])
def test_presets_stay_close_to_float32_attention(preset):
    # A sanity floor, not a precision claim: each cast loses about 2**-4 (e4m3) of a
    # value, a few casts compound, so outputs and gradients stay above 15 dB of SQNR
    # against float32 (measured 20-26 dB for random inputs); a role that dropped an
    # operand or a wrong scale gives below 0 dB.
    from attention_helpers import run, sdpa_math

    from amped.lowp.float8.cast import sqnr

    q, k, v = torch.randn(3, 1, 2, 96, 32, generator=torch.Generator().manual_seed(0)).unbind(0)
    grad = torch.randn(1, 2, 96, 32)
    ref = sdpa_math(q, k, v, grad, is_causal=True)
    ours = run(amped.scaled_dot_product_attention, q, k, v, grad, is_causal=True, config=preset)
    for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref, strict=True):
        assert sqnr(r, a) > 15, (preset, name, sqnr(r, a))


@pytest.mark.parametrize("rule", sorted(RULES))
def test_a_rule_round_trips_through_its_spelling(rule):
    assert AttentionCast.parse(str(RULES[rule])) == RULES[rule]
    spelled = amped.lowp.AttentionConfig(dq=str(RULES[rule]))
    assert spelled == amped.lowp.AttentionConfig(dq=RULES[rule])
