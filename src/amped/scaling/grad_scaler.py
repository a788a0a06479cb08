"""``amped.GradScaler``: a drop-in for ``torch.amp.GradScaler`` with pluggable strategies.

Host-device syncs, per optimizer step: exactly one, in :meth:`GradScaler.step`, to
decide whether to call ``optimizer.step()`` (none for optimizers that unscale inside
their own step, such as torch's fused Adam, unless ``on_stall`` is ``"warn"`` or
``"raise"``, which need the host to know before the step). :meth:`GradScaler.scale`
and :meth:`GradScaler.unscale_` never sync, whatever the strategy; nor does
:meth:`GradScaler.update`, except once per ``amped.scaling.stall.REPORT_EVERY`` (64)
iterations in which ``step()`` did not sync (those optimizers, under ``"recover"``), to
read the stalls the device handled alone. Reading the scale (``get_scale``,
``state_dict``, pickling) syncs, as in torch.
Under torch.distributed, ranks that hold different gradients agree on each step with
one collective (see :mod:`amped.scaling.distributed`), which adds no host sync.

Frameworks read some of torch's private attributes (``_scale``, ``_growth_tracker``,
``_enabled``, ``_device``, ``_per_optimizer_states[id(opt)]["stage"]``) and call some of
its private methods (``_lazy_init_scale_growth_tracker``, ``_unscale_grads_``); this
scaler has them, with torch's types and meaning.
"""

from __future__ import annotations

import inspect
import warnings
from collections import abc, defaultdict
from collections.abc import Mapping
from importlib.util import find_spec
from typing import Any, overload

import torch

from amped._internal.errors import received, value_error
from amped._internal.torch_compat import steps_with_amp_scaling
from amped.scaling.checks import (
    SCALE_FLOOR,
    ScalerOrderError,
    check_bool,
    check_device_type,
    check_factor,
    check_growth_interval,
    check_new_scale,
    check_scale,
)
from amped.scaling.distributed import agree_across_ranks, check_process_group
from amped.scaling.optimizer_state import OptimizerState, OptState
from amped.scaling.records import History, ScaleRecord
from amped.scaling.stall import StallGuard
from amped.scaling.state_dict import AMPED_KEY, amped_entry, read_state_dict
from amped.scaling.strategies import (
    DynamicScale,
    GrowthFactors,
    ScaleState,
    ScaleStrategy,
    choose_strategy,
)
from amped.scaling.unscale import PerDevice, combine_on, unscale_grads_

__all__ = ["GradScaler"]


