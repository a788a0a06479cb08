"""``nn.MultiheadAttention`` through :func:`amped.scaled_dot_product_attention`.

:func:`convert_multihead_attention` turns each ``nn.MultiheadAttention`` of a model into a
:class:`LowPrecisionMultiheadAttention` in place (the class is swapped: parameters,
``state_dict`` keys and the optimizer's references stay). Its forward is torch's
(``F.multi_head_attention_forward``): the same projections, masks and dropout, with
the attention itself in amped's formats. Left as they were, with the reason: modules
with ``add_bias_kv`` or ``add_zero_attn`` (they append a key that no mask covers) and
subclasses of ``nn.MultiheadAttention`` (their forward may differ).

``need_weights=True`` (torch's default) asks for the ``T x T`` attention weights, which a
tiled attention never forms: the converted forward refuses it (pass
``need_weights=False``, as ``nn.TransformerEncoderLayer`` does). In eval mode without
gradients, ``nn.TransformerEncoderLayer`` may take torch's fused inference path, which
reads the projection weights itself and skips this forward.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F

from amped.lowp.attention import scaled_dot_product_attention
from amped.lowp.attention_config import AttentionConfig, resolve_config

__all__ = ["LowPrecisionMultiheadAttention", "convert_multihead_attention"]


class LowPrecisionMultiheadAttention(torch.nn.MultiheadAttention):
    """``nn.MultiheadAttention`` whose attention is amped's, in ``attention_config``."""

    attention_config: AttentionConfig

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
        attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:  # fmt: skip
        if need_weights:
            raise NotImplementedError(
                "amped's attention never forms the T x T attention weights that "
                "need_weights=True returns; call this nn.MultiheadAttention with "
                "need_weights=False. Received: need_weights=True"
            )
        unbatched = query.dim() == 2
        if unbatched:  # [L, E] -> [1, L, E]
            query, key, value = (x.unsqueeze(0) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # [L, N, E] -> [N, L, E]
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        q, k, v = self._project(query, key, value)
        mask = _sdpa_mask(key_padding_mask, attn_mask, q)
        causal = is_causal and key_padding_mask is None
        if causal:  # torch's rule: is_causal is a hint that attn_mask is causal
            mask = None
        dropout = self.dropout if self.training else 0.0
        out = scaled_dot_product_attention(
            q, k, v, mask, dropout, causal, config=self.attention_config, layer=self
        )
        out = self.out_proj(out.transpose(1, 2).flatten(2))
        if unbatched:
            return out.squeeze(0), None
        return (out if self.batch_first else out.transpose(0, 1)), None

    def _project(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """Q, K, V as ``[N, heads, L, head_dim]``, by torch's input projections."""
        if self._qkv_same_embed_dim:
            weights = self.in_proj_weight.chunk(3)
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        biases: Any = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        out = []
        for x, w, b in zip((query, key, value), weights, biases, strict=True):
            y = F.linear(x, w, b)
            out.append(y.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2))
        return tuple(out)


def _sdpa_mask(
    key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None, q: torch.Tensor
) -> torch.Tensor | None:
    """nn.MultiheadAttention's masks (boolean True: *masked*; float: added) as one
    SDPA float mask broadcasting to ``[N, heads, L, S]`` (``-inf``: masked)."""
    n, h = q.shape[:2]
    merged = None
    if attn_mask is not None:
        merged = _additive(attn_mask, q.dtype)
        if merged.dim() == 3:  # [N * heads, L, S]
            merged = merged.unflatten(0, (n, h))
    if key_padding_mask is not None:
        pad = _additive(key_padding_mask, q.dtype).reshape(n, 1, 1, -1)
        merged = pad if merged is None else merged + pad
    return merged


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill(mask, -math.inf)
    return mask.to(dtype)


def convert_multihead_attention(
    model: torch.nn.Module, config: str | AttentionConfig = "fp8"
) -> list[tuple[str, str]]:
    """Swap each ``nn.MultiheadAttention`` of ``model`` (``model`` itself included) for a
    :class:`LowPrecisionMultiheadAttention` with ``config``, in place (the module doc
    says which are left).

    Returns:
        The ``nn.MultiheadAttention`` modules left as they were, as ``(module name,
        reason)`` pairs.

    Example:
        >>> import torch, amped
        >>> from amped.lowp.attention_modules import convert_multihead_attention
        >>> layer = torch.nn.TransformerEncoderLayer(64, 2, batch_first=True, dropout=0.0)
        >>> convert_multihead_attention(layer, "fp8")
        []
        >>> layer(torch.randn(2, 32, 64), is_causal=True,
        ...       src_mask=torch.nn.Transformer.generate_square_subsequent_mask(32)).shape
        torch.Size([2, 32, 64])
    """
    cfg = resolve_config(config)
    skipped = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.MultiheadAttention):
            continue
        kind = type(module)
        if kind is not torch.nn.MultiheadAttention and kind is not LowPrecisionMultiheadAttention:
            why = (
                f"{kind.__name__} subclasses nn.MultiheadAttention, and its forward "
                "may differ from torch's; call amped.scaled_dot_product_attention from it"
            )
            skipped.append((name, why))  # fmt: skip
        elif module.bias_k is not None or module.add_zero_attn:
            why = (
                "add_bias_kv / add_zero_attn append a key to every sequence, which "
                "amped's attention does not build; construct it without them"
            )
            skipped.append((name, why))  # fmt: skip
        else:
            module.__class__ = LowPrecisionMultiheadAttention
            cast(LowPrecisionMultiheadAttention, module).attention_config = cfg
    return skipped
