"""Seeded fault injection: the monitor names the first non-finite, skips or stops there.

Grid: every FP8 and block recipe (mxfp8, mxfp4, nvfp4) x every converted layer x
every GEMM role it runs, each with {inf, NaN} and each step of the fault (paired, see
``_grid``). The fault is an inf or NaN written into one element (chosen by a seeded
generator) of one low-precision GEMM's output (``scaled_mm`` of Float8Linear,
``operand_mm`` of BlockLinear), at one step: the forward output of a layer, the
grad_input or the grad_weight it computes. Must hold in 100% of cases:

- the monitor's first non-finite is exactly (step, layer, role, that output);
- ``on_nonfinite="skip"``: only that step is skipped, and no parameter or optimizer
  state is ever non-finite;
- ``on_nonfinite="raise"``: ``NonFiniteError`` at that step, nothing changed by it.

``fp8-rowwise-gw-hp`` runs its grad-weight GEMM in high precision (not an FP8 GEMM),
so its grid has no grad_weight faults.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn

import amped
import amped.lowp.float8.blockwise_linear
import amped.lowp.float8.linear
import amped.lowp.mx.block_linear
from amped.lowp.float8.config import FLOAT8_CONFIGS
from amped.recipes import NonFiniteError
from amped.recipes.lowp import BLOCK_RECIPE_NAMES, FP8_RECIPE_NAMES
from amped.recipes.monitoring import NonFinite

RECIPES = FP8_RECIPE_NAMES + BLOCK_RECIPE_NAMES

STEPS = 4
SOURCE = "(loss = setup.model(x).float().pow(2).mean())"  # the user's line in _run
OUTPUT_NAME = {"forward": "output", "grad_input": "grad_input", "grad_weight": "grad_weight"}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(64, 64), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(64, 16))


@functools.cache
def _converted(recipe: str) -> tuple[str, ...]:
    """The layers the recipe converts, in model order: "0", "2", "4" (the head "6" is
    kept out; nvfp4 also keeps its last layers in bfloat16)."""
    model = _model()
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters()), recipe)
    assert setup.low_precision_layers is not None
    return tuple(sorted(dict(setup.low_precision_layers.layers), key=int))


def _gemm_order(recipe: str) -> list[tuple[str, str]]:
    """The (layer, role) of each low-precision GEMM call of one step, in the order they
    run.

    Backward runs the layers in reverse, grad_input before grad_weight; the first layer's
    input needs no gradient (no grad_input GEMM).
    """
    layers = _converted(recipe)
    fp8_grad_weight = recipe in BLOCK_RECIPE_NAMES or not (
        FLOAT8_CONFIGS[recipe.removeprefix("fp8-")].grad_weight_hp
    )
    order = [(layer, "forward") for layer in layers]
    for layer in reversed(layers):
        if layer != "0":
            order.append((layer, "grad_input"))
        if fp8_grad_weight:
            order.append((layer, "grad_weight"))
    return order


def _gemm_site(recipe: str) -> tuple[object, str]:
    """The module and name of the GEMM function the recipe's layers call."""
    if recipe in BLOCK_RECIPE_NAMES:
        return amped.lowp.mx.block_linear, "operand_mm"
    if recipe == "fp8-blockwise":
        return amped.lowp.float8.blockwise_linear, "blockwise_mm"
    return amped.lowp.float8.linear, "scaled_mm"


class _Injector:
    """Wraps the layers' GEMM function: poisons the output of one call of one step."""

    def __init__(self, original, step: int, call: int, value: float, seed: int) -> None:
        self.original, self.step, self.call, self.value = original, step, call, value
        self.generator = torch.Generator().manual_seed(seed)
        self.current_step, self.calls = 0, 0

    def __call__(self, *args, **kwargs):
        out = self.original(*args, **kwargs)
        if self.current_step == self.step and self.calls == self.call:
            index = int(torch.randint(out.numel(), (), generator=self.generator))
            out.view(-1)[index] = self.value
        self.calls += 1
        return out

    def next_step(self, step: int) -> None:
        self.current_step, self.calls = step, 0


def _all_finite(setup) -> bool:
    tensors = [p for p in setup.model.parameters()]
    for state in setup.optimizer.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v) and v.is_floating_point()]
    return all(torch.isfinite(t.float()).all() for t in tensors)


