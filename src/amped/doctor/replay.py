"""``amped.doctor.replay(path)``: rerun a recorded step's low-precision GEMMs on a CPU.

A bundle (``amped.monitor(setup, record=DIR)``, :mod:`amped.recipes.recorder`) holds,
per layer, the input, weight and grad_output it received, its cast state and config,
and the digests of its three GEMM outputs. The replay rebuilds each layer from that data alone (a
fresh ``nn.Linear`` of the recorded shape converted with the recorded config, the
state loaded; nothing from the bundle is executed), runs its forward and backward,
and compares:

- the first non-finite value, found as the monitor finds it (the GEMMs in the order
  the step ran them, operands before outputs), down to the element: the same module,
  role, tensor, part (values or scale), flat index and bits;
- every GEMM output with the recorded one, bit for bit (SHA-256 of the bits). A bundle
  recorded on a CPU replays bitwise; one recorded on a GPU (a real ``torch._scaled_mm``)
  replays with emulated GEMMs, whose outputs may differ from the GPU's in the last bits
  of the accumulation (reported as not bitwise; the bound is not checked here).

A bundle written at a *total underflow* (reason ``"underflow"``: an NVFP4 cast that
made a non-zero operand all zero, :mod:`amped.lowp.health`) is compared the same way,
on the first total underflow of the replay, judged from the replayed cast's elements
themselves (the operand held a non-zero value, its quantized elements are all zero),
among the casts the monitor judges (NVFP4, rounding to nearest): the same module, role,
tensor, and the first value lost (flat index and bits).

With a non-finite value it then bisects the layer that holds it over the parts of the
recipe, each changed alone and rerun (:data:`PARTS`), in this order, smallest change
first: the stochastic-rounding draw, the Hadamard transform, the scale rule, the
element format, the role (that GEMM in bfloat16) and the layer itself (all three
GEMMs in bfloat16). The parts whose change makes every GEMM of the layer finite are
the cause; the first of them is the fix, reported with its error against float32
(SQNR of the flagged GEMM's output, the three GEMMs recomputed in float32). When no
part makes it finite, the value came into the layer non-finite: the cause is upstream.
A total underflow is bisected over the same parts; a change fixes it when that tensor's
cast keeps a non-zero element and every GEMM of the layer stays finite.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from amped._internal.version import __version__
from amped.checkpoint.bundle import BundleError, read_bundle, tensor_digest
from amped.lowp.float8.cast import sqnr
from amped.lowp.float8.config import E4M3, E5M2, Float8Config
from amped.lowp.float8.linear import Float8Linear
from amped.lowp.health import Operand, Probe, probe_nonfinite
from amped.lowp.mx.block_cast import BlockTensor
from amped.lowp.mx.block_config import BlockConfig
from amped.lowp.mx.block_format import BLOCK_FORMATS
from amped.lowp.mx.block_linear import BlockLinear
from amped.recipes.recorder import (
    SPIKE_K,
    Recorder,
    config_from_json,
    first_lost_element,
    stochastic_cast,
)
from amped.recipes.registry import resolve_recipe

__all__ = ["PARTS", "ReplayResult", "Trial", "replay"]

ROLES = ("forward", "grad_input", "grad_weight")
PARTS = ("stochastic-rounding draw", "Hadamard", "scale rule", "element format", "role", "layer")
"""The parts of a recipe the bisection changes, smallest change first."""
_OPERANDS = {"forward": ("input", "weight"), "grad_input": ("grad_output", "weight")}


@dataclasses.dataclass(frozen=True)
class Trial:
    """One rerun of the bisection: ``part`` changed as ``change`` says; whether all the
    layer's GEMMs were finite, the flagged GEMM's SQNR against float32 (dB), and, for a
    total underflow, whether the flagged tensor's cast was all zero again."""

    part: str
    change: str
    finite: bool
    sqnr_db: float | None
    flushed: bool = False


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    """What :func:`replay` found (see :mod:`amped.doctor.replay`).

    Attributes:
        path: the bundle's folder.
        reason: why it was written: ``"nonfinite"``, ``"underflow"``, ``"loss_spike"``
            or ``"capture"``.
        recipe, step: the recipe and the step it recorded.
        recorded: the first non-finite the monitor recorded (module, role, tensor,
            element), or None; for an ``"underflow"`` bundle the total underflow it
            recorded (element: the first value lost).
        replayed: the same of the replay, the same fields, or None.
        reproduced: ``replayed == recorded``, element and bits included.
        bitwise: per ``"module/role"``, whether the replayed output has the recorded bits.
        trials: the bisection's reruns (empty without a non-finite value or total
            underflow).
        cause: the parts whose change alone makes the layer finite (and, for a total
            underflow, keeps the tensor from flushing to zero), in words, or None.
        fix: the smallest such change with its SQNR, or None.
    """

    path: str
    reason: str
    recipe: str
    step: int
    recorded: dict[str, Any] | None
    replayed: dict[str, Any] | None
    reproduced: bool
    bitwise: dict[str, bool]
    trials: tuple[Trial, ...] = ()
    cause: str | None = None
    fix: str | None = None

    def summary(self) -> str:
        """A few lines for a terminal."""
        equal = sum(self.bitwise.values())
        lines = [
            f"replay of {self.path} ({self.reason}, recipe {self.recipe}, step {self.step})",
            f"GEMM outputs bitwise equal to the recorded ones: {equal} of {len(self.bitwise)}",
        ]
        if self.recorded is not None or self.replayed is not None:
            verdict = "reproduced" if self.reproduced else "NOT reproduced"
            event = "total underflow" if self.reason == "underflow" else "non-finite"
            lines.append(f"first {event} {verdict}: {_where(self.replayed)}")
            if not self.reproduced:
                lines.append(f"  recorded: {_where(self.recorded)}")
        for trial in self.trials:
            db = "" if trial.sqnr_db is None else f", {trial.sqnr_db:.1f} dB"
            state = "finite" if trial.finite else "non-finite"
            state = "flushed to zero" if trial.flushed else state
            lines.append(f"  {trial.part}: {trial.change}: {state}{db}")
        if self.cause is not None:
            lines.append(f"cause: {self.cause}")
        if self.fix is not None:
            lines.append(f"fix: {self.fix}")
        return "\n".join(lines)


