"""Low-precision training: FP8 (:mod:`.float8`) and the block formats MXFP8, MXFP4 and
NVFP4 (:mod:`.mx`), with what they share beside them.

- :mod:`.convert`: which ``nn.Linear``/``Conv1D`` layers convert, and the conversion;
- :mod:`.health`: the GEMMs' operand probes (range, non-finite values) that
  :func:`amped.monitor` reads;
- :mod:`.conv1d`: transformers' ``Conv1D`` treated as a transposed Linear.

Below the recipes layer; :mod:`amped.recipes.lowp` builds the ``fp8-*`` and block
recipes on it. Exported here is what converting a model needs: one conversion,
:func:`convert_to_low_precision`, for every format, chosen by its config
(:class:`Float8Config` or :class:`BlockConfig`; the named ones in :data:`CONFIGS`),
and the two layers it makes. The building blocks (``scaled_mm``, ``quantize``,
``quantize_block``, ...) are importable from their modules.
"""

from amped.lowp.attention import scaled_dot_product_attention
from amped.lowp.attention_config import AttentionConfig
from amped.lowp.convert import CONFIGS, convert_to_low_precision
from amped.lowp.float8.config import Float8Config
from amped.lowp.float8.linear import Float8Linear
from amped.lowp.mx.block_config import BlockConfig
from amped.lowp.mx.block_linear import BlockLinear

__all__ = [
    "CONFIGS",
    "AttentionConfig",
    "BlockConfig",
    "BlockLinear",
    "Float8Config",
    "Float8Linear",
    "convert_to_low_precision",
    "scaled_dot_product_attention",
]
