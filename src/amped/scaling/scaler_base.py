"""A GradScaler's state, settings and serialisation (the iteration is in ``grad_scaler``).

``state_dict()`` holds torch's five keys, so checkpoints move between amped and torch
both ways, and one more, ``"amped"`` (strategy settings and counters), which
``torch.amp.GradScaler.load_state_dict`` ignores since it reads only its own keys.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from amped.scaling import config as cfg
from amped.scaling.checks import ScalerOrderError, ScalerStateDictError, check_int, received
from amped.scaling.distributed import agree_found_inf_, agreement_groups
from amped.scaling.records import History, ScaleRecord
from amped.scaling.strategies import ScaleStrategy
from amped.scaling.unscale import combine_on, unscale_grads_

__all__ = ["AMPED_KEY", "TORCH_KEYS", "GradScalerBase", "OptState", "OptimizerState"]

TORCH_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
AMPED_KEY = "amped"
_FORMAT_VERSION = 1


class OptState(enum.Enum):
    """Where an optimizer is in the iteration: scale -> (unscale_) -> step -> update."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclasses.dataclass
class OptimizerState:
    """Per optimizer, per iteration: its stage and its inf/NaN flag on each device."""

    stage: OptState = OptState.READY
    found_inf_per_device: dict[torch.device, torch.Tensor] = dataclasses.field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        """Read as torch's per-optimizer dict: ``"stage"`` gives torch's ``OptState``."""
        if key == "stage":
            return torch.amp.grad_scaler.OptState[self.stage.name]
        if key == "found_inf_per_device":
            return self.found_inf_per_device
        raise KeyError(key)


