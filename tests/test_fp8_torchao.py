"""Differential against torchao 0.18's float8 training (``convert_to_float8_training``),
which runs on CPU through torch's CPU ``torch._scaled_mm``: same layer, weights and
inputs; output and all three gradients compared.

With amped's layers calling the same ``_scaled_mm`` (``emulate=False``) the results are
bitwise equal: both compute the scale as ``float32(fp8_max / float64(amax))`` (a power
of two below it for rowwise), saturate then cast, and call ``_scaled_mm`` with the
reciprocal scales; torchao's rowwise grad GEMMs multiply the scales in after a bfloat16
GEMM, ours pass them to the GEMM, which is the same number because rowwise scales are
powers of two (exact in any binary float).

amped's emulated GEMM (the CPU default: amped.fp8.gemm) computes the same exact
products of FP8 values but sums them in float32 in another order (oneDNN's bfloat16
GEMM) and scales the float32 sums: not bitwise by design, so those cases are held to
the issue's bar for differing summation order, SQNR >= 40 dB. Measured: 80-112 dB
for tensorwise bfloat16 outputs and gradients (one bfloat16 rounding landing
differently), 130-139 dB for float32 ones; the rowwise cases came out bitwise here.
The FP8 casts feeding the GEMMs are torchao's bit for bit in every case (the
``_scaled_mm`` cases above take the same casts).
"""

from __future__ import annotations

import copy

import pytest
import torch

from amped.fp8 import FP8_CONFIGS, convert_to_fp8
from amped.fp8.cast import sqnr
from fp8_helpers import TORCHAO_RECIPE, every_linear, ffn, torchao_convert

SQNR_DIFFERENT_SUMMATION = 40.0  # dB: the bound where algorithms differ by design


def _run(model, x, grad):
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    grads = {n: p.grad for n, p in model.named_parameters()}
    return {"output": out, "grad_input": x.grad, **grads}


def _compare(ours, theirs, bitwise):
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype, key
        if bitwise:
            assert torch.equal(ours[key], theirs[key]), key
        else:
            assert sqnr(theirs[key], ours[key]) >= SQNR_DIFFERENT_SUMMATION, key


@pytest.mark.parametrize("emulate", [False, True], ids=["scaled_mm", "emulated"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("scaling", list(TORCHAO_RECIPE))
def test_linear_matches_torchao(scaling, dtype, emulate):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256))
    theirs = torchao_convert(model, scaling)
    ours = copy.deepcopy(model)
    convert_to_fp8(ours, FP8_CONFIGS[scaling], ["0"], emulate=emulate)
    x = torch.randn(2, 16, 128, dtype=dtype) * 3
    grad = torch.randn(2, 16, 256, dtype=dtype) * 1e-3
    _compare(_run(ours, x, grad), _run(theirs, x, grad), bitwise=not emulate)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_llama_ffn_matches_torchao(scaling):
    model = ffn()
    theirs = torchao_convert(model, scaling, lambda m, n: True)
    ours = copy.deepcopy(model)
    layers = convert_to_fp8(ours, FP8_CONFIGS[scaling], module_filter=every_linear, emulate=False)
    assert layers.names() == ["w1", "w3", "w2"]
    x = torch.randn(4, 32, 256, dtype=torch.bfloat16)
    grad = torch.randn(4, 32, 256, dtype=torch.bfloat16)
    # torch's reference CPU kernel for both sides: oneDNN's (tested above) takes seconds here.
    with torch.backends.mkldnn.flags(enabled=False):
        _compare(_run(ours, x, grad), _run(theirs, x, grad), bitwise=True)


def test_frozen_input_and_weight_skip_their_gemms_and_keep_the_rest_bitwise():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    theirs = torchao_convert(model, "tensorwise")
    ours = copy.deepcopy(model)
    convert_to_fp8(ours, FP8_CONFIGS["tensorwise"], ["0"], emulate=False)
    x = torch.randn(8, 64, dtype=torch.bfloat16)  # no grad: grad_input GEMM skipped
    for m in (ours, theirs):
        m(x).float().sum().backward()
    assert torch.equal(ours[0].weight.grad, theirs[0].weight.grad)
    ours[0].weight.requires_grad_(False)  # frozen weight: grad_weight GEMM skipped
    x = x.clone().requires_grad_()
    ours(x).float().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
