"""FP8 weights on the FSDP2 wire: each rank casts its shard before the all-gather.

FSDP2 (``fully_shard``) all-gathers a parameter's local shards before each forward and
backward. A local shard that defines ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` chooses what travels: a :class:`WireShard` (the local tensor of
a :class:`~amped.lowp.Float8Linear`'s sharded weight) sends its rows cast to FP8, one
byte per element instead of bfloat16's two, and FSDP2 gives the layer a
:class:`GatheredFloat8Weight`, which the layer uses instead of casting the weight again.

**Same bits as one process.** A tensorwise cast is elementwise once the scale is known,
and the scale depends on the whole weight's amax only: before the all-gather the ranks
take the maximum of their shards' amaxes (one ``all_reduce(MAX)`` per layer and
all-gather, over the FSDP mesh; a NaN travels as a flag beside it, since a MAX
reduction may drop it), compute the scale from it exactly as the unsharded layer does
(dynamically, or by delayed scaling's rule, which records that amax too), and cast
their rows. The gathered FP8 weight and its scale are then bit for bit the unsharded
layer's cast. This holds where the backward reuses the forward's weight cast (tensorwise
``weight`` and ``weight_for_grad_input`` rules: ``fp8-tensorwise``, ``fp8-delayed``);
:func:`wire_refusal` says why the others cannot.

**Uneven shards.** FSDP2 pads every rank's shard to ``ceil(rows / world)`` rows (padding
after the last rank's rows, as ``torch.chunk`` cuts); a rank sends its FP8 rows and
zero bytes for the padding, and the gathered weight is cut to the real rows.

**Gradients.** The gathered weight is a tensor of the parameter's dtype (bfloat16 or
float32) to autograd and FSDP2: the layer's backward returns a plain gradient of that
dtype, which FSDP2 reduce-scatters as for any weight. Ops other than views on a
gathered weight (a health monitor's statistics, say) see its dequantized value.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from amped._internal.torch_compat import DISABLED_TORCH_FUNCTION, make_wrapper_subclass
from amped._internal.trees import map_tensors
from amped.lowp.float8.cast import Float8Tensor, amax_to_scale, cast_saturated
from amped.lowp.float8.config import Float8Config

__all__ = [
    "GatheredFloat8Weight",
    "WireShard",
    "first_gathered",
    "gathered_fp8",
    "global_amax",
    "in_param_dtype",
    "wire_refusal",
]

_WEIGHT = 1  # amped.lowp.float8.delayed.WEIGHT (not imported: delayed imports nothing of ours)


def wire_refusal(config: Float8Config) -> str | None:
    """Why a layer with ``config`` cannot all-gather FP8 weights exactly, or None if it can.

    The wire carries one FP8 cast of the weight, which must serve every GEMM the weight
    enters: the backward must reuse the forward's cast, which needs the same tensorwise
    rule in both (a rowwise cast of the grad-input GEMM scales each input feature by an
    amax over all output rows, across the shards, from the high-precision weight).
    """
    if config.blockwise:
        return (
            "its weight is cast in 128x128 tiles, each with its own scale, and the FP8 "
            "wire carries one scale per tensor; it all-gathers the weight in its dtype "
            "and each rank casts the whole weight (the same bits)"
        )
    if config.weight.granularity != "tensorwise":
        return (
            "its forward casts the weight rowwise and its backward casts it again along "
            "the other dim (one scale per input feature, from every rank's rows), so one "
            "FP8 cast cannot serve both GEMMs"
        )
    if config.w_gi != config.weight:
        return (
            "its grad-input GEMM casts the weight by another rule than the forward, so "
            "the backward needs the high-precision weight"
        )
    return None


@torch.no_grad()
def global_amax(shard: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The largest magnitude over every rank's ``shard`` (float32 scalar; NaN if any rank
    holds a NaN, as ``max`` over the whole tensor gives). One all-reduce of 2 numbers."""
    local = (shard.abs().max() if shard.numel() else shard.new_zeros(())).to(torch.float32)
    isnan = torch.isnan(local)
    both = torch.stack([torch.where(isnan, torch.inf, local), isnan.to(torch.float32)])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return torch.where(both[1] > 0, torch.nan, both[0])


def in_param_dtype(shard: torch.Tensor, mp_policy: Any) -> torch.Tensor:
    """``shard`` as the layer would cast it: in a MixedPrecisionPolicy's ``param_dtype``."""
    param_dtype = getattr(mp_policy, "param_dtype", None)
    return shard if param_dtype in (None, shard.dtype) else shard.to(param_dtype)


