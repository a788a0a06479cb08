"""No silent stall, anywhere: every recipe x optimizer kind x ``on_stall`` mode.

Each case prepares a tiny model with an enabled ``GradScaler(on_stall=mode)``, trains 5
clean steps, then 200 steps whose loss is NaN (an overflow burst that drives the scale
to the floor, 2**-126), then up to 50 clean steps. What each mode promises:

- ``"recover"``: every parameter moves within the 50 clean steps, stays finite, and the
  scaler warns once (for torch's own fused optimizers, which skip on the device without
  a sync, the scaler reads what they decided every ``REPORT_EVERY`` iterations: set to
  1 here, so that the warning comes within the case's steps);
- ``"warn"``: the scaler warns exactly once;
- ``"raise"``: ``ScaleStallError``.

A combination that cannot work is refused with an error, which the case checks:
``step_in_backward`` takes the bf16-pure optimizers only (``TypeError`` for the others),
and under loss scaling ``setup.backward`` refuses it (``ValueError``: each parameter
would step on its scaled gradient, unchecked).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import amped
from amped.optim import step_in_backward
from amped.recipes.registry import OPT_IN_RECIPES, recipe_names
from amped.scaling import ScaleStallError, stall

WARMUP, BURST, CLEAN = 5, 200, 50
RECIPES = [*recipe_names(), *(name for name in OPT_IN_RECIPES if name == "bf16-pure-8bit")]
KINDS = {
    "eager": dict(foreach=False),
    "foreach": dict(foreach=True),
    "fused": dict(fused=True),
    "in-backward": dict(foreach=False),
}
MODES = ["recover", "warn", "raise"]
CASES = [(r, k, m) for r in RECIPES for k in KINDS for m in MODES]


def _setup(recipe: str, kind: str, mode: str) -> amped.recipes.TrainSetup:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, **KINDS[kind])
    scaler = amped.GradScaler("cpu", on_stall=mode)
    return amped.prepare(model, optimizer, recipe, scaler=scaler)


def _loss(setup: amped.recipes.TrainSetup, step: int, poison: bool) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    with setup.autocast():
        loss = (setup.model(x.to(setup.model[0].weight.dtype)).float() - 1.0).pow(2).mean()
    return loss * math.nan if poison else loss


def _train_step(setup: amped.recipes.TrainSetup, step: int, poison: bool) -> None:
    setup.backward(_loss(setup, step, poison))
    setup.step()
    setup.zero_grad()


def _burst_then_clean(setup: amped.recipes.TrainSetup) -> tuple[bool, list[str]]:
    """Whether every parameter moved within the clean steps after the burst, and the
    scaler's warnings."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(WARMUP):
            _train_step(setup, step, False)
        for step in range(WARMUP, WARMUP + BURST):
            _train_step(setup, step, True)
        before = [p.detach().clone() for p in setup.model.parameters()]
        moved = [False] * len(before)
        for step in range(WARMUP + BURST, WARMUP + BURST + CLEAN):
            _train_step(setup, step, False)
            now = setup.model.parameters()
            moved = [m or not torch.equal(b, p) for m, b, p in zip(moved, before, now, strict=True)]
            if all(moved):
                break
    return all(moved), [str(w.message) for w in caught if "amped.GradScaler" in str(w.message)]


@pytest.mark.slow  # 255 steps a case, 72 cases of them: about 3 s each
@pytest.mark.parametrize(("recipe", "kind", "mode"), CASES, ids=["-".join(c) for c in CASES])
def test_no_silent_stall(recipe: str, kind: str, mode: str, monkeypatch) -> None:
    monkeypatch.setattr(stall, "REPORT_EVERY", 1)
    setup = _setup(recipe, kind, mode)
    if kind == "in-backward":
        if not recipe.startswith("bf16-pure"):
            with pytest.raises(TypeError, match="bf16-pure optimizer"):
                step_in_backward(setup.optimizer)
            return
        step_in_backward(setup.optimizer)
        with pytest.raises(ValueError, match="loss scaling cannot run under it"):
            setup.backward(_loss(setup, 0, False))
        assert all(p.grad is None for p in setup.model.parameters())  # nothing ran
        return
    if mode == "raise":
        with pytest.raises(ScaleStallError):
            _burst_then_clean(setup)
        return
    moved, stalls = _burst_then_clean(setup)
    assert len(stalls) == 1, stalls
    assert all(torch.isfinite(p).all() for p in setup.model.parameters())
    if mode == "recover":
        assert moved, "a parameter did not move within 50 clean steps after the burst"
