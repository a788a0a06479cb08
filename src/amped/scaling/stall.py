"""No silent stall: the scaler notices steps that cannot train, says so once, and recovers.

torch's rule halves the scale on every overflow. After a long burst (200 overflowing
steps from 65536) the scale sits at the floor, 2**-126, where every float16 gradient
flushes to zero: each later step is "clean", is taken, and moves nothing, and growing
back to 1 takes 126 * ``growth_interval`` (252,000) steps. Nothing says so.

A step *stalls* when no gradient holds an inf or NaN, the loss that ``scale()`` saw is
finite and non-zero, and gradients underflowed to zero: every gradient of the optimizer
is zero, or, with the scale below the last clean one, more gradients are zero in every
element than at the last clean step (a *partial* stall: float32 gradients, such as a head
kept in float32 under fp16 autocast, survive a scale at which every float16 one flushes
to zero). Gradients that were already zero at the last clean step (a parameter the loss
does not reach) do not count. Per iteration, on the device (no sync of its own)::

    zeros   = how many gradients are zero in every element
    stalled = no inf/NaN  and  loss finite and != 0  and
              (zeros == all gradients  or
               (scale < last_clean_scale  and  zeros > zeros at the last clean step))
    clean   = no inf/NaN  and  not stalled
    last_clean_scale = scale of this iteration, if clean  (init_scale before any)
    on_stall="recover" (default):
        if stalled and scale < last_clean_scale:  scale = last_clean_scale
        if the next iteration overflows:  last_clean_scale = the strategy's new scale

So the first stalled step after a burst returns the scale to the last one that gave a
clean step, and the next step trains; if that scale overflows at once, the strategy backs
off as usual and the last clean scale follows it down, so a recovery is never retried at
a scale that overflowed. Where no step stalls, the scale is the strategy's, bitwise
(torch's with the defaults).

The zero count reads every gradient once more, so it runs only where a stall can begin:
in the first iteration and after one that overflowed or stalled (the host knows from
``step()``'s sync, which brings the scale along with the inf/NaN flag). The host learns
of a stall, and of a step taken at the floor, within that sync; the first one warns
(once per scaler) or, with ``on_stall="raise"``, raises :class:`ScaleStallError` before
``optimizer.step()`` (as DeepSpeed stops at its minimum scale). ``on_stall="warn"``
warns once and keeps the strategy's scale.

Optimizers that unscale inside their own step (``_step_supports_amp_scaling``: torch's
fused and capturable ones) skip on the device, with no sync. Under ``"warn"`` and
``"raise"`` the scaler syncs once in ``step()`` for them too, so that it can warn or
raise before the step (and skips the call on an overflow, as for any other optimizer);
under ``"recover"`` it recovers on the device and checks their gradients every
iteration, and counts, on the device, the iterations that stalled or were taken at the
floor; every :data:`REPORT_EVERY` iterations ``update()`` reads that count (one sync,
skipped while a CUDA graph is being captured) and warns once, so the warning comes up
to that many iterations late. amped's fp16-master fused step decides on the host in
every mode (it syncs anyway).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from amped._internal.errors import value_error
from amped.scaling.checks import SCALE_FLOOR

__all__ = ["REPORT_EVERY", "STALL_MODES", "ScaleStallError", "StallGuard", "check_on_stall"]

STALL_MODES = ("recover", "warn", "raise")
REPORT_EVERY = 64
"""Iterations between two reads of the stalls the device handled alone (torch's fused
optimizers under ``on_stall="recover"``): one sync per this many, none in between."""


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


# A zero count never exceeds: stands for "no clean step counted yet".
_UNKNOWN = 2**62


class StallGuard:
    """The scaler's stall state: the last clean scale and zero counts (on the device),
    this iteration's loss check, and whether it has warned."""

    def __init__(self, mode: str, init_scale: float) -> None:
        self.mode = check_on_stall(mode)
        self.warned = False
        # Whether this iteration counts zero gradients: the count reads every gradient
        # once more, so it runs only where a stall can begin: the first iteration, and
        # after one that overflowed or stalled (as the host learned in step()'s sync).
        # Optimizers that never sync there are counted every iteration.
        self.watch = True
        self._loss_ok: torch.Tensor | None = None
        # The scale of the latest clean step (init_scale before any), made on the
        # scale's device at first use; per optimizer (by id), how many of its gradients
        # were zero at the latest clean step that counted them.
        self._init_clean = init_scale
        self._clean: torch.Tensor | None = None
        self._zeros: dict[int, torch.Tensor] = {}
        self._recovered: torch.Tensor | None = None  # the latest update recovered
        # Iterations that stalled or were taken at the floor, decided on the device
        # alone (no step() sync), not yet reported to the host.
        self._unreported: torch.Tensor | None = None

    def note_loss(self, output: torch.Tensor) -> None:
        """Record whether a tensor ``scale()`` multiplies is finite and non-zero. No sync."""
        if not self.watch:
            return
        with torch.no_grad():
            ok = torch.isfinite(output).all() & (output != 0).any()
        self._loss_ok = ok if self._loss_ok is None else self._loss_ok | ok.to(self._loss_ok)

    def last_clean(self, scale: torch.Tensor) -> torch.Tensor:
        """The last clean scale, a float32 0-d tensor on ``scale``'s device."""
        if self._clean is None:
            self._clean = torch.full_like(scale, self._init_clean)
        return self._clean

    def stalled(
        self,
        key: int,
        found_inf: torch.Tensor,
        zero_counts: list[tuple[torch.Tensor, int]],
        scale: torch.Tensor,
    ) -> torch.Tensor | None:
        """bool, 0-d, on ``found_inf``'s device: whether the step of optimizer ``key``
        (its id) stalls (see the module); None where this iteration did not count."""
        if self._loss_ok is None or not zero_counts:
            return None
        device = found_inf.device
        zeros = self._count(zero_counts, device)
        stall = zeros == sum(total for _, total in zero_counts)
        before = self._zeros.get(key)
        if before is not None:
            below = scale.to(device) < self.last_clean(scale).to(device)
            stall = stall | (below & (zeros > before.to(device)))
        return (found_inf == 0) & stall & self._loss_ok.to(device, non_blocking=True)

    def check_step(self, scale: float, found_inf: bool, stalled: bool, update: int) -> None:
        """After ``step()``'s sync, before ``optimizer.step()``: raise or warn (once).

        Raises:
            ScaleStallError: with ``on_stall="raise"``, at the floor or on a stall.
        """
        self.watch = found_inf or stalled
        at_floor = scale <= SCALE_FLOOR
        if not (stalled or at_floor):
            return
        if stalled:
            what = (
                "had gradients underflow to zero (all gradients zero, or some that were "
                "non-zero at the last clean step) while the loss was finite and non-zero"
            )
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
            "When gradients underflow to zero, the scale returns to the last one that "
            "gave a clean step (on_stall='recover')."
            if self.mode == "recover"
            else "The scale stays (on_stall='warn'); on_stall='recover' would restore the "
            "last clean scale when gradients underflow to zero."
        )
        warnings.warn(
            message + fix + " If overflows persist, find their source with "
            "amped.doctor.diagnose. Warned once per scaler.",
            RuntimeWarning,
            stacklevel=4,
        )

    def before_update(
        self,
        scale: torch.Tensor,
        found_inf: torch.Tensor,
        stalled: torch.Tensor | None,
        zero_counts: dict[int, list[tuple[torch.Tensor, int]]],
        host_decided: bool,
    ) -> None:
        """In ``update()``, before the strategy moves the scale: on a clean iteration,
        remember its scale and the zero counts it made. In place, on the device."""
        clean = found_inf == 0 if stalled is None else (found_inf == 0) & ~stalled
        if not host_decided and not self.warned:
            event = (found_inf == 0) & (scale <= SCALE_FLOOR)
            event = (event if stalled is None else event | stalled).int()
            self._unreported = event if self._unreported is None else self._unreported + event
        last = self.last_clean(scale)
        torch.where(clean, scale, last, out=last)
        for key, counts in zero_counts.items():
            if not counts:
                continue
            zeros = self._count(counts, scale.device)
            before = self._zeros.get(key)
            if before is None:
                before = torch.full_like(zeros, _UNKNOWN)
            self._zeros[key] = torch.where(clean, zeros, before)

    def after_update(
        self, scale: torch.Tensor, found_inf: torch.Tensor, stalled: torch.Tensor | None
    ) -> None:
        """In ``update()``, after the strategy: a recovered scale that overflowed at once
        is no longer the last clean one; on a stall below the last clean scale, return
        to it (``on_stall="recover"``). In place, on the device, no sync."""
        last = self.last_clean(scale)
        if self._recovered is not None:
            torch.where(self._recovered & (found_inf > 0), scale, last, out=last)
        self._recovered = None
        if stalled is not None and self.mode == "recover":
            self._recovered = stalled & (scale < last)
            torch.where(self._recovered, last, scale, out=scale)
        self._loss_ok = None

    def report_every(self, updates: int) -> None:
        """After ``updates`` updates: every :data:`REPORT_EVERY` of them, warn once if
        iterations the device decided alone stalled or were taken at the floor (see the
        module). Reads one count then (a sync), and nothing otherwise."""
        if updates % REPORT_EVERY != 0:
            return
        unreported, self._unreported = self._unreported, None
        if unreported is None or self.warned:
            return
        update = updates - 1
        count = int(unreported.item())
        if count == 0:
            return
        self.warned = True
        warnings.warn(
            f"amped.GradScaler: {count} iteration(s) up to iteration {update} had gradients "
            "underflow to zero while the loss was finite and non-zero, or were taken at the "
            "scale floor 2**-126. A long run of overflows drove the scale down, and float16 "
            "gradients flush to zero there. When gradients underflow to zero, the scale "
            "returns to the last one that gave a clean step (on_stall='recover'); this "
            "optimizer skips on the device, so the scaler reads this every "
            f"{REPORT_EVERY} iterations. If overflows persist, find their source with "
            "amped.doctor.diagnose. Warned once per scaler.",
            RuntimeWarning,
            stacklevel=3,
        )

    def reset(self, init_scale: float) -> None:
        """After ``load_state_dict``: the loaded scale is the last clean one known."""
        self._init_clean = init_scale
        self._clean = None
        self._zeros = {}
        self._recovered = None
        self.watch = True

    @staticmethod
    def _count(counts: list[tuple[torch.Tensor, int]], device: torch.device) -> torch.Tensor:
        return torch.stack([zeros.to(device, non_blocking=True) for zeros, _ in counts]).sum()

    def __getstate__(self) -> dict[str, Any]:
        # Device tensors are rebuilt on the other side, from their values now (syncs);
        # the zero counts start afresh (the first iteration counts again).
        init_clean = self._init_clean if self._clean is None else float(self._clean.item())
        return self.__dict__ | {
            "_loss_ok": None,
            "watch": True,
            "_init_clean": init_clean,
            "_clean": None,
            "_zeros": {},
            "_recovered": None,
            "_unreported": None,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Pickled before the guard kept its state on the device: a float last_clean.
        if "last_clean" in state:
            state["_init_clean"] = state.pop("last_clean")
        defaults: dict[str, Any] = {
            "_clean": None,
            "_zeros": {},
            "_recovered": None,
            "_loss_ok": None,
            "_unreported": None,
        }
        self.__dict__.update(defaults | state)
