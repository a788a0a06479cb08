"""Models built to break in float16 at a known module and op, and their inputs."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ExpHead(nn.Module):
    """exp of a float16 linear output above 11.1 overflows float16 (exp(11.1) ~ 65504)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        with torch.no_grad():
            self.proj.weight.mul_(40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.proj(x))


def exp_overflow() -> tuple[nn.Module, torch.Tensor, str, str]:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(8, 8))
    model.add_module("act", nn.ReLU())
    model.add_module("head", ExpHead())
    return model, torch.randn(4, 8) * 3, "head", "exp"


class Attention(nn.Module):
    """Pre-softmax scores from a linear with huge weights: the scores exceed 65504."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.scores = nn.Linear(16, 16)
        with torch.no_grad():
            self.scores.weight.mul_(100_000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.scores(torch.tanh(self.embed(x))), dim=-1)


def softmax_input_overflow() -> tuple[nn.Module, torch.Tensor, str, str]:
    torch.manual_seed(0)
    return Attention(), torch.randn(4, 16), "scores", "linear"


class RMSNorm(nn.Module):
    """A hand-written RMSNorm: the mean of squares overflows for activations ~300."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(variance + 1e-6)


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 16)
        with torch.no_grad():
            self.up.weight.mul_(400)
        self.norm = RMSNorm(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.up(x)))


def norm_variance_overflow() -> tuple[nn.Module, torch.Tensor, str, str]:
    torch.manual_seed(0)
    return NormNet(), torch.randn(4, 16), "norm", "pow"


def tiny_gradients() -> tuple[nn.Module, torch.Tensor]:
    """A healthy forward whose loss is so small that float16 gradients underflow at scale 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, torch.randn(8, 16)
