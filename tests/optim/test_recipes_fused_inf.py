"""Fused and eager compensated steps agree on weights at +-inf.

torch's SGD and AdamW keep a weight at +-inf (inf + finite = inf). The fused kernels
added ``w * 0`` where a decay was off, which is NaN at inf, so a weight at +-inf became
NaN on the next step while the eager step (which skips the zero decay) kept it.
"""

from __future__ import annotations

import math

import pytest
import torch

from amped.optim import CompensatedAdamW, CompensatedSGD

STEPS = 3
CONFIGS = {
    "sgd-momentum": (CompensatedSGD, dict(lr=1e-2, momentum=0.9)),
    "sgd-momentum-wd": (CompensatedSGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3)),
    "adamw-no-wd": (CompensatedAdamW, dict(lr=1e-3, weight_decay=0.0)),
}


def _run(kind, config, compensation: str, fused: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(64, 32, generator=generator)).to(torch.bfloat16)
    weight[0, 0], weight[5, 7] = math.inf, -math.inf
    param = weight.requires_grad_(True)
    optimizer = kind([param], **config, compensation=compensation, seed=3, fused=fused)
    for _ in range(STEPS):
        param.grad = torch.randn(64, 32, generator=generator).to(torch.bfloat16)
        optimizer.step()
    return param.detach().float()


@pytest.mark.parametrize("compensation", ["kahan", "stochastic"])
@pytest.mark.parametrize("name", CONFIGS)
def test_fused_keeps_infinite_weights_as_the_eager_step_does(name, compensation):
    kind, config = CONFIGS[name]
    eager = _run(kind, config, compensation, fused=False)
    fused = _run(kind, config, compensation, fused=True)
    if config.get("weight_decay", 0.0) == 0.0:  # as torch: inf + finite stays inf
        assert eager[0, 0].item() == math.inf and eager[5, 7].item() == -math.inf
        assert not torch.isnan(eager).any()
    # With decay, inf * decay meets the weight again: inf - inf is NaN, in torch too.
    for where in (torch.isposinf, torch.isneginf, torch.isnan):
        assert torch.equal(where(fused), where(eager)), where.__name__