def _where(found: dict[str, Any] | None) -> str:
    if found is None:
        return "none"
    element = found.get("element") or {}
    value = f", value {element['value']}" if "value" in element else ""
    return (
        f"{found['module']} {found['role']} GEMM, its {found['tensor']} "
        f"({element.get('part')} element {element.get('index')}, "
        f"bits {element.get('bits')}{value})"
    )


@dataclasses.dataclass
class _Run:
    """One layer run: its GEMM outputs and events, and the recorder that kept them."""

    outputs: dict[str, torch.Tensor]
    events: list[tuple[str, str, Probe]]
    recorder: _CastRecorder
    layer: torch.nn.Module


class _CastRecorder(Recorder):
    """The replay's recorder: also keeps each operand's quantized form, per (role,
    tensor), to judge a total underflow from the cast's elements themselves."""

    def clear(self) -> None:
        super().clear()
        self.casts: dict[tuple[str, str], Operand] = {}

    def keep(
        self,
        layer: torch.nn.Module,
        role: str,
        operands: dict[str, Any],
        output_name: str,
        output: torch.Tensor,
    ) -> None:
        super().keep(layer, role, operands, output_name, output)
        for tensor, operand in operands.items():
            self.casts[(role, tensor)] = operand


class _Observer:
    """A monitor's view of one replayed layer (``layer.fp8_observer``)."""

    sampling = False

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.events: list[tuple[str, str, Probe]] = []

    def observe(self, layer: Any, role: str, probes: list[tuple[str, Probe]], stats: Any) -> None:
        self.events += [(role, tensor, probe) for tensor, probe in probes]


