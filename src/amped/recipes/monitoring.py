"""``amped.monitor``: per-GEMM health of a setup's FP8 layers, the first non-finite named.

Attach one to a :class:`~amped.recipes.TrainSetup`; :meth:`TrainSetup.step` then
consults it::

    setup = amped.prepare(model, optimizer, "fp8-tensorwise")
    monitor = amped.monitor(setup, every=50)          # on_nonfinite="skip"
    ...training loop as usual...
    monitor.read()       # {layer: {role: {"nonfinite": ..., "underflow": ...}}}, one sync
    monitor.first_nonfinite   # NonFinite(step=..., module=..., role=..., tensor=...) or None

Under ``prepare(..., attention=...)`` the converted attention modules report the same
way, per attention role (``attn.s``, ``attn.o``, ``attn.dv``, ``attn.dp``, ``attn.dq``,
``attn.dk``: :mod:`amped.lowp.attention_health`).

Every step, each FP8 layer leaves, per GEMM role (forward, grad_input, grad_weight),
a probe per operand and output (:mod:`amped.lowp.health`: an operand's is data its
cast computed anyway, an output's is made by :func:`~amped.lowp.health.range_probe`,
which on the CPU already knows a finite output and leaves none), and the monitor adds
one per gradient the optimizer would step on that no GEMM probed. Before the
optimizer steps it tests them all in a few batched ops and brings one flag to the host
(**one** sync); only if it is set (a bad step, rare) does it test the probes one by
one, in the order the step ran them, to name the first (module, role, step, tensor),
then:

- ``on_nonfinite="skip"`` (default): the optimizer step is skipped (no parameter or
  optimizer state changes; delayed scaling's amaxes of the step are dropped); the
  first occurrence warns once. Under a loss-scaling recipe the scaler skips the step
  and the monitor only names it.
- ``"warn"``: a warning per bad step; the step is taken.
- ``"raise"``: :class:`NonFiniteError` at that step, before the optimizer steps.

Every ``every`` steps (the first step included) the layers also count, on the device,
the :data:`~amped.lowp.health.STATS` of each GEMM; :meth:`Monitor.read` fetches them
in one sync. The *audit* runs on those sampled steps: every layer the plan converted
must still be the model's module of that name and must have run its FP8 forward; a
layer replaced after ``prepare`` or a compile that dropped the conversion is reported
in :attr:`Monitor.audit`, and with ``strict=True`` raises :class:`NonFiniteError`'s
sibling, ``RuntimeError``.

With ``record=DIR`` the monitor is also a flight recorder
(:mod:`amped.recipes.recorder`): it keeps references to each GEMM's tensors until the
step ends, reads the loss in the step's one sync, and writes a replay bundle at the
first non-finite value, at the first total underflow (an NVFP4 cast that made a
non-zero operand all zero, :mod:`amped.lowp.health`; warned once), at a loss spike and
at :meth:`Monitor.capture`;
:func:`amped.doctor.replay` reruns it.

Not under optimizer-in-backward (:func:`amped.optim.step_in_backward`): each
parameter there steps inside backward and its gradient is gone before
``setup.step()`` could check it, so a monitor refuses an optimizer that steps in
backward, and ``step_in_backward`` refuses a monitored one (``ValueError``, either order).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path
from typing import Any

import torch

from amped._internal.errors import value_error
from amped._internal.source import describe, user_frame
from amped.lowp.attention_config import ROLES as ATTENTION_ROLES
from amped.lowp.attention_health import PREFIX
from amped.lowp.health import (
    ROLES,
    STATS,
    Probe,
    any_nonfinite,
    floored,
    probe_nonfinite,
    range_probe,
)
from amped.optim.in_backward import set_monitored
from amped.recipes.attention import attention_modules
from amped.recipes.recorder import SPIKE_K, Recorder
from amped.recipes.setup import TrainSetup

__all__ = ["Monitor", "NonFinite", "NonFiniteError", "monitor"]

_MODES = ("skip", "warn", "raise")
_ORDER = (*ROLES, *(PREFIX + role for role in ATTENTION_ROLES))  # as a step runs them
_FORWARD = ("forward", PREFIX + "s", PREFIX + "o")


class NonFiniteError(RuntimeError):
    """A step produced an inf or NaN (``on_nonfinite="raise"``); nothing was stepped."""


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """Where a non-finite value first appeared in a step.

    Attributes:
        step: the setup's step index (0 for the first ``setup.step()``).
        module: the layer's qualified name in the model, or ``None`` when no FP8 GEMM
            flagged and only the gradients held it (the value arose elsewhere).
        role: ``"forward"``, ``"grad_input"`` or ``"grad_weight"``; for an attention
            module its role, ``"attn.s"``, ``"attn.o"``, ``"attn.dv"``, ...
            (:mod:`amped.lowp.attention_health`); None likewise.
        tensor: which tensor of that GEMM: ``"input"``, ``"weight"``, ``"output"``,
            ``"grad_output"``, ``"grad_input"``, ``"grad_weight"``; ``"gradients"`` for
            the optimizer's gradients.
        source: the user's source line that called the module in that step's forward,
            as ``amped.doctor`` points at it (``path:line (code)``); None when unknown.
            Not part of equality: the four fields above say what happened.
    """

    step: int
    module: str | None
    role: str | None
    tensor: str
    source: str | None = dataclasses.field(default=None, compare=False)

    def __str__(self) -> str:
        if self.module is None:
            return f"step {self.step}: the gradients (no FP8 GEMM flagged one)"
        where = f" (called from {self.source})" if self.source else ""
        return (
            f"step {self.step}: module {self.module!r}, {self.role} GEMM, its {self.tensor}{where}"
        )


class Monitor:
    """The health monitor of one setup (see :mod:`amped.recipes.monitoring`); make one with
    :func:`amped.monitor`."""

    def __init__(
        self,
        setup: TrainSetup,
        every: int = 50,
        on_nonfinite: str = "skip",
        strict: bool = False,
        record: str | Path | None = None,
        spike_k: float = SPIKE_K,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise value_error("every is an int >= 1 (sample every that many steps)", "every", every)
        if on_nonfinite not in _MODES:
            raise value_error(
                "on_nonfinite is 'skip', 'warn' or 'raise'", "on_nonfinite", on_nonfinite
            )
        # Before anything changes: refused where the optimizer steps in backward.
        set_monitored(setup.optimizer, True)
        self.setup, self.every, self.on_nonfinite, self.strict = setup, every, on_nonfinite, strict
        self.step = 0
        self.sampling = True
        self.first_nonfinite: NonFinite | None = None
        self.nonfinite_steps: list[NonFinite] = []
        self.audit: list[str] = []
        self.sampled_steps = 0
        self._layers: dict[str, torch.nn.Module] = (
            {} if setup.low_precision_layers is None else dict(setup.low_precision_layers.layers)
        )
        # the attention modules of prepare(..., attention=...): their roles report too
        self._attention = {} if setup.attention is None else attention_modules(setup.model)
        observed = {**self._layers, **self._attention}
        self._names = {id(layer): name for name, layer in observed.items()}
        # Per tensor reported this step, in the order the step ran them: (module, role,
        # tensor, its probe).
        self._events: list[tuple[str, str, str, Probe]] = []
        self._stats: dict[tuple[str, str], torch.Tensor] = {}
        self._ran: set[str] = set()
        # Per layer, where the user's code called it in this step's forward (file, line,
        # function): found by walking frames, the text read only for a report.
        self._callers: dict[str, tuple[str, int, str] | None] = {}
        self._warned = False
        for layer in observed.values():
            layer.fp8_observer = self  # type: ignore[assignment]
        self._unprobed = self._unprobed_parameters()
        self.recorder: Recorder | None = None
        if record is not None:
            self.recorder = Recorder(record, self._layers, setup.recipe.name, spike_k)
        self._loss: torch.Tensor | None = None
        self._underflow_recorded = False
        setup.monitor = self

    # --- what the layers report (amped.lowp.health.record_gemm) ---------------------------

    def observe(
        self,
        layer: torch.nn.Module,
        role: str,
        probes: list[tuple[str, Probe]],
        stats: torch.Tensor | None,
    ) -> None:
        """A layer's GEMM of this step: its probes and, on a sampled step, its counters."""
        name = self._names.get(id(layer), type(layer).__name__)
        if role in _FORWARD:  # backward runs in autograd's engine: no user frame there
            self._callers[name] = user_frame()
        for tensor, probe in probes:
            self._events.append((name, role, tensor, probe))
        if stats is None:
            return
        self._ran.add(name)
        key = (name, role)
        total = self._stats.get(key)
        if total is None:
            self._stats[key] = stats.clone()
        else:
            total[:-1] += stats[:-1]
            total[-1] = torch.maximum(total[-1], stats[-1])

    def observe_loss(self, loss: torch.Tensor) -> None:
        """The step's loss (``setup.backward`` passes it): read with the step's one sync
        when recording, for the loss-spike rule (:mod:`amped.recipes.recorder`)."""
        if self.recorder is not None:
            self._loss = loss.detach()

    def capture(self, layers: list[str] | None = None) -> Path:
        """Write a replay bundle of the step in progress (call it between
        ``setup.backward`` and ``setup.step()``) for ``layers`` (default: every converted
        layer that ran); returns its folder. No sync beyond the copy to the host.

        Raises:
            RuntimeError: the monitor does not record (``record=None``), or no
                low-precision GEMM has run since the last ``setup.step()``.
            ValueError: a name in ``layers`` that is not a converted layer.
        """
        if self.recorder is None:
            raise RuntimeError(
                "monitor.capture() writes a replay bundle, which needs a recording monitor: "
                "amped.monitor(setup, record=DIR)"
            )
        ran = list(self.recorder.inputs)
        if not ran:
            raise RuntimeError(
                "monitor.capture() records the step in progress: call it after "
                "setup.backward(loss) and before setup.step() (no low-precision GEMM has "
                "run since the last step)"
            )
        unknown = [name for name in layers or () if name not in self._layers]
        if unknown:
            raise value_error(
                f"layers are names of converted layers: {sorted(self._layers)}", "layers", unknown
            )
        return self.recorder.write("capture", self.step, list(layers or ran), {})

    def _check_with_loss(self, probes: list[Probe]) -> bool:
        """Recording: the flag, the loss and whether an NVFP4 tensor scale is at its floor,
        in one sync; a loss spike or a total underflow writes a bundle."""
        assert self.recorder is not None
        loss, self._loss = self._loss, None
        parts: dict[str, torch.Tensor] = {}
        if loss is not None and loss.numel() == 1:
            parts["loss"] = loss.reshape(()).float()
        if probes:
            parts["nonfinite"] = any_nonfinite(probes).float()
        floors = [probe for probe in probes if probe.floor]
        flags = floored(floors)  # per NVFP4 probe: its tensor scale at the floor
        if not parts and flags is None:
            return False
        pieces = [part.reshape(1) for part in parts.values()]
        if flags is not None:
            pieces.append(flags.float())
        device = pieces[0].device
        read = torch.cat([piece.to(device) for piece in pieces]).tolist()  # the one sync
        values = dict(zip(parts, read[: len(parts)], strict=True))
        flags_read = read[len(parts) :]
        at_floor = {id(probe) for probe, flag in zip(floors, flags_read, strict=True) if flag}
        if "loss" in values and math.isfinite(values["loss"]):
            spike = self.recorder.is_spike(values["loss"])
            if spike is not None:
                extra = {"loss": values["loss"], "spike": spike}
                self._write("loss_spike", list(self.recorder.inputs), extra)
        if at_floor and not self._underflow_recorded:
            self._record_underflow(at_floor)
        return values.get("nonfinite", 0.0) > 0

    def _record_underflow(self, at_floor: set[int]) -> None:
        """NVFP4 tensor scales at their floor (the ids of their probes; an all-zero or
        tiny operand, rare): find the step's first total underflow among those operands,
        in the order the step ran its GEMMs, and write the bundle of its layer (once per
        monitor), with a warning."""
        assert self.recorder is not None
        for module, role, tensor, probe in self._events:
            if id(probe) not in at_floor:
                continue
            element = self.recorder.locate_underflow(module, role, tensor, probe)
            if element is None:
                continue
            self._underflow_recorded = True
            first = {"module": module, "role": role, "tensor": tensor, "element": element}
            self._write("underflow", [module], {"total_underflow": first})
            warnings.warn(
                f"amped.monitor: a total underflow at step {self.step}: module {module!r}, "
                f"{role} GEMM, its {tensor}: every element of its cast is zero (the first "
                f"value lost: {element['value']}, index {element['index']}). "
                "amped.doctor.replay on the bundle finds the part of the recipe to change.",
                RuntimeWarning,
                stacklevel=4,
            )
            return

    def _record_nonfinite(self, found: NonFinite, probe: Probe) -> None:
        """Write the bundle of the first non-finite, named by a GEMM's ``probe``: that
        layer only."""
        assert self.recorder is not None and found.module is not None and found.role
        where = self.recorder.locate(found.module, found.role, found.tensor, probe)
        first = {"module": found.module, "role": found.role, "tensor": found.tensor}
        modules = [found.module]
        extra = {"first_nonfinite": {**first, "element": where}}
        self._write("nonfinite", modules, extra)

    def _write(self, reason: str, modules: list[str], extra: dict[str, Any]) -> None:
        """Write a bundle the monitor decided on: a failed write warns, training goes on."""
        assert self.recorder is not None
        try:
            self.recorder.write(reason, self.step, modules, extra)
        except OSError as error:
            warnings.warn(
                f"amped.monitor: could not write the {reason} bundle of step {self.step} "
                f"into {str(self.recorder.folder)!r}: {error}",
                RuntimeWarning,
                stacklevel=4,
            )

    # --- what TrainSetup.step calls -----------------------------------------------------

    def check_step(self) -> bool:
        """Before the optimizer steps: one sync; name the first non-finite, if any, and act.

        Returns False if the step must be skipped. Raises :class:`NonFiniteError` with
        ``on_nonfinite="raise"``.
        """
        setup = self.setup
        scaled = setup.scaler.is_enabled()  # the scaler checks (and skips) the gradients
        probes = [event[3] for event in self._events]
        if not scaled:
            # One pass per gradient (CPU: 10x faster than _foreach_norm), see range_probe.
            grads = (p.grad for p in self._unprobed if p.grad is not None and p.grad.numel())
            probes += [probe for probe in map(range_probe, grads) if probe is not None]
        if self.recorder is not None:
            if not self._check_with_loss(probes):  # the one sync
                return True
        elif not probes or not bool(any_nonfinite(probes)):  # the one sync
            return True
        # A bad step: the probes one by one (a sync each), in the order the step ran them.
        flagged = next((event for event in self._events if probe_nonfinite(event[3])), None)
        if flagged is not None:
            module, role, tensor, probe = flagged
            caller = self._callers.get(module)
            source = None if caller is None else describe(*caller)
            found = NonFinite(self.step, module, role, tensor, source)
            if self.recorder is not None and self.first_nonfinite is None:
                self._record_nonfinite(found, probe)
        else:
            found = NonFinite(self.step, None, None, "gradients")
        self.nonfinite_steps.append(found)
        if self.first_nonfinite is None:
            self.first_nonfinite = found
        message = f"amped.monitor: a non-finite value (inf/NaN) first appeared at {found}"
        if self.on_nonfinite == "raise":
            raise NonFiniteError(
                f"{message}. Stopping before the optimizer step (on_nonfinite='raise'); "
                "nothing was changed. amped.doctor.diagnose_low_precision finds the op and a fix."
            )
        if self.on_nonfinite == "warn" or not self._warned:
            action = "taken anyway (on_nonfinite='warn')"
            if self.on_nonfinite == "skip":
                action = "skipped (on_nonfinite='skip'; warned once)"
            warnings.warn(f"{message}; the step is {action}.", RuntimeWarning, stacklevel=3)
            self._warned = True
        return self.on_nonfinite == "warn" or scaled

    def skip_step(self) -> None:
        """Drop what the skipped step recorded: delayed scaling's pending amaxes."""
        for layer in self._layers.values():
            pending = getattr(layer, "fp8_pending", None)
            if pending is not None:
                pending.zero_()

    def end_step(self) -> None:
        """After the step (taken or skipped): audit a sampled step, start the next one."""
        if self.sampling:
            self.sampled_steps += 1
            self._audit()
            self._unprobed = self._unprobed_parameters()
        self._events.clear()
        if self.recorder is not None:
            self.recorder.clear()
        self.step += 1
        self.sampling = self.step % self.every == 0
        if self.sampling:
            self._ran = set()

    def _unprobed_parameters(self) -> list[torch.nn.Parameter]:
        """The model's parameters whose gradients no GEMM probes (all but the FP8 layers'
        weights, whose gradients are their grad_weight GEMMs' outputs): the model's own,
        as a fused master step may never fill the masters'. Listed at the start and at
        each sampled step (walking the modules every step costs ~1 ms in a large model),
        so a module added in between is checked from the next sampled step on."""
        probed = {id(layer.weight) for layer in self._layers.values()}
        return [p for p in self.setup.model.parameters() if id(p) not in probed]

    def _audit(self) -> None:
        model = self.setup.model
        found = []
        for name, layer in self._layers.items():
            try:
                current = model.get_submodule(name) if name else model
            except AttributeError:
                current = None
            if current is not layer:
                found.append(f"{name!r} was replaced after prepare: it no longer runs FP8")
            elif layer.training and name not in self._ran:
                found.append(f"{name!r} did not run its FP8 GEMMs in sampled step {self.step}")
        self.audit = found
        if found and self.strict:
            raise RuntimeError(
                "amped.monitor audit (strict=True): " + "; ".join(found) + ". The plan "
                "converted these layers; check for a module swapped after prepare, or a "
                "compile that dropped the conversion."
            )

    # --- reading --------------------------------------------------------------------------

    def read(self) -> dict[str, dict[str, dict[str, float]]]:
        """The counters summed over the sampled steps so far, per layer and role (one sync).

        Each role's entry has :data:`~amped.lowp.health.STATS` plus ``underflow_fraction``
        (of non-zero operand elements) and ``saturation_fraction`` (of operand elements).
        """
        keys = list(self._stats)
        if not keys:
            return {}
        values = torch.stack([self._stats[k].to(torch.float64).cpu() for k in keys]).tolist()
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (name, role), row in zip(keys, values, strict=True):
            entry = dict(zip(STATS, row, strict=True))
            entry["underflow_fraction"] = entry["underflow"] / max(entry["nonzero"], 1.0)
            entry["saturation_fraction"] = entry["saturated"] / max(entry["elements"], 1.0)
            out.setdefault(name, {})[role] = entry
        for roles in out.values():  # the order a step runs them
            ordered = {role: roles[role] for role in _ORDER if role in roles}
            roles.clear()
            roles.update(ordered)
        return out

    def summary(self) -> dict[str, Any]:
        """A JSON-ready summary: steps, sampled steps, first non-finite, audit, counters."""
        first = self.first_nonfinite
        return {
            "steps": self.step,
            "every": self.every,
            "sampled_steps": self.sampled_steps,
            "first_nonfinite": None if first is None else dataclasses.asdict(first),
            "nonfinite_steps": len(self.nonfinite_steps),
            "audit": list(self.audit),
            "gemms": self.read(),
        }

    def detach(self) -> None:
        """Stop monitoring: the layers and the setup forget this monitor."""
        for layer in (*self._layers.values(), *self._attention.values()):
            if getattr(layer, "fp8_observer", None) is self:
                layer.fp8_observer = None  # type: ignore[assignment]
        if self.setup.monitor is self:
            self.setup.monitor = None
            set_monitored(self.setup.optimizer, False)


