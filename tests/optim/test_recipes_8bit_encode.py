"""The 8-bit code computed from a value (``quantized_state.encode``) against the search
in the map that torchao's ``AdamW8bit`` runs, equal on every class of float32; and the
value computed from a code (``quantized_state.decode``) against the map, on every code."""

from __future__ import annotations

import math

import pytest
import torch

from amped.optim import quantized_state as q8

torchao_quant = pytest.importorskip("torchao.optim.quant_utils")

SIGNS = pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])


def _search(scaled: torch.Tensor, signed: bool) -> torch.Tensor:
    """torchao's code: a binary search in the map, then the nearer of two entries."""
    return torchao_quant.quantize_8bit_with_qmap(scaled, q8.dynamic_map(signed)).int()


def _neighbours(values: torch.Tensor, ulps: int) -> torch.Tensor:
    """``values`` and the ``ulps`` float32 numbers on each side of each."""
    out, down, up = [values], values, values
    for _ in range(ulps):
        down = torch.nextafter(down, torch.full_like(down, -math.inf))
        up = torch.nextafter(up, torch.full_like(up, math.inf))
        out += [down, up]
    return torch.cat(out)


def _bit_patterns(stride: int) -> torch.Tensor:
    """Every ``stride``-th float32 bit pattern, positive and negative (NaNs dropped):
    every exponent, denormals included, with assorted mantissas."""
    bits = torch.arange(0, 1 << 31, stride, dtype=torch.int64).to(torch.int32)
    positive = bits.view(torch.float32)
    values = torch.cat([positive, -positive])
    return values[~values.isnan()]


def _classes(signed: bool) -> dict[str, torch.Tensor]:
    qmap, thresholds = q8.dynamic_map(signed), q8.thresholds(signed)
    midpoints = (qmap[:-1] + qmap[1:]) / 2
    tiny = torch.finfo(torch.float32).tiny
    big = torch.finfo(torch.float32).max
    return {
        # In [-1, 1], as scaled values are: random magnitudes over all decades.
        "random": torch.cat(
            [
                torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * 2 - 1,
                torch.exp(-torch.rand(200_000, generator=torch.Generator().manual_seed(1)) * 40),
            ]
        ),
        "bit-patterns": _bit_patterns(4099),
        # Around each entry and each tie (the midpoints, where the rule rounds up), and
        # the thresholds the code is decided by: 8 floats either side, and their negatives.
        "entries": _neighbours(torch.cat([qmap, -qmap]), 8),
        "ties": _neighbours(torch.cat([midpoints, -midpoints]), 8),
        "thresholds": _neighbours(torch.cat([thresholds, -thresholds]), 8),
        # Decade boundaries, where the estimate changes its formula.
        "decades": _neighbours(
            torch.tensor([10.0**-e for e in range(9)] * 2) * torch.tensor([1.0] * 9 + [-1.0] * 9),
            16,
        ),
        "zero-denormal": torch.tensor(
            [0.0, -0.0, tiny, -tiny, tiny / 2**23, -tiny / 2**23, tiny / 3, 1e-39]
        ),
        # Beyond the block's largest magnitude (scaled values lie in [-1, 1]).
        "outside": torch.tensor(
            [1.0, -1.0, 1.0001, -1.0001, 1.5, -2.0, 1e10, -1e30, big, -big, math.inf, -math.inf]
        ),
    }


@SIGNS
@pytest.mark.parametrize(
    "kind",
    [
        "random",
        "bit-patterns",
        "entries",
        "ties",
        "thresholds",
        "decades",
        "zero-denormal",
        "outside",
    ],
)
def test_encode_equals_the_search(signed: bool, kind: str) -> None:
    scaled = _classes(signed)[kind]
    codes = q8.encode(scaled, q8.thresholds(signed), signed)
    expected = _search(scaled, signed)
    mismatched = (codes != expected).nonzero().flatten()
    assert mismatched.numel() == 0, (
        scaled[mismatched[:5]],
        codes[mismatched[:5]],
        expected[mismatched[:5]],
    )


@pytest.mark.slow  # compiles (10-30 s on a loaded 2-core machine)
@SIGNS
def test_compiled_encode_equals_the_search(signed: bool) -> None:
    # The fused step runs encode inside a compiled kernel: Inductor evaluates the same
    # float32 comparisons, selections and multiply-add, so the same codes come out.
    compiled = torch.compile(q8.encode, dynamic=True, fullgraph=True)
    classes = _classes(signed)
    scaled = torch.cat([classes[k] for k in ("random", "entries", "ties", "thresholds", "decades")])
    codes = compiled(scaled, q8.thresholds(signed), signed)
    assert torch.equal(codes, _search(scaled, signed).to(codes.dtype))


def test_nan_takes_code_zero_as_in_the_search() -> None:
    scaled = torch.tensor([math.nan, -math.nan])
    for signed in (True, False):
        assert q8.encode(scaled, q8.thresholds(signed), signed).tolist() == [0, 0]
        assert _search(scaled, signed).tolist() == [0, 0]


@SIGNS
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64, torch.float32], ids=str)
def test_decode_is_the_map_on_every_code(signed: bool, dtype: torch.dtype) -> None:
    # decode computes each entry from torch.linspace's formula instead of reading the
    # table; the 256 codes of each map are all there is to check.
    values = q8.decode(torch.arange(256).to(dtype), signed)
    assert values.dtype == torch.float32
    assert torch.equal(values.view(torch.int32), q8.dynamic_map(signed).view(torch.int32))


@pytest.mark.slow  # compiles (10-30 s on a loaded 2-core machine)
@SIGNS
def test_compiled_decode_is_the_map_on_every_code(signed: bool) -> None:
    # The fused step decodes inside a compiled kernel: the same float32 operations, each
    # exact but the last addition of each bin edge, so the same values come out.
    compiled = torch.compile(q8.decode, dynamic=True, fullgraph=True)
    values = compiled(torch.arange(256, dtype=torch.uint8).repeat(3), signed)
    expected = q8.dynamic_map(signed).repeat(3)
    assert torch.equal(values.view(torch.int32), expected.view(torch.int32))
