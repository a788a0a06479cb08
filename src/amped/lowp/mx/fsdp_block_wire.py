"""NVFP4 weights on the FSDP2 wire: each rank casts its rows to 16x16 FP4 tiles first.

The block-format counterpart of :mod:`.fsdp_wire`. An ``nvfp4`` layer (``weight_2d``)
casts its weight in 16x16 tiles (one E4M3 scale per tile, one float32 tensor scale),
and that one cast serves both GEMMs the weight enters (the tiles are the same along
either dim). A :class:`BlockWireShard` (the local tensor of a
:class:`~amped.lowp.BlockLinear`'s sharded weight) sends its rows so cast: the E2M1
elements packed two per byte and its tiles' scales, half a byte per element plus one
byte per 256 (a quarter of bfloat16's bytes, plus 1/512 of them), and FSDP2 gives the
layer a :class:`GatheredBlockWeight`, which the layer reads instead of casting again
(:meth:`~amped.lowp.BlockLinear.block_operand`).

**Same bits as one process.** The tensor scale depends on the whole weight's amax only:
the ranks take the maximum of their shards' amaxes first (one ``all_reduce(MAX)`` per
layer and all-gather, :func:`~amped.lowp.float8.fsdp_wire.global_amax`). Each tile's scale
depends on its own 256 elements only, so where every shard holds whole tiles (its rows
a multiple of 16) each rank casts its tiles as the unsharded cast does.

**Where it does not apply** (:func:`block_wire_refusal`): MX formats and ``nvfp4``
without ``weight_2d`` (blocks along the input features in the forward and along the
output features in the grad-input GEMM, which cross the shards); a Conv1D twin (its
weight is stored transposed); shards that are uneven or not whole tiles; and a mesh of
one rank (nothing travels; FSDP2 reads only the first of the wire's two inputs there). FSDP2
requires a rank whose shard is shorter than the padded shard (uneven sharding) to send
all-gather inputs of the padded shard's shape, at least a byte per element, so packed
FP4 can travel only where the weight's rows split evenly into whole tiles.
"""

from __future__ import annotations

from typing import Any

import torch

from amped._internal.torch_compat import DISABLED_TORCH_FUNCTION, make_wrapper_subclass
from amped._internal.trees import map_tensors
from amped.lowp.float8.fsdp_wire import first_gathered, global_amax, in_param_dtype
from amped.lowp.mx.block_cast import BlockTensor, nvfp4_tensor_scale, quantize_block
from amped.lowp.mx.block_config import BlockConfig
from amped.lowp.mx.block_format import BLOCK_FORMATS, BlockFormat
from amped.lowp.mx.block_operand import BlockOperand
from amped.lowp.mx.e2m1 import unpack_e2m1

__all__ = ["BlockWireShard", "GatheredBlockWeight", "block_wire_refusal", "gathered_block"]

TILE = 16
"""The rows (and columns) of an NVFP4 weight tile."""


def block_wire_refusal(
    config: BlockConfig, rows: int, world: int, transposed: bool = False
) -> str | None:
    """Why a block layer's weight of ``rows`` rows, sharded on dim 0 over ``world``
    ranks, cannot all-gather in its block format exactly, or None if it can."""
    if config.format is not BLOCK_FORMATS["nvfp4"] or not config.weight_2d:
        return (
            "its block cast runs along the input features in the forward and along the "
            "output features in the grad-input GEMM (crossing the shards), from the "
            "high-precision weight its backward saves; only nvfp4's 16x16 weight tiles "
            "serve both GEMMs"
        )
    if world == 1:
        return (
            "a mesh of one rank all-gathers nothing (and FSDP2 then reads only a weight's "
            "first all-gather input, where the FP4 wire sends two: elements and scales)"
        )
    if transposed:
        return "a Conv1D's weight is stored transposed, so a dim-0 shard cuts its tiles' other dim"
    if rows % (TILE * world):
        return (
            f"its {rows} rows do not split into {world} equal shards of whole 16-row "
            f"tiles (a multiple of {TILE * world} rows is needed: FSDP2 makes an uneven "
            "shard send the padded shard's shape, a byte per element at least)"
        )
    return None


