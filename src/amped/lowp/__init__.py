"""Low-precision training: FP8 (:mod:`.float8`) and the block formats MXFP8, MXFP4 and
NVFP4 (:mod:`.mx`), with what they share beside them.

- :mod:`.convert`: which ``nn.Linear``/``Conv1D`` layers convert, and the conversion;
- :mod:`.health`: the GEMMs' operand probes (range, non-finite values) that
  :func:`amped.monitor` reads;
- :mod:`.conv1d`: transformers' ``Conv1D`` treated as a transposed Linear.

Below the recipes layer; :mod:`amped.recipes.fp8` builds the ``fp8-*`` and block
recipes on it. Exported here is what converting a model and checking its numerics
needs; the building blocks (``scaled_mm``, ``quantize``, ``quantize_block``, ...) are
importable from their modules.
"""

from amped.lowp.convert import convert_to_fp8
from amped.lowp.float8.config import FP8_CONFIGS, Fp8Config
from amped.lowp.float8.linear import Float8Linear
from amped.lowp.mx.block_config import BLOCK_CONFIGS

__all__ = [
    "BLOCK_CONFIGS",
    "FP8_CONFIGS",
    "Float8Linear",
    "Fp8Config",
    "convert_to_fp8",
]
