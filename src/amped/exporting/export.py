"""``amped.export``: write a trained model in the inference format of its recipe.

The steps, each in :mod:`amped.exporting`'s module of that name:

1. find the layers the recipe trained in low precision (:mod:`.grid`) and the format:
   by default the one they trained in; another one only with ``requantize=True``;
2. cast each one's weight with the quantizer its forward used (:mod:`.grid`) and lay
   the casts out as the format stores them (:mod:`.compressed`);
3. write ``model.safetensors`` and ``config.json`` (a transformers model's own config,
   with the ``quantization_config`` added) into a temporary folder beside ``path``;
4. with ``check=True``, read it back with compressed-tensors and compare weights and
   logits bit for bit (:mod:`.check`);
5. only then move it to ``path``. Any failure removes the temporary folder, so a failed
   export leaves nothing at ``path`` (and an existing folder as it was).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from amped._internal.errors import type_error, value_error
from amped.exporting import deepseek
from amped.exporting.check import check_export
from amped.exporting.compressed import layer_tensors, quantization_config
from amped.exporting.formats import EXPORT_FORMATS, ExportFormat, export_format
from amped.exporting.grid import LayerGrid, layer_grid, low_precision_layers, trained_format
from amped.lowp import BlockLinear, Float8Linear
from amped.recipes import TrainSetup

__all__ = ["export"]

_HELD_OUT = (2, 2, 16)  # held-out batches of token ids for a transformers model: 2 of 2x16


def _model_and_region(
    setup_or_model: TrainSetup | torch.nn.Module,
) -> tuple[torch.nn.Module, Callable[[], contextlib.AbstractContextManager[Any]]]:
    if isinstance(setup_or_model, TrainSetup):
        return setup_or_model.model, setup_or_model.autocast
    if isinstance(setup_or_model, torch.nn.Module):
        return setup_or_model, contextlib.nullcontext
    raise type_error(
        "export takes what amped.prepare returned (a TrainSetup) or its model",
        "setup_or_model",
        setup_or_model,
    )


def _choose_format(
    layers: dict[str, Float8Linear | BlockLinear], format: str | None, requantize: bool
) -> ExportFormat:
    trained = {trained_format(layer) for layer in layers.values()}
    if format is None:
        if len(trained) != 1 or next(iter(trained)) not in EXPORT_FORMATS:
            raise value_error(
                f"The model trained in {sorted(trained)}, which has no export format of its "
                f"own; name one of {sorted(EXPORT_FORMATS)} as format= and pass "
                "requantize=True (a new grid, not the trained one)",
                "format",
                format,
            )
        return EXPORT_FORMATS[next(iter(trained))]
    fmt = export_format(format)
    other = sorted(trained - {fmt.name})
    if other and not requantize:
        raise value_error(
            f"The model trained in {other}, not {fmt.name}: exporting it to {fmt.name} "
            "re-quantizes its weights to a grid it never trained on. Export to the format "
            "it trained in, or pass requantize=True (--requantize) to accept that",
            "format",
            format,
        )
    if other:
        warnings.warn(
            f"Re-quantizing layers trained in {other} to {fmt.name}: the served weights "
            "are not the trained grid",
            stacklevel=3,
        )
    return fmt


def _held_out_batches(model: torch.nn.Module, inputs: Iterable[Any] | None) -> list[Any]:
    if inputs is not None:
        return list(inputs)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int):
        raise value_error(
            "check=True runs the exported and the trained forward on held-out batches; "
            "pass them as inputs= (tensors or dicts of keyword arguments), or check=False",
            "inputs",
            inputs,
        )
    count, batch, length = _HELD_OUT
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(vocab, (count, batch, length), generator=generator)
    return [t.to(device) for t in tokens]


def _tensors(
    model: torch.nn.Module, grids: list[LayerGrid], fmt: ExportFormat
) -> dict[str, torch.Tensor]:
    """The file's tensors: the quantized layers' and the rest as they are (a tied
    weight once, under its first name, as transformers saves it)."""
    quantized = {grid.name for grid in grids}
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in model.state_dict().items():
        if key.rpartition(".")[0] in quantized:
            continue
        pointer = value.untyped_storage().data_ptr()
        if pointer in seen:
            continue
        seen.add(pointer)
        tensors[key] = value.detach().contiguous().cpu()
    for grid in grids:
        layer = deepseek.layer_tensors(grid) if fmt.is_deepseek else layer_tensors(grid, fmt)
        for name, value in layer.items():
            tensors[f"{grid.name}.{name}"] = value.cpu()
    return tensors


def _config(model: torch.nn.Module, fmt: ExportFormat, layers: list[str]) -> dict[str, Any]:
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    document: dict[str, Any] = dict(to_dict()) if callable(to_dict) else {}
    if fmt.is_deepseek:  # the loader converts every nn.Linear but those named
        kept = [
            name
            for name, module in model.named_modules()
            if type(module) is torch.nn.Linear and name not in layers
        ]
        document["quantization_config"] = deepseek.quantization_config(kept)
    else:
        document["quantization_config"] = quantization_config(fmt, layers)
    return document


def _prepare_path(path: Path, force: bool) -> None:
    if path.exists() and not force:
        raise FileExistsError(
            f"{path} exists; export does not overwrite it. Pass force=True (--force) to "
            "replace it, or choose another folder"
        )
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a folder; export writes a folder")


def export(
    setup_or_model: TrainSetup | torch.nn.Module,
    path: str | os.PathLike[str],
    format: str | None = None,
    check: bool = True,
    *,
    requantize: bool = False,
    force: bool = False,
    inputs: Iterable[Any] | None = None,
) -> Path:
    """Write a trained model to ``path`` in the inference format of its recipe.

    The low-precision layers' weights are cast with the quantizer their forward used
    and stored as compressed-tensors stores them (``nvfp4``, ``mxfp8``, ``mxfp4``) or
    as DeepSeek-V3 does (``fp8-blockwise``: ``weight`` E4M3 and ``weight_scale_inv``):
    ``model.safetensors`` and ``config.json`` with the ``quantization_config`` their
    loaders read; the layers the recipe kept in high precision stay so; a
    transformers model's config is copied through. See docs/export.md.

    Args:
        setup_or_model: what :func:`amped.prepare` returned, or its model.
        path: the folder to write (created; its parent must exist).
        format: ``"nvfp4"``, ``"mxfp8"``, ``"mxfp4"`` or ``"fp8-blockwise"``; default
            the format the recipe trained in.
        check: read the folder back with an independent reader (compressed-tensors'
            decompressor; for ``fp8-blockwise`` a dequantizer written from the format's
            description) and require the training grid and the training forward's
            logits, bit for bit (docs/export.md says where NVFP4 cannot be).
            compressed-tensors' layouts need compressed-tensors installed.
        requantize: allow a format the model did not train in (warns: a new grid).
        force: replace an existing folder at ``path``.
        inputs: the held-out batches of the check (tensors, or dicts of keyword
            arguments); default, for a transformers model, two batches of random tokens.

    Returns:
        The folder written.

    Raises:
        TypeError: ``setup_or_model`` is neither.
        ValueError: no low-precision layers, a format the model did not train in
            without ``requantize``, or a layer the format cannot hold (named).
        FileExistsError: ``path`` exists and ``force`` is False.
        amped.exporting.check.ExportCheckError: the check failed; nothing was written.

    Example:
        >>> import tempfile, torch, amped
        >>> layers = [torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)]
        >>> model = torch.nn.Sequential(*layers)  # the first converts; the head stays
        >>> setup = amped.prepare(model, torch.optim.SGD(model.parameters()), "mxfp8")
        >>> out = tempfile.mkdtemp() + "/served"
        >>> folder = amped.export(setup, out, inputs=[torch.randn(2, 64)])
        >>> sorted(p.name for p in folder.iterdir())
        ['config.json', 'model.safetensors']
    """
    from safetensors.torch import save_file

    model, region = _model_and_region(setup_or_model)
    layers = low_precision_layers(model)
    if not layers:
        raise value_error(
            "The model has no low-precision layers (Float8Linear or BlockLinear) to "
            "export; prepare it with an FP8 or block recipe (amped.prepare)",
            "setup_or_model",
            type(setup_or_model).__name__,
        )
    fmt = _choose_format(layers, format, requantize)
    target = Path(path)
    _prepare_path(target, force)
    grids = [layer_grid(name, layer, fmt) for name, layer in layers.items()]
    batches = _held_out_batches(model, inputs) if check else []
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        save_file(_tensors(model, grids, fmt), str(staging / "model.safetensors"), {"format": "pt"})
        document = _config(model, fmt, [grid.name for grid in grids])
        (staging / "config.json").write_text(json.dumps(document, indent=2, sort_keys=True))
        if check:
            check_export(staging, model, grids, fmt, batches, region)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
