"""Shared pieces of the FP8 tests: torchao's configs by our recipe names, a LLaMA-like
FFN, and a quiet torchao import."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from amped.lowp.float8.emulated_gemm import set_emulated_gemm

# amped's scaling name -> torchao 0.18's recipe name.
TORCHAO_RECIPE = {
    "tensorwise": "tensorwise",
    "rowwise": "rowwise",
    "rowwise-gw-hp": "rowwise_with_gw_hp",
}


def torchao_float8():
    """torchao.float8, imported once with its CUDA-extension warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pytest.importorskip("torchao.float8")


def torchao_convert(model: nn.Module, scaling: str, filter_fn=None) -> nn.Module:
    """A deep copy of ``model`` converted by torchao's ``convert_to_float8_training``."""
    ao = torchao_float8()
    config = ao.Float8LinearConfig.from_recipe_name(TORCHAO_RECIPE[scaling])
    return ao.convert_to_float8_training(
        copy.deepcopy(model), config=config, module_filter_fn=filter_fn
    )


class FeedForward(nn.Module):
    """LLaMA's SwiGLU FFN: ``w2(silu(w1(x)) * w3(x))``, hidden = 8/3 dim rounded to 16."""

    def __init__(self, dim: int = 256, hidden: int = 688) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def ffn(seed: int = 0, dim: int = 256, hidden: int = 688) -> FeedForward:
    torch.manual_seed(seed)
    model = FeedForward(dim, hidden)
    for lin in (model.w1, model.w2, model.w3):  # LLaMA-style init: std 0.02
        nn.init.trunc_normal_(lin.weight, std=0.02)
    return model


@contextlib.contextmanager
def forced_emulated_gemm(choice: str | None) -> Iterator[None]:
    """Emulated GEMMs forced to ``choice`` (``"bf16"``, ``"float32"``; None: unchanged)
    inside the block (amped.lowp.float8.emulated_gemm)."""
    previous = set_emulated_gemm(choice) if choice is not None else None  # type: ignore[arg-type]
    try:
        yield
    finally:
        if choice is not None:
            set_emulated_gemm(previous)


def every_linear(module: nn.Module, name: str) -> bool:
    return True
