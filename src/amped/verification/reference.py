"""amped's exact reference casts of one layer's GEMM operands, for a named recipe.

Given the high-precision operands a layer's GEMMs started from (its input, weight and
grad_output, read by module hooks) this casts each GEMM's two operands as the recipe
prescribes, in the orientation of :mod:`amped.verification.operands` (``A @ B.T``, the
inner dim last), with amped's casts (:func:`amped.lowp.float8.cast.quantize`,
:func:`amped.lowp.mx.block_operand.block_operand`), which are bitwise torchao's
(tests/lowp). A recipe's random draws are the layer's: stochastic rounding's generator
seeded from ``(seed, draws)`` as :meth:`amped.lowp.BlockLinear.rounding_generator` seeds
it, used by grad_input's cast and then grad_weight's, and the Hadamard signs of
``seed``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from amped.lowp.convert import CONFIGS, LowPrecisionConfig
from amped.lowp.float8.cast import quantize
from amped.lowp.float8.config import CastRule, Float8Config
from amped.lowp.mx.block_config import BlockConfig
from amped.lowp.mx.block_format import SCALE_MODES
from amped.lowp.mx.block_operand import block_operand
from amped.lowp.mx.hadamard import HADAMARD_SIZE, hadamard_signs
from amped.verification.operands import Operand, from_amped, plain

__all__ = ["LayerInputs", "alternatives", "reference_operands"]


@dataclass(frozen=True)
class LayerInputs:
    """The high-precision tensors one layer's GEMMs start from.

    Attributes:
        x: the input as the layer computes with it, ``[tokens, in]``.
        weight: ``[out, in]`` in the parameter's dtype.
        grad_output: ``[tokens, out]``, or None before backward.
        rng: ``(seed, draws)`` of the layer's stochastic rounding and Hadamard signs
            at this backward (amped's block layers), or None.
        grad_input: whether the step computes the grad-input GEMM (not where the
            layer's input needs no gradient).
    """

    x: torch.Tensor
    weight: torch.Tensor
    grad_output: torch.Tensor | None = None
    rng: tuple[int, int] | None = None
    grad_input: bool = True


def _float8(rule: CastRule, x: torch.Tensor, power_of_2: bool) -> Operand:
    assert rule.granularity != "blockwise"  # fp8-blockwise: refused by verify first
    return from_amped(x, quantize(x, rule.dtype, rule.granularity, -1, power_of_2))


def _float8_operands(cfg: Float8Config, t: LayerInputs) -> dict[str, tuple[Operand, Operand]]:
    p2 = cfg.power_of_2
    out = {"forward": (_float8(cfg.input, t.x, p2), _float8(cfg.weight, t.weight, p2))}
    go = t.grad_output
    if go is None:
        return out
    out["grad_input"] = (_float8(cfg.grad_output, go, p2), _float8(cfg.w_gi, t.weight.t(), p2))
    if cfg.grad_weight_hp:
        out["grad_weight"] = (plain(go.t()), plain(t.x.to(go.dtype).t()))
    else:
        x_t = t.x.to(go.dtype).t()
        out["grad_weight"] = (_float8(cfg.grad_output, go.t(), p2), _float8(cfg.input, x_t, p2))
    return out


def _pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -x.shape[0] % multiple
    return x if extra == 0 else torch.cat([x, x.new_zeros(extra, x.shape[1])])


def _block(x: torch.Tensor, cfg: BlockConfig, **options: object) -> Operand:
    cast = block_operand(
        x,
        cfg.format,
        cfg.scale_mode,
        dtype=None,
        keep_cast=True,
        **options,  # type: ignore[arg-type]
    )
    if options.get("dim") == 0:
        cast = cast.t()
    assert cast.cast is not None  # keep_cast
    return from_amped(x, cast.cast)


def _block_operands(cfg: BlockConfig, t: LayerInputs) -> dict[str, tuple[Operand, Operand]]:
    w2d = cfg.weight_2d
    out = {"forward": (_block(t.x, cfg), _block(t.weight, cfg, tile_2d=w2d))}
    go = t.grad_output
    if go is None:
        return out
    generator = None
    seed = t.rng[0] if t.rng is not None else cfg.seed
    if cfg.stochastic_rounding:
        draws = t.rng[1] if t.rng is not None else 0
        generator = torch.Generator(go.device).manual_seed((seed << 32) + draws)
    if t.grad_input:  # its cast draws first from the generator
        a = _block(go, cfg, generator=generator)
        out["grad_input"] = (a, _block(t.weight, cfg, dim=0, tile_2d=w2d))
    multiple = max(cfg.format.block_size, HADAMARD_SIZE if cfg.hadamard else 1)
    go_rows, x_rows = _pad_rows(go, multiple), _pad_rows(t.x.to(go.dtype), multiple)
    signs = hadamard_signs(seed).to(go.device) if cfg.hadamard else None
    a = _block(go_rows, cfg, dim=0, generator=generator, hadamard_signs=signs)
    out["grad_weight"] = (a, _block(x_rows, cfg, dim=0, hadamard_signs=signs))
    return out


def reference_operands(
    config: LowPrecisionConfig, inputs: LayerInputs
) -> dict[str, tuple[Operand, Operand]]:
    """Role -> the reference ``(A, B)`` of each GEMM the inputs allow (the forward
    only, without a grad_output), cast as ``config`` prescribes."""
    with torch.no_grad():
        if isinstance(config, Float8Config):
            return _float8_operands(config, inputs)
        return _block_operands(config, inputs)


def alternatives(config: LowPrecisionConfig) -> Iterator[tuple[str, LowPrecisionConfig]]:
    """Configs that differ from ``config`` in the scale rule alone, with a description:
    a cast that matches one of them was cast by that rule instead."""
    if isinstance(config, BlockConfig):
        if config.format.is_mx:
            for mode in SCALE_MODES:
                if mode != config.scale_mode:
                    yield f"{mode} scales", config.replace(scale_mode=mode)
        return
    flip = not config.power_of_2
    yield ("power-of-two" if flip else "unrounded") + " scales", replace(config, power_of_2=flip)
    rules = (config.input, config.weight, config.grad_output, config.w_gi)
    if all(r.granularity == "rowwise" for r in rules):
        yield (
            "tensorwise scales",
            replace(
                config,
                input=CastRule(config.input.dtype),
                weight=CastRule(config.weight.dtype),
                grad_output=CastRule(config.grad_output.dtype),
                weight_for_grad_input=CastRule(config.w_gi.dtype),
            ),
        )


def recipe_config(name: str) -> LowPrecisionConfig:
    """The low-precision config of an amped recipe name (``fp8-rowwise``, ``mxfp8``)."""
    return CONFIGS[name.removeprefix("fp8-")]
