"""``check=True``: read the exported folder back with an independent reader and compare.

1. **Weights.** DeepSeek's FP8 layout: the pure-torch dequantizer of
   :mod:`.deepseek`, written from the format's description, must read the training grid
   bit for bit (E4M3 elements, float32 ``weight_scale_inv``, and their product).
   compressed-tensors' layouts: compressed-tensors' own parser reads config.json's
   ``quantization_config`` and its own decompressor (the one its loaders call) each
   quantized layer's tensors. MX: the decompressed weight (bfloat16 block values,
   exact) must equal the training grid's block values bit for bit. NVFP4: the E2M1
   elements compressed-tensors unpacks and the E4M3 block scales it reads must equal
   the grid's bit for bit, and its decompressed weight must be what its formula
   ``e * (scale / global_scale)`` gives from them (so the tensors sit where it reads them).
2. **Logits.** A copy of the model whose quantized layers are
   :class:`~amped.exporting.served.ServedLinear` (the format's served forward, its
   weights from step 1) and whose other weights come from the file must give the
   training forward's logits bit for bit on held-out batches, in the recipe's autocast
   region. One exception, NVFP4: compressed-tensors stores the reciprocal of the
   weight's float32 tensor scale, and ``1 / (1 / t)`` is ``t`` again only for most
   ``t``; a layer where it is not is served with a scale one float32 ulp off, which can
   move the logits by an ulp, so for NVFP4 the logits are compared bitwise only when
   every weight's scale survives the round trip (else the check says so, as a warning).
   A re-quantized export (``requantize=True``) is checked by step 1 alone: the training
   forward never ran on its grid.
"""

from __future__ import annotations

import contextlib
import copy
import json
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from amped.exporting.deepseek import TILE, dequantize
from amped.exporting.formats import ExportFormat
from amped.exporting.grid import LayerGrid
from amped.exporting.served import ServedBlockwiseLinear, ServedLinear
from amped.lowp.float8.blockwise import BlockwiseTensor
from amped.lowp.mx.block_cast import BlockTensor

__all__ = ["ExportCheckError", "check_export", "read_layers"]


class ExportCheckError(RuntimeError):
    """The exported file does not read back as the training grid or forward."""


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.itemsize == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.dtype.itemsize]
    return torch.equal(a.contiguous().view(width), b.contiguous().view(width))


