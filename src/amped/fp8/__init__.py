"""FP8 training: casts, scales, the FP8 GEMM and the Float8 linear layer.

Below the recipes layer; :mod:`amped.recipes.fp8` builds the ``fp8-*`` recipes on it.

- :mod:`.cast`: amax, scale and the saturating cast (:func:`quantize`, :func:`sqnr`);
- :mod:`.gemm`: :func:`scaled_mm`, ``torch._scaled_mm`` or its exact emulation;
- :mod:`.config`: :class:`Fp8Config`, the named configs :data:`FP8_CONFIGS`;
- :mod:`.delayed`: delayed (amax-history) scaling state and its per-step update;
- :mod:`.linear`: :class:`Float8Linear`; :mod:`.convert`: which layers convert.

Exported here is what converting a model and checking its numerics needs; the
building blocks (``amax_to_scale``, ``has_scaled_mm``, ``update_delayed_scaling``, ...)
are importable from their modules.
"""

from amped.fp8.block_cast import BlockTensor, quantize_block
from amped.fp8.block_config import BLOCK_CONFIGS, BlockConfig
from amped.fp8.block_format import BLOCK_FORMATS, BlockFormat
from amped.fp8.block_linear import BlockLinear
from amped.fp8.cast import Fp8Tensor, quantize, sqnr
from amped.fp8.config import FP8_CONFIGS, CastRule, DelayedScaling, Fp8Config
from amped.fp8.convert import (
    Fp8Layers,
    ModuleFilter,
    convert_to_fp8,
    default_module_filter,
    plan_fp8,
)
from amped.fp8.gemm import scaled_mm
from amped.fp8.linear import Float8Linear

__all__ = [
    "BLOCK_CONFIGS",
    "BLOCK_FORMATS",
    "FP8_CONFIGS",
    "BlockConfig",
    "BlockFormat",
    "BlockLinear",
    "BlockTensor",
    "CastRule",
    "DelayedScaling",
    "Float8Linear",
    "Fp8Config",
    "Fp8Layers",
    "Fp8Tensor",
    "ModuleFilter",
    "convert_to_fp8",
    "default_module_filter",
    "plan_fp8",
    "quantize",
    "quantize_block",
    "scaled_mm",
    "sqnr",
]
