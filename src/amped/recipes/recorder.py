"""The flight recorder of ``amped.monitor(setup, record=DIR)``: replay bundles of a step.

While a step runs, each low-precision GEMM hands the monitor its operands and output
(:func:`amped.lowp.health.record_gemm`); the recorder keeps *references* to the
high-precision operands and the output until the step ends (no copy, no extra pass:
the memory of about one more activation per layer, held to the end of the step; the
quantized forms are freed as without recording), plus a copy of each layer's small state at its
forward (delayed scaling's scales and amax histories, ``[3]`` and ``[3, history]``;
a block layer's stochastic-rounding seed and draw count, two int64 numbers).

A bundle (:mod:`amped.checkpoint.bundle`: safetensors plus JSON, never a pickle) is
written for the layers concerned only, before the optimizer steps:

- ``"nonfinite"``: at the first non-finite value the monitor names in a GEMM (that
  layer only; none when only gradients outside the low-precision GEMMs held it);
- ``"underflow"``: at the first *total underflow* (:mod:`amped.lowp.health`: a cast
  whose input held a non-zero element and whose every element is zero), among the
  NVFP4 casts that round to nearest (:meth:`Recorder.locate_underflow`); that layer
  only;
- ``"loss_spike"``: a finite loss above the median of the last :data:`SPIKE_WINDOW`
  losses by more than ``spike_k`` robust deviations (``1.4826 * MAD``, the median
  absolute deviation scaled to a normal's standard deviation), once at least
  :data:`SPIKE_MIN_HISTORY` losses are known; every converted layer that ran (a loss
  names no layer);
- ``"capture"``: :meth:`Monitor.capture` between ``backward`` and ``setup.step()``.

Per layer the bundle holds what its three GEMMs need to run again: the input the layer
received (in the GEMM's dtype), its weight, the grad_output it received, its state, its
config, and the SHA-256 digest of each GEMM output's bits (to compare bitwise).
:func:`amped.doctor.replay` reruns them.
"""

from __future__ import annotations

import collections
import statistics
from pathlib import Path
from typing import Any

import torch

from amped._internal.errors import value_error
from amped._internal.version import __version__
from amped.checkpoint.bundle import tensor_digest, write_bundle
from amped.lowp.float8.config import CastRule, DelayedScaling, Float8Config
from amped.lowp.float8.linear import Float8Linear
from amped.lowp.health import Probe, flushes_to_zero
from amped.lowp.mx.block_config import BlockConfig
from amped.lowp.mx.block_format import BLOCK_FORMATS
from amped.lowp.mx.block_linear import BlockLinear

__all__ = [
    "SPIKE_K",
    "Recorder",
    "config_from_json",
    "config_to_json",
    "first_lost_element",
    "first_nonfinite_element",
    "stochastic_cast",
]

SPIKE_K = 6.0
"""Robust deviations above the running median that make a loss a spike (a normal loss
passes 6 with probability 1e-9; training noise is heavier-tailed, hence not 3)."""
SPIKE_WINDOW = 50
SPIKE_MIN_HISTORY = 10
_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its sigma
_FP8_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def config_to_json(config: Float8Config | BlockConfig) -> dict[str, Any]:
    """A layer's config as JSON (:func:`config_from_json` reads it back)."""
    if isinstance(config, BlockConfig):
        return {
            "kind": "block",
            "format": config.format.name,
            "scale_mode": config.scale_mode,
            "weight_2d": config.weight_2d,
            "stochastic_rounding": config.stochastic_rounding,
            "hadamard": config.hadamard,
        }

    def rule(r: CastRule) -> list[str]:
        return [str(r.dtype).removeprefix("torch."), r.granularity]

    delayed = config.delayed
    return {
        "kind": "float8",
        "input": rule(config.input),
        "weight": rule(config.weight),
        "grad_output": rule(config.grad_output),
        "weight_for_grad_input": rule(config.w_gi),
        "grad_weight_hp": config.grad_weight_hp,
        "power_of_2": config.power_of_2,
        "fast_accum_output": config.fast_accum_output,
        "delayed": None
        if delayed is None
        else [delayed.history_len, delayed.amax_compute, delayed.margin],
    }


