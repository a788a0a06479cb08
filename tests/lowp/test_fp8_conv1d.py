"""transformers' Conv1D (GPT-2) under every FP8 and block recipe: it converts as an
nn.Linear with the transposed weight would, bitwise, keeps its parameters and
state_dict keys, and a GPT-2 from transformers trains under each recipe."""

from __future__ import annotations

import copy

import pytest
import torch

import amped
from amped.lowp import Float8Linear
from amped.lowp.convert import convert_layers
from amped.lowp.float8.config import FLOAT8_CONFIGS
from amped.lowp.mx.block_config import BLOCK_CONFIGS
from amped.lowp.mx.block_linear import BlockLinear

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

CONFIGS = {**{f"fp8-{k}": v for k, v in FLOAT8_CONFIGS.items()}, **BLOCK_CONFIGS}
RECIPES = [*(f"fp8-{k}" for k in FLOAT8_CONFIGS), *BLOCK_CONFIGS]


def _gpt2(seed=0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _run(module, x, grad):
    x = x.clone().requires_grad_()
    out = module(x)
    out.backward(grad)
    return [out, x.grad, *(p.grad for p in module.parameters())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_conv1d_converts_as_the_transposed_linear_bitwise(name, dtype, emulated_gemm):
    torch.manual_seed(0)
    conv = Conv1D(128, 64)  # 64 -> 128, weight [64, 128]
    torch.nn.init.normal_(conv.bias)
    linear = torch.nn.Linear(64, 128)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    keys = set(conv.state_dict())
    convert_layers(conv, CONFIGS[name], [""])
    convert_layers(linear, CONFIGS[name], [""])
    assert isinstance(conv, Conv1D) and isinstance(conv, Float8Linear | BlockLinear)
    assert {k for k in conv.state_dict() if not k.startswith("fp8_")} == keys
    x, grad = torch.randn(4, 32, 64, dtype=dtype), torch.randn(4, 32, 128, dtype=dtype)
    ours, theirs = _run(conv, x, grad), _run(linear, x, grad)
    ours[2] = ours[2].t()  # Conv1D's weight gradient is stored [in, out]
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "recipe",
    [pytest.param(r, marks=pytest.mark.slow) if r == "fp8-blockwise" else r for r in RECIPES],
)
def test_gpt2_from_transformers_trains_under_every_recipe(recipe):
    model = _gpt2()
    reference = copy.deepcopy(model)
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), recipe)
    converted = setup.low_precision_layers.names()
    expected = [f"transformer.h.{i}.{m}" for i in range(2)
                for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]  # fmt: skip
    if recipe == "nvfp4":  # bf16_last=0.15: the last 2 of 8 stay in bfloat16
        expected = expected[:6]
    assert converted == expected
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    with setup.autocast():
        loss = model(ids, labels=ids).loss
    with torch.autocast("cpu", torch.bfloat16):
        reference_loss = reference(ids, labels=ids).loss
    assert abs(loss.item() - reference_loss.item()) < 0.05 * reference_loss.item()
    setup.backward(loss)
    assert setup.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_no_layer_to_convert_names_each_layer_and_why():
    model = torch.nn.Sequential(Conv1D(24, 64), torch.nn.Linear(24, 10))
    with pytest.raises(ValueError) as error:
        amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "mxfp8")
    text = str(error.value)
    assert "Conv1D 0 (64x24): dims not multiples of 32" in text
    assert "Linear 1 (24x10): the output head" in text