def monitor(
    setup: TrainSetup,
    every: int = 50,
    *,
    on_nonfinite: str = "skip",
    strict: bool = False,
    record: str | Path | None = None,
    spike_k: float = SPIKE_K,
) -> Monitor:
    """Attach a :class:`Monitor` to ``setup`` (see :mod:`amped.recipes.monitoring`).

    Args:
        setup: what :func:`amped.prepare` returned; its FP8 layers report per-GEMM
            health (a setup without any is checked for non-finite gradients only).
        every: sample the counters (and audit the plan) every this many steps.
        on_nonfinite: ``"skip"`` (default), ``"warn"`` or ``"raise"``.
        strict: make a failed audit fatal (``RuntimeError``).
        record: a folder: keep what replaying the step's low-precision GEMMs needs and
            write a replay bundle there at the first non-finite value, at the first
            total underflow, at a loss spike and at :meth:`Monitor.capture`
            (:mod:`amped.recipes.recorder`; :func:`amped.doctor.replay` reruns one).
            None (default): no recording.
        spike_k: robust deviations above the running median loss that make a spike.

    Raises:
        ValueError: ``setup.optimizer`` steps in backward
            (:func:`amped.optim.step_in_backward`), where no gradient is left for the
            monitor to check; remove its hooks first.

    Example:
        >>> import torch, amped
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        >>> setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
        ...                       "fp8-tensorwise")
        >>> health = amped.monitor(setup, every=50)
        >>> setup.backward(setup.model(torch.randn(16, 64)).float().square().mean())
        >>> setup.step()
        True
        >>> sorted(health.read()["0"])
        ['forward', 'grad_weight']
    """
    return Monitor(setup, every, on_nonfinite, strict, record, spike_k)