class BlockWireShard(torch.Tensor):
    """A sharded NVFP4 BlockLinear weight's local tensor that all-gathers itself in FP4.

    A plain tensor in every other respect (see :class:`~amped.lowp.float8.fsdp_wire.WireShard`).
    """

    __torch_function__ = DISABLED_TORCH_FUNCTION

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: torch.nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This rank's rows cast to NVFP4 tiles with the whole weight's tensor scale:
        the packed elements (uint8, ``[rows, in / 2]``) and one E4M3 scale per tile
        (uint8, ``[rows / 16, in / 16]``)."""
        layer: Any = module  # a BlockLinear (not imported: it imports this module)
        fmt: BlockFormat = layer.block_config.format
        shard = in_param_dtype(self, mp_policy)
        tensor_scale = nvfp4_tensor_scale(global_amax(shard, mesh.get_group()))
        cast = quantize_block(shard, fmt, tensor_scale=tensor_scale, tile_2d=True)
        packed = cast.data.view(torch.uint8)
        tiles = cast.scale_bits[::TILE].contiguous()  # every row of a tile holds its scale
        return (packed, tiles), (tensor_scale, fmt)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The gathered bytes as a :class:`GatheredBlockWeight`; at later all-gathers
        FSDP2 refills the same memory and passes the weight made the first time as
        ``out``, whose tensor scale is renewed here."""
        packed, tiles = all_gather_outputs
        tensor_scale, fmt = metadata
        if out is not None:
            first_gathered(out, GatheredBlockWeight).tensor_scale = tensor_scale
            return None
        weight = GatheredBlockWeight(packed, tiles, tensor_scale, fmt, param_dtype)
        return weight, (packed, tiles)


class GatheredBlockWeight(torch.Tensor):
    """An all-gathered NVFP4 weight in 16x16 tiles, a tensor of the parameter's dtype
    to autograd and FSDP2; other ops than the views FSDP2 takes see its dequantized value.

    Attributes:
        packed: the E2M1 elements, two per byte (uint8, ``[out, in / 2]``).
        tiles: one E4M3 scale per tile, its bits (uint8, ``[out / 16, in / 16]``).
        tensor_scale: the float32 tensor scale.
        format: the block format (nvfp4).
    """

    packed: torch.Tensor
    tiles: torch.Tensor
    tensor_scale: torch.Tensor
    format: BlockFormat
    __torch_function__ = DISABLED_TORCH_FUNCTION

    @staticmethod
    def __new__(
        cls,
        packed: torch.Tensor,
        tiles: torch.Tensor,
        tensor_scale: torch.Tensor,
        format: BlockFormat,
        dtype: torch.dtype,
    ) -> Any:
        shape = torch.Size((packed.shape[0], 2 * packed.shape[1]))
        self = make_wrapper_subclass(cls, shape, (shape[1], 1), dtype, packed.device)
        self.packed, self.tiles = packed, tiles
        self.tensor_scale, self.format = tensor_scale, format
        return self

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"GatheredBlockWeight(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"format={self.format.name}, tensor_scale={self.tensor_scale})"
        )

    def cast(self, dim: int = -1) -> BlockTensor:
        """The weight's cast as :func:`~amped.lowp.mx.block_operand.block_operand` keeps it
        for blocks along ``dim`` (-1, or 0: one scale per tile and column)."""
        elements = unpack_e2m1(self.packed)
        axis = 0 if dim == -1 else 1
        scale_bits = self.tiles.repeat_interleave(TILE, dim=axis)
        return BlockTensor(elements, scale_bits, self.tensor_scale, self.format)

    def operand(self, dim: int, dtype: torch.dtype | None, keep_cast: bool) -> BlockOperand:
        """The GEMM operand the layer would have cast from the unsharded weight: block
        values in ``dtype`` (None: none) and, with ``keep_cast``, the cast."""
        rows = self.cast()  # a tile's values are the same read along either dim
        values = None if dtype is None else rows.block_values(dtype)
        cast = (rows if dim == -1 else self.cast(dim)) if keep_cast else None
        return BlockOperand(values, self.tensor_scale, cast)

    def dequantized(self) -> torch.Tensor:
        """The weight read back in its dtype (a new plain tensor)."""
        return self.cast().dequantize(self.dtype)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        weight = args[0] if args else None
        if isinstance(weight, cls) and _is_identity_view(func, weight, args[1:], kwargs):
            # FSDP2's as_strided to the unsharded shape, nn.Parameter's detach
            w = weight
            return cls(w.packed, w.tiles, w.tensor_scale, w.format, w.dtype)

        def plain(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.dequantized() if isinstance(tensor, cls) else tensor

        return func(*map_tensors(plain, args), **map_tensors(plain, kwargs))


_aten = torch.ops.aten


def _is_identity_view(func: Any, weight: torch.Tensor, args: tuple[Any, ...], kwargs: Any) -> bool:
    if func in (_aten.detach.default, _aten.alias.default):
        return True
    if func is _aten.as_strided.default:
        size, stride = args[0], args[1]
        offset = args[2] if len(args) > 2 else kwargs.get("storage_offset", 0)
        same = tuple(size) == tuple(weight.shape) and tuple(stride) == weight.stride()
        return same and not offset
    return False


def gathered_block(weight: torch.Tensor) -> GatheredBlockWeight | None:
    """The NVFP4 cast FSDP2 all-gathered for ``weight``, or None for any other tensor."""
    return weight if isinstance(weight, GatheredBlockWeight) else None
