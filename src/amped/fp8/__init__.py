"""FP8 and block-format training: casts, scales, GEMMs and the low-precision linear layers.

Below the recipes layer; :mod:`amped.recipes.fp8` builds the ``fp8-*`` recipes on it.

- :mod:`.cast`: amax, scale and the saturating cast (:func:`quantize`, :func:`sqnr`);
- :mod:`.gemm`: :func:`scaled_mm`, ``torch._scaled_mm`` or its exact emulation;
- :mod:`.config`: :class:`Fp8Config`, the named configs :data:`FP8_CONFIGS`;
- :mod:`.delayed`: delayed (amax-history) scaling state and its per-step update;
- :mod:`.linear`: :class:`Float8Linear`; :mod:`.convert`: which layers convert;
- :mod:`.attention`: :func:`scaled_dot_product_attention` with a format per matmul
  (:mod:`.attention_config`: :class:`AttentionConfig`; :mod:`.attention_cast`,
  :mod:`.attention_roles`: its casts and matmuls);
- :mod:`.block_format`, :mod:`.block_cast`, :mod:`.block_gemm`, :mod:`.block_config`,
  :mod:`.block_linear`: the MX and NVFP4 block formats and their ``BlockLinear``;
  :mod:`.block_kernel` (a cast's arithmetic), :mod:`.block_operand` (an emulated GEMM's
  operand, one fused kernel) and :mod:`.compiled_cast` (running casts compiled).

Exported here is what converting a model and checking its numerics needs; the
building blocks (``scaled_mm``, ``quantize``, ``quantize_block``, ``BlockLinear``, ...)
are importable from their modules.
"""

from amped.fp8.attention import scaled_dot_product_attention
from amped.fp8.attention_config import AttentionConfig
from amped.fp8.block_config import BLOCK_CONFIGS
from amped.fp8.config import FP8_CONFIGS, Fp8Config
from amped.fp8.convert import convert_to_fp8
from amped.fp8.linear import Float8Linear

__all__ = [
    "BLOCK_CONFIGS",
    "FP8_CONFIGS",
    "AttentionConfig",
    "Float8Linear",
    "Fp8Config",
    "convert_to_fp8",
    "scaled_dot_product_attention",
]
