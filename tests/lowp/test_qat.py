"""Fake quantization for QAT (amped.lowp.qat): the forward sees the format's weight grid,
the gradient reaches the high-precision weight straight through, and removing it leaves
the optimizer's parameter as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tolerances import FP32_REORDERED

from amped.lowp.float8.blockwise import quantize_weight_blockwise
from amped.lowp.qat import (
    QAT_FORMATS,
    fake_quantize_weights,
    quantize_weights_,
    remove_fake_quantization,
    weight_grid,
)


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64), torch.nn.Linear(64, 8)
    )


@pytest.mark.parametrize("fmt", QAT_FORMATS)
def test_forward_uses_the_grid_and_the_gradient_passes_straight_through(fmt):
    model = _model()
    original = model[0].weight
    assert fake_quantize_weights(model, fmt, ["0"]) == ["0"]
    x = torch.randn(16, 64)
    out = model[0](x)
    grid = weight_grid(original.detach(), fmt)
    assert torch.equal(out, F.linear(x, grid, model[0].bias))
    out.square().sum().backward()
    # d/dW of sum((x @ G.T + b)**2) at the grid G, given to the high-precision weight
    expected = (2 * (x @ grid.T + model[0].bias.detach())).T @ x
    # the same float32 products summed in another order: a few ulps
    torch.testing.assert_close(original.grad, expected, **FP32_REORDERED)
    remove_fake_quantization(model)
    assert model[0].weight is original and not torch.equal(original.detach(), grid)


def test_the_blockwise_grid_is_the_served_deepseek_weight():
    w = _model()[2].weight.detach()
    served = quantize_weight_blockwise(w)
    assert torch.equal(weight_grid(w, "fp8-blockwise"), served.data.float() * served.scale_inv)


def test_mxfp8_grid_is_idempotent():
    """Power-of-two block scales: a weight on the grid maps to itself."""
    grid = weight_grid(_model()[2].weight.detach(), "mxfp8")
    assert torch.equal(weight_grid(grid, "mxfp8"), grid)


def test_post_training_quantization_writes_the_grid_into_the_default_layers():
    model = _model()
    before = model[0].weight.detach().clone()
    assert quantize_weights_(model, "nvfp4") == ["0"]  # the head and nvfp4's last layer stay
    assert torch.equal(model[0].weight.detach(), weight_grid(before, "nvfp4"))


def test_an_unknown_format_is_refused():
    with pytest.raises(ValueError, match="fp8-blockwise, mxfp8, nvfp4"):
        fake_quantize_weights(_model(), "fp8-rowwise")
