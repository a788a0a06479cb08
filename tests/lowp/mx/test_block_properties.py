"""Properties of the NVFP4 recipe's parts: 16x16 weight tiles are transpose-consistent,
stochastic rounding is unbiased, the random Hadamard transform is orthogonal and leaves
the weight-gradient GEMM unchanged in exact arithmetic."""

from __future__ import annotations

import pytest
import torch

from amped.lowp.float8.cast import sqnr
from amped.lowp.mx.block_cast import quantize_block
from amped.lowp.mx.block_format import BLOCK_FORMATS
from amped.lowp.mx.e2m1 import E2M1_VALUES
from amped.lowp.mx.element_round import (
    ELEMENTS,
    hashed_uniform,
    round_nearest_,
    round_stochastic,
    round_stochastic_,
    rounding_key,
)
from amped.lowp.mx.hadamard import (
    hadamard_matrix,
    hadamard_rows,
    hadamard_signs,
    random_hadamard,
    rotate_rows,
)

NVFP4 = BLOCK_FORMATS["nvfp4"]
E2M1 = ELEMENTS[torch.float4_e2m1fn_x2]
UNBIASED_ULPS = 0.02  # mean error within 2% of an ulp; round-to-nearest is off by up to 1/2
# Draws of each stochastic cast: with 1024 copies of a value, 102,400 roundings, whose
# mean has a standard deviation of at most 0.16% of an ulp (a Bernoulli's sqrt(p(1-p)/n)
# <= 0.5/320): the 2% gate is 12 standard deviations, and a bias of 2% of an ulp or more
# (round-to-nearest's is 10% or more at every fraction tested) still fails.
DRAWS = 100
COPIES = 1024


@pytest.mark.parametrize("shape", [(16, 16), (64, 128), (256, 48)])
@pytest.mark.parametrize("seed", [0, 1])
def test_16x16_weight_tiles_are_transpose_consistent(shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 8, shape, generator=g))
    q, q_t = (
        quantize_block(w, NVFP4, tile_2d=True),
        quantize_block(w.t().contiguous(), NVFP4, tile_2d=True),
    )
    assert torch.equal(q.dequantize().t(), q_t.dequantize())
    assert torch.equal(q.block_values(torch.bfloat16).t(), q_t.block_values(torch.bfloat16))
    # 1x16 blocks are not: the control that makes this test able to fail
    assert not torch.equal(quantize_block(w, NVFP4).dequantize().t(),
                           quantize_block(w.t().contiguous(), NVFP4).dequantize())  # fmt: skip


def _ulp(x):
    values = torch.tensor(E2M1_VALUES)
    hi = torch.bucketize(x.abs(), values, right=True).clamp(max=7)
    return values[hi] - values[hi - 1]


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 0.8])
def test_stochastic_rounding_is_unbiased(fraction):
    """Every point between two E2M1 neighbours, 1024 copies x 100 draws: the mean is
    within 2% of the local ulp of the value (the mean's standard deviation is below
    0.16% of an ulp), where round-to-nearest is off by up to half an ulp."""
    lo = torch.tensor(E2M1_VALUES[:-1])
    x = lo + fraction * (torch.tensor(E2M1_VALUES[1:]) - lo)
    x = torch.cat([x, -x]).repeat(COPIES)  # 14 values x COPIES
    g = torch.Generator().manual_seed(0)
    mean = sum(round_stochastic_(x.clone(), E2M1, g) for _ in range(DRAWS)) / DRAWS
    per_value = ((mean - x) / _ulp(x)).view(COPIES, 14).mean(0)
    error = per_value.abs().max().item()
    assert error <= UNBIASED_ULPS
    nearest = ((round_nearest_(x.clone(), E2M1) - x) / _ulp(x)).abs().max().item()
    assert nearest >= min(fraction, 1 - fraction) - 1e-6


def test_stochastic_rounding_through_a_block_cast_is_unbiased():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g)
    q = [quantize_block(x, NVFP4, generator=g).dequantize() for _ in range(DRAWS)]
    mean = torch.stack(q).mean(0)
    scale = quantize_block(x, NVFP4).block_scale().repeat_interleave(16, -1) * (
        x.abs().max() / 2688
    )
    ulp = _ulp(x / scale) * scale
    assert ((mean - x) / ulp).mean().abs().item() <= UNBIASED_ULPS
    nearest = quantize_block(x, NVFP4).dequantize()
    assert ((nearest - x) / ulp).abs().mean().item() > 10 * UNBIASED_ULPS


def test_stochastic_rounding_is_the_documented_formula_bitwise():
    """``floor(|v| / q + u) * q`` in float32 with the sign put back, ``q`` E2M1's spacing
    at ``|v|`` saturated to 6 (``max(2 ** (floor(log2 |v|) - 1), 0.5)``): every binade
    from float32 subnormals to beyond the largest element, zeros of both signs, exact
    E2M1 values, and draws that make ``|v| / q + u`` round up in float32."""
    g = torch.Generator().manual_seed(3)
    mantissa = 1 + torch.rand(4096, generator=g)
    exponent = torch.randint(-149, 8, (4096,), generator=g).to(torch.float32)
    v = mantissa * torch.exp2(exponent)
    v = torch.cat([v, torch.tensor([0.0, 6.0, 5.0, 3.0, 1.5, 0.5, 7.0, 1e30])])
    v = torch.cat([v, -v])
    draw = torch.rand(v.shape, generator=g)
    draw[:64] = 1 - 2.0**-24  # the largest draw: frac + u rounds to the next integer
    magnitude = v.abs().clamp(max=6.0)
    binade = torch.exp2(torch.floor(torch.log2(magnitude.double()))).float()
    quantum = (binade / 2).clamp(min=0.5)
    expected = torch.floor(magnitude / quantum + draw) * quantum
    expected = torch.where(v < 0, -expected, torch.where(v == 0, v, expected))  # -0 stays
    got = round_stochastic(v, E2M1, draw)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_stochastic_rounding_is_reproducible_from_its_seed():
    x = torch.randn(32, 64)
    a = quantize_block(x, NVFP4, generator=torch.Generator().manual_seed(7))
    b = quantize_block(x, NVFP4, generator=torch.Generator().manual_seed(7))
    c = quantize_block(x, NVFP4, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a.elements, b.elements)
    assert not torch.equal(a.elements, c.elements)


