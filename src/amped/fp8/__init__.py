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

from amped.fp8.config import FP8_CONFIGS, DelayedScaling, Fp8Config
from amped.fp8.convert import convert_to_fp8
from amped.fp8.gemm import scaled_mm
from amped.fp8.linear import Float8Linear

__all__ = [
    "FP8_CONFIGS",
    "DelayedScaling",
    "Float8Linear",
    "Fp8Config",
    "convert_to_fp8",
    "scaled_mm",
]
