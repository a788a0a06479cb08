"""Drop-in behaviour: what torch.amp.GradScaler does in corner cases, amped does too.

Also the public names of the scaling layer, written so they can join a public-API test.
"""

from __future__ import annotations

import doctest
import inspect
import math
import warnings

import pytest
import torch

import amped
import amped.scaling

SCALERS = {"amped": amped.GradScaler, "torch": torch.amp.GradScaler}
BOTH = pytest.mark.parametrize("make", SCALERS.values(), ids=SCALERS.keys())

# What the scaling layer adds to amped's top-level __all__.
EXPECTED_TOP_LEVEL_FROM_SCALING = {"GradScaler"}


def test_scaling_public_names() -> None:
    # amped.scaling.__all__ itself is pinned in test_public_api.py.
    assert set(amped.__all__) >= EXPECTED_TOP_LEVEL_FROM_SCALING
    for name in EXPECTED_TOP_LEVEL_FROM_SCALING:
        assert getattr(amped, name) is getattr(amped.scaling, name)


def test_signature_extends_torch() -> None:
    ours = inspect.signature(amped.GradScaler).parameters
    theirs = inspect.signature(torch.amp.GradScaler).parameters
    assert [(p.name, p.default, p.kind) for p in list(ours.values())[: len(theirs)]] == [
        (p.name, p.default, p.kind) for p in theirs.values()
    ]
    extras = list(ours.values())[len(theirs) :]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extras)


def test_every_public_torch_method_exists() -> None:
    public = {name for name in dir(torch.amp.GradScaler) if not name.startswith("_")}
    assert public <= set(dir(amped.GradScaler))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@BOTH
def test_cuda_without_cuda_warns_and_disables(make) -> None:
    with pytest.warns(UserWarning, match="GradScaler is enabled, but CUDA is not available"):
        scaler = make()
    assert not scaler.is_enabled()
    loss = torch.ones(())
    assert scaler.scale(loss) is loss


def test_disabled_on_purpose_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not amped.GradScaler(enabled=False).is_enabled()


@BOTH
def test_disabled_is_a_pass_through(make) -> None:
    param = torch.ones(2, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = make("cpu", enabled=False)
    loss = (param * 3).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.unscale_(optimizer)
    assert torch.equal(param.grad, torch.full((2,), 3.0))

    def closure() -> torch.Tensor:
        return torch.tensor(5.0)

    assert scaler.step(optimizer, closure=closure) == torch.tensor(5.0)
    assert torch.equal(param.detach(), torch.full((2,), 0.7))
    scaler.update()
    assert scaler.get_scale() == 1.0
    assert scaler.state_dict() == {}
    scaler.load_state_dict({})
    assert not scaler.is_enabled()


@BOTH
def test_scale_keeps_nested_structure(make) -> None:
    scaler = make("cpu", init_scale=4.0)
    outputs = [torch.ones(2), (torch.full((1,), 2.0), [torch.zeros(3)])]
    scaled = scaler.scale(outputs)
    assert isinstance(scaled, list) and isinstance(scaled[1], tuple)
    assert isinstance(scaled[1][1], list)
    assert torch.equal(scaled[0], torch.full((2,), 4.0))
    assert torch.equal(scaled[1][0], torch.full((1,), 8.0))
    lazy = scaler.scale(t for t in [torch.ones(1)])
    assert isinstance(lazy, map)
    assert torch.equal(next(iter(lazy)), torch.full((1,), 4.0))


def test_scale_nested_matches_torch() -> None:
    outputs = (torch.randn(3), [torch.randn(2, 2)])
    ours = amped.GradScaler("cpu").scale(outputs)
    theirs = torch.amp.GradScaler("cpu").scale(outputs)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1][0], theirs[1][0])


def sparse_run(make) -> torch.Tensor:
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(20, 4, sparse=True)
    optimizer = torch.optim.SGD(embedding.parameters(), lr=0.1)
    scaler = make("cpu", init_scale=2.0**20, growth_interval=2)
    for step in range(12):
        optimizer.zero_grad()
        # Repeated indices leave the sparse gradient uncoalesced.
        indices = torch.tensor([step % 20, 3, 3, (7 * step) % 20])
        loss = embedding(indices).sum() * (math.inf if step == 4 else 1.0)
        scaler.scale(loss).backward()
        assert embedding.weight.grad.is_sparse
        scaler.step(optimizer)
        scaler.update()
    return embedding.weight.detach().clone()


