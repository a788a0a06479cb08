"""The GEMM output bound (amped.verification.bound) holds for float32 accumulation and
fails for less: derived from the arithmetic, it separates the two without tuning."""

from __future__ import annotations

import torch

from amped.verification.bound import gemm_bound


def _operands(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(32, k, generator=generator).to(torch.bfloat16)
    b = torch.randn(48, k, generator=generator).to(torch.bfloat16)
    return a, b


def _within(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias=None) -> torch.Tensor:
    reference, bound = gemm_bound(a.double(), b.double(), out.dtype, bias)
    return (out.double() - reference).abs() <= bound


def test_a_bfloat16_gemm_accumulating_in_float32_is_within_its_bound():
    a, b = _operands(4096)
    assert _within(a @ b.t(), a, b).all()
    # twice rounded (the sum to bfloat16, then a power-of-two scale and bfloat16 again)
    twice = ((a.float() @ b.float().t()).to(torch.bfloat16).float() * 0.25).to(torch.bfloat16)
    assert _within(twice, a * 0.5, b * 0.5).all()


def test_the_forward_bias_added_in_the_output_dtype_is_within_its_bound():
    a, b = _operands(256)
    bias = torch.randn(48, generator=torch.Generator().manual_seed(1)) * 100
    out = (a @ b.t()) + bias.to(torch.bfloat16)
    assert _within(out, a, b, bias).all()


def test_accumulating_in_bfloat16_falls_outside_the_bound():
    a, b = _operands(512)
    products = a.float()[:, None, :] * b.float()[None, :, :]  # exact in float32
    out = torch.zeros(32, 48, dtype=torch.bfloat16)
    for k in range(512):  # a bfloat16 accumulator: the sum rounded after every product
        out = (out.float() + products[:, :, k]).to(torch.bfloat16)
    assert (~_within(out, a, b)).float().mean() > 0.5