def _under(tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """The tensors of module ``name`` itself (not of its children), by local name."""
    prefix = f"{name}."
    return {
        k[len(prefix) :]: v
        for k, v in tensors.items()
        if k.startswith(prefix) and "." not in k[len(prefix) :]
    }


def _read_deepseek(
    folder: Path, grids: list[LayerGrid]
) -> tuple[dict[str, torch.nn.Module], dict[str, torch.Tensor]]:
    """DeepSeek's layout, read by :func:`amped.exporting.deepseek.dequantize`: the stored
    E4M3 weight and ``weight_scale_inv`` must be the grid's, bit for bit, and so must
    their dequantization (float32)."""
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    if config["weight_block_size"] != [TILE, TILE]:
        raise ExportCheckError(f"weight_block_size is {config['weight_block_size']}")
    tensors = load_file(str(folder / "model.safetensors"))
    served: dict[str, torch.nn.Module] = {}
    for grid in grids:
        local = _under(tensors, grid.name)
        cast = grid.weight
        assert isinstance(cast, BlockwiseTensor)
        weight, scale_inv = local["weight"], local["weight_scale_inv"]
        if grid.transposed:  # stored [in, out], as the model keeps it
            weight, scale_inv = weight.t().contiguous(), scale_inv.t().contiguous()
        ok = (
            _bitwise_equal(weight, cast.data)
            and _bitwise_equal(scale_inv, cast.scale_inv)
            and _bitwise_equal(dequantize(weight, scale_inv), cast.dequantize(torch.float32))
        )
        if not ok:
            raise ExportCheckError(
                f"Layer {grid.name!r}: the file's weight does not dequantize to the training "
                "grid (fp8-blockwise); the export is wrong. Report it with the model."
            )
        values = weight.to(torch.float32)
        served[grid.name] = ServedBlockwiseLinear(
            values, scale_inv, local.get("bias"), grid.power_of_2
        )
    rest = {k: v for k, v in tensors.items() if k.rpartition(".")[0] not in served}
    return served, rest


def _nvfp4_layer(
    local: dict[str, torch.Tensor], weight: torch.Tensor, cast: BlockTensor
) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """NVFP4: whether compressed-tensors reads the grid (its unpacked elements, its
    scales, its formula ``e * (scale / global_scale)``), the exact block values, and the
    tensor scale the served forward takes (``1 / global_scale``)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    packed, scale = local["weight_packed"], local["weight_scale"]
    rows, cols = packed.shape
    elements = unpack_fp4_from_uint8(packed, rows, cols * 2, dtype=torch.float32)
    global_scale = local["weight_global_scale"]
    block_scale = scale.to(torch.float32).repeat_interleave(16, dim=1)
    ok = (
        _bitwise_equal(elements, cast.elements.to(torch.float32))
        and _bitwise_equal(scale.view(torch.uint8), cast.scale_bits)
        and _bitwise_equal(weight, (elements * (block_scale / global_scale)).to(weight.dtype))
    )
    values = elements * block_scale  # exact: 2 x 4 significant bits
    return ok, values, (1.0 / global_scale).reshape(())


def read_layers(
    folder: Path, grids: list[LayerGrid], fmt: ExportFormat
) -> tuple[dict[str, torch.nn.Module], dict[str, torch.Tensor], list[str]]:
    """Read and check the quantized layers (step 1 of the module); return their served
    layers, the file's other tensors, and the layers whose NVFP4 tensor scale does not
    survive the round trip through its reciprocal."""
    if fmt.is_deepseek:
        return (*_read_deepseek(folder, grids), [])
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    parsed = QuantizationConfig.model_validate(config["quantization_config"])
    compressor = BaseCompressor.get_value_from_registry(parsed.format)
    tensors = load_file(str(folder / "model.safetensors"))
    served: dict[str, torch.nn.Module] = {}
    inexact: list[str] = []
    for grid in grids:
        scheme = next(g for g in parsed.config_groups.values() if grid.name in g.targets)
        local = _under(tensors, grid.name)
        weight = compressor.decompress(local, scheme)["weight"]
        cast = grid.weight
        assert isinstance(cast, BlockTensor)
        values, tensor_scale = weight, None  # MX: bfloat16 block values, exact
        if fmt.block_format().is_mx:
            ok = _bitwise_equal(weight, cast.block_values(weight.dtype))
        else:
            ok, values, tensor_scale = _nvfp4_layer(local, weight, cast)
            assert cast.tensor_scale is not None  # NVFP4 casts have one
            if not _bitwise_equal(tensor_scale, cast.tensor_scale.reshape(())):
                inexact.append(grid.name)
        if not ok:
            raise ExportCheckError(
                f"Layer {grid.name!r}: compressed-tensors decompresses a weight that is not "
                f"the training grid ({fmt.name}); the export is wrong. Report it with the model."
            )
        served[grid.name] = ServedLinear(fmt, values, tensor_scale, local.get("bias"))
    rest = {k: v for k, v in tensors.items() if k.rpartition(".")[0] not in served}
    return served, rest, inexact


def served_model(
    model: torch.nn.Module, served: dict[str, torch.nn.Module], rest: dict[str, torch.Tensor]
) -> torch.nn.Module:
    """A copy of ``model`` with the served layers in place and the file's other weights."""
    copied = copy.deepcopy(model)
    for name, layer in served.items():
        parent_name, _, child = name.rpartition(".")
        parent = copied.get_submodule(parent_name) if parent_name else copied
        setattr(parent, child, layer)
    result = copied.load_state_dict(rest, strict=False)
    if result.unexpected_keys:
        raise ExportCheckError(f"The file holds tensors the model lacks: {result.unexpected_keys}")
    return copied


def _logits(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    out = model(**batch) if isinstance(batch, dict) else model(batch)
    if hasattr(out, "logits"):
        out = out.logits
    elif isinstance(out, (tuple, list)):
        out = out[0]
    assert isinstance(out, torch.Tensor)
    return out


@torch.no_grad()
def check_export(
    folder: Path,
    model: torch.nn.Module,
    grids: list[LayerGrid],
    fmt: ExportFormat,
    batches: Iterable[Any],
    region: Callable[[], contextlib.AbstractContextManager[Any]],
) -> None:
    """Steps 1 and 2 of the module on ``folder``; ExportCheckError where either fails."""
    served, rest, inexact = read_layers(folder, grids, fmt)
    if not all(grid.trained for grid in grids):
        return  # re-quantized: the training forward ran on another grid (export warned)
    twin = served_model(model, served, rest)
    was_training = model.training
    model.eval()
    twin.eval()
    try:
        for i, batch in enumerate(batches):
            with region():
                trained, serving = _logits(model, batch), _logits(twin, batch)
            if _bitwise_equal(trained, serving):
                continue
            diff = (trained.float() - serving.float()).abs().max().item()
            message = (
                f"Held-out batch {i}: the served forward's logits differ from the training "
                f"forward's (largest difference {diff:.3g})"
            )
            if inexact:
                warnings.warn(
                    f"{message}: NVFP4 stores each weight's tensor scale as its reciprocal, "
                    f"which does not round-trip exactly for layers {inexact}",
                    stacklevel=3,
                )
                return
            raise ExportCheckError(message + "; the export is wrong. Report it with the model.")
    finally:
        model.train(was_training)
