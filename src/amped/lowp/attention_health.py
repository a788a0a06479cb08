"""Attention's health per role, reported as a low-precision Linear's GEMMs are
(:mod:`amped.lowp.health`): to the observer attached to the attention's module
(``module.fp8_observer``, which :func:`amped.monitor` sets), under role names
``"attn.s"``, ``"attn.o"``, ``"attn.dv"``, ``"attn.dp"``, ``"attn.dq"``, ``"attn.dk"``.

Per call and role, the observer gets:

- a probe per tile of the role's output (:func:`~amped.lowp.health.range_probe`: on
  the CPU, none for a finite one), so that the first inf or NaN of a step is named by
  module and role (tensor ``"output"``): a NaN in Q shows first in ``attn.s``;
- on a sampled step, the :data:`~amped.lowp.health.STATS` of its casts, from each
  operand before and after its cast (a cast reused across tiles is counted once; a
  recomputed one, in the backward's passes, again: fractions are unchanged):
  ``nonfinite`` (operands and outputs), ``nonzero`` and ``underflow`` (non-zero
  elements the cast made 0), ``elements``, ``saturated`` and ``amax``.
  ``scale_clamps`` is 0: the scales here are powers of two from each region's own
  amax, never clamped.

**Saturated, from the cast alone.** The clamp sets an element to the format's largest
value over its (power-of-two) scale, ``1.75 * 2**k`` for every format here (e4m3: 448,
e5m2: 57344), so a saturated cast ``c`` has the mantissa 1.75, and it lost more than
a rounding: a rounding loses at most half a step, ``|c|/14`` at most (e4m3's largest
subnormal, ``7 * 2**-9``; normals ``|c|/28`` and less, e5m2's ``|c|/14``). So an element
is counted where ``c``'s mantissa is 1.75 and ``|x| > 1.125 * |c|``: never a rounding,
and every clamp that lost more than 12.5%; an element clamped by less (e4m3: 448 to
504) is not counted.

A role that is not cast (None) reports its output probes only.
"""

from __future__ import annotations

from typing import Any

import torch

from amped.lowp.health import STATS, Probe, range_probe

__all__ = ["PREFIX", "RoleHealth"]

PREFIX = "attn."


class RoleHealth:
    """What one attention call reports: its roles' probes and sampled counters."""

    def __init__(self, layer: torch.nn.Module | None) -> None:
        self.layer = layer
        self.observer: Any = None if layer is None else getattr(layer, "fp8_observer", None)
        self.probes: dict[str, list[tuple[str, Probe]]] = {}
        self.stats: dict[str, torch.Tensor] = {}

    @property
    def on(self) -> bool:
        return self.observer is not None

    def output(self, role: str, out: torch.Tensor) -> None:
        """A tile of ``role``'s output: its probe, and its non-finite count if sampled."""
        if self.observer is None:
            return
        out = out.detach()
        probe = range_probe(out)
        self.probes.setdefault(role, [])
        if probe is not None:
            self.probes[role].append(("output", probe))
        if self.observer.sampling:
            self._add(role, "nonfinite", _count_nonzero(out.abs() * 0))

    def cast(self, role: str, high: torch.Tensor, cast: torch.Tensor) -> None:
        """One operand of ``role`` before (``high``) and after its cast."""
        if self.observer is None or not self.observer.sampling:
            return
        x, c = high.detach().abs(), cast.detach().abs()
        nonzero = _count_nonzero(x)
        self._add(role, "nonfinite", _count_nonzero(x * 0))
        self._add(role, "nonzero", nonzero)
        self._add(role, "underflow", (nonzero - _count_nonzero(c)).clamp(min=0))
        self._add(role, "elements", torch.tensor(float(c.numel()), device=c.device))
        largest = torch.frexp(c).mantissa == 0.875  # 1.75 * 2**k
        self._add(role, "saturated", torch.count_nonzero(largest & (x > 1.125 * c)))
        row = self.stats[role]
        row[-1] = torch.maximum(row[-1], x.amax().float())

    def _add(self, role: str, stat: str, value: torch.Tensor) -> None:
        row = self.stats.get(role)
        if row is None:
            row = self.stats[role] = torch.zeros(len(STATS), device=value.device)
        row[STATS.index(stat)] += value.float()

    def report(self, roles: tuple[str, ...]) -> None:
        """Hand each of ``roles`` (those the call ran, in order) to the observer."""
        if self.observer is None:
            return
        assert self.layer is not None
        for role in roles:
            if role in self.probes or role in self.stats:
                stats = self.stats.get(role) if self.observer.sampling else None
                self.observer.observe(self.layer, PREFIX + role, self.probes.get(role, []), stats)


def _count_nonzero(x: torch.Tensor) -> torch.Tensor:
    return torch.count_nonzero(x)
