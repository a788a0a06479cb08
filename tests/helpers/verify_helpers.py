"""Models and planted-bug backends of the ``amped.verify`` tests.

Each mutation backend prepares the model with a built-in backend, then plants one bug
in one layer (a real change to what that layer computes, never a mock):

(i)   ``InBf16``: the layer left out of torchao's conversion (it runs in bfloat16);
(ii)  ``GradOutputE5M2``: torchao's MXFP8 op casting the layer's grad_output to E5M2;
(iii) ``TensorScaleTwice``: amped's NVFP4 layer multiplying its forward output by the
      input's tensor scale once more;
(iv)  ``FloorScales``: torchao's MXFP8 op with ``floor`` block scales on the layer;
(v)   ``PerturbedGradInput``: the layer's grad_input with ``delta`` added to one element.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn

from amped.lowp.mx.block_kernel import nvfp4_tensor_scale
from amped.lowp.mx.block_linear import BlockLinear
from amped.verification.backends import BACKENDS, Prepared


def mlp(seed: int = 0) -> nn.Sequential:
    """A 4-layer MLP: three layers amped's plans convert (``0``, ``2``, ``4``; NVFP4
    keeps ``4`` in bfloat16) and the head."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
        nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 64),
    )  # fmt: skip


def mlp_batch() -> torch.Tensor:
    return torch.randn(64, 64, generator=torch.Generator().manual_seed(1))


def mlp_task(seed: int = 0):
    """:func:`mlp` as a task factory (``--model verify_helpers:mlp_task``)."""

    def batches():
        while True:
            x = mlp_batch()
            yield x, x

    return mlp(seed), batches(), nn.functional.mse_loss


class _Unused(nn.Module):
    """:func:`mlp` with one more layer the plan converts and the forward never calls."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.spare = nn.Linear(64, 64)
        self.net = mlp(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def unused_layer_task(seed: int = 0):
    _, batches, loss_fn = mlp_task(seed)
    return _Unused(seed), batches, loss_fn


def gpt2(seed: int = 0) -> nn.Module:
    """A transformers GPT-2 with random weights: 2 layers, width 64, 128 tokens."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import transformers

    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32,
        bos_token_id=0, eos_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def gpt2_batch() -> tuple[tuple[torch.Tensor], torch.Tensor]:
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    return (tokens,), tokens


def gpt2_loss(outputs, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(outputs.logits.float().flatten(0, 1), targets.flatten())


class InBf16:
    """(i) torchao converting every planned layer but ``layer``."""

    name = "torchao-one-layer-in-bf16"

    def __init__(self, layer: str) -> None:
        self.layer = layer

    def prepare(self, model: nn.Module, recipe: str, layers: list[str]) -> Prepared:
        return BACKENDS["torchao"].prepare(model, recipe, [n for n in layers if n != self.layer])


def _torchao_mx_mm(x, weight, grad_dtype, mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.moe_training.mxfp8_linear import mx_mm
        from torchao.prototype.mx_formats.config import (
            MXFP8Dim0CastKernelChoice,
            MXFP8Dim1CastKernelChoice,
            ScaleCalculationMode,
        )
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference
    e4m3 = torch.float8_e4m3fn
    return mx_mm.apply(
        x, weight, e4m3, e4m3, grad_dtype, 32, KernelPreference.EMULATED,
        MXFP8Dim0CastKernelChoice.TORCH, MXFP8Dim1CastKernelChoice.TORCH,
        ScaleCalculationMode(mode), False,
    )  # fmt: skip


class _PlantedMX(nn.Linear):
    grad_dtype = torch.float8_e4m3fn
    mode = "rceil"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _torchao_mx_mm(x, self.weight, self.grad_dtype, self.mode) + self.bias


class _E5M2Grads(_PlantedMX):
    grad_dtype = torch.float8_e5m2


class _FloorScales(_PlantedMX):
    mode = "floor"


class _Planting:
    """A built-in backend, then ``layer``'s class swapped for ``planted``."""

    inner = "torchao"
    planted: type[nn.Module]

    def __init__(self, layer: str) -> None:
        self.layer = layer
        self.name = f"{self.inner}-{type(self).__name__}"

    def prepare(self, model: nn.Module, recipe: str, layers: list[str]) -> Prepared:
        prepared = BACKENDS[self.inner].prepare(model, recipe, layers)
        prepared.model.get_submodule(self.layer).__class__ = self.planted
        return prepared


class GradOutputE5M2(_Planting):
    """(ii) grad_output cast to E5M2 under MXFP8."""

    planted = _E5M2Grads


class FloorScales(_Planting):
    """(iv) floor block scales where the recipe (mxfp8) rounds them by rceil."""

    planted = _FloorScales


class _ScaleForward(torch.autograd.Function):
    """``out * factor`` in the forward pass; the gradient passes unchanged (a bug of the
    forward dequantization alone)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
        return out * factor.to(out.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _TwiceScaled(BlockLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        xc = x.to(out.dtype).reshape(-1, x.shape[-1])
        return _ScaleForward.apply(out, nvfp4_tensor_scale(xc))


class TensorScaleTwice(_Planting):
    """(iii) NVFP4's input tensor scale applied a second time to the forward output."""

    inner = "amped"
    planted = _TwiceScaled


class _AddToGrad(torch.autograd.Function):
    """Identity forward; backward adds ``delta`` to the first gradient element."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, delta: float) -> torch.Tensor:
        ctx.delta = delta
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        grad.view(-1, grad.shape[-1])[0, 0] += ctx.delta
        return grad, None


class PerturbedGradInput:
    """(v) amped's layer ``layer`` whose grad_input gets ``delta`` added to one element."""

    name = "amped-perturbed-grad-input"

    def __init__(self, layer: str, delta: float) -> None:
        self.layer, self.delta = layer, delta

    def prepare(self, model: nn.Module, recipe: str, layers: list[str]) -> Prepared:
        prepared = BACKENDS["amped"].prepare(model, recipe, layers)
        module = prepared.model.get_submodule(self.layer)
        inner_forward = module.forward
        delta = self.delta

        def forward(x: torch.Tensor) -> torch.Tensor:
            return inner_forward(_AddToGrad.apply(x, delta))

        module.forward = forward
        return prepared


class AmpedRunning:
    """amped's backend running ``recipe`` whatever recipe is claimed."""

    def __init__(self, recipe: str) -> None:
        self.recipe = recipe
        self.name = f"amped-{recipe}"

    def prepare(self, model: nn.Module, recipe: str, layers: list[str]) -> Prepared:
        return BACKENDS["amped"].prepare(model, self.recipe, layers)