def first_gathered(out: torch.Tensor, kind: type[torch.Tensor]) -> Any:
    """``out``, the weight a wire made at its first all-gather, which FSDP2 refills."""
    if not isinstance(out, kind):
        raise TypeError(
            f"FSDP2 passed an unsharded weight that is not the {kind.__name__} made at its "
            "first all-gather; reshard the model and call amped.prepare again. "
            f"Received: type(out)={type(out).__name__}"
        )
    return out


class WireShard(torch.Tensor):
    """A sharded Float8Linear weight's local tensor that all-gathers itself in FP8.

    A plain tensor in every other respect (the same storage and values; every op on it
    returns a plain tensor), so optimizers, state dicts and checkpoints see the shard.
    FSDP2 calls the two hooks below with the module that owns the weight.
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
        """This rank's rows cast to FP8 with the whole weight's scale, padded to FSDP2's
        shard size and sent as bytes (uint8: every backend all-gathers it, and FSDP2
        packs the group's other parameters beside it as bytes too)."""
        layer: Any = module  # a Float8Linear (not imported: it imports this module)
        config: Float8Config = layer.float8_config
        dtype = config.weight.dtype
        shard = in_param_dtype(self, mp_policy)
        amax = global_amax(shard, mesh.get_group())
        if config.delayed is None:
            scale = amax_to_scale(amax, dtype, config.power_of_2)
        else:
            scale = layer.fp8_delayed_scale(amax, _WEIGHT, reduced=True)
        rows = -(-outer_size[0] // mesh.size())
        wire = torch.zeros((rows, *self.shape[1:]), dtype=torch.uint8, device=self.device)
        wire[: self.shape[0]] = cast_saturated(shard, scale, dtype).view(torch.uint8)
        return (wire,), (scale, dtype)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The gathered bytes as a :class:`GatheredFloat8Weight` (FSDP2 cuts the padding
        rows away); at later all-gathers FSDP2 refills the same memory and passes the
        weight made the first time as ``out``, whose scale is renewed here."""
        (wire,) = all_gather_outputs
        scale, dtype = metadata
        if out is not None:
            first_gathered(out, GatheredFloat8Weight).fp8_scale = scale
            return None
        return GatheredFloat8Weight(wire.view(dtype), scale, param_dtype), (wire,)


class GatheredFloat8Weight(torch.Tensor):
    """An all-gathered FP8 weight: ``fp8_data / fp8_scale``, a tensor of the parameter's
    dtype to autograd and FSDP2 (see the module).

    Attributes:
        fp8_data: the FP8 weight, the parameter's shape.
        fp8_scale: its float32 scale (``weight ~= fp8_data / fp8_scale``).
    """

    fp8_data: torch.Tensor
    fp8_scale: torch.Tensor
    __torch_function__ = DISABLED_TORCH_FUNCTION

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Any:
        self = make_wrapper_subclass(cls, data.shape, data.stride(), dtype, data.device)
        self.fp8_data, self.fp8_scale = data, scale
        return self

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"GatheredFloat8Weight(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"fp8={self.fp8_data.dtype}, scale={self.fp8_scale})"
        )

    def dequantized(self) -> torch.Tensor:
        """``fp8_data / fp8_scale`` in the weight's dtype (a new plain tensor)."""
        return Float8Tensor(self.fp8_data, self.fp8_scale).dequantize(self.dtype)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _VIEWS and isinstance(args[0], cls):
            # A view (FSDP2's as_strided to the unpadded rows, nn.Parameter's detach, a
            # Conv1D's transpose) stays an FP8 weight over the same bytes.
            weight = args[0]
            data = func(weight.fp8_data, *args[1:], **kwargs)
            return cls(data, weight.fp8_scale, weight.dtype)

        def plain(tensor: torch.Tensor) -> torch.Tensor:
            return tensor.dequantized() if isinstance(tensor, cls) else tensor

        return func(*map_tensors(plain, args), **map_tensors(plain, kwargs))


_aten = torch.ops.aten
_VIEWS = frozenset(
    {
        _aten.detach.default,
        _aten.alias.default,
        _aten.as_strided.default,
        _aten.t.default,
        _aten.transpose.int,
        _aten.view.default,
    }
)


def gathered_fp8(weight: torch.Tensor) -> Float8Tensor | None:
    """The FP8 cast FSDP2 all-gathered for ``weight``, or None for any other tensor."""
    if isinstance(weight, GatheredFloat8Weight):
        return Float8Tensor(weight.fp8_data, weight.fp8_scale)
    return None
