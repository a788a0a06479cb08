"""Writes compensated_checkpoint_v0.pt, read by tests/optim/test_recipes_compensated.py.

Run once with amped ddcec43 on the path (before the hashed random bits):
``git archive ddcec43 src | tar -x -C /tmp/old && PYTHONPATH=/tmp/old/src python
tests/data/make_compensated_checkpoint_v0.py tests/data/compensated_checkpoint_v0.pt``.
Per case: three steps, a copy of the state dict, two more steps and their results.
"""

from __future__ import annotations

import copy
import sys

import torch

from amped.optim import CompensatedAdamW, CompensatedSGD

CASES = {
    "adamw-kahan": (CompensatedAdamW, dict(lr=1e-2, betas=(0.9, 0.95)), "kahan"),
    "sgd-kahan": (CompensatedSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01), "kahan"),
    "adamw-stochastic": (CompensatedAdamW, dict(lr=1e-2), "stochastic"),
}
SHAPES = ((7, 5), (33,))


def grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(s, generator=g) * 0.5).bfloat16() for s in SHAPES]


def main(path):
    out = {}
    for name, (kind, config, compensation) in CASES.items():
        g = torch.Generator().manual_seed(0)
        params = [(torch.randn(s, generator=g) * 2).bfloat16().requires_grad_(True) for s in SHAPES]
        opt = kind(params, **config, compensation=compensation, seed=7)
        saved = {}
        for step in range(5):
            if step == 3:
                saved["params"] = [p.detach().clone() for p in params]
                saved["optimizer"] = copy.deepcopy(opt.state_dict())
            for param, grad in zip(params, grads(step), strict=True):
                param.grad = grad
            opt.step()
        saved["continued"] = [p.detach().clone() for p in params]
        saved["continued_state"] = copy.deepcopy(opt.state_dict()["state"])
        out[name] = saved
    torch.save(out, path)


if __name__ == "__main__":
    main(sys.argv[1])
