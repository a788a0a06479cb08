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
:data:`~amped.scaling.checks.SCALE_FLOOR` (2**-126, float32's smallest normal
number), so no strategy, including one written by a user, can reach a scale whose
reciprocal overflows (at 0.0 a clean step would turn every parameter into NaN).

``growth_factor``, ``backoff_factor`` and ``growth_interval`` belong to the scaler (torch
lets you change them between iterations), so they are passed to every update as
:class:`GrowthFactors` rather than frozen into the strategy.

Example:
    >>> import amped
    >>> scaler = amped.GradScaler("cpu", hysteresis=2, min_scale=1.0)
    >>> scaler.strategy
    Bounded(inner=Hysteresis(inner=DynamicScale(), hysteresis=2), min_scale=1.0, max_scale=None)
"""

from __future__ import annotations

import abc
import dataclasses
from typing import NamedTuple

import torch

__all__ = [
    "Bounded",
    "DynamicScale",
    "GrowthFactors",
    "Hysteresis",
    "ScaleState",
    "ScaleStrategy",
    "StaticScale",
    "make_strategy",
]


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
        torch._amp_update_scale_(
            state.scale,
            state.growth_tracker,
            found_inf,
            factors.growth_factor,
            factors.backoff_factor,
            factors.growth_interval,
        )


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

    def counters(self) -> dict[str, int]:
        return _merge_counters(self.inner.counters(), {self.counter: 0})

    def update(self, state: ScaleState, found_inf: torch.Tensor, factors: GrowthFactors) -> None:
        streak, limit = state.counters[self.counter], self.hysteresis
        # A saturating count of overflows in a row: min(streak + 1, limit), or 0 after a
        # clean iteration. In place, and no host reads.
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
        if self.min_scale is None and self.max_scale is None:
            raise ValueError(
                "Bounded needs `min_scale`, `max_scale` or both; without either, use the "
                "inner strategy alone. Received: min_scale=None, max_scale=None"
            )

    def counters(self) -> dict[str, int]:
        return self.inner.counters()

    def update(self, state: ScaleState, found_inf: torch.Tensor, factors: GrowthFactors) -> None:
        self.inner.update(state, found_inf, factors)
        # Clamping an in-range float32 returns it unchanged, so bounds that are never
        # reached leave the inner rule's scale bitwise intact.
        state.scale.clamp_(min=self.min_scale, max=self.max_scale)


def make_strategy(
    *,
    dynamic: bool = True,
    hysteresis: int = 1,
    min_scale: float | None = None,
    max_scale: float | None = None,
) -> ScaleStrategy:
    """Compose the strategy that :class:`amped.GradScaler`'s keyword arguments describe.

    Only what is asked for is wrapped, so the defaults give the bare
    :class:`DynamicScale` and torch's numbers. Arguments are assumed valid (the
    scaler checks them).
    """
    if not dynamic:
        return StaticScale()
    strategy: ScaleStrategy = DynamicScale()
    if hysteresis > 1:
        strategy = Hysteresis(strategy, hysteresis)
    if min_scale is not None or max_scale is not None:
        strategy = Bounded(strategy, min_scale, max_scale)
    return strategy


def _merge_counters(inner: dict[str, int], own: dict[str, int]) -> dict[str, int]:
    clash = inner.keys() & own.keys()
    if clash:
        raise ValueError(
            f"Two strategies in one composition own the counter(s) {sorted(clash)}; give "
            f"the outer wrapper another `counter` name. Received: counters={sorted(inner)}"
        )
    return {**inner, **own}
