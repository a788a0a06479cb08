# rewrite: keep-file (this shim names the old paths on purpose)
"""Deprecated: the FP8 and block formats moved to :mod:`amped.lowp`.

``amped.fp8.<name>`` still works for the names this package exported, for one release,
and warns with a ``DeprecationWarning`` saying what to use instead. Its submodules
(``amped.fp8.cast``, ...) are gone: import from :mod:`amped.lowp.float8` and
:mod:`amped.lowp.mx`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

__all__: list[str] = []

_INSTEAD = {
    "BLOCK_CONFIGS": "amped.lowp.CONFIGS",
    "FP8_CONFIGS": "amped.lowp.CONFIGS",
    "Float8Linear": "amped.lowp.Float8Linear",
    "Fp8Config": "amped.lowp.Float8Config",
    "convert_to_fp8": "amped.lowp.convert_to_low_precision (module_filter_fn= selects)",
}


def _convert_to_fp8(
    model: torch.nn.Module,
    config: Any,
    names: list[str] | None = None,
    *,
    module_filter: Any = None,
    emulate: bool | None = None,
    exclude: set[str] = frozenset(),  # type: ignore[assignment]
) -> Any:
    """The old ``convert_to_fp8``: the layers by name, or chosen by ``module_filter``."""
    from amped.lowp.convert import convert_layers, no_layer_error, plan_low_precision

    if names is None:
        names = plan_low_precision(model, module_filter, exclude, config)
    if not names:
        raise no_layer_error(model, module_filter, exclude, config)
    return convert_layers(model, config, names, emulate=emulate)


def _old(name: str) -> Any:
    """The object ``amped.fp8.<name>`` was."""
    from amped.lowp import Float8Config, Float8Linear
    from amped.lowp.float8.config import FLOAT8_CONFIGS
    from amped.lowp.mx.block_config import BLOCK_CONFIGS

    return {
        "BLOCK_CONFIGS": BLOCK_CONFIGS,
        "FP8_CONFIGS": FLOAT8_CONFIGS,
        "Float8Linear": Float8Linear,
        "Fp8Config": Float8Config,
        "convert_to_fp8": _convert_to_fp8,
    }[name]


def __getattr__(name: str) -> Any:
    if name not in _INSTEAD:
        raise AttributeError(f"module 'amped.fp8' has no attribute {name!r}")
    warnings.warn(
        f"amped.fp8.{name} is deprecated and will be removed in the next release; "
        f"use {_INSTEAD[name]}",
        DeprecationWarning,
        stacklevel=2,
    )
    return _old(name)
