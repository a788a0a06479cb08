"""Differential against torchao 0.18's float8 training (``convert_to_float8_training``),
which runs on CPU through torch's CPU ``torch._scaled_mm``: same layer, weights and
inputs; output and all three gradients compared.

With amped's layers calling the same ``_scaled_mm`` (``emulate=False``) the results are
bitwise equal: both compute the scale as ``float32(fp8_max / float64(amax))`` (a power
of two below it for rowwise), saturate then cast, and call ``_scaled_mm`` with the
reciprocal scales; torchao's rowwise grad GEMMs multiply the scales in after a bfloat16
GEMM, ours pass them to the GEMM, which is the same number because rowwise scales are
powers of two (exact in any binary float).

amped's emulated GEMM (the CPU default: amped.lowp.float8.gemm) computes the same exact
products of FP8 values but sums them in float32 in another order: not bitwise by
design, so those cases are held to the bar where the algorithm differs, SQNR >= 40 dB.
It runs on each of its two paths (amped.lowp.float8.emulated_gemm), forced here whatever this
machine would choose:

- ``emulated-bf16`` (machines with native bf16 matmul): for a bfloat16 result a
  bfloat16 GEMM rounds the sums to bfloat16 before the scales multiply them and the
  result is rounded again. Measured: 51.1-51.8 dB for tensorwise bfloat16 outputs and
  gradients (the second rounding: a tensorwise scale is not a power of two);
- ``emulated-fp32`` (machines without): a float32 GEMM, the scales applied to its
  float32 sums, one rounding: 80.0-112.0 dB for tensorwise bfloat16 results.

Float32 results take a float32 GEMM on both paths: 133.4-138.9 dB (summation order
only). The rowwise cases came out bitwise on both paths (power-of-two scales make
the scaling exact, and the sums came out in torchao's order). The FP8 casts feeding
the GEMMs are torchao's bit for bit in every case (the ``_scaled_mm`` cases above take
the same casts; test_cast_is_torchaos_bitwise the cast that also writes the
emulation's bfloat16 operand).
"""

from __future__ import annotations

import copy

import pytest
import torch
from fp8_helpers import TORCHAO_RECIPE, every_linear, ffn, forced_emulated_gemm, torchao_convert

from amped.lowp import convert_to_low_precision
from amped.lowp.convert import convert_layers
from amped.lowp.float8.cast import sqnr
from amped.lowp.float8.config import FLOAT8_CONFIGS

SQNR_DIFFERENT_SUMMATION = 40.0  # dB: where algorithms differ by design (docstring)


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


@pytest.mark.parametrize(
    "path", [None, "bf16", "float32"], ids=["scaled_mm", "emulated-bf16", "emulated-fp32"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("scaling", list(TORCHAO_RECIPE))
def test_linear_matches_torchao(scaling, dtype, path):
    emulate = path is not None
    with forced_emulated_gemm(path):
        _linear_matches_torchao(scaling, dtype, emulate)


def _linear_matches_torchao(scaling, dtype, emulate):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256))
    theirs = torchao_convert(model, scaling)
    ours = copy.deepcopy(model)
    convert_layers(ours, FLOAT8_CONFIGS[scaling], ["0"], emulate=emulate)
    x = torch.randn(2, 16, 128, dtype=dtype) * 3
    grad = torch.randn(2, 16, 256, dtype=dtype) * 1e-3
    _compare(_run(ours, x, grad), _run(theirs, x, grad), bitwise=not emulate)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_llama_ffn_matches_torchao(scaling):
    model = ffn()
    theirs = torchao_convert(model, scaling, lambda m, n: True)
    ours = copy.deepcopy(model)
    layers = convert_to_low_precision(
        ours, FLOAT8_CONFIGS[scaling], module_filter_fn=every_linear, emulate=False
    )
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
    convert_layers(ours, FLOAT8_CONFIGS["tensorwise"], ["0"], emulate=False)
    x = torch.randn(8, 64, dtype=torch.bfloat16)  # no grad: grad_input GEMM skipped
    for m in (ours, theirs):
        m(x).float().sum().backward()
    assert torch.equal(ours[0].weight.grad, theirs[0].weight.grad)
    ours[0].weight.requires_grad_(False)  # frozen weight: grad_weight GEMM skipped
    x = x.clone().requires_grad_()
    ours(x).float().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("values_dtype", [None, torch.bfloat16], ids=["bytes", "with-values"])
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_cast_is_torchaos_bitwise(dtype, granularity, values_dtype):
    """The cast an emulated layer makes (bytes and bfloat16 values in one pass) keeps the
    FP8 bytes and scale of torchao's ``hp_tensor_to_float8_dynamic`` bit for bit; its
    values are those bytes, divided by the scale where that is a power of two."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    from amped.lowp.float8.cast import quantize

    torch.manual_seed(0)
    x = torch.randn(256, 1024, dtype=torch.bfloat16) * 5  # 2**18 elements: the compiled cast
    rowwise = granularity == "rowwise"
    axiswise, tensorwise = ScalingGranularity.AXISWISE, ScalingGranularity.TENSORWISE
    theirs = hp_tensor_to_float8_dynamic(
        x,
        dtype,
        LinearMMConfig(),
        scaling_granularity=axiswise if rowwise else tensorwise,
        axiswise_dim=-1 if rowwise else None,
        round_scales_to_power_of_2=rowwise,
    )
    ours = quantize(x, dtype, granularity, power_of_2=rowwise, values_dtype=values_dtype)
    assert torch.equal(ours.data.view(torch.uint8), theirs._data.view(torch.uint8))
    assert torch.equal(ours.scale, theirs._scale.reshape(ours.scale.shape))
    if values_dtype is not None:  # rowwise: power-of-two scales, the values dequantized
        values = theirs._data.to(torch.float64) / (theirs._scale.double() if rowwise else 1)
        assert ours.dequantized is rowwise
        assert torch.equal(ours.values, values.to(values_dtype))
