"""Blockwise FP8 casts (amped.lowp.float8.blockwise) against torchao's reference casts.

torchao's pure-torch ``torch_blockwise_scale_*`` functions (loaded from torchao's file by
tests/helpers/torchao_blockwise.py, without Triton) are the oracle: data and scale_inv
bit for bit, on shapes of our own, in bfloat16 and float32, over a wide range of
magnitudes. They take whole tiles only; a ragged shape is compared against torchao's cast
of the tensor zero-padded to whole tiles, cropped (zeros change no tile's amax).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torchao_blockwise import kernels_path, load_reference

from amped.lowp.float8.blockwise import (
    ACTIVATION_TILE,
    COLUMN_TILE,
    WEIGHT_TILE,
    dequantize_blockwise,
    quantize_blockwise,
    quantize_weight_blockwise,
)

needs_torchao = pytest.mark.skipif(kernels_path() is None, reason="torchao not installed")

REFERENCE = {
    ACTIVATION_TILE: "torch_blockwise_scale_act_quant_lhs",
    COLUMN_TILE: "torch_blockwise_scale_act_quant_rhs",
    WEIGHT_TILE: "torch_blockwise_scale_weight_quant",
}


def _tensor(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Normal values times magnitudes from 1e-4 to 1e4 along both dims, so tiles differ."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    x = x * torch.logspace(-4, 4, rows, dtype=torch.float64)[:, None]
    x = x * torch.logspace(2, -2, cols, dtype=torch.float64)[None, :]
    return x.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _padded_reference(x: torch.Tensor, tile: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's cast of ``x`` zero-padded to whole 128 x 128 tiles (its rhs cast wants
    both dims so), cropped back to ``x``'s shape and its tiles."""
    rows, cols = x.shape
    padded = F.pad(x, (0, -cols % 128, 0, -rows % 128)).contiguous()
    data, scale_inv = load_reference()[REFERENCE[tile]](padded)
    return data[:rows, :cols], scale_inv[: -(-rows // tile[0]), : -(-cols // tile[1])]


_CASES = [
    (tile, shape, dtype)
    for tile in (ACTIVATION_TILE, WEIGHT_TILE)
    for shape, dtype in [
        ((256, 128), torch.bfloat16),
        ((200, 72), torch.bfloat16),
        ((130, 136), torch.float32),
    ]
]
# torchao's 128x1 reference loops over columns in Python (seconds for a few hundred): one
# ragged shape, whose padding to 256 x 128 holds whole and partial tiles.
_CASES.append((COLUMN_TILE, (200, 72), torch.bfloat16))


@needs_torchao
@pytest.mark.parametrize(
    ("tile", "shape", "dtype"),
    _CASES,
    ids=[f"{t[0]}x{t[1]}-{s[0]}x{s[1]}-{str(d)[6:]}" for t, s, d in _CASES],
)
def test_cast_is_torchaos_bitwise(
    tile: tuple[int, int], shape: tuple[int, int], dtype: torch.dtype
) -> None:
    x = _tensor(*shape, dtype)
    q = quantize_blockwise(x, tile)
    data, scale_inv = _padded_reference(x, tile)
    assert _same_bits(q.data, data)
    assert q.scale_inv.dtype is torch.float32
    assert torch.equal(q.scale_inv, scale_inv)
    rows, cols = shape
    assert q.scale_inv.shape == (math.ceil(rows / tile[0]), math.ceil(cols / tile[1]))


@needs_torchao
def test_weight_quantizer_is_the_deepseek_layout() -> None:
    w = _tensor(384, 256, torch.bfloat16, seed=1)
    q = quantize_weight_blockwise(w)
    data, scale_inv = load_reference()["torch_blockwise_scale_weight_quant"](w)
    assert q.data.dtype is torch.float8_e4m3fn and q.scale_inv.shape == (3, 2)
    assert _same_bits(q.data, data) and torch.equal(q.scale_inv, scale_inv)


@pytest.mark.parametrize("tile", list(REFERENCE), ids=["1x128", "128x1", "128x128"])
def test_power_of_2_scales_round_the_scale_down(tile: tuple[int, int]) -> None:
    """Closed form: scale = 2**floor(log2(448 / amax)) per tile, amax in float64; the data
    is x * scale rounded to E4M3, and data * scale_inv is exact."""
    x = _tensor(200, 136, torch.bfloat16, seed=2)
    q = quantize_blockwise(x, tile, power_of_2=True)
    rows, cols = x.shape
    x64 = F.pad(x.to(torch.float64), (0, -cols % tile[1], 0, -rows % tile[0]))
    tiles = x64.reshape(x64.shape[0] // tile[0], tile[0], x64.shape[1] // tile[1], tile[1])
    amax = tiles.abs().amax(dim=(1, 3))
    expected_scale = torch.exp2(torch.floor(torch.log2(448.0 / amax)))
    assert torch.equal(q.scale_inv.to(torch.float64), 1 / expected_scale)
    per_element = q.scale_inv_per_element().to(torch.float64)
    expected = (x.to(torch.float64) / per_element).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert _same_bits(q.data, expected)
    exact = q.data.to(torch.float64) * per_element
    assert torch.equal(q.dequantize().to(torch.float64), exact)


def test_dequantize_is_within_half_an_e4m3_step() -> None:
    """Rounding to E4M3 (3 mantissa bits) errs by at most 2**-4 of the value's binade,
    and by at most half the smallest subnormal step (2**-10) times the tile's scale_inv
    below E4M3's normal range; the float32 product adds 2**-24 relative."""
    x = _tensor(130, 260, torch.float32, seed=3)
    q = quantize_blockwise(x, WEIGHT_TILE)
    back = dequantize_blockwise(q.data, q.scale_inv, WEIGHT_TILE).to(torch.float64)
    x64, s = x.to(torch.float64), q.scale_inv_per_element().to(torch.float64)
    bound = x64.abs() * (2**-4 + 2**-24) + s * 2**-10
    assert bool(((back - x64).abs() <= bound).all())


def test_transpose_keeps_tiles_with_their_scales() -> None:
    x = _tensor(256, 136, torch.bfloat16, seed=4)
    q = quantize_blockwise(x, (1, 128))
    assert torch.equal(q.t().dequantize(), q.dequantize().t())
    assert q.t().tile == (128, 1)


@pytest.mark.parametrize(
    ("x", "tile", "match"),
    [
        (torch.ones(2, 3, 4), (1, 128), "2-D tensor"),
        (torch.ones(4, 4, dtype=torch.int32), (1, 128), "floating"),
        (torch.ones(4, 4), (0, 128), "positive ints"),
    ],
    ids=["3d", "int", "tile"],
)
def test_bad_input_is_refused(x: torch.Tensor, tile: tuple[int, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        quantize_blockwise(x, tile)
