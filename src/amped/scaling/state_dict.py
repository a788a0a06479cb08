"""The layout of ``GradScaler.state_dict()``, and its checked reading.

torch's five keys, so checkpoints move between amped and torch both ways, and, only
when the scaler holds something torch's layout cannot (a strategy other than torch's
rule, a recorded history), one more, ``"amped"``::

    {"version": 1,
     "strategy": {"dynamic", "hysteresis", "min_scale", "max_scale"} or None,
     "counters": {counter name: int}, "updates": int}

``torch.amp.GradScaler.load_state_dict`` reads only its own keys, so it ignores the
extra one. ``"strategy"`` is the :func:`~amped.scaling.strategies.make_strategy`
arguments that rebuild the strategy, or None for a strategy no arguments describe (a
user's own): loading then keeps the scaler's own strategy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from amped._internal.errors import received, type_error, value_error
from amped.scaling.checks import (
    ScalerStateDictError,
    check_factor,
    check_growth_interval,
    check_int,
    check_loaded_scale,
)
from amped.scaling.strategies import (
    KEYWORD_DEFAULTS,
    ScaleStrategy,
    describe_strategy,
    make_strategy,
)

__all__ = [
    "AMPED_KEY",
    "FORMAT_VERSION",
    "TORCH_KEYS",
    "LoadedState",
    "amped_entry",
    "read_state_dict",
]

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
AMPED_KEY = "amped"
FORMAT_VERSION = 1
_COUNTS_RULE = "Strategy counters and the update count count iterations."


@dataclasses.dataclass(frozen=True)
class LoadedState:
    """A state dict's values, checked; ``counters``/``updates`` are None for torch's."""

    scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    growth_tracker: int
    strategy: ScaleStrategy
    counters: dict[str, int] | None
    updates: int | None


def amped_entry(strategy: ScaleStrategy, counters: dict[str, int], updates: int) -> dict[str, Any]:
    """The ``"amped"`` entry for a scaler's strategy, counter values and update count."""
    return {
        "version": FORMAT_VERSION,
        "strategy": describe_strategy(strategy),
        "counters": counters,
        "updates": updates,
    }


def read_state_dict(state_dict: object, current: ScaleStrategy) -> LoadedState:
    """Check a state dict from amped's or torch's ``GradScaler.state_dict()``.

    ``current`` is the loading scaler's strategy, kept for torch's dict and for a
    strategy the dict does not describe.

    Raises:
        RuntimeError: an empty dict (saved from a disabled scaler), as in torch.
        TypeError, ValueError: a missing key or a bad value.
    """
    if not isinstance(state_dict, Mapping):
        raise type_error("state_dict must be a dict", "state_dict", state_dict)
    if len(state_dict) == 0:
        raise RuntimeError(
            "The source state dict is empty, possibly because it was saved "
            "from a disabled instance of GradScaler."
        )
    missing = [key for key in TORCH_KEYS if key not in state_dict]
    if missing:
        raise ScalerStateDictError(
            f"This GradScaler state_dict lacks {missing}; expected torch's keys "
            f"{list(TORCH_KEYS)}. {received('keys', sorted(state_dict))}"
        )
    rule = "It counts clean iterations in a row."
    entry = state_dict.get(AMPED_KEY)
    strategy, counters, updates = (
        (current, None, None) if entry is None else _read_entry(entry, current)
    )
    return LoadedState(
        scale=check_loaded_scale(state_dict["scale"]),
        growth_factor=check_factor("growth_factor", state_dict["growth_factor"]),
        backoff_factor=check_factor("backoff_factor", state_dict["backoff_factor"]),
        growth_interval=check_growth_interval(state_dict["growth_interval"]),
        growth_tracker=check_int(
            "_growth_tracker", state_dict["_growth_tracker"], minimum=0, rule=rule
        ),
        strategy=strategy,
        counters=counters,
        updates=updates,
    )


def _read_entry(entry: object, current: ScaleStrategy) -> tuple[ScaleStrategy, dict[str, int], int]:
    """Strategy, counters and update count from the ``"amped"`` entry."""
    if not isinstance(entry, Mapping) or entry.get("version") != FORMAT_VERSION:
        raise value_error(
            f"The 'amped' entry of this state_dict is not format version {FORMAT_VERSION} "
            "of amped.GradScaler.state_dict()",
            AMPED_KEY,
            entry,
        )
    described, counters = entry.get("strategy"), entry.get("counters")
    if not isinstance(counters, Mapping):
        raise value_error("Malformed 'amped' entry: no counters", AMPED_KEY, entry)
    strategy = current if described is None else _read_strategy(described, entry)
    if described is None and describe_strategy(current) is not None:
        raise value_error(
            "This state_dict was saved with a strategy of your own, which it cannot "
            "describe; construct the GradScaler with that strategy (strategy=...) before "
            f"loading it. This scaler's strategy is {current!r}",
            AMPED_KEY,
            entry,
        )
    expected = strategy.counters()
    if set(counters) != set(expected):
        raise value_error(
            f"The 'amped' entry holds counters {sorted(counters)} but its strategy owns "
            f"{sorted(expected)}",
            AMPED_KEY,
            entry,
        )
    values = {
        name: check_int(name, n, minimum=0, rule=_COUNTS_RULE) for name, n in counters.items()
    }
    updates = check_int("updates", entry.get("updates"), minimum=0, rule=_COUNTS_RULE)
    return strategy, values, updates


def _read_strategy(described: object, entry: Mapping[str, Any]) -> ScaleStrategy:
    """Rebuild a described strategy. The checkpoint's scale is not held to its bounds:
    ``update(new_scale=...)`` may have set it outside them on purpose."""
    if not isinstance(described, Mapping):
        raise value_error("Malformed 'amped' entry: bad strategy", AMPED_KEY, entry)
    missing = sorted(set(KEYWORD_DEFAULTS) - set(described))
    if missing:
        raise value_error(
            f"The 'amped' entry of this GradScaler state_dict lacks {missing}; it was not "
            "written by amped.GradScaler.state_dict()",
            AMPED_KEY,
            entry,
        )
    return make_strategy(**{key: described[key] for key in KEYWORD_DEFAULTS})
