"""Export a trained model to the formats inference stacks load: :func:`export`.

The layers a recipe trained in low precision are written with the quantizer their
forward used, in compressed-tensors' layout (NVFP4, MXFP8, MXFP4), and, with
``check=True``, read back by compressed-tensors and compared bit for bit with the
training grid and the training forward's logits. See docs/export.md.
"""

from amped.exporting.export import export

__all__ = ["export"]