def _run(name: str, entry: dict[str, Any], data: dict[str, torch.Tensor], config: Any) -> _Run:
    """Rebuild layer ``name`` with ``config`` and the recorded state; run its GEMMs."""
    weight = data["weight"]
    linear = torch.nn.Linear(entry["in_features"], entry["out_features"], bias=False)
    linear.weight = torch.nn.Parameter(weight.clone())
    emulate = entry["emulated"] or entry["device"] != "cpu"
    layer: Any
    if isinstance(config, BlockConfig):
        layer = BlockLinear.convert_(linear, config, emulate=emulate)
        layer.fp8_rng.copy_(data["state/fp8_rng"])
    else:
        layer = Float8Linear.convert_(linear, config, emulate=emulate)
        if config.delayed is not None and "state/fp8_scale" in data:
            layer.fp8_scale.copy_(data["state/fp8_scale"])
            layer.fp8_amax_history.copy_(data["state/fp8_amax_history"])
            layer.fp8_started = bool(data["state/fp8_started"])
    recorder = _CastRecorder(Path("."), {name: layer}, "", SPIKE_K)
    observer = _Observer(recorder)
    layer.fp8_observer = observer
    x = data["input"].clone().requires_grad_("grad_input" in entry["roles"])
    out = layer(x)
    if "grad_output" in data:
        out.backward(data["grad_output"].reshape(out.shape))
    outputs = {
        role: recorder.gemms[(name, role)][2] for role in ROLES if (name, role) in recorder.gemms
    }
    return _Run(outputs, observer.events, recorder, layer)


def _first(name: str, run: _Run) -> dict[str, Any] | None:
    for role, tensor, probe in run.events:
        if probe_nonfinite(probe):
            element = run.recorder.locate(name, role, tensor, probe)
            return {"module": name, "role": role, "tensor": tensor, "element": element}
    return None


def _flushed(run: _Run, role: str, tensor: str) -> bool:
    """Whether the run's cast of ``tensor`` in ``role`` made a non-zero operand all zero,
    read from its elements (False for an operand not cast to a block format)."""
    high, low = run.recorder.casts.get((role, tensor), (None, None))
    if high is None or not isinstance(low, BlockTensor):
        return False
    return bool(torch.count_nonzero(high) > 0) and not bool(torch.count_nonzero(low.elements))


def _first_underflow(name: str, run: _Run) -> dict[str, Any] | None:
    """The run's first total underflow among the casts the monitor judges (NVFP4,
    rounding to nearest), in the order the GEMMs ran."""
    for role, tensor, probe in run.events:
        if not probe.floor or stochastic_cast(run.layer, tensor):
            continue
        if _flushed(run, role, tensor):
            high = run.recorder.casts[(role, tensor)][0]
            assert high is not None  # _flushed read it
            element = first_lost_element(high)
            return {"module": name, "role": role, "tensor": tensor, "element": element}
    return None


