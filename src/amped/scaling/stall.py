"""No silent stall: the scaler notices steps that cannot train, says so once, and recovers.

torch's rule halves the scale on every overflow. After a long burst (200 overflowing
steps from 65536) the scale sits at the floor, 2**-126, where every float16 gradient
flushes to zero: each later step is "clean", is taken, and moves nothing, and growing
back to 1 takes 126 * ``growth_interval`` (252,000) steps. Nothing says so.

A step *stalls* when no gradient holds an inf or NaN, every gradient of the optimizer is
zero, and the loss that ``scale()`` saw is finite and non-zero. Per iteration, on the
device (no sync of its own)::

    stalled = no inf/NaN  and  all gradients == 0  and  loss finite and != 0
    clean   = no inf/NaN  and  not stalled
    on_stall="recover" (default):
        if stalled and scale < last_clean_scale:  scale = last_clean_scale
    last_clean_scale = scale of this iteration, if clean  (init_scale before any)

The all-zero check reads every gradient once more, so it runs only where a stall can
begin: in the first iteration and after one that overflowed or stalled (the host
knows from ``step()``'s sync, which brings the scale along with the inf/NaN flag).

So the first stalled step after a burst returns the scale to the last one that gave a
clean step, and the next step trains; if that scale overflows again, the strategy backs
off as usual. Where no step stalls, the scale is the strategy's, bitwise (torch's with
the defaults). The host learns of a stall, and of a step taken at the floor, within
``step()``'s one sync; the first one warns (once per scaler) or, with
``on_stall="raise"``, raises :class:`ScaleStallError` before ``optimizer.step()`` (as
DeepSpeed stops at its minimum scale). ``on_stall="warn"`` warns once and keeps the
strategy's scale. Optimizers that unscale inside their own step (torch's fused ones)
never sync there: they recover on the device but are not warned about.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from amped._internal.errors import value_error
from amped.scaling.checks import SCALE_FLOOR

__all__ = ["STALL_MODES", "ScaleStallError", "StallGuard", "check_on_stall"]

STALL_MODES = ("recover", "warn", "raise")


class ScaleStallError(RuntimeError):
    """A step would be taken at the scale floor, or with all gradients zero while the
    loss is finite and non-zero (``GradScaler(on_stall="raise")``)."""


def check_on_stall(value: object) -> str:
    if isinstance(value, str) and value in STALL_MODES:
        return value
    raise value_error(
        "on_stall must be 'recover' (restore the last clean scale, warn once), 'warn' "
        "(warn once, keep the strategy's scale) or 'raise' (stop with ScaleStallError)",
        "on_stall",
        value,
    )


class StallGuard:
    """The scaler's stall state: the last clean scale (on the device), this iteration's
    loss check, and whether it has warned."""

    def __init__(self, mode: str, init_scale: float) -> None:
        self.mode = check_on_stall(mode)
        self.warned = False
        # The scale of the latest clean step, as the host learned it in step()'s sync
        # (init_scale before any; optimizers that never sync there keep that).
        self.last_clean = init_scale
        # Whether this iteration checks for all-zero gradients: the check reads every
        # gradient once more, so it runs only where a stall can begin: the first
        # iteration, and after one that overflowed or stalled (as the host learned in
        # step()'s sync). Optimizers that never sync there are checked every iteration.
        self.watch = True
        self._loss_ok: torch.Tensor | None = None

    def note_loss(self, output: torch.Tensor) -> None:
        """Record whether a tensor ``scale()`` multiplies is finite and non-zero. No sync."""
        if not self.watch:
            return
        with torch.no_grad():
            ok = torch.isfinite(output).all() & (output != 0).any()
        self._loss_ok = ok if self._loss_ok is None else self._loss_ok | ok.to(self._loss_ok)

    def stalled(self, found_inf: torch.Tensor, all_zero: list[torch.Tensor]) -> torch.Tensor | None:
        """bool, 0-d, on ``found_inf``'s device: whether the step stalls (see the module);
        None where this iteration did not check."""
        if self._loss_ok is None or not all_zero:
            return None
        device = found_inf.device
        zero = torch.stack([flag.to(device, non_blocking=True) for flag in all_zero]).all()
        return (found_inf == 0) & zero & self._loss_ok.to(device, non_blocking=True)

    def check_step(self, scale: float, found_inf: bool, stalled: bool, update: int) -> None:
        """After ``step()``'s sync, before ``optimizer.step()``: remember a clean scale,
        then raise or warn (once).

        Raises:
            ScaleStallError: with ``on_stall="raise"``, at the floor or on a stall.
        """
        self.watch = found_inf or stalled
        if not self.watch:
            self.last_clean = scale
        at_floor = scale <= SCALE_FLOOR
        if not (stalled or at_floor):
            return
        if stalled:
            what = "had all gradients zero while the loss was finite and non-zero"
        else:
            what = f"{'overflowed' if found_inf else 'was taken'} at the scale floor"
        message = (
            f"amped.GradScaler: iteration {update} {what}; loss scale {scale!r} "
            "(floor 2**-126). A long run of overflows drove the scale down, and float16 "
            "gradients flush to zero there. "
        )
        if self.mode == "raise":
            raise ScaleStallError(
                message + "Stopping (on_stall='raise'). Find the overflow's source with "
                "amped.doctor.diagnose, or lower the learning rate; on_stall='recover' "
                "restores the last clean scale instead."
            )
        if self.warned or not (stalled or not found_inf):
            return  # an overflow at the floor is skipped: nothing stalls yet
        self.warned = True
        fix = (
            "When the gradients underflow to zero, the scale returns to the last one that "
            "gave a clean step (on_stall='recover')."
            if self.mode == "recover"
            else "The scale stays (on_stall='warn'); on_stall='recover' would restore the "
            "last clean scale when the gradients underflow to zero."
        )
        warnings.warn(
            message + fix + " If overflows persist, find their source with "
            "amped.doctor.diagnose. Warned once per scaler.",
            RuntimeWarning,
            stacklevel=4,
        )

    def update(self, scale: torch.Tensor, stalled: torch.Tensor | None) -> None:
        """In ``update()``, after the strategy: on a stall below the last clean scale,
        return to it (``on_stall="recover"``). In place, on the device, no sync."""
        if stalled is not None and self.mode == "recover":
            target = torch.full_like(scale, self.last_clean)
            torch.where(stalled & (scale < target), target, scale, out=scale)
        self._loss_ok = None

    def reset(self, init_scale: float) -> None:
        """After ``load_state_dict``: the loaded scale is the last clean one known."""
        self.last_clean = init_scale
        self.watch = True

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_loss_ok": None, "watch": True}