class GradScalerBase:
    """Settings, accessors and (de)serialisation shared by :class:`amped.GradScaler`."""

    _device: str
    _enabled: bool
    _init_scale: float
    _growth_factor: float
    _backoff_factor: float
    _growth_interval: int
    _init_growth_tracker: int
    _init_counters: dict[str, int]
    _config: cfg.StrategyConfig
    _strategy: ScaleStrategy
    _scale: torch.Tensor | None
    _growth_tracker: torch.Tensor | None
    _counters: dict[str, torch.Tensor]
    _per_optimizer_states: defaultdict[int, OptimizerState]
    _history: History | None
    _process_group: Any
    _updates: int
    _last_skipped: bool | torch.Tensor

    def _set_strategy(self, config: cfg.StrategyConfig) -> None:
        self._config = config
        self._strategy = config.build()
        self._init_counters = self._strategy.counters()

    def _lazy_init(self, device: torch.device) -> torch.Tensor:
        scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
        self._scale = scale
        self._growth_tracker = torch.full(
            (), self._init_growth_tracker, dtype=torch.int32, device=device
        )
        self._counters = {
            name: torch.full((), value, dtype=torch.int32, device=device)
            for name, value in self._init_counters.items()
        }
        return scale

    def _require_scale(self, method: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scale is None or self._growth_tracker is None:
            raise ScalerOrderError(
                f"{method}() was called before scale(): the scale does not exist yet. Call "
                "scaler.scale(loss).backward() earlier in the iteration."
            )
        return self._scale, self._growth_tracker

    @property
    def strategy(self) -> ScaleStrategy:
        """The composed loss-scale strategy (see :mod:`amped.scaling.strategies`)."""
        return self._strategy

    @property
    def history(self) -> list[ScaleRecord]:
        """One :class:`~amped.ScaleRecord` per ``update()``, oldest first.

        Syncs once if the latest records are still on the device (each ``step()``
        fetches the waiting ones within its own sync). Needs ``record_history=True``.
        """
        if self._history is None:
            raise RuntimeError(
                "This GradScaler keeps no history; construct it with record_history=True. "
                "Received: record_history=False"
            )
        return self._history.records()

    @property
    def last_step_skipped(self) -> bool:
        """Whether the latest ``step()`` skipped ``optimizer.step()`` (inf/NaN gradients).

        Lets a learning-rate scheduler skip with the optimizer::

            scaler.step(optimizer)
            scaler.update()
            if not scaler.last_step_skipped:
                scheduler.step()

        No sync, except after an optimizer that skips inside its own step (torch's
        fused ones): that decision stays on the device until read here.
        """
        if isinstance(self._last_skipped, torch.Tensor):
            self._last_skipped = bool(self._last_skipped.item() > 0)
        return self._last_skipped

    def get_scale(self) -> float:
        """The current scale as a float, or 1.0 if disabled. Syncs with the device."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = cfg.check_growth_factor(new_factor)

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = cfg.check_backoff_factor(new_factor)

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = cfg.check_growth_interval(new_interval)

    def is_enabled(self) -> bool:
        return self._enabled

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        tracker = self._growth_tracker
        return self._init_growth_tracker if tracker is None else int(tracker.item())

    def _counter_values(self) -> dict[str, int]:
        if self._scale is None:
            return dict(self._init_counters)
        return {name: int(tensor.item()) for name, tensor in self._counters.items()}

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
        """Flag inf/NaN in the optimizer's gradients without unscaling them (torch's hook
        for optimizers that unscale inside their own step). No sync."""
        scale, _ = self._require_scale("_check_inf_per_device")
        unit = torch.ones((), dtype=torch.float32, device=scale.device)
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        state.found_inf_per_device = unscale_grads_(optimizer, unit, found_inf, allow_fp16=True)
        self._agree_across_ranks(optimizer, state, scale.device)
        return state.found_inf_per_device

    def _agree_across_ranks(
        self, optimizer: torch.optim.Optimizer, state: OptimizerState, device: torch.device
    ) -> None:
        """Replace this rank's inf/NaN flags by the flag all the ranks agree on (one
        all-reduce per group, usually one), so that they skip alike. No sync."""
        params = (p for group in optimizer.param_groups for p in group["params"])
        groups = agreement_groups(self._process_group, params)
        if not groups:
            return
        # Every rank must join the collective, even one with no gradients (whose step()
        # then raises its own error rather than leaving the others waiting).
        found = combine_on(device, list(state.found_inf_per_device.values()))
        agree_found_inf_(found, groups)
        if state.found_inf_per_device:
            state.found_inf_per_device = {device: found}

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)].found_inf_per_device

    def state_dict(self) -> dict[str, Any]:
        """torch's five entries (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``) and ``"amped"``: the strategy settings,
        its counters and the update count. Empty if disabled. Call it after ``update()``.
        Syncs with the device (it reads the scale and counters).
        """
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
            AMPED_KEY: {
                "version": _FORMAT_VERSION,
                "strategy": self._config.to_dict(),
                "counters": self._counter_values(),
                "updates": self._updates,
            },
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict from amped's or torch's ``GradScaler.state_dict()``.

        Everything is checked before anything changes. A torch state dict keeps this
        scaler's strategy and starts its counters afresh. No-op if disabled.

        Raises:
            RuntimeError: an empty dict (saved from a disabled scaler), as in torch.
            TypeError, ValueError: a missing key or a bad value.
        """
        if not self._enabled:
            return
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict. {received('state_dict', state_dict)}")
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved "
                "from a disabled instance of GradScaler."
            )
        missing = [key for key in TORCH_KEYS if key not in state_dict]
        if missing:
            raise ScalerStateDictError(
                f"This GradScaler state_dict lacks {missing}; expected torch's keys "
                f"{list(TORCH_KEYS)}. Received: keys={sorted(state_dict)}"
            )
        scale = cfg.check_loaded_scale(state_dict["scale"])
        factors = (
            cfg.check_growth_factor(state_dict["growth_factor"]),
            cfg.check_backoff_factor(state_dict["backoff_factor"]),
            cfg.check_growth_interval(state_dict["growth_interval"]),
        )
        tracker = check_int(
            "_growth_tracker",
            state_dict["_growth_tracker"],
            minimum=0,
            rule="It counts clean iterations in a row.",
        )
        extra = _read_amped_entry(state_dict.get(AMPED_KEY), self._config)
        self._growth_factor, self._backoff_factor, self._growth_interval = factors
        self._apply_loaded(scale, tracker, *extra)

    def _apply_loaded(
        self,
        scale: float,
        tracker: int,
        config: cfg.StrategyConfig,
        counters: dict[str, int] | None,
        updates: int | None,
    ) -> None:
        self._set_strategy(config)
        if counters is not None:
            self._init_counters = counters
        self._init_scale, self._init_growth_tracker = scale, tracker
        if updates is not None:
            self._updates = updates
        if self._scale is not None:
            self._refill(self._scale)

    def _refill(self, scale: torch.Tensor) -> None:
        # In place, as torch does: a capturable optimizer or a CUDA graph may hold
        # these very tensors.
        scale.fill_(self._init_scale)
        assert self._growth_tracker is not None  # for mypy: made with the scale
        self._growth_tracker.fill_(self._init_growth_tracker)
        counters = {}
        for name, value in self._init_counters.items():
            tensor = self._counters.get(name)
            if tensor is None:
                tensor = torch.zeros((), dtype=torch.int32, device=scale.device)
            counters[name] = tensor.fill_(value)
        self._counters = counters

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._enabled:
            if len(self._per_optimizer_states) != 0:
                raise ScalerOrderError(
                    "A GradScaler instance may only be pickled at the beginning "
                    "of an iteration, or at the end after scaler.update()."
                )
            # Device tensors are rebuilt lazily on the other side (as torch does), from
            # their values now (this syncs).
            state["_init_scale"] = self.get_scale()
            state["_init_growth_tracker"] = self._get_growth_tracker()
            state["_init_counters"] = self._counter_values()
            state["_scale"] = state["_growth_tracker"] = None
            state["_counters"] = {}
        # A process group belongs to one process; the copy detects its ranks again.
        state["_process_group"] = None
        state["_last_skipped"] = self.last_step_skipped
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("_process_group", None)  # pickled before process_group existed
        self.__dict__.update(state)


def _read_amped_entry(
    entry: object, current: cfg.StrategyConfig
) -> tuple[cfg.StrategyConfig, dict[str, int] | None, int | None]:
    """Strategy, counters and update count from the ``"amped"`` entry (None: torch's dict)."""
    if entry is None:
        return current, None, None
    if not isinstance(entry, Mapping) or entry.get("version") != _FORMAT_VERSION:
        raise ValueError(
            f"The 'amped' entry of this state_dict is not format version {_FORMAT_VERSION} "
            f"of amped.GradScaler.state_dict(). {received(AMPED_KEY, entry)}"
        )
    strategy, counters = entry.get("strategy"), entry.get("counters")
    if not isinstance(strategy, Mapping) or not isinstance(counters, Mapping):
        raise ValueError(f"Malformed 'amped' entry. {received(AMPED_KEY, entry)}")
    config = cfg.StrategyConfig.from_dict(strategy)
    expected = config.build().counters()
    if set(counters) != set(expected):
        raise ValueError(
            f"The 'amped' entry holds counters {sorted(counters)} but its strategy owns "
            f"{sorted(expected)}. {received(AMPED_KEY, entry)}"
        )
    rule = "Strategy counters and the update count count iterations."
    values = {name: check_int(name, n, minimum=0, rule=rule) for name, n in counters.items()}
    updates = check_int("updates", entry.get("updates"), minimum=0, rule=rule)
    return config, values, updates
