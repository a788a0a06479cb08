"""Low-precision attention you can train with: ``scaled_dot_product_attention`` with a
format per matmul (:mod:`amped.lowp.attention_config`), emulated exactly on any device.

The computation is tiled over query rows and keys (``config.block_size`` each,
:mod:`amped.lowp.attention_tiling`), as FlashAttention is, so the ``T x T`` score matrix
is never held whole: a tile's scores are ``[B, H, block_size, block_size]``::

    forward:   per query tile, over its key tiles (online softmax):
                   S = scale * (Q·Kᵀ) + mask;  m, l = running rowmax, rowsum(exp(S - m))
                   lse = m + log(l)                          (saved, per row)
               then per key tile:  P = exp(S - lse);  O += P·V
    backward:  per tile, S and P again from the saved lse (same casts, same bits):
                   dP = dO·Vᵀ;  delta += rowsum(P * dP)      (a first pass)
                   dS = P * (dP - delta)
                   dV += Pᵀ·dO;  dQ += scale * dS·K;  dK += scale * dSᵀ·Q

P is cast as the final softmax (``exp(S - lse)``), never a running one, so its casts
are those of the whole P; a scale spanning every key of a row (P or dS in FP8 per row,
head or tensor) takes one more pass for that row's amax first. Softmax and its
statistics are float32 (float64 for float64 input); so is every matmul, whose operands
are the FP8 or MX values where a role is cast. A row that sees no key gets
``lse = +inf``, so its P is 0 and its output and gradients 0, as torch's SDPA gives.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from amped._internal.errors import type_error, value_error
from amped.autocast_mode import autocast
from amped.lowp.attention_cast import is_mx
from amped.lowp.attention_config import MX_BLOCK, AttentionConfig, resolve_config
from amped.lowp.attention_dropout import Dropout
from amped.lowp.attention_health import RoleHealth
from amped.lowp.attention_roles import Roles, Tile
from amped.lowp.attention_tiling import Mask, online_lse

__all__ = ["scaled_dot_product_attention"]


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    config: str | AttentionConfig = "fp8",
    layer: torch.nn.Module | None = None,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with each matmul in its format.

    Args:
        query, key, value: ``[batch, heads, seq, head_dim]`` (3-D: no batch dim), as
            torch takes them; float32, bfloat16, float16 or float64.
        attn_mask, is_causal, scale, enable_gqa: as torch's (a boolean mask: True
            attends; a float mask is added, ``-inf`` masks).
        dropout_p: as torch's: P is multiplied by ``keep / (1 - dropout_p)`` before
            ``P·V``, the mask drawn from the default generator, the same in backward
            (:mod:`amped.lowp.attention_dropout`). Set it 0 in evaluation.
        config: an :class:`~amped.lowp.attention_config.AttentionConfig` or a preset
            name (``"fp8"``, ``"fp8-forward"``, ``"fp8-all-but-ds"``, ``"mxfp8"``,
            ``"bf16"``: no casts).
        layer: the module this attention belongs to, if any: an observer attached to it
            (:func:`amped.monitor`) gets each role's health
            (:mod:`amped.lowp.attention_health`), and a ``layer.attention_recorder``
            (:func:`amped.doctor.attention.diagnose_attention`) the call's inputs and output.

    Returns:
        The attention output in ``query``'s dtype; differentiable in all three inputs.

    Raises:
        RuntimeError: what torch's SDPA raises for the same arguments (a mask that does
            not broadcast to ``[batch, heads, q_len, k_len]``, mismatched dims, ...).
        ValueError: an MX format on ``s`` or ``dp`` with a head dim that is not a
            multiple of 32, or input that is not 3-D or 4-D.
        RuntimeError: ``dropout_p`` outside 0..1 (torch's error).

    Example:
        >>> import torch, amped
        >>> q, k, v = torch.randn(3, 1, 2, 64, 32).unbind(0)
        >>> amped.scaled_dot_product_attention(q, k, v, is_causal=True, config="fp8").shape
        torch.Size([1, 2, 64, 32])
    """
    cfg = resolve_config(config)
    _check(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, cfg)
    if query.dim() == 3:
        mask = attn_mask if attn_mask is None or attn_mask.dim() < 3 else attn_mask.unsqueeze(0)
        q, k, v = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        out = _apply(q, k, v, mask, dropout_p, is_causal, scale, cfg, layer).squeeze(0)
    else:
        out = _apply(query, key, value, attn_mask, dropout_p, is_causal, scale, cfg, layer)
    recorder = None if layer is None else getattr(layer, "attention_recorder", None)
    if recorder is not None:  # amped.doctor's capture of a step's attention inputs
        arguments = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)  # fmt: skip
        recorder(layer, (query, key, value), arguments, out)
    return out


