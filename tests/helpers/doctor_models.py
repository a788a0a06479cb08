"""Models built to break in float16 at a known module and op, and their inputs."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

# The models of examples/doctor_reports.py (which made docs/doctor/), so the reports
# there and these tests are about the same models.
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import doctor_reports


def exp_overflow() -> tuple[nn.Module, torch.Tensor, str, str]:
    """exp of a float16 linear output above 11.1 overflows float16 (exp(11.1) ~ 65504)."""
    return (*doctor_reports.exp_overflow(), "head", "exp")


def softmax_input_overflow() -> tuple[nn.Module, torch.Tensor, str, str]:
    """Pre-softmax scores from a linear with huge weights: the scores exceed 65504."""
    return (*doctor_reports.softmax_input_overflow(), "scores", "linear")


def norm_variance_overflow() -> tuple[nn.Module, torch.Tensor, str, str]:
    """A hand-written RMSNorm: the mean of squares overflows for activations ~300."""
    return (*doctor_reports.norm_variance_overflow(), "norm", "pow")


def tiny_gradients() -> tuple[nn.Module, torch.Tensor]:
    """A healthy forward whose loss is so small that float16 gradients underflow at scale 1."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    return model, torch.randn(8, 16)
