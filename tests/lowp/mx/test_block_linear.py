"""BlockLinear against oracles, on both paths of the emulated GEMMs (the
``emulated_gemm`` fixture: bfloat16 GEMMs, as a machine with native bf16 matmul runs
them, and float32 ones, as a machine without does).

- ``mxfp8``: torchao 0.18's MXFP8 training function (``mx_mm``) with its emulated
  kernel: output, grad_input and grad_weight bitwise, in bfloat16 and float32, at the
  shapes below, on both paths. Both sides cast the same operands the same way and
  dequantize them exactly; torchao multiplies them in bfloat16 for a bfloat16 input (as
  amped's bfloat16 path), amped's float32 path in float32: the same exact products and
  float32 sums, here in the same order. The backward GEMMs' operand layouts differ from
  torchao's (it copies its transposed operands contiguous), which at some larger shapes
  changes oneDNN's float32 summation order, as does the float32 path's GEMM kernel:
  there the results are held to 40 dB (the test at 4096 tokens; measured 91-125 dB).
- ``mxfp4`` and ``nvfp4`` have no installed training oracle: each GEMM is held to the
  float64 product of its dequantized operands (SQNR >= 40 dB; the emulation differs by
  float32 summation order and its roundings to the output dtype only).
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch

from amped._internal import testing
from amped.lowp.float8.cast import sqnr
from amped.lowp.health import record_gemm
from amped.lowp.mx.block_cast import quantize_block
from amped.lowp.mx.block_config import BLOCK_CONFIGS
from amped.lowp.mx.block_format import BLOCK_FORMATS
from amped.lowp.mx.block_gemm import block_mm, operand_mm
from amped.lowp.mx.block_linear import BlockLinear
from amped.lowp.mx.block_operand import block_operand

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ao_linear = pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear")
    ao_config = pytest.importorskip("torchao.prototype.mx_formats.config")
    ao_pref = pytest.importorskip("torchao.quantization.quantize_.common.kernel_preference")

SQNR_DIFFERENT_SUMMATION = 40.0  # dB: well above an FP8/FP4 cast's own error, so only a
# summation order or rounding that differs by design passes, never a wrong cast or scale


def _torchao_mxfp8(x, weight, mode):
    e4m3 = torch.float8_e4m3fn
    return ao_linear.mx_mm.apply(
        x,
        weight,
        e4m3,
        e4m3,
        e4m3,
        32,
        ao_pref.KernelPreference.EMULATED,
        ao_config.MXFP8Dim0CastKernelChoice.TORCH,
        ao_config.MXFP8Dim1CastKernelChoice.TORCH,
        ao_config.ScaleCalculationMode(mode),
        False,
    )


def _grads(fn, x, weight, grad):
    """Output and gradients of ``fn(x, weight)``; ``weight`` a leaf tensor."""
    x = x.clone().requires_grad_()
    out = fn(x, weight)
    out.backward(grad)
    return {"output": out, "grad_input": x.grad, "grad_weight": weight.grad}


def _block_linear(weight, config):
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
    return BlockLinear.convert_(linear, config)


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", [(2, 16), (3, 32)], ids=["32tok", "96tok"])
def test_mxfp8_matches_torchao_emulated_bitwise(mode, dtype, tokens, emulated_gemm):
    torch.manual_seed(0)
    weight = (torch.randn(256, 128) * 0.05).to(dtype)
    x = (torch.randn(*tokens, 128) * 3).to(dtype)
    grad = (torch.randn(*tokens, 256) * 1e-3).to(dtype)
    config = BLOCK_CONFIGS["mxfp8"].replace(scale_mode=mode)
    layer = _block_linear(weight, config)
    ours = _grads(lambda a, w: layer(a), x, layer.weight, grad)
    leaf = weight.clone().requires_grad_()
    theirs = _grads(lambda a, w: _torchao_mxfp8(a, w, mode), x, leaf, grad)
    for key in ours:
        assert ours[key].dtype == theirs[key].dtype, key
        assert torch.equal(ours[key], theirs[key]), key


def test_mxfp8_backward_gemms_differ_from_torchao_by_summation_order_only_at_large_shapes(
    monkeypatch, emulated_gemm
):
    """4096 tokens, 512 -> 256: the backward GEMMs hand ``torch.mm`` other layouts than
    torchao's (grad_weight's left operand ``grad_output.T`` a transposed view where
    torchao copies it contiguous; grad_input's weight row-major where torchao's is a
    transposed view), and at this shape oneDNN's float32 summation order follows the
    layout: grad_weight is not bitwise torchao's here (docs/fp8.md, "What the tests
    hold"). Same casts, same exact products: held to 40 dB for a summation
    order that differs, and the output (the same layouts on both sides) bitwise on the
    bfloat16 path (the float32 path's GEMM sums in its own order: 106-113 dB). Casts
    eager (the compiled ones are the same bits), so that no kernel compiles here."""
    monkeypatch.setattr(testing, "CASTS", "eager")
    torch.manual_seed(0)
    weight = (torch.randn(256, 512) * 0.05).to(torch.bfloat16)
    x = (torch.randn(4096, 512) * 3).to(torch.bfloat16)
    grad = (torch.randn(4096, 256) * 1e-3).to(torch.bfloat16)
    layer = _block_linear(weight, BLOCK_CONFIGS["mxfp8"])
    ours = _grads(lambda a, w: layer(a), x, layer.weight, grad)
    leaf = weight.clone().requires_grad_()
    theirs = _grads(lambda a, w: _torchao_mxfp8(a, w, "rceil"), x, leaf, grad)
    if emulated_gemm is torch.bfloat16:
        assert torch.equal(ours["output"], theirs["output"])
    for key in ("output", "grad_input", "grad_weight"):
        assert sqnr(theirs[key], ours[key]) >= SQNR_DIFFERENT_SUMMATION, key


def _exact_product(a, b):
    """float64 ``dequantize(a) @ dequantize(b).T`` with the scales applied exactly."""

    def exact(t):
        blocks = t.elements.double().unflatten(-1, (-1, t.format.block_size))
        values = (blocks * t.block_scale().double().unsqueeze(-1)).flatten(-2)
        return values if t.tensor_scale is None else values * t.tensor_scale.double()

    return exact(a) @ exact(b).t()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4"])
def test_block_gemm_is_the_exact_product_up_to_summation_and_output_rounding(
    name, out_dtype, emulated_gemm
):
    torch.manual_seed(1)
    fmt = BLOCK_FORMATS[name]
    a = quantize_block(torch.randn(64, 256) * 10, fmt)
    b = quantize_block(torch.randn(96, 256), fmt, tile_2d=not fmt.is_mx)
    out = block_mm(a, b, out_dtype)
    assert out.dtype is out_dtype
    assert sqnr(_exact_product(a, b), out) >= SQNR_DIFFERENT_SUMMATION


# A bfloat16 result rounded once from the float32 accumulator (NVFP4's tensor scales
# multiply the accumulator, as the GEMM's alpha) equals the float64 product rounded to
# bfloat16 except where float32 summation error (256 exact products: a few float32 ulps,
# 2**-21 relative) moves the sum across a bfloat16 rounding boundary, a band of about
# 2**-21 / 2**-8 = 2**-13 of the values: 1% of the entries allows that with a wide
# margin, and each such entry is one bfloat16 ulp off at most. A second rounding (the
# bfloat16 result times the scale, as before) differs at about a quarter of the entries.
ONCE_ROUNDED_DIFFERING = 0.01


@pytest.mark.parametrize("shape", [(64, 96, 256), (128, 256, 512)], ids=str)
def test_nvfp4_gemm_rounds_the_scaled_product_to_bfloat16_once(shape, emulated_gemm):
    torch.manual_seed(4)
    m, n, k = shape
    fmt = BLOCK_FORMATS["nvfp4"]
    a = quantize_block(torch.randn(m, k) * 10, fmt)
    b = quantize_block(torch.randn(n, k) * 1e-3, fmt, tile_2d=True)
    out = block_mm(a, b, torch.bfloat16)
    once = _exact_product(a, b).to(torch.bfloat16)
    differing = out != once
    assert differing.float().mean() <= ONCE_ROUNDED_DIFFERING
    ulp = torch.finfo(torch.bfloat16).eps * once.float().abs().clamp(min=1e-30)
    assert ((out.float() - once.float()).abs() <= ulp).all()


def test_nvfp4_layer_inside_a_users_compile_has_no_graph_break():
    """Under torch.compile the tensor scales cannot be addmm's alpha (a Python number
    out of a computed tensor breaks the graph): the float32 product times the scale,
    rounded once as on the eager path (the tests above)."""
    torch.manual_seed(4)
    # (stochastic rounding and Hadamard off: their torch.Generator breaks a graph by itself)
    config = dataclasses.replace(BLOCK_CONFIGS["nvfp4"], stochastic_rounding=False, hadamard=False)
    layer = BlockLinear.convert_(torch.nn.Linear(256, 96), config)
    x = torch.randn(64, 256, requires_grad=True)
    eager = layer(x)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    out = compiled(x)  # fullgraph: a graph break raises
    assert sqnr(eager, out) > 40  # the same casts; the GEMMs sum in another order
    out.sum().backward()  # backward's two GEMMs too
    assert x.grad is not None


def test_float32_mx_gemm_is_bitwise_the_float32_product_of_dequantized_operands():
    torch.manual_seed(2)
    fmt = BLOCK_FORMATS["mxfp4"]
    a, b = quantize_block(torch.randn(32, 64), fmt), quantize_block(torch.randn(48, 64), fmt)
    assert torch.equal(block_mm(a, b, torch.float32), a.dequantize() @ b.dequantize().t())


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4"])
def test_every_gemm_of_a_layer_is_close_to_float64(name):
    """The whole layer: output and both gradients against float64 math on the same
    inputs, for a quantization-limited bar (FP4 is coarse: 15 dB; MXFP8 25 dB)."""
    torch.manual_seed(3)
    config = BLOCK_CONFIGS[name]
    linear = torch.nn.Linear(128, 64)
    ref = copy.deepcopy(linear).double()
    layer = BlockLinear.convert_(linear, config)
    x = torch.randn(4, 32, 128)
    grad = torch.randn(4, 32, 64)
    xa, xb = x.clone().requires_grad_(), x.double().requires_grad_()
    layer(xa).backward(grad)
    ref(xb).backward(grad.double())
    bar = 25.0 if name == "mxfp8" else 15.0
    assert sqnr(ref(xb), layer(x)) >= bar
    assert sqnr(xb.grad, xa.grad) >= bar
    assert sqnr(ref.weight.grad, layer.weight.grad) >= bar
    assert sqnr(ref.bias.grad, layer.bias.grad) > 100  # bias grad is not quantized


class _Recorder:
    """A GEMM observer (amped.lowp.health.GemmObserver) that keeps what it is told."""

    sampling = True

    def __init__(self):
        self.seen = {}

    def observe(self, layer, role, probes, stats):
        self.seen[role] = (probes, stats)


@pytest.mark.parametrize("observed", [False, True], ids=["plain", "monitored"])
def test_nvfp4_grad_input_reads_the_forward_weight_tiles_as_a_fresh_cast_would(
    observed, emulated_gemm
):
    """With 16x16 weight tiles the backward reuses the forward's weight operand: the
    grad-input GEMM is bit for bit the one with the weight cast again along out_features,
    and a health monitor's counts and probes of it are those of that cast."""
    torch.manual_seed(5)
    config = dataclasses.replace(BLOCK_CONFIGS["nvfp4"], stochastic_rounding=False, hadamard=False)
    layer = BlockLinear.convert_(torch.nn.Linear(512, 256, bias=False), config)
    recorder = _Recorder()
    if observed:
        layer.fp8_observer = recorder
    x = torch.randn(1024, 512, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1024, 256, dtype=torch.bfloat16)
    layer(x).backward(grad)
    fmt, bf16, weight = config.format, torch.bfloat16, layer.weight.detach()
    gemm = emulated_gemm  # the operands' dtype on this path
    goq = block_operand(grad, fmt, dtype=gemm, keep_cast=True)
    wq = block_operand(weight, fmt, dim=0, tile_2d=True, dtype=gemm, keep_cast=True).t()
    expected = operand_mm(goq, wq, bf16)
    assert torch.equal(x.grad, expected)
    if observed:
        fresh = _Recorder()
        layer.fp8_observer = fresh
        operands = {"grad_output": (grad, goq.cast), "weight": (weight.t(), wq.cast)}
        record_gemm(layer, "grad_input", "grad_input", expected, operands)
        (probes, stats), (fresh_probes, fresh_stats) = (
            recorder.seen["grad_input"],
            fresh.seen["grad_input"],
        )
        assert torch.equal(stats, fresh_stats)
        assert [name for name, _ in probes] == [name for name, _ in fresh_probes]
        for (_, probe), (_, fresh_probe) in zip(probes, fresh_probes, strict=True):
            assert probe.kind == fresh_probe.kind
            assert all(map(torch.equal, probe.values, fresh_probe.values))


