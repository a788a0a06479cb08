"""Loss-scale strategies: how ``update()`` moves the scale after each iteration.

Each strategy is a small frozen object; its state lives on the device, next to the
scale, as 0-d tensors the update changes in place, so choosing a strategy never adds
a host-device sync. Wrappers compose an inner strategy with their own explicit,
saturating counter, in the shape of optax's wrappers. The rules, per update, given
``found_inf`` (any inf/NaN in this iteration's gradients)::

    DynamicScale (torch's rule, and the default):
        if found_inf:  scale *= backoff_factor;  growth_tracker = 0
        else:          growth_tracker += 1
                       if growth_tracker == growth_interval:
                           growth_tracker = 0
                           scale *= growth_factor   # only if the result is finite
    StaticScale:       nothing changes (found_inf still skips the optimizer step).
    Hysteresis(inner, n):
        overflow_streak = min(overflow_streak + 1, n) if found_inf else 0
        run inner;  if found_inf and overflow_streak < n: restore the scale
        (so the n-th consecutive overflow and every one after it back off, as
        DeepSpeed's and Megatron's ``hysteresis``; the growth tracker still resets)
    Bounded(inner, min_scale, max_scale):
        run inner;  scale = clamp(scale, min_scale, max_scale)

After every update the scaler clamps the scale to at least
:data:`~amped.scaling.checks.SCALE_FLOOR` (2**-126), so no strategy, including one
written by a user, can reach a scale whose reciprocal overflows.

``growth_factor``, ``backoff_factor`` and ``growth_interval`` belong to the scaler (torch
lets you change them between iterations), so they are passed to every update as
:class:`GrowthFactors` rather than frozen into the strategy.

The scaler's keyword arguments compose the strategy (:func:`make_strategy`) around
torch's rule, or around a strategy of the user's own given as ``strategy=`` (a
:class:`ScaleStrategy` subclass). The public names are :class:`ScaleStrategy` (the
contract) and the keywords; the built-in strategies are what ``GradScaler.strategy``
hands back, importable here for ``isinstance`` and equality.

Example:
    >>> import amped
    >>> from amped.scaling.strategies import Bounded, DynamicScale, Hysteresis
    >>> scaler = amped.GradScaler("cpu", hysteresis=2, min_scale=1.0)
    >>> scaler.strategy == Bounded(Hysteresis(DynamicScale(), hysteresis=2), min_scale=1.0)
    True
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

import torch

from amped._internal.errors import type_error, value_error
from amped._internal.torch_compat import amp_update_scale_
from amped.scaling.checks import check_bool, check_int, check_scale_bound

__all__ = [
    "KEYWORD_DEFAULTS",
    "Bounded",
    "DynamicScale",
    "GrowthFactors",
    "Hysteresis",
    "ScaleState",
    "ScaleStrategy",
    "StaticScale",
    "check_strategy",
    "choose_strategy",
    "describe_strategy",
    "make_strategy",
]

# make_strategy's arguments (GradScaler's keywords) that compose torch's rule alone.
KEYWORD_DEFAULTS: dict[str, object] = {
    "dynamic": True,
    "hysteresis": 1,
    "min_scale": None,
    "max_scale": None,
}
_HYSTERESIS_RULE = (
    "The scale backs off on the `hysteresis`-th overflow in a row; 1 is torch's rule, 2 "
    "tolerates one (DeepSpeed's and Megatron's default)."
)


class GrowthFactors(NamedTuple):
    """torch's three knobs of the dynamic rule, read from the scaler at each update."""

    growth_factor: float
    backoff_factor: float
    growth_interval: int


