"""Low-precision attention you can train with: ``scaled_dot_product_attention`` with a
format per matmul (:mod:`amped.lowp.attention_config`), emulated exactly on any device.

The computation is tiled over query rows (``config.block_size`` per tile), as
FlashAttention is, so the ``T x T`` score matrix is never held whole: each tile holds its
rows' scores against every key, ``[B, H, block_size, T]``::

    forward, per tile:   S = scale * (Q·Kᵀ) + mask      float32
                         m = rowmax(S);  lse = m + log(rowsum(exp(S - m)))
                         P = exp(S - lse)               (lse saved, per row)
                         O = P·V
    backward, per tile:  S, P again from the saved lse (same casts, same bits)
                         dP = dO·Vᵀ;  dS = P * (dP - rowsum(P * dP))
                         dV += Pᵀ·dO;  dQ = scale * dS·K;  dK += scale * dSᵀ·Q

Softmax and its statistics are float32 (float64 for float64 input); so is every
matmul, whose operands are the FP8 or MX values where a role is cast. A row that sees no
key gets ``lse = +inf``, so its P is 0 and its output and gradients 0, as torch's SDPA
gives. A scale computed over a whole score tensor (P or dS with ``"tensorwise"`` or
``"head"`` scaling where no safe mask narrows it to a row) needs that tensor's amax
first, so that pass runs twice (once for the amax).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from amped._internal.errors import type_error, value_error
from amped.lowp.attention_cast import is_mx
from amped.lowp.attention_config import MX_BLOCK, AttentionConfig, resolve_config
from amped.lowp.attention_roles import Roles, Tile

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
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with each matmul in its format.

    Args:
        query, key, value: ``[batch, heads, seq, head_dim]`` (3-D: no batch dim), as
            torch takes them; float32, bfloat16, float16 or float64.
        attn_mask, is_causal, scale, enable_gqa: as torch's (a boolean mask: True
            attends; a float mask is added, ``-inf`` masks).
        dropout_p: 0.0 only (dropout is not built yet).
        config: an :class:`~amped.lowp.attention_config.AttentionConfig` or a preset
            name (``"fp8"``, ``"fp8-forward"``, ``"fp8-all-but-ds"``, ``"mxfp8"``,
            ``"bf16"``: no casts).

    Returns:
        The attention output in ``query``'s dtype; differentiable in all three inputs.

    Raises:
        RuntimeError: what torch's SDPA raises for the same arguments (a mask that does
            not broadcast to ``[batch, heads, q_len, k_len]``, mismatched dims, ...).
        ValueError: an MX format on ``s`` or ``dp`` with a head dim that is not a
            multiple of 32, or input that is not 3-D or 4-D.
        NotImplementedError: ``dropout_p > 0``.

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
        return _apply(q, k, v, mask, is_causal, scale, cfg).squeeze(0)
    return _apply(query, key, value, attn_mask, is_causal, scale, cfg)


def _apply(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
    is_causal: bool, scale: float | None, cfg: AttentionConfig,
) -> torch.Tensor:  # fmt: skip
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    out: torch.Tensor = _Attention.apply(query, key, value, attn_mask, is_causal, scale, cfg)
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
    if dropout_p:
        raise NotImplementedError(
            "amped's attention has no dropout yet; pass dropout_p=0.0 (a model's "
            f"attention dropout set to 0), or keep this attention in torch's SDPA. "
            f"Received: dropout_p={dropout_p!r}"
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


class _Mask:
    """Which keys each query row sees, and the float mask's bias, tile by tile."""

    def __init__(
        self, attn_mask: torch.Tensor | None, is_causal: bool, shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> None:  # fmt: skip
        self.shape, self.is_causal = shape, is_causal
        self.visible: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        if attn_mask is None:
            return
        if attn_mask.dtype == torch.bool:
            self.visible = None if bool(attn_mask.all()) else attn_mask.expand(shape)
            return
        self.bias = attn_mask.to(dtype).expand(shape)
        # -inf masks, and so does the dtype's lowest value (masks built as
        # finfo.min, which makes exp underflow to exactly 0 all the same)
        masked = attn_mask <= torch.finfo(attn_mask.dtype).min
        self.visible = ~masked.expand(shape) if bool(masked.any()) else None

    @property
    def masks(self) -> bool:
        return self.is_causal or self.visible is not None

    def tile(self, r0: int, r1: int) -> Tile:
        """Rows ``r0:r1``; a causal mask and an ``attn_mask`` together mask what either
        masks, as torch's default SDPA backend does (its math backend refuses both)."""
        visible = None if self.visible is None else self.visible[:, :, r0:r1]
        if self.is_causal:
            b, h, _, tk = self.shape
            rows = torch.arange(r0, r1).unsqueeze(1)
            causal = (torch.arange(tk) <= rows).expand(b, h, r1 - r0, tk)
            visible = causal if visible is None else causal & visible
        return Tile(r0, r1, visible)

    def logits(self, qk: torch.Tensor, scale: float, tile: Tile) -> torch.Tensor:
        s = qk * scale
        if self.bias is not None:
            s = s + self.bias[:, :, tile.r0 : tile.r1]
        if tile.visible is not None:
            s = torch.where(tile.visible, s, -math.inf)
        return s


def _lse(s: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp (``[B, H, rows, 1]``); +inf for a row that sees nothing."""
    m = s.amax(dim=-1, keepdim=True)
    empty = torch.isneginf(m)
    m = torch.where(empty, 0, m)
    return torch.where(empty, math.inf, m + torch.log(torch.exp(s - m).sum(-1, keepdim=True)))


def _head_amax(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().amax(dim=(2, 3), keepdim=True)


def _needs_score_amax(cfg: AttentionConfig, role: str, per_row: bool) -> bool:
    """Whether a role's score operand (P or dS) is FP8 scaled over whole heads or the
    whole tensor, so its amax is needed before the role's first tile."""
    rule = cfg.rule(role)
    if rule is None:
        return False
    fmt = rule.grad if role in ("dq", "dk") else rule.format
    return not is_mx(fmt) and rule.scaling != "block" and not per_row


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
    ) -> torch.Tensor:  # fmt: skip
        dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        b, h, tq, _ = query.shape
        q = query.to(dtype)
        k, v = (_expand_heads(x.to(dtype), h, b) for x in (key, value))
        mask = _Mask(attn_mask, is_causal, (b, h, tq, k.shape[2]), dtype)
        roles = Roles(q, k, v, cfg)
        per_row = cfg.causal_safe and mask.masks
        tiles = [mask.tile(r, min(r + cfg.block_size, tq)) for r in range(0, tq, cfg.block_size)]
        lse = q.new_empty((b, h, tq, 1))
        p_amax = q.new_zeros((b, h, 1, 1))
        two_pass = _needs_score_amax(cfg, "o", per_row)
        for tile in tiles if two_pass else ():
            s = mask.logits(roles.s(tile), scale, tile)
            lse[:, :, tile.r0 : tile.r1] = tile_lse = _lse(s)
            p_amax = torch.maximum(p_amax, _head_amax(torch.exp(s - tile_lse)))
        roles.score_amax["P"] = p_amax
        out = q.new_empty((b, h, tq, v.shape[3]))
        for tile in tiles:
            s = mask.logits(roles.s(tile), scale, tile)
            if not two_pass:
                lse[:, :, tile.r0 : tile.r1] = _lse(s)
            p = torch.exp(s - lse[:, :, tile.r0 : tile.r1])
            if not two_pass:
                p_amax = torch.maximum(p_amax, _head_amax(p))
            out[:, :, tile.r0 : tile.r1] = roles.o(p, tile)
        ctx.save_for_backward(query, key, value, attn_mask, lse, p_amax)
        ctx.is_causal, ctx.scale, ctx.cfg = is_causal, scale, cfg
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, attn_mask, lse, p_amax = ctx.saved_tensors
        cfg, scale = ctx.cfg, ctx.scale
        dtype = lse.dtype
        b, h, tq, _ = query.shape
        q = query.to(dtype)
        k, v = (_expand_heads(x.to(dtype), h, b) for x in (key, value))
        do = grad_out.to(dtype)
        mask = _Mask(attn_mask, ctx.is_causal, (b, h, tq, k.shape[2]), dtype)
        roles = Roles(q, k, v, cfg)
        roles.score_amax["P"] = p_amax
        per_row = cfg.causal_safe and mask.masks
        tiles = [mask.tile(r, min(r + cfg.block_size, tq)) for r in range(0, tq, cfg.block_size)]

        def scores(tile: Tile) -> tuple[torch.Tensor, torch.Tensor]:
            s = mask.logits(roles.s(tile), scale, tile)
            p = torch.exp(s - lse[:, :, tile.r0 : tile.r1])
            dp = roles.dp(do, tile)
            return p, p * (dp - (p * dp).sum(dim=-1, keepdim=True))

        if _needs_score_amax(cfg, "dq", per_row) or _needs_score_amax(cfg, "dk", False):
            ds_amax = q.new_zeros((b, h, 1, 1))
            for tile in tiles:
                ds_amax = torch.maximum(ds_amax, _head_amax(scores(tile)[1]))
            roles.score_amax["dS"] = ds_amax
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for tile in tiles:
            p, ds = scores(tile)
            dv += roles.dv(p, do, tile)
            dq[:, :, tile.r0 : tile.r1] = roles.dq(ds, tile) * scale
            dk += roles.dk(ds, tile) * scale
        grads = (dq.to(query.dtype), _reduce_heads(dk, key), _reduce_heads(dv, value))
        return (*grads, None, None, None, None)