def _apply(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
    dropout_p: float, is_causal: bool, scale: float | None, cfg: AttentionConfig,
    layer: torch.nn.Module | None,
) -> torch.Tensor:  # fmt: skip
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    shape = (*query.shape[:-1], key.shape[-2])
    drop = Dropout.draw(float(dropout_p), shape, query.device)
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # as torch's autocast runs SDPA: Q, K, V in the region's dtype; then autocast
        # off, so that no policy re-casts the emulation's float32 arithmetic
        low = torch.get_autocast_dtype(device_type)
        query, key, value = (x.to(low) for x in (query, key, value))
    with autocast(device_type, enabled=False):
        out: torch.Tensor = _Attention.apply(
            query, key, value, attn_mask, is_causal, scale, cfg, drop, layer
        )
    return out


def _check(
    query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: float, is_causal: bool,
    scale: float | None, enable_gqa: bool, cfg: AttentionConfig,
) -> None:  # fmt: skip
    """Refuse what torch's SDPA refuses (its own errors, from a run on meta tensors), and
    what this emulation cannot do."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise type_error(f"{name} is a tensor, as torch's SDPA takes it", name, x)
    if query.dim() not in (3, 4):
        raise value_error(
            "amped's attention takes [batch, heads, seq, head_dim] (or [heads, seq, "
            "head_dim]) tensors; reshape the leading dims into batch and heads",
            "query.shape",
            tuple(query.shape),
        )
    if attn_mask is not None:
        target = (*query.shape[:-1], key.shape[-2])
        try:
            fits = torch.broadcast_shapes(attn_mask.shape, target) == target
        except RuntimeError:
            fits = False
        if not fits:
            raise RuntimeError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to the "
                f"attention scores' shape {target} ([batch, heads, q_len, k_len]); give a "
                "mask of that shape or one that broadcasts to it (e.g. [q_len, k_len], "
                "[batch, 1, 1, k_len] for padding)"
            )
    q, k, v = (x.detach().to("meta") for x in (query, key, value))
    mask = None if attn_mask is None else attn_mask.detach().to("meta")
    with torch.no_grad():
        # with a mask, is_causal is checked here (torch's math backend, which meta
        # tensors run, refuses the pair that its default backend combines)
        causal = is_causal and mask is None
        F.scaled_dot_product_attention(
            q, k, v, mask, dropout_p, causal, scale=scale, enable_gqa=enable_gqa
        )
    head_dim = query.shape[-1]
    for role in ("s", "dp"):
        rule = cfg.rule(role)
        if rule is not None and head_dim % MX_BLOCK and (is_mx(rule.format) or is_mx(rule.grad)):
            raise value_error(
                f"role {role!r} multiplies over the head dim, which MX formats scale in "
                f"blocks of {MX_BLOCK}: the head dim must be a multiple of {MX_BLOCK}; use "
                f"an FP8 format for this role (config.replace({role}=AttentionCast("
                "'e4m3'))) or pad the head dim",
                "head_dim",
                head_dim,
            )


def _needs_row_amax(cfg: AttentionConfig, role: str) -> bool:
    """Whether a role casts its score operand (P or dS) to FP8 scaled per row, head or
    tensor: a scale whose amax spans every key, needed before the role's first tile."""
    rule = cfg.rule(role)
    if rule is None:
        return False
    fmt = rule.grad if role in ("dq", "dk") else rule.format
    return not is_mx(fmt) and rule.scaling != "block"