def config_from_json(document: dict[str, Any]) -> Float8Config | BlockConfig:
    """The config :func:`config_to_json` wrote (only known names are looked up).

    Raises:
        ValueError: a kind, format or dtype this amped does not know.
    """
    if document.get("kind") == "block":
        fmt = BLOCK_FORMATS.get(document.get("format", ""))
        if fmt is None:
            raise value_error(
                f"the block format is one of {sorted(BLOCK_FORMATS)}",
                "format",
                document.get("format"),
            )
        flags = ("scale_mode", "weight_2d", "stochastic_rounding", "hadamard")
        return BlockConfig(fmt, **{k: document[k] for k in flags})
    if document.get("kind") != "float8":
        raise value_error(
            "a layer config's kind is 'float8' or 'block'", "kind", document.get("kind")
        )

    def rule(pair: list[str]) -> CastRule:
        if pair[0] not in _FP8_DTYPES:
            raise value_error(f"an FP8 dtype is one of {sorted(_FP8_DTYPES)}", "dtype", pair[0])
        return CastRule(_FP8_DTYPES[pair[0]], pair[1])  # type: ignore[arg-type]

    delayed = document["delayed"]
    return Float8Config(
        rule(document["input"]),
        rule(document["weight"]),
        rule(document["grad_output"]),
        weight_for_grad_input=rule(document["weight_for_grad_input"]),
        grad_weight_hp=bool(document["grad_weight_hp"]),
        power_of_2=bool(document["power_of_2"]),
        fast_accum_output=bool(document["fast_accum_output"]),
        delayed=None if delayed is None else DelayedScaling(*delayed),
    )


def _bits(value: torch.Tensor) -> str:
    """The bits of a one-element tensor, as hex."""
    size = value.element_size()
    raw = int(value.reshape(1).contiguous().view(_INT_OF[size]).item())
    return f"0x{raw & ((1 << (8 * size)) - 1):0{2 * size}x}"


def _first(bad: torch.Tensor, values: torch.Tensor, part: str) -> dict[str, Any] | None:
    where = torch.nonzero(bad.reshape(-1))
    if not len(where):
        return None
    index = int(where[0, 0])
    value = values.reshape(-1)[index]
    return {"part": part, "index": index, "bits": _bits(value), "value": repr(float(value))}


def first_nonfinite_element(
    high: torch.Tensor | None, probe: Probe | None
) -> dict[str, Any] | None:
    """Where a GEMM tensor first holds a non-finite value: ``{"part", "index", "bits",
    "value"}`` with ``part`` ``"values"`` (``high``, flattened in its logical order) or,
    for a quantized operand whose values are finite, ``"scale"``: the first scale its
    monitor ``probe`` calls non-finite (a float scale outside ``(0, inf)``, an E8M0 scale
    at the format's inf exponent); None when neither holds one."""
    if high is not None and high.numel():
        found = _first(~torch.isfinite(high.detach()), high.detach(), "values")
        if found is not None:
            return found
    if probe is None or probe.kind == "range":
        return None
    scale = probe.values[0].detach()
    if probe.kind == "exponent":
        return _first(scale >= probe.threshold, scale, "scale")
    return _first(~torch.isfinite(torch.log(scale.float())), scale, "scale")


def first_lost_element(high: torch.Tensor) -> dict[str, Any] | None:
    """The first non-zero element of ``high`` (flattened in its logical order), which a
    total underflow lost: ``{"part": "values", "index", "bits", "value"}``; None when
    ``high`` is all zero."""
    return _first(high.detach() != 0, high.detach(), "values")