def test_sparse_gradients_as_torch() -> None:
    assert torch.equal(sparse_run(amped.GradScaler), sparse_run(torch.amp.GradScaler))


class ScalingOptimizer(torch.optim.SGD):
    """Claims to unscale inside its step, as torch's fused optimizers do; records what
    the scaler hands it."""

    _step_supports_amp_scaling = True

    def __init__(self, params) -> None:
        super().__init__(params, lr=0.1)
        self.seen: list[tuple[float | None, float]] = []

    def step(self, closure=None):  # type: ignore[override]
        grad_scale = getattr(self, "grad_scale", None)
        value = None if grad_scale is None else grad_scale.item()
        self.seen.append((value, self.found_inf.item()))
        return "stepped"


@BOTH
@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale-then-step"])
def test_optimizer_that_unscales_itself_gets_grad_scale_and_found_inf(make, unscale_first):
    param = torch.ones(2, requires_grad=True)
    optimizer = ScalingOptimizer([param])
    scaler = make("cpu", init_scale=8.0)
    for overflow in (False, True):
        optimizer.zero_grad()
        scaler.scale((param * (math.inf if overflow else 1.0)).sum()).backward()
        if unscale_first:
            scaler.unscale_(optimizer)
        assert scaler.step(optimizer) == "stepped"
        assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")
        scaler.update()
    expected_scale = None if unscale_first else 8.0
    assert optimizer.seen == [(expected_scale, 0.0), (expected_scale, 1.0)]


class LegacyScalingOptimizer(torch.optim.SGD):
    _step_supports_amp_scaling = True

    def step(self, closure=None, grad_scaler=None):  # type: ignore[override]
        self.scaler_seen = grad_scaler
        return 7


@BOTH
def test_optimizer_taking_grad_scaler_keyword(make) -> None:
    param = torch.ones(2, requires_grad=True)
    optimizer = LegacyScalingOptimizer([param], lr=0.1)
    scaler = make("cpu")
    scaler.scale(param.sum()).backward()
    with pytest.warns(FutureWarning, match="stop passing itself as a keyword argument"):
        assert scaler.step(optimizer) == 7
    assert optimizer.scaler_seen is scaler


class ReturningOptimizer(torch.optim.SGD):
    def step(self, closure=None):  # type: ignore[override]
        super().step()
        return 42


@BOTH
def test_step_returns_what_the_optimizer_returns_or_none_when_skipped(make) -> None:
    param = torch.ones(2, requires_grad=True)
    optimizer = ReturningOptimizer([param], lr=0.1)
    scaler = make("cpu")
    returned = []
    for overflow in (False, True):
        optimizer.zero_grad()
        scaler.scale((param * (math.inf if overflow else 1.0)).sum()).backward()
        returned.append(scaler.step(optimizer))
        scaler.update()
    assert returned == [42, None]


@BOTH
def test_step_forwards_arguments(make) -> None:
    received = []

    class Recording(torch.optim.SGD):
        def step(self, *args, **kwargs):  # type: ignore[override]
            received.append((args, kwargs))

    param = torch.ones(1, requires_grad=True)
    scaler = make("cpu")
    scaler.scale(param.sum()).backward()
    scaler.step(Recording([param], lr=0.1), 1, flag=True)
    assert received == [((1,), {"flag": True})]


def test_device_accepts_torch_device() -> None:
    scaler = amped.GradScaler(torch.device("cpu"))
    assert scaler.is_enabled() and scaler._device == "cpu"


@pytest.mark.parametrize(
    "module",
    [
        amped.scaling.grad_scaler,
        amped.scaling.strategies,
        amped.checkpoint.save_load,
        amped.scaling.records,
    ],
    ids=lambda module: module.__name__.rsplit(".", 1)[-1],
)
def test_docstring_examples_run(module) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