def _row_amax(blocks: Iterator[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Each row's amax over its key tiles' ``blocks`` (``[B, H, rows, 1]``)."""
    amax = torch.zeros_like(like)
    for x in blocks:
        amax = torch.maximum(amax, x.detach().abs().amax(dim=-1, keepdim=True))
    return amax


def _expand_heads(x: torch.Tensor, heads: int, batch: int) -> torch.Tensor:
    """K or V broadcast to Q's batch and heads (GQA: each K/V head serves a group)."""
    b, h = x.shape[:2]
    x = x.expand(batch, *x.shape[1:]) if b != batch else x
    if h != heads:
        x = x.unsqueeze(2).expand(batch, h, heads // h, *x.shape[2:]).flatten(1, 2)
    return x


def _reduce_heads(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`_expand_heads`: summed back to ``like``'s batch and heads."""
    b, h = like.shape[:2]
    if grad.shape[1] != h:
        grad = grad.unflatten(1, (h, -1)).sum(dim=2)
    if grad.shape[0] != b:
        grad = grad.sum(dim=0, keepdim=True)
    return grad.to(like.dtype)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attn_mask: torch.Tensor | None, is_causal: bool, scale: float, cfg: AttentionConfig,
        drop: Dropout | None, layer: torch.nn.Module | None,
    ) -> torch.Tensor:  # fmt: skip
        dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        b, h, tq, _ = query.shape
        q = query.to(dtype)
        k, v = (_expand_heads(x.to(dtype), h, b) for x in (key, value))
        shape = (b, h, tq, k.shape[2])
        mask = Mask(attn_mask, is_causal, shape, dtype, cfg.block_size, q.device)
        roles = Roles(q, k, v, cfg, RoleHealth(layer))
        tiles = mask.query_tiles()

        def logits(tile: Tile) -> Iterator[torch.Tensor]:
            return (mask.logits(roles.run("s", kt), scale, kt) for kt in mask.key_tiles(tile))

        def probs(tile: Tile) -> Iterator[tuple[Tile, torch.Tensor]]:
            """Each key tile's P, dropped out where dropout is on (O's operand)."""
            rows = lse[:, :, tile.r0 : tile.r1]
            for kt in mask.key_tiles(tile):
                p = torch.exp(mask.logits(roles.run("s", kt), scale, kt) - rows)
                yield kt, p if drop is None else drop.apply(p, kt)

        lse = q.new_empty((b, h, tq, 1))
        p_amax = None
        if _needs_row_amax(cfg, "o") or _needs_row_amax(cfg, "dv"):
            p_amax = roles.score_amax["P"] = q.new_empty((b, h, tq, 1))  # filled per tile
        out = q.new_zeros((b, h, tq, v.shape[3]))

        def output(tile: Tile) -> None:
            for kt, p in probs(tile):
                out[:, :, tile.r0 : tile.r1] += roles.run("o", kt, p)

        # each tile's passes one after the other, so its causal-safe casts of K and V
        # are made once; unless O's P takes a head's amax, known after every tile
        whole = _needs_row_amax(cfg, "o") and not (cfg.causal_safe and mask.masks)
        for tile in tiles:
            rows = slice(tile.r0, tile.r1)
            lse[:, :, rows] = online_lse(logits(tile), lse[:, :, rows])
            if p_amax is not None:
                p_amax[:, :, rows] = _row_amax((p for _, p in probs(tile)), p_amax[:, :, rows])
            if not whole:
                output(tile)
        for tile in tiles if whole else ():
            output(tile)
        ctx.save_for_backward(query, key, value, attn_mask, lse, p_amax)
        ctx.is_causal, ctx.scale, ctx.cfg, ctx.drop = is_causal, scale, cfg, drop
        ctx.layer = layer
        roles.health.report(("s", "o"))
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, attn_mask, lse, p_amax = ctx.saved_tensors
        cfg, scale, drop = ctx.cfg, ctx.scale, ctx.drop
        dtype = lse.dtype
        b, h, tq, _ = query.shape
        q = query.to(dtype)
        k, v = (_expand_heads(x.to(dtype), h, b) for x in (key, value))
        do = grad_out.to(dtype)
        shape = (b, h, tq, k.shape[2])
        mask = Mask(attn_mask, ctx.is_causal, shape, dtype, cfg.block_size, q.device)
        roles = Roles(q, k, v, cfg, RoleHealth(ctx.layer))
        if p_amax is not None:
            roles.score_amax["P"] = p_amax
        tiles = mask.query_tiles()

        def scores(tile: Tile) -> Iterator[tuple[Tile, torch.Tensor, torch.Tensor, torch.Tensor]]:
            """Each key tile's P, P dropped out (dV's operand) and dP (the gradient of P,
            through the dropout), recomputed: the same casts and mask, the same bits."""
            rows = lse[:, :, tile.r0 : tile.r1]
            for kt in mask.key_tiles(tile):
                p = torch.exp(mask.logits(roles.run("s", kt), scale, kt) - rows)
                dp = roles.run("dp", kt, do)
                if drop is None:
                    yield kt, p, p, dp
                else:
                    yield kt, p, drop.apply(p, kt), drop.apply(dp, kt)

        delta = q.new_zeros((b, h, tq, 1))

        def grad_scores(tile: Tile) -> Iterator[tuple[Tile, torch.Tensor, torch.Tensor]]:
            """Each key tile's dropped-out P and dS."""
            rows = delta[:, :, tile.r0 : tile.r1]
            for kt, p, p_drop, dp in scores(tile):
                yield kt, p_drop, p * (dp - rows)

        ds_amax = None
        if _needs_row_amax(cfg, "dq") or _needs_row_amax(cfg, "dk"):
            ds_amax = roles.score_amax["dS"] = q.new_empty((b, h, tq, 1))  # filled per tile
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

        def gradients(tile: Tile) -> None:
            for kt, p, ds in grad_scores(tile):
                dv[:, :, kt.keys] += roles.run("dv", kt, p, do)
                dq[:, :, tile.r0 : tile.r1] += roles.run("dq", kt, ds)
                dk[:, :, kt.keys] += roles.run("dk", kt, ds) * scale

        # per tile, as in forward; unless dS takes a head's amax (dK's always does)
        per_row = cfg.causal_safe and mask.masks
        whole = _needs_row_amax(cfg, "dk") or (_needs_row_amax(cfg, "dq") and not per_row)
        for tile in tiles:
            rows = slice(tile.r0, tile.r1)
            # delta = rowsum(P * dP) over every key, before any dS = P * (dP - delta)
            for _, p, _, dp in scores(tile):
                delta[:, :, rows] += (p * dp).sum(dim=-1, keepdim=True)
            if ds_amax is not None:
                blocks = (ds for _, _, ds in grad_scores(tile))
                ds_amax[:, :, rows] = _row_amax(blocks, ds_amax[:, :, rows])
            if not whole:
                gradients(tile)
        for tile in tiles if whole else ():
            gradients(tile)
        dq *= scale
        roles.health.report(("s", "dp", "dv", "dq", "dk"))
        grads = (dq.to(query.dtype), _reduce_heads(dk, key), _reduce_heads(dv, value))
        return (*grads, None, None, None, None, None, None)
