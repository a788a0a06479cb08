"""The backends :func:`amped.verify` runs a step through: amped's own recipes, torchao's
float8 training and its emulated MXFP8 training op, and Transformer Engine (refused,
saying why, where it is not installed).

A backend is any object with a ``name`` and ``prepare(model, recipe, layers)``, which
converts ``model`` (a private copy) in place or returns another, for the amped recipe
name ``recipe`` and the layers amped's plan converts (``layers``, qualified names),
and returns a :class:`Prepared`. A test's wrapper backend calls a built-in one and
plants a change.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from amped._internal.errors import value_error
from amped.lowp.conv1d import is_conv1d, linear_dims

__all__ = ["BACKENDS", "Backend", "Prepared", "resolve_backend"]


@dataclass(frozen=True)
class Prepared:
    """A model ready for one step: call it inside ``autocast()`` with its inputs'
    floating tensors in ``input_dtype`` (None: as given)."""

    model: torch.nn.Module
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    input_dtype: torch.dtype | None = None


class Backend(Protocol):
    name: str

    def prepare(self, model: torch.nn.Module, recipe: str, layers: list[str]) -> Prepared: ...


class AmpedBackend:
    """amped's recipes (:func:`amped.prepare`), on the model's device."""

    name = "amped"

    def prepare(self, model: torch.nn.Module, recipe: str, layers: list[str]) -> Prepared:
        from amped.recipes.build import prepare

        setup = prepare(model, torch.optim.SGD(model.parameters(), lr=0.0), recipe)
        return Prepared(setup.model, setup.autocast)


TORCHAO_FLOAT8 = {
    "fp8-tensorwise": "tensorwise",
    "fp8-rowwise": "rowwise",
    "fp8-rowwise-gw-hp": "rowwise_with_gw_hp",
}
"""amped's recipe name -> torchao's float8 training recipe of the same casts."""


def _quiet_import(name: str) -> Any:
    import importlib

    with warnings.catch_warnings():  # torchao warns about its missing CUDA extensions
        warnings.simplefilter("ignore")
        return importlib.import_module(name)


def _as_linear(model: torch.nn.Module, name: str) -> torch.nn.Linear:
    """The layer ``name`` as an ``nn.Linear`` (a transformers Conv1D is one with its
    weight transposed; torchao converts ``nn.Linear`` only)."""
    module = model.get_submodule(name)
    if not is_conv1d(module):
        return module  # type: ignore[return-value]
    d_in, d_out = linear_dims(module)
    weight, bias = module.weight, module.bias
    assert isinstance(weight, torch.Tensor)  # a Conv1D
    linear = torch.nn.Linear(d_in, d_out, bias=bias is not None)
    linear = linear.to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight.t())
        if isinstance(bias, torch.Tensor):
            linear.bias.copy_(bias)
    parent, _, child = name.rpartition(".")
    model.get_submodule(parent).register_module(child, linear)
    return linear


class TorchaoBackend:
    """torchao's float8 training (``convert_to_float8_training`` with the recipe of the
    same name) and its emulated MXFP8 training op (``mx_mm``, e4m3, ``rceil``), on the
    layers amped's plan converts, with the model in bfloat16 (torchao computes in the
    model's dtype)."""

    name = "torchao"

    def prepare(self, model: torch.nn.Module, recipe: str, layers: list[str]) -> Prepared:
        if recipe not in (*TORCHAO_FLOAT8, "mxfp8"):
            raise value_error(
                "torchao trains with fp8-tensorwise, fp8-rowwise, fp8-rowwise-gw-hp and "
                "mxfp8 (its emulated MXFP8 op); verify another recipe with backend='amped'",
                "recipe",
                recipe,
            )
        model = model.to(torch.bfloat16)
        for name in layers:
            _as_linear(model, name)
        if recipe == "mxfp8":
            for name in layers:
                _to_mxfp8(model.get_submodule(name))
        else:
            ao = _quiet_import("torchao.float8")
            config = ao.Float8LinearConfig.from_recipe_name(TORCHAO_FLOAT8[recipe])
            chosen = set(layers)
            model = ao.convert_to_float8_training(
                model, config=config, module_filter_fn=lambda m, fqn: fqn in chosen
            )
        return Prepared(model, input_dtype=torch.bfloat16)


class _TorchaoMXFP8Linear(torch.nn.Linear):
    """An ``nn.Linear`` whose three GEMMs are torchao's emulated MXFP8 training op."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        e4m3 = torch.float8_e4m3fn
        mx = _quiet_import("torchao.prototype.moe_training.mxfp8_linear")
        config = _quiet_import("torchao.prototype.mx_formats.config")
        kernel = _quiet_import("torchao.quantization.quantize_.common.kernel_preference")
        out = mx.mx_mm.apply(
            input,
            self.weight,
            e4m3,
            e4m3,
            e4m3,
            32,
            kernel.KernelPreference.EMULATED,
            config.MXFP8Dim0CastKernelChoice.TORCH,
            config.MXFP8Dim1CastKernelChoice.TORCH,
            config.ScaleCalculationMode("rceil"),
            False,
        )
        return out if self.bias is None else out + self.bias.to(out.dtype)


def _to_mxfp8(module: torch.nn.Module) -> None:
    module.__class__ = _TorchaoMXFP8Linear


class TransformerEngineBackend:
    """Transformer Engine's ``te.Linear``: refused, saying why (not installed, or not
    read by this version of amped)."""

    name = "te"

    def prepare(self, model: torch.nn.Module, recipe: str, layers: list[str]) -> Prepared:
        try:
            _quiet_import("transformer_engine.pytorch")
        except ImportError as error:
            raise RuntimeError(
                "backend 'te' needs Transformer Engine, which is not installed here "
                f"({error}); install transformer-engine[pytorch] on a CUDA machine, or "
                "verify with backend='torchao' or 'amped'"
            ) from None
        raise RuntimeError(
            "amped.verify does not read Transformer Engine's FP8 tensors yet; verify with "
            "backend='torchao' or 'amped'"
        )


BACKENDS: dict[str, Backend] = {
    "amped": AmpedBackend(),
    "torchao": TorchaoBackend(),
    "te": TransformerEngineBackend(),
}
"""The built-in backends by name."""


def resolve_backend(backend: str | Backend) -> Backend:
    """A built-in backend by name, or a backend object as it is."""
    if isinstance(backend, str):
        if backend not in BACKENDS:
            raise value_error(f"backend is one of {sorted(BACKENDS)}", "backend", backend)
        return BACKENDS[backend]
    if not callable(getattr(backend, "prepare", None)) or not hasattr(backend, "name"):
        raise value_error(
            "backend is a name or an object with a name and prepare(model, recipe, layers)",
            "backend",
            backend,
        )
    return backend