@dataclasses.dataclass
class ScaleState:
    """The device tensors an update reads and changes in place.

    Attributes:
        scale: float32, 0-d: the loss scale.
        growth_tracker: int32, 0-d: consecutive clean iterations (torch's counter).
        counters: int32 0-d tensors owned by wrappers, by name (see
            :meth:`ScaleStrategy.counters`).
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor
    counters: dict[str, torch.Tensor]


class ScaleStrategy(abc.ABC):
    """The contract of a loss-scale strategy.

    ``update`` runs once per iteration, on the device, with no host-device sync: it
    may only launch tensor ops on ``state`` (never ``.item()``, ``bool(tensor)``, ...).
    """

    def counters(self) -> dict[str, int]:
        """Names and initial values of the counters this strategy (and any inner one) owns."""
        return {}

    @abc.abstractmethod
    def update(self, state: ScaleState, found_inf: torch.Tensor, factors: GrowthFactors) -> None:
        """Change ``state`` in place after an iteration.

        Args:
            state: the scale and counters, on the scale's device.
            found_inf: float32, 0-d, on the scale's device: nonzero if any gradient of
                the iteration held an inf or NaN.
            factors: the scaler's current growth factor, backoff factor and interval.
        """


@dataclasses.dataclass(frozen=True)
class DynamicScale(ScaleStrategy):
    """torch's rule, through torch's own kernel: bitwise identical to ``torch.amp``."""

    def update(self, state: ScaleState, found_inf: torch.Tensor, factors: GrowthFactors) -> None:
        amp_update_scale_(state.scale, state.growth_tracker, found_inf, *factors)


@dataclasses.dataclass(frozen=True)
class StaticScale(ScaleStrategy):
    """A fixed scale. Steps with inf/NaN gradients are still skipped."""

    def update(self, state: ScaleState, found_inf: torch.Tensor, factors: GrowthFactors) -> None:
        return None


@dataclasses.dataclass(frozen=True)
class Hysteresis(ScaleStrategy):
    """Back off only on the ``hysteresis``-th consecutive overflow and after.

    ``hysteresis=1`` is the inner rule unchanged; ``hysteresis=2`` tolerates one
    overflow in a row (DeepSpeed's and Megatron's default). A tolerated overflow still
    skips the step and resets the inner growth tracker; a clean iteration resets the
    streak. The streak counter saturates at ``hysteresis``.
    """

    inner: ScaleStrategy
    hysteresis: int
    counter: str = dataclasses.field(default="overflow_streak", repr=False)

    def __post_init__(self) -> None:
        check_strategy("inner", self.inner)
        check_int("hysteresis", self.hysteresis, minimum=1, rule=_HYSTERESIS_RULE)

    def counters(self) -> dict[str, int]:
        return _merge_counters(self.inner.counters(), {self.counter: 0})

    def update(self, state: ScaleState, found_inf: torch.Tensor, factors: GrowthFactors) -> None:
        streak, limit = state.counters[self.counter], self.hysteresis
        # min(streak + 1, limit) after an overflow, 0 after a clean iteration; no host reads.
        streak.add_(1).clamp_(max=limit).masked_fill_(found_inf == 0, 0)
        # Tolerated: an overflow (streak > 0) short of the limit-th in a row.
        tolerated = streak.bool() & (streak != limit)
        kept = state.scale.clone()
        self.inner.update(state, found_inf, factors)
        torch.where(tolerated, kept, state.scale, out=state.scale)


@dataclasses.dataclass(frozen=True)
class Bounded(ScaleStrategy):
    """Keep the scale inside ``[min_scale, max_scale]`` (either bound may be None)."""

    inner: ScaleStrategy
    min_scale: float | None = None
    max_scale: float | None = None

    def __post_init__(self) -> None:
        check_strategy("inner", self.inner)
        low = check_scale_bound("min_scale", self.min_scale)
        high = check_scale_bound("max_scale", self.max_scale)
        if low is None and high is None:
            raise value_error(
                "Bounded needs `min_scale`, `max_scale` or both; without either, use the "
                "inner strategy alone",
                "max_scale",
                high,
            )
        if low is not None and high is not None and low > high:
            raise value_error(
                f"min_scale must not exceed max_scale ({high!r})", "min_scale", self.min_scale
            )

    def counters(self) -> dict[str, int]:
        return self.inner.counters()

    def update(self, state: ScaleState, found_inf: torch.Tensor, factors: GrowthFactors) -> None:
        self.inner.update(state, found_inf, factors)
        # Clamping an in-range float32 returns it unchanged: unreached bounds leave the
        # inner rule's scale bitwise intact.
        state.scale.clamp_(min=self.min_scale, max=self.max_scale)


def make_strategy(
    base: ScaleStrategy | None = None,
    /,
    *,
    dynamic: object = True,
    hysteresis: object = 1,
    min_scale: object = None,
    max_scale: object = None,
) -> ScaleStrategy:
    """Compose the strategy that :class:`amped.GradScaler`'s keyword arguments describe,
    around ``base`` (a strategy of the user's own; default: :class:`DynamicScale`, or
    :class:`StaticScale` for ``dynamic=False``).

    Only what is asked for is wrapped, so the defaults give the bare ``base`` (torch's
    numbers without one).

    Raises:
        TypeError, ValueError: an argument of the wrong type or value, or
            ``dynamic=False`` with a hysteresis, a bound or a ``base`` (which would do
            nothing, or contradict it).
    """
    checked_hysteresis = check_int("hysteresis", hysteresis, minimum=1, rule=_HYSTERESIS_RULE)
    low = check_scale_bound("min_scale", min_scale)
    high = check_scale_bound("max_scale", max_scale)
    if not check_bool("dynamic", dynamic):
        if checked_hysteresis != 1 or low is not None or high is not None:
            raise value_error(
                "With dynamic=False the scale never moves, so hysteresis, min_scale and "
                "max_scale would do nothing; drop them or pass dynamic=True (here "
                f"hysteresis={checked_hysteresis!r}, min_scale={low!r}, max_scale={high!r})",
                "dynamic",
                dynamic,
            )
        if base is not None:
            raise value_error(
                "dynamic=False fixes the scale, and strategy= gives a strategy of your own "
                "that moves it: pass one of the two",
                "dynamic",
                dynamic,
            )
        return StaticScale()
    strategy = DynamicScale() if base is None else base
    wraps = checked_hysteresis > 1 or low is not None or high is not None
    if wraps and isinstance(base, StaticScale):
        raise value_error(
            "strategy=StaticScale() never moves the scale, so hysteresis, min_scale and "
            "max_scale would do nothing; drop them (here "
            f"hysteresis={checked_hysteresis!r}, min_scale={low!r}, max_scale={high!r})",
            "strategy",
            base,
        )
    if checked_hysteresis > 1 and "overflow_streak" in strategy.counters():
        raise value_error(
            "strategy= already holds a hysteresis (it owns the counter 'overflow_streak'); "
            "pass hysteresis= with a strategy that has none, or leave it out",
            "hysteresis",
            checked_hysteresis,
        )
    if checked_hysteresis > 1:
        strategy = Hysteresis(strategy, checked_hysteresis)
    if low is not None or high is not None:
        strategy = Bounded(strategy, low, high)
    return strategy


def describe_strategy(strategy: ScaleStrategy) -> dict[str, object] | None:
    """The :func:`make_strategy` arguments that compose ``strategy``; None if none do
    (a strategy of the user's own, or wrappers in another order)."""
    found = dict(KEYWORD_DEFAULTS)
    layer = strategy
    if isinstance(layer, Bounded):
        found.update(min_scale=layer.min_scale, max_scale=layer.max_scale)
        layer = layer.inner
    if isinstance(layer, Hysteresis):
        found["hysteresis"] = layer.hysteresis
    found["dynamic"] = not isinstance(layer, StaticScale)
    try:
        rebuilt = make_strategy(**found)
    except (TypeError, ValueError):
        return None
    # Dataclass equality compares classes exactly, so subclasses are not described.
    return found if rebuilt == strategy else None


def choose_strategy(
    strategy: object, keywords: Mapping[str, object], init_scale: float
) -> ScaleStrategy:
    """A scaler's strategy: the one its ``keywords`` (:func:`make_strategy`'s) compose
    around ``strategy`` (a :class:`ScaleStrategy` of the user's own, or None for torch's
    rule); ``init_scale`` must lie inside the outermost bounds."""
    base = None if strategy is None else check_strategy("strategy", strategy)
    chosen = make_strategy(base, **keywords)
    layer: ScaleStrategy | None = chosen
    while isinstance(layer, (Bounded, Hysteresis)):  # every bound of the composition
        if isinstance(layer, Bounded):
            low, high = layer.min_scale, layer.max_scale
            if (low is not None and init_scale < low) or (high is not None and init_scale > high):
                raise value_error(
                    f"init_scale must lie within [min_scale, max_scale] = [{low!r}, {high!r}]",
                    "init_scale",
                    init_scale,
                )
        layer = layer.inner
    return chosen


def check_strategy(name: str, value: object) -> ScaleStrategy:
    """A :class:`ScaleStrategy` instance (a class is refused with a hint)."""
    if isinstance(value, ScaleStrategy):
        return value
    hint = ""
    if isinstance(value, type) and issubclass(value, ScaleStrategy):
        hint = f"; pass an instance, e.g. {name}={value.__name__}()"
    raise type_error(
        f"`{name}` must be a ScaleStrategy instance: a subclass of "
        "amped.scaling.ScaleStrategy of your own, or another scaler's `.strategy` (torch's "
        f"rule, hysteresis and bounds are GradScaler's keywords){hint}",
        name,
        value,
    )


def _merge_counters(inner: dict[str, int], own: dict[str, int]) -> dict[str, int]:
    clash = sorted(inner.keys() & own.keys())
    if clash:
        raise value_error(
            f"Two strategies in one composition own the counter(s) {clash}; give the outer "
            "wrapper another `counter` name",
            "counters",
            sorted(inner),
        )
    return {**inner, **own}