def _run(monkeypatch, recipe, base, position, value, step, mode):
    """Train STEPS steps with one fault; returns (setup, monitor, taken steps, raised at)."""
    layer, role = _gemm_order(recipe)[position]
    module, name = _gemm_site(recipe)
    injector = _Injector(getattr(module, name), step, position, value, seed=position)
    monkeypatch.setattr(module, name, injector)
    model = _model()
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), recipe, base=base)
    health = amped.monitor(setup, every=2, on_nonfinite=mode)
    generator = torch.Generator().manual_seed(123)
    taken, raised_at, before = [], None, None
    for index in range(STEPS):
        injector.next_step(index)
        x = torch.randn(8, 64, generator=generator)
        with setup.autocast():
            loss = setup.model(x).float().pow(2).mean()
        setup.backward(loss)
        if index == step:
            before = [p.detach().clone() for p in setup.model.parameters()]
        try:
            taken.append(setup.step())
        except NonFiniteError:
            raised_at = index
            break
        finally:
            setup.zero_grad()
        assert _all_finite(setup) or mode != "skip", (index, layer, role)
    expected = NonFinite(step, layer, role, OUTPUT_NAME[role])
    return setup, health, taken, raised_at, before, expected


def _grid(recipe: str, steps=(0, 2)):
    """(position, value, step) cases: every GEMM call gets both values and every step,
    paired so that the values alternate over the positions (inf at the first step on one,
    NaN on the next): each (position, value), (position, step) and (value, step) pair
    occurs, in half the runs of the full product. The detection does not depend on
    which pair of value and step meets a position: it is ``isfinite`` on each output."""
    values = (math.inf, math.nan)
    return [
        (position, values[(position + i) % 2], step)
        for position in range(len(_gemm_order(recipe)))
        for i, step in enumerate(steps)
    ]


def _check_skip(monkeypatch, recipe, base, grid) -> int:
    named = 0
    for position, value, step in grid:
        setup, health, taken, raised_at, _, expected = _run(
            monkeypatch, recipe, base, position, value, step, "skip"
        )
        assert raised_at is None
        assert health.first_nonfinite == expected, (health.first_nonfinite, expected)
        assert health.first_nonfinite.source.endswith(SOURCE), health.first_nonfinite.source
        named += 1
        assert taken == [index != step for index in range(STEPS)], (expected, taken)
        assert _all_finite(setup), expected
        monkeypatch.undo()
    return named


@pytest.mark.filterwarnings("ignore:amped.monitor:RuntimeWarning")
@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "mxfp8"])
def test_fault_grid_skip_names_the_first_non_finite(monkeypatch, recipe):
    """The fast subset's share of the grid: the first GEMM call of each role (forward,
    grad_input, grad_weight) at step 2; test_full_fault_grid_skip runs every call."""
    firsts = {}
    for position, (_, role) in enumerate(_gemm_order(recipe)):
        firsts.setdefault(role, position)
    # inf and NaN alternate; the emulated block casts are slow: inf faults only there
    values = (math.inf,) if recipe in BLOCK_RECIPE_NAMES else (math.inf, math.nan)
    grid = [(p, values[i % len(values)], 2) for i, p in enumerate(firsts.values())]
    assert len(grid) == 3
    assert _check_skip(monkeypatch, recipe, "bf16-mixed", grid) == len(grid)  # 100%


# fp8-blockwise on bf16-mixed only: the base moves no GEMM (and the slow set has a budget).
_FULL_GRID = [
    (recipe, base)
    for recipe in RECIPES
    for base in ("bf16-mixed", "bf16-pure")
    if not (recipe == "fp8-blockwise" and base == "bf16-pure")
]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:amped.monitor:RuntimeWarning")
@pytest.mark.parametrize(("recipe", "base"), _FULL_GRID)
def test_full_fault_grid_skip(monkeypatch, recipe, base):
    grid = _grid(recipe)
    assert _check_skip(monkeypatch, recipe, base, grid) == len(grid)  # 100%


@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param(r, marks=pytest.mark.slow)
        if r in ("mxfp4", "nvfp4", "fp8-blockwise", "mxfp8", "fp8-delayed")
        else r
        for r in RECIPES
    ],
)
def test_raise_stops_at_the_faulty_step_with_nothing_changed(monkeypatch, recipe):
    order = _gemm_order(recipe)
    for position in range(len(order)):
        setup, health, taken, raised_at, before, expected = _run(
            monkeypatch, recipe, "bf16-mixed", position, math.nan, 1, "raise"
        )
        assert raised_at == 1 and taken == [True], (expected, taken)
        assert health.first_nonfinite == expected
        after = list(setup.model.parameters())
        assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))
        monkeypatch.undo()


def test_skip_warns_once_and_warn_mode_takes_the_step(monkeypatch):
    with pytest.warns(RuntimeWarning, match=r"first appeared at step 0: module '2', forward") as w:
        _, _, taken, *_ = _run(monkeypatch, "fp8-tensorwise", "bf16-mixed", 1, math.inf, 0, "skip")
    assert len([x for x in w if "amped.monitor" in str(x.message)]) == 1
    assert taken == [False, True, True, True]
    monkeypatch.undo()
    with pytest.warns(RuntimeWarning, match="taken anyway"):
        setup, _, taken, *_ = _run(
            monkeypatch, "fp8-tensorwise", "bf16-mixed", 1, math.inf, 0, "warn"
        )
    assert taken == [True] * STEPS and not _all_finite(setup)  # as asked: it was taken
