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