def test_hadamard_is_orthogonal():
    h = hadamard_matrix(16)
    assert torch.equal(h @ h.t(), torch.eye(16))  # entries +-1/4: exact in float32
    r = random_hadamard(seed=3)
    x = torch.randn(256, 48)
    back = rotate_rows(rotate_rows(x, r), r.t())  # R (R.T x) = x, in float32
    assert sqnr(x, back) > 100


def test_hadamard_leaves_the_weight_gradient_gemm_unchanged_in_exact_arithmetic():
    """Small integers: every sum of the rotated products is exact in float32 (entries
    are multiples of 1/4 under 2**10), so the rotated GEMM equals the plain one bitwise."""
    g = torch.Generator().manual_seed(5)
    go = torch.randint(-8, 9, (64, 32), generator=g).float()
    x = torch.randint(-8, 9, (64, 48), generator=g).float()
    r = random_hadamard(seed=11)
    assert torch.equal(rotate_rows(go, r).t() @ rotate_rows(x, r), go.t() @ x)
    assert not torch.equal(rotate_rows(go, r), go)


def test_the_butterfly_rotation_is_the_matrix_rotation():
    """:func:`hadamard_rows` (what the casts run) is ``R.T @ x``: bitwise on small
    integers (every partial sum exact), and orthogonal on Gaussian data: R (R.T x)
    reconstructs x above 100 dB, and it differs from the matrix form only by float32
    rounding (relative error of each output below 2**-20: 4 rounded stages)."""
    signs, r = hadamard_signs(4), random_hadamard(4)
    g = torch.Generator().manual_seed(6)
    small = torch.randint(-8, 9, (64, 40), generator=g).float()
    assert torch.equal(hadamard_rows(small, signs), rotate_rows(small, r))
    assert not torch.equal(hadamard_rows(small, signs), small)
    x = torch.randn(256, 48, generator=g)
    rotated = hadamard_rows(x, signs)
    assert sqnr(x, rotate_rows(rotated, r.t())) > 100
    error = (rotated - rotate_rows(x, r)).abs() / x.abs().max()
    assert error.max().item() < 2.0**-20


def test_the_hashed_draws_are_uniform_and_independent():
    """The draws of stochastic rounding (a hash of key and index, not torch.rand):
    2**20 draws of one key fill 256 equal bins as a uniform source would (chi-square
    with 255 degrees of freedom below 360, its 99.99th percentile); each of the 24 bits
    is set half the time (within 5 standard deviations, 0.0025), neighbours and two
    keys are uncorrelated (|r| < 5 / sqrt(n)), and the key changes every draw."""
    n = 1 << 20
    key = rounding_key(torch.Generator().manual_seed(0), torch.device("cpu"))
    u = hashed_uniform(key, torch.Size([n]))
    assert u.dtype == torch.float32 and u.min() >= 0 and u.max() < 1
    counts = torch.bincount((u * 256).long(), minlength=256).double()
    chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum().item()
    assert chi2 < 360
    bits = (u * 2**24).long()
    for bit in range(24):
        assert abs(((bits >> bit) & 1).double().mean().item() - 0.5) < 0.0025
    bound = 5 / n**0.5
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < bound
    other = hashed_uniform(key + torch.tensor([1, 0]), torch.Size([n]))
    assert abs(torch.corrcoef(torch.stack([u, other]))[0, 1].item()) < bound
    g = torch.Generator().manual_seed(0)
    assert not torch.equal(rounding_key(g, u.device), rounding_key(g, u.device))


def _lowbias32(h):
    """The documented hash in int64 arithmetic, each product masked to 32 bits."""
    mask = 0xFFFFFFFF
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & mask
    h = h ^ (h >> 15)
    h = (h * 0x5BD1E995) & mask
    return h ^ (h >> 16)


@pytest.mark.parametrize(
    "key",
    [(0, 0), (0xFFFFFFFF, 0xFFFFFFFF), (123456789, 4000000000), (1 << 31, (1 << 31) - 1)],
    ids=["zeros", "all-ones", "mixed", "sign-bit"],
)
def test_hashed_uniform_is_the_documented_32_bit_hash_bitwise(key):
    """The int32 (wrapping) hash gives the bits of the documented formula computed in
    int64 with 32-bit masks, keys with the top bit set included."""
    shape = torch.Size([300, 1001])
    index = torch.arange(shape.numel(), dtype=torch.int64).view(shape)
    h = _lowbias32((index & 0xFFFFFFFF) ^ key[0])
    h = _lowbias32(h ^ (index >> 32) ^ key[1])
    expected = (h >> 8).to(torch.float32) * 2.0**-24
    got = hashed_uniform(torch.tensor(key, dtype=torch.int64), shape)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