def _reference(data: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The layer's three GEMMs in ``dtype`` (float32: the reference)."""
    x, w = data["input"].to(dtype), data["weight"].to(dtype)
    out = {"forward": x @ w.t()}
    if "grad_output" in data:
        go = data["grad_output"].to(dtype)
        out["grad_input"], out["grad_weight"] = go @ w, go.t() @ x
    return out


def _variants(config: Any, first: dict[str, Any]) -> list[tuple[str, str, Any, int]]:
    """(part, change in words, config, extra stochastic-rounding draws) per variant."""
    out: list[tuple[str, str, Any, int]] = []
    if isinstance(config, BlockConfig):
        if config.stochastic_rounding:
            out.append((PARTS[0], "with the next stochastic-rounding draw", config, 1))
        if config.hadamard:
            out.append(
                (PARTS[1], "without the Hadamard transform", config.replace(hadamard=False), 0)
            )
        if config.format.is_mx:
            mode = "floor" if config.scale_mode != "floor" else "rceil"
            out.append((PARTS[2], f"with {mode} block scales", config.replace(scale_mode=mode), 0))
        elif config.weight_2d:
            out.append((PARTS[2], "with 1x16 weight blocks", config.replace(weight_2d=False), 0))
        other = "mxfp8" if config.format.name != "mxfp8" else "mxfp8-e5m2"
        out.append((PARTS[3], f"in {other}", BlockConfig(BLOCK_FORMATS[other]), 0))
        return out
    assert isinstance(config, Float8Config)
    if config.delayed is not None:
        fresh = dataclasses.replace(config, delayed=None)
        out.append((PARTS[2], "with dynamic scaling instead of delayed", fresh, 0))
    else:
        change = "without" if config.power_of_2 else "with"
        fresh = dataclasses.replace(config, power_of_2=not config.power_of_2)
        out.append((PARTS[2], f"{change} power-of-two scales", fresh, 0))
    field = {"input": "input", "weight": "weight"}.get(first["tensor"], "grad_output")
    rule = getattr(config, field)
    dtype = E5M2 if rule.dtype == E4M3 else E4M3
    swapped = dataclasses.replace(rule, dtype=dtype)
    changes: dict[str, Any] = {field: swapped}
    if field == "weight":  # its rule in the grad-input GEMM too, at its own granularity
        changes["weight_for_grad_input"] = dataclasses.replace(config.w_gi, dtype=dtype)
    name = str(dtype).removeprefix("torch.float8_").upper()
    fresh = dataclasses.replace(config, **changes)
    out.append((PARTS[3], f"with {field} in {name}", fresh, 0))
    return out


def _bisect(
    name: str,
    entry: dict[str, Any],
    data: dict[str, torch.Tensor],
    config: Any,
    first: dict[str, Any],
    underflow: bool,
) -> tuple[list[Trial], str | None, str | None]:
    role, tensor = first["role"], first["tensor"]
    reference = _reference(data, torch.float32)
    bf16 = _reference(data, torch.bfloat16)

    def trial(
        part: str, change: str, outputs: dict[str, torch.Tensor], flagged: bool, flushed: bool
    ) -> Trial:
        finite = not flagged and all(bool(torch.isfinite(o).all()) for o in outputs.values())
        db = sqnr(reference[role], outputs[role]) if finite and role in outputs else None
        return Trial(part, change, finite, db, flushed)

    trials = []
    for part, change, variant, draws in _variants(config, first):
        moved = dict(data)
        if draws:
            moved["state/fp8_rng"] = data["state/fp8_rng"] + torch.tensor([0, draws])
        run = _run(name, entry, moved, variant)
        flagged = any(probe_nonfinite(p) for _, _, p in run.events)
        flushed = underflow and _flushed(run, role, tensor)
        trials.append(trial(part, change, run.outputs, flagged, flushed))
    run = _run(name, entry, data, config)
    others = [p for r, _, p in run.events if r != role]
    mixed = {**run.outputs, role: bf16[role]}
    flagged = any(map(probe_nonfinite, others))
    trials.append(trial(PARTS[4], f"{role} in bfloat16", mixed, flagged, False))
    trials.append(trial(PARTS[5], "all three GEMMs in bfloat16", bf16, False, False))
    fixed = [t for t in trials if t.finite and not t.flushed]
    if not fixed:
        cause = (
            f"no part of the recipe: {first['tensor']} of {name} ({role}) is non-finite "
            "in every rerun, bfloat16 included; the value came into the layer non-finite "
            "(look upstream of it)"
        )
        return trials, cause, None
    cause = "; ".join(f"{t.part} ({t.change})" for t in fixed)
    best = fixed[0]
    db = "" if best.sqnr_db is None or math.isinf(best.sqnr_db) else f", {best.sqnr_db:.0f} dB"
    kept = f"its {tensor} not flushed to zero, " if underflow else ""
    fix = f"{role} of {name} {best.change}: {kept}finite{db} against float32"
    return trials, cause, fix


def _check(document: dict[str, Any], recipe: str | None, model: torch.nn.Module | None) -> None:
    """Refuse a bundle of another amped version, recipe or model (the message names it)."""
    if document.get("amped_version") != __version__:
        raise BundleError(
            f"This bundle was recorded by amped {document.get('amped_version')}, this is "
            f"amped {__version__}: the casts may differ between versions. Replay it with "
            f"amped {document.get('amped_version')}"
        )
    if recipe is not None and resolve_recipe(recipe).name != document.get("recipe"):
        raise BundleError(
            f"This bundle was recorded under recipe {document.get('recipe')!r}, not "
            f"{resolve_recipe(recipe).name!r}. Received: recipe={recipe!r}"
        )
    if model is None:
        return
    for name, entry in document["layers"].items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise BundleError(
                f"The model has no module {name!r}, which the bundle recorded"
            ) from None
        shape = (getattr(module, "out_features", None), getattr(module, "in_features", None))
        if shape != (entry["out_features"], entry["in_features"]):
            raise BundleError(
                f"Module {name!r} of the model is {type(module).__name__} with (out, in) = "
                f"{shape}; the bundle recorded ({entry['out_features']}, "
                f"{entry['in_features']}): not the model that was recorded"
            )


def _layer_data(
    name: str, entry: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    prefix = f"{name}/"
    data = {key[len(prefix) :]: t for key, t in tensors.items() if key.startswith(prefix)}
    shapes = {
        "input": (-1, entry["in_features"]),
        "weight": (entry["out_features"], entry["in_features"]),
    }
    for key, (rows, cols) in shapes.items():
        tensor = data.get(key)
        if (
            tensor is None
            or tensor.dim() != 2
            or tensor.shape[1] != cols
            or rows not in (-1, tensor.shape[0])
        ):
            got = None if tensor is None else tuple(tensor.shape)
            raise BundleError(
                f"The bundle's {name}/{key} has shape {got}; its layer entry says (.., {cols})"
            )
    return data


def replay(
    path: str | Path, *, recipe: str | None = None, model: torch.nn.Module | None = None
) -> ReplayResult:
    """Rerun the GEMMs a bundle recorded, on the CPU (see :mod:`amped.doctor.replay`).

    Args:
        path: a bundle folder (``amped.monitor(setup, record=DIR)`` wrote it in ``DIR``).
        recipe: if given, the recipe the bundle must have been recorded under.
        model: if given, a model the bundle's layers must be part of (names and shapes);
            only checked, never run.

    Raises:
        amped.checkpoint.bundle.BundleError: (a ``ValueError``) a truncated or changed
            bundle, one of another amped version or recipe, or a model it does not fit.
    """
    tensors, document = read_bundle(Path(path))
    _check(document, recipe, model)
    order = [tuple(pair) for pair in document["order"]]
    underflow = document["reason"] == "underflow"
    runs, firsts, bitwise = {}, [], {}
    for name, entry in document["layers"].items():
        try:
            config = config_from_json(entry["config"])
        except (ValueError, TypeError, KeyError) as error:
            raise BundleError(
                f"The bundle's config of {name!r} is not one amped reads: {error}"
            ) from None
        data = _layer_data(name, entry, tensors)
        runs[name] = (entry, data, config)
        run = _run(name, entry, data, config)
        for role, output in run.outputs.items():
            recorded = entry.get("outputs", {}).get(role)
            bitwise[f"{name}/{role}"] = recorded == tensor_digest(output)
        found = _first_underflow(name, run) if underflow else _first(name, run)
        if found is not None:
            firsts.append(found)
    rank = {pair: index for index, pair in enumerate(order)}
    firsts.sort(key=lambda f: rank.get((f["module"], f["role"]), len(rank)))
    replayed = firsts[0] if firsts else None
    recorded = document.get("total_underflow" if underflow else "first_nonfinite")
    trials: list[Trial] = []
    cause = fix = None
    if replayed is not None:
        entry, data, config = runs[replayed["module"]]
        module = replayed["module"]
        trials, cause, fix = _bisect(module, entry, data, config, replayed, underflow)
    return ReplayResult(
        path=str(path),
        reason=document["reason"],
        recipe=document["recipe"],
        step=document["step"],
        recorded=recorded,
        replayed=replayed,
        reproduced=replayed == recorded,
        bitwise=bitwise,
        trials=tuple(trials),
        cause=cause,
        fix=fix,
    )
