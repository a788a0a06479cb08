"""``--model`` factories for ``amped doctor`` tests: the doctor's overflow models as tasks."""

from __future__ import annotations

import itertools

import doctor_models
import torch


def exp_overflow():
    model, x, _, _ = doctor_models.exp_overflow()
    return model, itertools.repeat((x, None)), lambda out, _: out.float().mean()


class _TwoOverflows(torch.nn.Module):
    """exp overflows float16 in ``first`` and, once that runs in float32, pow in ``second``:
    no single-op or single-module fix removes both, so the doctor has no verified fix."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 8)
        self.second = torch.nn.Linear(8, 8)
        with torch.no_grad():
            self.first.weight.mul_(40)
            self.second.weight.mul_(400)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.exp(self.first(x)).clamp(max=1.0)
        return a + self.second(x).pow(2)


def two_overflows():
    torch.manual_seed(0)
    x = torch.randn(4, 8) * 3
    return _TwoOverflows(), itertools.repeat((x, None)), lambda out, _: out.float().mean()


def long_module_names():
    """A healthy model whose module names are as long as a real transformer's."""
    torch.manual_seed(0)
    inner = torch.nn.Sequential()
    inner.add_module("self_attention_query_key_value", torch.nn.Linear(8, 8))
    inner.add_module("post_attention_layernorm", torch.nn.LayerNorm(8))
    model = torch.nn.Sequential()
    model.add_module("transformer_encoder_layers_11", inner)
    x = torch.randn(4, 8)
    return model, itertools.repeat((x, None)), lambda out, _: out.float().mean()


class _BackwardOverflow(torch.nn.Module):
    """Weight gradients of 3 (``large``) and 3e-12 (``small``, through a float32 factor)."""

    def __init__(self) -> None:
        super().__init__()
        self.large = torch.nn.Linear(8, 1, bias=False)
        self.small = torch.nn.Linear(8, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.large(x).float() + self.small(x).float() * 1e-12


def backward_overflow():
    """A loss whose float16 gradients overflow at GradScaler's default scale (65536)
    and are safe, with a factor 2 to spare, at 8192, where a tiny one underflows (it
    needs 2**15): a routine overflow GradScaler's back-off absorbs."""
    torch.manual_seed(0)
    x = torch.full((4, 8), 3.0)  # d(mean of out)/d(large.weight) = 3 for every weight
    return _BackwardOverflow(), itertools.repeat((x, None)), lambda out, _: out.float().mean()


class _WideRange(torch.nn.Module):
    """Two weights whose gradients are 3 and about 1e-12: no float16 loss scale keeps
    the small one (it needs over 2**35) without overflowing the large (over 2**14)."""

    def __init__(self) -> None:
        super().__init__()
        self.large = torch.nn.Linear(8, 1, bias=False)
        self.small = torch.nn.Linear(8, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.large(x) + self.small(x * 1e-12)


def wide_gradient_range():
    torch.manual_seed(0)
    x = torch.full((4, 8), 3.0)
    return _WideRange(), itertools.repeat((x, None)), lambda out, _: out.float().mean()
