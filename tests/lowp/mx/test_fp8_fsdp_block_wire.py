"""NVFP4 weights on the FSDP2 wire (amped.lowp.mx.fsdp_block_wire), in one process: which
block layers get the wire, the gathered weight's semantics, and the layer computing
with it instead of casting again (tests/distributed/test_fp8_distributed.py runs 2 ranks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from amped.lowp.mx.block_cast import nvfp4_tensor_scale, quantize_block
from amped.lowp.mx.block_config import BLOCK_CONFIGS
from amped.lowp.mx.block_linear import BlockLinear
from amped.lowp.mx.block_operand import block_operand
from amped.lowp.mx.fsdp_block_wire import (
    GatheredBlockWeight,
    block_wire_refusal,
    gathered_block,
)

NVFP4 = BLOCK_CONFIGS["nvfp4"]


@pytest.mark.parametrize(
    "config, rows, world, transposed, refused",
    [
        pytest.param(NVFP4, 64, 2, False, None, id="nvfp4-64-rows-on-2"),
        pytest.param(NVFP4, 32, 1, False, "one rank", id="nvfp4-one-rank"),
        pytest.param(NVFP4, 48, 2, False, "equal shards of whole 16-row", id="nvfp4-24-rows-each"),
        pytest.param(NVFP4, 32, 3, False, "equal shards of whole 16-row", id="nvfp4-uneven"),
        pytest.param(NVFP4, 64, 2, True, "Conv1D", id="nvfp4-conv1d"),
        pytest.param(
            dataclasses.replace(NVFP4, weight_2d=False), 64, 2, False, "crossing", id="nvfp4-1d"
        ),
        pytest.param(BLOCK_CONFIGS["mxfp8"], 64, 2, False, "crossing", id="mxfp8"),
        pytest.param(BLOCK_CONFIGS["mxfp4"], 64, 2, False, "crossing", id="mxfp4"),
    ],
)
def test_only_nvfp4_tiles_on_whole_tile_shards_get_the_wire(
    config, rows, world, transposed, refused
):
    reason = block_wire_refusal(config, rows, world, transposed)
    if refused is None:
        assert reason is None
    else:
        assert reason is not None and refused in reason


def _gathered(weight: torch.Tensor) -> GatheredBlockWeight:
    """What 2 ranks all-gather for ``weight`` (their halves concatenated): each half cast
    with the whole weight's tensor scale."""
    fmt = NVFP4.format
    scale = nvfp4_tensor_scale(weight)
    halves = [quantize_block(h, fmt, tensor_scale=scale, tile_2d=True) for h in weight.chunk(2)]
    packed = torch.cat([h.data.view(torch.uint8) for h in halves])
    tiles = torch.cat([h.scale_bits[::16] for h in halves])
    return GatheredBlockWeight(packed, tiles, scale, fmt, weight.dtype)


@pytest.mark.parametrize("dim", [-1, 0], ids=["forward", "grad-input"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gathered_weight_is_the_unsharded_cast_bit_for_bit(dim, dtype):
    torch.manual_seed(0)
    weight = torch.randn(64, 48, dtype=dtype) * torch.logspace(-3, 2, 48)  # varied tiles
    gathered = _gathered(weight)
    expected = block_operand(
        weight, NVFP4.format, dim=dim, tile_2d=True, dtype=torch.bfloat16, keep_cast=True
    )
    got = gathered.operand(dim, torch.bfloat16, keep_cast=True)
    assert torch.equal(got.values, expected.values)
    assert torch.equal(got.tensor_scale, expected.tensor_scale)
    assert torch.equal(got.cast.elements, expected.cast.elements)
    assert torch.equal(got.cast.scale_bits, expected.cast.scale_bits)
    assert gathered.operand(dim, None, keep_cast=False).values is None


def test_the_gathered_weight_is_a_tensor_of_the_parameters_dtype_and_reads_dequantized():
    torch.manual_seed(0)
    weight = torch.randn(32, 16, dtype=torch.bfloat16)
    gathered = _gathered(weight)
    assert (gathered.shape, gathered.dtype) == (weight.shape, torch.bfloat16)
    for view in (gathered.detach(), torch.as_strided(gathered, (32, 16), (16, 1))):
        assert gathered_block(view) is not None
    cast = quantize_block(weight, NVFP4.format, tile_2d=True)
    doubled = gathered * 2  # any other op: the dequantized weight, a plain tensor
    assert type(doubled) is torch.Tensor
    assert torch.equal(doubled, cast.dequantize(torch.bfloat16) * 2)
    assert gathered_block(gathered.t()) is None  # a transpose reads dequantized, too
    assert gathered_block(weight) is None
    assert "GatheredBlockWeight(shape=(32, 16)" in repr(gathered)


def test_the_block_layer_computes_with_the_gathered_weight_as_with_its_own():
    """nvfp4 (16x16 tiles, stochastic rounding of gradients, Hadamard): the layer given
    the gathered cast computes the output and both gradients bit for bit as the layer
    casting its bfloat16 weight, and the weight's gradient is a plain bfloat16 tensor."""
    torch.manual_seed(0)
    plain = nn.Linear(32, 64, bias=False).to(torch.bfloat16)
    x = torch.randn(20, 32, dtype=torch.bfloat16, requires_grad=True)
    reference = BlockLinear.convert_(plain, NVFP4)
    out = reference(x)
    out.float().square().sum().backward()

    layer = BlockLinear.convert_(nn.Linear(32, 64, bias=False), NVFP4)
    layer.weight = nn.Parameter(_gathered(plain.weight.detach()))
    x2 = x.detach().clone().requires_grad_()
    out2 = layer(x2)
    out2.float().square().sum().backward()
    assert torch.equal(out2, out) and torch.equal(x2.grad, x.grad)
    grad = layer.weight.grad
    assert type(grad) is torch.Tensor and grad.dtype is torch.bfloat16
    assert torch.equal(grad, reference.weight.grad)


@pytest.mark.slow  # importing FSDP2 takes seconds
def test_a_plan_refuses_a_layer_fully_shard_wrapped_and_says_to_convert_first():
    from dist_launch import one_rank_group
    from torch.distributed.fsdp import fully_shard

    import amped
    from amped.recipes.plan import PrecisionPlan

    plan = PrecisionPlan("bf16-pure", {"0": "nvfp4", "1": "bf16"})
    with one_rank_group():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
        fully_shard(model[0])
        fully_shard(model[1])  # a "bf16" layer may be sharded: nothing converts it
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters())
        with pytest.raises(ValueError, match=r"FSDPLinear: fully_shard wrapped.*plan\.convert"):
            amped.prepare(model, optimizer, plan)
        other = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
        PrecisionPlan("bf16-pure", {"0": "mxfp8"}).convert(other)
        with pytest.raises(ValueError, match="converted already, with other rules"):
            plan.convert(other)