def layer_state(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the small state a layer's casts read (see the module)."""
    if isinstance(layer, BlockLinear):
        return {"fp8_rng": layer.fp8_rng.detach().clone()}
    if isinstance(layer, Float8Linear) and layer.float8_config.delayed is not None:
        started = torch.tensor(layer.fp8_started)
        return {
            "fp8_scale": layer.fp8_scale.detach().clone(),
            "fp8_amax_history": layer.fp8_amax_history.detach().clone(),
            "fp8_started": started,
        }
    return {}


def stochastic_cast(layer: torch.nn.Module, tensor: str) -> bool:
    """Whether ``layer`` casts its GEMM operand ``tensor`` with stochastic rounding
    (a block layer's grad_output under ``stochastic_rounding``)."""
    if not isinstance(layer, BlockLinear):
        return False
    return layer.block_config.stochastic_rounding and tensor == "grad_output"


class Recorder:
    """What one monitor keeps for replay, and the bundles it writes (see the module)."""

    def __init__(
        self, folder: str | Path, layers: dict[str, torch.nn.Module], recipe: str, spike_k: float
    ) -> None:
        if not spike_k > 0:
            raise value_error("spike_k is a number of robust deviations > 0", "spike_k", spike_k)
        self.folder, self.recipe, self.spike_k = Path(folder), recipe, float(spike_k)
        self.layers = layers
        self._names = {id(layer): name for name, layer in layers.items()}
        self.losses: collections.deque[float] = collections.deque(maxlen=SPIKE_WINDOW)
        self.bundles: list[Path] = []
        self.clear()

    def clear(self) -> None:
        """Forget the step (the monitor calls it when the step ends)."""
        self.inputs: dict[str, dict[str, torch.Tensor]] = {}
        self.states: dict[str, dict[str, torch.Tensor]] = {}
        self.gemms: dict[tuple[str, str], tuple[dict[str, Any], str, torch.Tensor]] = {}
        # per GEMM: its high-precision operands by name, its output's name, its output

    def keep(
        self,
        layer: torch.nn.Module,
        role: str,
        operands: dict[str, Any],
        output_name: str,
        output: torch.Tensor,
    ) -> None:
        """One GEMM of the step: references to its high-precision operands and output (no
        copy; the quantized forms are left to be freed, their scales are in the probes)."""
        name = self._names.get(id(layer))
        if name is None:
            return
        highs = {tensor: high for tensor, (high, _) in operands.items()}
        self.gemms[(name, role)] = (highs, output_name, output)
        kept = self.inputs.setdefault(name, {})
        if role == "forward":
            kept["input"], kept["weight"] = operands["input"][0], operands["weight"][0]
            self.states[name] = layer_state(layer)
        elif role == "grad_input" or isinstance(layer, Float8Linear):
            # grad_input's grad_output is the one the layer received; an FP8 layer's
            # grad_weight GEMM takes it as it is too (a block layer's pads it).
            kept.setdefault("grad_output", operands["grad_output"][0])

    def locate(
        self, module: str, role: str, tensor: str, probe: Probe | None
    ) -> dict[str, Any] | None:
        """:func:`first_nonfinite_element` of a GEMM tensor of this step, given the probe
        the monitor flagged it by."""
        entry = self.gemms.get((module, role))
        if entry is None:
            return None
        highs, output_name, output = entry
        high = output if tensor == output_name else highs.get(tensor)
        return first_nonfinite_element(high, probe)

    def locate_underflow(
        self, module: str, role: str, tensor: str, probe: Probe
    ) -> dict[str, Any] | None:
        """Where a total underflow of a GEMM operand of this step lost its first value
        (``{"part": "values", "index", "bits", "value"}``: the first non-zero element of
        the operand, flattened in its logical order), given its probe; None when it is
        none. Only an NVFP4 cast whose tensor scale is at its floor (``probe.floor``)
        can be one, and only one that rounds to nearest is judged
        (:func:`~amped.lowp.health.flushes_to_zero`, a pass over the operand): a
        grad_output rounded stochastically keeps a tiny tensor's mean (each element
        becomes 0 or the smallest element with the odds of its value), so whether all
        of it drew 0 depends on the draws, which are not kept."""
        entry = self.gemms.get((module, role))
        layer = self.layers.get(module)
        if not probe.floor or entry is None or layer is None:
            return None
        if stochastic_cast(layer, tensor):
            return None
        high = entry[0].get(tensor)
        if high is None or not flushes_to_zero(high, probe.values[0]):
            return None
        return first_lost_element(high)

    def is_spike(self, loss: float) -> dict[str, float] | None:
        """Whether ``loss`` is a spike against the losses before it (then the median,
        the robust deviation and k), and remember it."""
        found = None
        if len(self.losses) >= SPIKE_MIN_HISTORY:
            median = statistics.median(self.losses)
            mad = statistics.median(abs(x - median) for x in self.losses)
            sigma = _MAD_TO_SIGMA * mad
            if sigma > 0 and loss > median + self.spike_k * sigma:
                found = {"median": median, "sigma": sigma, "k": self.spike_k}
        self.losses.append(loss)
        return found

    def write(self, reason: str, step: int, modules: list[str], extra: dict[str, Any]) -> Path:
        """Write the bundle of ``modules`` for this step into ``DIR/step<step>-<reason>``."""
        tensors: dict[str, torch.Tensor] = {}
        described = {}
        for name in modules:
            kept = self.inputs.get(name, {})
            if "input" not in kept:
                continue  # the layer did not run this step
            layer = self.layers[name]
            config = _config(layer)
            outputs = {}
            for key, value in {**kept, **self.states.get(name, {})}.items():
                prefix = "state/" if key.startswith("fp8_") else ""
                tensors[f"{name}/{prefix}{key}"] = value
            for role in ("forward", "grad_input", "grad_weight"):
                if (name, role) in self.gemms:  # the outputs' bits, as digests
                    outputs[role] = tensor_digest(self.gemms[(name, role)][2])
            described[name] = {
                "class": type(layer).__name__,
                "in_features": layer.in_features,
                "out_features": layer.out_features,
                "config": config_to_json(config),
                "emulated": bool(layer.fp8_emulate),
                "device": layer.weight.device.type,
                "roles": list(outputs),
                "outputs": outputs,
            }
        order = [list(key) for key in self.gemms if key[0] in described]
        meta = {
            "amped_version": __version__,
            "torch_version": torch.__version__,
            "recipe": self.recipe,
            "plan": {name: str(_config(layer)) for name, layer in self.layers.items()},
            "reason": reason,
            "step": step,
            "layers": described,
            "order": order,
            **extra,
        }
        path = write_bundle(self.folder / f"step{step}-{reason}", tensors, meta)
        self.bundles.append(path)
        return path


def _config(layer: torch.nn.Module) -> Float8Config | BlockConfig:
    if isinstance(layer, BlockLinear):
        return layer.block_config
    config: Float8Config = layer.float8_config  # type: ignore[assignment]
    return config