def test_dims_off_the_block_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match=r"blocks of 32 elements.*module_filter"):
        BlockLinear.convert_(torch.nn.Linear(48, 64), BLOCK_CONFIGS["mxfp8"])
    with pytest.raises(ValueError, match="blocks of 16"):
        BlockLinear.convert_(torch.nn.Linear(64, 40), BLOCK_CONFIGS["nvfp4"])
    with pytest.raises(TypeError, match="Linear and transformers Conv1D"):
        BlockLinear.convert_(torch.nn.Conv1d(64, 64, 1), BLOCK_CONFIGS["mxfp8"])


def test_forcing_the_native_gemm_without_a_blackwell_gpu_says_what_to_do():
    with pytest.raises(RuntimeError, match=r"sm100-class GPUs.*emulate=True"):
        BlockLinear.convert_(torch.nn.Linear(64, 64), BLOCK_CONFIGS["mxfp8"], emulate=False)


def test_tokens_off_the_block_are_padded_exactly(emulated_gemm):
    """96 + 5 tokens: the grad-weight GEMM pads to 128 rows of zeros; equal to running
    the 5 extra tokens as a zero-padded batch by hand."""
    torch.manual_seed(4)
    layer = BlockLinear.convert_(torch.nn.Linear(64, 64, bias=False), BLOCK_CONFIGS["mxfp8"])
    x = torch.randn(101, 64)
    grad = torch.randn(101, 64)
    layer(x).backward(grad)
    ragged = layer.weight.grad.clone()
    layer.weight.grad = None
    layer(torch.cat([x, torch.zeros(27, 64)])).backward(torch.cat([grad, torch.zeros(27, 64)]))
    assert torch.equal(ragged, layer.weight.grad)