class GradScaler:
    """Scales the loss so small float16 gradients survive; skips steps that overflow.

    A drop-in for :class:`torch.amp.GradScaler`: same arguments, defaults, methods,
    call-order errors and ``state_dict`` keys, and with the defaults bitwise the same
    scales and parameters. ``scale(loss)`` multiplies the loss by the scale;
    ``step(optimizer)`` unscales the gradients, and calls ``optimizer.step()`` only if
    none holds an inf or NaN; ``update()`` moves the scale by the strategy (see
    :mod:`amped.scaling.strategies` for the rules).

    Args:
        device: device type of the gradients: ``"cuda"`` (default, as torch's),
            ``"cpu"``, ... With ``"cuda"`` and no CUDA, warns and disables itself, as
            torch does.
        init_scale: the first scale, a finite number >= ``SCALE_FLOOR`` (2**-126).
            Whatever the strategy, the scale never goes below that floor.
        growth_factor: multiplies the scale after ``growth_interval`` clean
            iterations; > 1.
        backoff_factor: multiplies the scale after an iteration with inf/NaN
            gradients; in (0, 1).
        growth_interval: clean iterations in a row before the scale grows; >= 1.
        enabled: if False, every method is a pass-through (``step`` just calls
            ``optimizer.step``), so one loop serves fp32, bf16 and fp16.
        strategy: keyword-only. A :class:`~amped.scaling.ScaleStrategy` of your own
            that moves the scale (default: torch's rule). ``hysteresis``, ``min_scale``
            and ``max_scale`` wrap it as they wrap torch's rule; :attr:`strategy` is
            the composition.
        dynamic: keyword-only. False fixes the scale at ``init_scale`` (steps with
            inf/NaN gradients are still skipped).
        hysteresis: keyword-only. Back off only on the ``hysteresis``-th overflow in
            a row (DeepSpeed's and Megatron's meaning); 1, the default, is torch's rule.
        min_scale: keyword-only. The scale never backs off below this (>= 2**-126).
        max_scale: keyword-only. The scale never grows above this.
        record_history: keyword-only. Keep a
            :class:`~amped.scaling.records.ScaleRecord` per update in :attr:`history`, at
            no extra sync.
        process_group: keyword-only. The ranks that must agree on skipping a step:
            None (default) finds them from DTensor gradients (FSDP2's ``fully_shard``)
            and needs none for plain ones (one process, DDP); a ``ProcessGroup`` is
            always used, with one all-reduce per step. See
            :mod:`amped.scaling.distributed`. Not pickled (it belongs to one process).
        on_stall: keyword-only. What a stall does: a step whose gradients underflowed to
            zero (all of them, or, below the last clean scale, some that were non-zero
            at the last clean step) while the loss is finite and non-zero, or a step at
            the scale floor (see :mod:`amped.scaling.stall`). ``"recover"`` (default)
            warns once and returns the scale to the last one that gave a clean step
            (torch's fused optimizers: recovered on the device, warned about within
            ``amped.scaling.stall.REPORT_EVERY`` (64) iterations, one sync per 64);
            ``"warn"`` warns once and keeps the strategy's scale (torch's numbers);
            ``"raise"`` raises :class:`~amped.scaling.ScaleStallError` before
            ``optimizer.step()``. ``"warn"`` and ``"raise"`` sync once per step with
            torch's fused optimizers too.

    Example:
        >>> import torch, amped
        >>> param = torch.tensor(2.0, requires_grad=True)
        >>> optimizer = torch.optim.SGD([param], lr=0.1)
        >>> scaler = amped.GradScaler("cpu")
        >>> scaler.scale(param**2 + 3).backward()
        >>> param.grad
        tensor(262144.)
        >>> scaler.step(optimizer)
        >>> scaler.update()
        >>> param
        tensor(1.6000, requires_grad=True)
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        strategy: ScaleStrategy | None = None,
        dynamic: bool = True,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = None,
        record_history: bool = False,
        process_group: Any = None,
        on_stall: str = "recover",
    ) -> None:
        self._device = check_device_type(device)
        self._enabled = check_bool("enabled", enabled)
        self._init_scale = check_scale("init_scale", init_scale)
        self._growth_factor = check_factor("growth_factor", growth_factor)
        self._backoff_factor = check_factor("backoff_factor", backoff_factor)
        self._growth_interval = check_growth_interval(growth_interval)
        keywords: dict[str, object] = {
            "dynamic": dynamic,
            "hysteresis": hysteresis,
            "min_scale": min_scale,
            "max_scale": max_scale,
        }
        self._set_strategy(choose_strategy(strategy, keywords, self._init_scale))
        self._init_growth_tracker = 0
        # The scale and counters live on the device of the first tensor scale() sees.
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._counters: dict[str, torch.Tensor] = {}
        self._per_optimizer_states: defaultdict[int, OptimizerState] = defaultdict(OptimizerState)
        self._history = History() if check_bool("record_history", record_history) else None
        self._process_group = check_process_group(process_group)
        self._updates = 0
        self._stall = StallGuard(on_stall, self._init_scale)
        self._last_skipped: bool | torch.Tensor = False
        self._synced = False  # whether this iteration's step() has synced already
        if self._device == "cuda" and self._enabled and _cuda_definitely_unavailable():
            warnings.warn(
                "amped.GradScaler is enabled, but CUDA is not available.  Disabling. "
                "Pass device='cpu' to scale on the CPU.",
                stacklevel=2,
            )
            self._enabled = False

    # --- the iteration: scale, unscale_, step, update ------------------------------

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...

    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...

    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...

    @overload
    def scale(self, outputs: abc.Iterable[torch.Tensor]) -> abc.Iterable[torch.Tensor]: ...

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or nested lists/tuples/iterables of tensors, by the scale.

        Lists and tuples keep their type; other iterables come back as lazy ``map``
        objects, as in torch. Returns ``outputs`` unchanged when disabled. No sync.

        Raises:
            ValueError: ``outputs`` holds something other than tensors and iterables.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            scale = self._scale if self._scale is not None else self._lazy_init(outputs.device)
            self._stall.note_loss(outputs)
            return outputs * scale.to(device=outputs.device, non_blocking=True)
        replicas: list[PerDevice] = []  # one, made at the first tensor met
        return self._scale_nested(outputs, replicas)

    def _scale_nested(self, value: Any, replicas: list[PerDevice]) -> Any:
        if isinstance(value, torch.Tensor):
            if not replicas:
                scale = self._scale if self._scale is not None else self._lazy_init(value.device)
                replicas.append(PerDevice(scale))
            self._stall.note_loss(value)
            return value * replicas[0].get(value.device)
        if isinstance(value, abc.Iterable) and not isinstance(value, (str, bytes)):
            scaled = map(lambda item: self._scale_nested(item, replicas), value)
            return type(value)(scaled) if isinstance(value, (list, tuple)) else scaled
        raise value_error(
            "outputs must be a Tensor or an iterable of Tensors (lists and tuples may nest)",
            "outputs",
            value,
        )

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale, in place, and look for inf/NaN.

        Optional: call it to clip or inspect true gradients before :meth:`step`, once
        per optimizer per iteration. Sparse gradients are unscaled through their
        values, DTensor ones through their local shards. No sync; the ranks' collective
        agreement, when there is one, happens here.

        Raises:
            RuntimeError: called twice for this optimizer since ``update()``, or after
                ``step()``, or before ``scale()``.
            ValueError: a float16 gradient ("Attempting to unscale FP16 gradients.").
        """
        if not self._enabled:
            return
        scale, _ = self._require_scale("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state.stage is OptState.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state.stage is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # The reciprocal in float64, rounded once: a float32 division may be inexact
        # under some compile options (as torch does). MPS has no float64.
        if scale.device.type == "mps":
            inv_scale = scale.reciprocal()
        else:
            inv_scale = scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        state.zero_counts = []
        state.found_inf_per_device = unscale_grads_(
            optimizer,
            inv_scale,
            found_inf,
            allow_fp16=False,
            zero_counts=state.zero_counts if self._stall.watch else None,
        )
        state.found_inf_per_device = agree_across_ranks(
            self._process_group, optimizer, state.found_inf_per_device, scale.device
        )
        state.stage = OptState.UNSCALED

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (unless :meth:`unscale_` did), then ``optimizer.step(*args, **kwargs)``
        if no gradient holds an inf or NaN.

        Returns ``optimizer.step``'s return value, or None when the step is skipped.
        Syncs once, to decide; an optimizer with ``_step_supports_amp_scaling`` (torch's
        fused and capturable ones) gets ``grad_scale`` and ``found_inf`` attributes and
        decides on the device, with no sync, under ``on_stall="recover"``; under
        ``"warn"``/``"raise"`` (or if it sets ``_amped_decides_on_host``) the scaler
        syncs once for it too and does not call it on an overflow.

        Raises:
            RuntimeError: a closure (unsupported, as in torch), ``step()`` twice since
                ``update()``, a call before ``scale()``, or no gradients to check.
            ScaleStallError: ``on_stall="raise"`` and the step stalls or is at the floor.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        # A closure would recompute an unscaled loss inside optimizer.step.
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale, _ = self._require_scale("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state.stage is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if steps_with_amp_scaling(optimizer):
            return self._step_in_optimizer(optimizer, state, scale, args, kwargs)
        if state.stage is OptState.READY:
            self.unscale_(optimizer)
        if not state.found_inf_per_device:
            raise ScalerOrderError(
                "No inf checks were recorded for this optimizer: none of its parameters has "
                "a gradient. Call scaler.scale(loss).backward() before scaler.step()."
            )
        found = combine_on(scale.device, list(state.found_inf_per_device.values()))
        self._decide_on_host(optimizer, state, scale, found)
        retval = None if self._last_skipped else optimizer.step(*args, **kwargs)
        state.stage = OptState.STEPPED
        return retval

    def _decide_on_host(
        self,
        optimizer: torch.optim.Optimizer,
        state: OptimizerState,
        scale: torch.Tensor,
        found: torch.Tensor,
    ) -> None:
        """The one host-device sync of the step: whether it overflowed or stalled; it also
        fetches waiting history records and brings the scale, for the stall check.

        Raises:
            ScaleStallError: ``on_stall="raise"`` and a stall or a step at the floor.
        """
        stalled = self._stall.stalled(id(optimizer), found, state.zero_counts, scale)
        parts = [found, scale] if stalled is None else [found, scale, stalled.float()]
        if self._history is None:
            flag, used, *stall = torch.stack(parts).tolist()
        else:
            flag, used, *stall = self._history.fetch(torch.stack(parts))
        self._synced = True
        self._last_skipped = flag > 0
        self._stall.check_step(used, flag > 0, bool(stall and stall[0] > 0), self._updates)

    def _step_in_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        state: OptimizerState,
        scale: torch.Tensor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """torch's contract with optimizers that unscale and skip inside their step."""
        if "grad_scaler" in inspect.signature(optimizer.step).parameters:
            warnings.warn(
                "GradScaler is going to stop passing itself as a keyword argument to the "
                "passed optimizer. In the near future GradScaler registers `grad_scale: "
                "Tensor` and `found_inf: Tensor` to the passed optimizer and let the "
                "optimizer use them directly.",
                FutureWarning,
                stacklevel=3,
            )
            optimizer_step: Any = optimizer.step
            retval = optimizer_step(*args, **{**kwargs, "grad_scaler": self})
            state.stage = OptState.STEPPED
            # Such an optimizer checks its gradients through _check_inf_per_device.
            flags = list(state.found_inf_per_device.values())
            self._last_skipped = combine_on(scale.device, flags) if flags else False
            return retval
        if state.stage is OptState.READY:
            self._check_inf_per_device(optimizer)
        found_inf = combine_on(scale.device, list(state.found_inf_per_device.values()))
        # Under on_stall="warn"/"raise" (and for amped's fp16-master fused step, which
        # syncs anyway) the host decides, so that a stall is reported before the step.
        if self._stall.mode != "recover" or getattr(optimizer, "_amped_decides_on_host", False):
            self._decide_on_host(optimizer, state, scale, found_inf)
            if self._last_skipped:  # as the optimizer would, without being called
                state.stage = OptState.STEPPED
                return None
            host_decided = True
        else:
            host_decided = False
        # Unscaled already: the optimizer must not unscale again. Otherwise multiply in a
        # grad_scale the user may have set on the optimizer.
        if state.stage is OptState.UNSCALED:
            grad_scale = getattr(optimizer, "grad_scale", None)
        else:
            grad_scale = scale * getattr(optimizer, "grad_scale", 1)
        optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
        optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        retval = optimizer.step(*args, **kwargs)
        state.stage = OptState.STEPPED
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]
        if not host_decided:
            self._last_skipped = found_inf
        return retval

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Move the scale by the strategy, after every optimizer's ``step()`` of the iteration.

        With ``new_scale`` (a float, or a 1-element float tensor on the scaler's device
        type without grad), the scale is set to it instead, bypassing the strategy.
        No sync.

        Raises:
            RuntimeError: before ``scale()``, or no ``unscale_``/``step`` this iteration.
            TypeError, ValueError: a ``new_scale`` of the wrong type or value.
        """
        if not self._enabled:
            return
        scale, tracker = self._require_scale("update")
        found_infs = [
            flag
            for state in self._per_optimizer_states.values()
            for flag in state.found_inf_per_device.values()
        ]
        if new_scale is None and not found_infs:
            raise ScalerOrderError(
                "No inf checks were recorded prior to update(). Call scaler.step(optimizer) "
                "(or scaler.unscale_(optimizer)) for each optimizer before scaler.update()."
            )
        before = scale.clone() if self._history is not None else None
        found = combine_on(scale.device, found_infs)
        zero_counts = {key: state.zero_counts for key, state in self._per_optimizer_states.items()}
        # A scale the caller chose is not overridden.
        stalled = None if new_scale is not None else self._stalled(scale, found, zero_counts)
        self._stall.before_update(scale, found, stalled, zero_counts, self._synced)
        if new_scale is not None:
            value = check_new_scale(new_scale, self._device)
            if isinstance(value, float):
                scale.fill_(value)
            else:
                scale.copy_(value)
        else:
            factors = GrowthFactors(
                self._growth_factor, self._backoff_factor, self._growth_interval
            )
            self._strategy.update(ScaleState(scale, tracker, self._counters), found, factors)
        # The floor, whatever the strategy or new_scale did. Clamping an in-range float32
        # returns it unchanged, so wherever torch's rule is sound the scale is torch's.
        scale.clamp_(min=SCALE_FLOOR)
        self._stall.after_update(scale, found, stalled)
        if before is not None and self._history is not None:
            floats = [before, found, self._skipped_flag(scale.device), scale]
            streak = self._counters.get("overflow_streak")  # Hysteresis's counter
            ints = [tracker] if streak is None else [tracker, streak]
            self._history.add(self._updates, floats, ints, may_sync=not self._synced)
        self._updates += 1
        if not self._synced and not _capturing():
            self._stall.report_every(self._updates)  # what the device decided alone
        self._synced = False
        self._per_optimizer_states = defaultdict(OptimizerState)

    def _stalled(
        self,
        scale: torch.Tensor,
        found: torch.Tensor,
        zero_counts: dict[int, list[tuple[torch.Tensor, int]]],
    ) -> torch.Tensor | None:
        """Whether any optimizer's step stalled this iteration (on the device), or None
        where none counted its zero gradients."""
        flags = [
            flag
            for key, counts in zero_counts.items()
            if (flag := self._stall.stalled(key, found, counts, scale)) is not None
        ]
        if not flags:
            return None
        return torch.stack(flags).any()

    def _skipped_flag(self, device: torch.device) -> torch.Tensor:
        """Nonzero if an optimizer that stepped this iteration found inf/NaN (so skipped)."""
        return combine_on(
            device,
            [
                combine_on(device, list(state.found_inf_per_device.values()))
                for state in self._per_optimizer_states.values()
                if state.stage is OptState.STEPPED and state.found_inf_per_device
            ],
        )

    # --- settings and readings -----------------------------------------------------

    @property
    def strategy(self) -> ScaleStrategy:
        """The loss-scale strategy (see :mod:`amped.scaling.strategies`)."""
        return self._strategy

    @property
    def history(self) -> list[ScaleRecord]:
        """One :class:`~amped.scaling.records.ScaleRecord` per ``update()``, oldest first.

        Syncs once if the latest records are still on the device (each ``step()``
        fetches the waiting ones within its own sync). Needs ``record_history=True``.
        """
        if self._history is None:
            raise RuntimeError(
                "This GradScaler keeps no history; construct it with record_history=True. "
                + received("record_history", False)
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

    def is_enabled(self) -> bool:
        return self._enabled

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = check_factor("growth_factor", new_factor)

    def set_backoff_factor(self, new_factor: float) -> None:
        self._backoff_factor = check_factor("backoff_factor", new_factor)

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = check_growth_interval(new_interval)

    # --- state_dict (layout: amped.scaling.state_dict) and pickling ---------------

    def state_dict(self) -> dict[str, Any]:
        """torch's five entries (``scale``, ``growth_factor``, ``backoff_factor``,
        ``growth_interval``, ``_growth_tracker``), plus ``"amped"`` (strategy, counters,
        update count) only when a strategy other than torch's rule or a history is in
        use. Empty if disabled. Call it after ``update()``. Syncs with the device.
        """
        if not self._enabled:
            return {}
        state: dict[str, Any] = {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._get_growth_tracker(),
        }
        if self._strategy != DynamicScale() or self._history is not None:
            counters = self._counter_values()
            state[AMPED_KEY] = amped_entry(self._strategy, counters, self._updates)
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict from amped's or torch's ``GradScaler.state_dict()``.

        Everything is checked before anything changes. A torch state dict keeps this
        scaler's strategy and starts its counters afresh; an amped one brings its
        strategy (or, for a strategy of the user's own, needs this scaler to have it).
        No-op if disabled.

        Raises:
            RuntimeError: an empty dict (saved from a disabled scaler), as in torch.
            TypeError, ValueError: a missing key or a bad value.
        """
        if not self._enabled:
            return
        loaded = read_state_dict(state_dict, self._strategy)
        self._growth_factor, self._backoff_factor = loaded.growth_factor, loaded.backoff_factor
        self._growth_interval = loaded.growth_interval
        self._set_strategy(loaded.strategy)
        if loaded.counters is not None:
            self._init_counters = loaded.counters
        self._init_scale, self._init_growth_tracker = loaded.scale, loaded.growth_tracker
        if loaded.updates is not None:
            self._updates = loaded.updates
        self._stall.reset(loaded.scale)
        if self._scale is not None:
            self._refill(self._scale)

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
        state.setdefault("_stall", StallGuard("recover", state.get("_init_scale", 2.0**16)))
        self.__dict__.update(state)

    # --- torch's private methods, which frameworks call --------------------------

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        """Create the scale and growth tracker on ``dev`` (Accelerate calls it after
        loading an FSDP2 checkpoint); ``scale()`` otherwise does it on the first loss."""
        if self._growth_tracker is not None:
            raise RuntimeError("_growth_tracker initialized before _scale")
        self._lazy_init(torch.device(dev))

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        """Multiply ``optimizer``'s gradients by ``inv_scale``; flag inf/NaN per device."""
        return unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16=allow_fp16)

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
        """Flag inf/NaN in the optimizer's gradients without unscaling them (for optimizers
        that unscale inside their own step). No sync."""
        scale, _ = self._require_scale("_check_inf_per_device")
        unit = torch.ones((), dtype=torch.float32, device=scale.device)
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        state = self._per_optimizer_states[id(optimizer)]
        state.zero_counts = []
        state.found_inf_per_device = unscale_grads_(
            optimizer,
            unit,
            found_inf,
            allow_fp16=True,
            zero_counts=state.zero_counts if self._stall.watch else None,
        )
        state.found_inf_per_device = agree_across_ranks(
            self._process_group, optimizer, state.found_inf_per_device, scale.device
        )
        return state.found_inf_per_device

    def _found_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
        return self._per_optimizer_states[id(optimizer)].found_inf_per_device

    def _get_scale_async(self) -> torch.Tensor | None:
        return self._scale

    def _get_growth_tracker(self) -> int:
        if not self._enabled:
            return 0
        tracker = self._growth_tracker
        return self._init_growth_tracker if tracker is None else int(tracker.item())

    # --- internals -------------------------------------------------------------------

    def _set_strategy(self, strategy: ScaleStrategy) -> None:
        self._strategy = strategy
        self._init_counters = strategy.counters()

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

    def _require_scale(self, method: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._scale is None or self._growth_tracker is None:
            raise ScalerOrderError(
                f"{method}() was called before scale(): the scale does not exist yet. Call "
                "scaler.scale(loss).backward() earlier in the iteration."
            )
        return self._scale, self._growth_tracker

    def _counter_values(self) -> dict[str, int]:
        if self._scale is None:
            return dict(self._init_counters)
        return {name: int(tensor.item()) for name, tensor in self._counters.items()}


def _capturing() -> bool:
    """Whether a CUDA graph is being captured (no sync may happen then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _cuda_definitely_unavailable() -> bool:
    # torch's test: no CUDA and no torch_xla (whose GradScaler path reuses "cuda").
    return not (torch.cuda.is_available() or find_spec("torch_xla"))
