"""transformers models' attention through :func:`amped.scaled_dot_product_attention`.

transformers (v5) dispatches every attention layer of a model that supports it through
its attention-implementation registry (``AttentionInterface``): the model's
``config._attn_implementation`` names the function each layer calls with its Q, K, V
and mask. :func:`convert_attention` registers amped's attention under a name of its own
for one :class:`~amped.lowp.AttentionConfig` (with torch SDPA's mask construction) and
switches the model to it::

    from amped.integrations.transformers_attention import convert_attention
    not_converted = convert_attention(model, "fp8")   # [(module name, why), ...]

GPT-2, Llama (GQA included) and BERT dispatch so; a model that does not is listed with
the reason instead. Its ``nn.MultiheadAttention`` modules convert too
(:func:`amped.lowp.attention_modules.convert_multihead_attention`).

Requires ``transformers``; ``import amped`` never imports it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from amped.lowp.attention import scaled_dot_product_attention
from amped.lowp.attention_config import AttentionConfig, resolve_config
from amped.lowp.attention_modules import convert_multihead_attention

__all__ = ["attention_forward", "convert_attention", "implementation_name"]


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    config: AttentionConfig,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention function (``sdpa_attention_forward``) with amped's
    attention: the same causal rule, cache cropping and GQA, output ``[B, T, H, D]``."""
    for unsupported in ("softcap", "position_bias"):
        if kwargs.get(unsupported) is not None:
            raise NotImplementedError(
                f"amped's attention takes no {unsupported} yet; keep this model's "
                "attention in 'sdpa' or 'eager'"
            )
    q_length = query.shape[2]
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = q_length > 1 and attention_mask is None and causal
    if causal and key.shape[2] > q_length:  # prefill with an empty static cache
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    out = scaled_dot_product_attention(
        query,
        key,
        value,
        attention_mask,
        dropout,
        causal,
        scaling,
        gqa,
        config=config,
        layer=module,
    )
    return out.transpose(1, 2).contiguous(), None


_NAMES: dict[AttentionConfig, str] = {}


def implementation_name(config: AttentionConfig) -> str:
    """The registry name of amped's attention with ``config`` (registered on first use;
    equal configs share one)."""
    if config not in _NAMES:
        name = f"amped-attention-{len(_NAMES)}"
        AttentionInterface.register(name, functools.partial(attention_forward, config=config))
        AttentionMaskInterface.register(name, sdpa_mask)
        _NAMES[config] = name
    return _NAMES[config]


def convert_attention(
    model: torch.nn.Module, config: str | AttentionConfig = "fp8"
) -> list[tuple[str, str]]:
    """Run ``model``'s attention layers through amped's attention with ``config``.

    Returns:
        The attention modules left as they were, as ``(module name, reason)`` pairs
        (empty: every attention layer converted).
    """
    cfg = resolve_config(config)
    skipped = convert_multihead_attention(model, cfg)
    if not isinstance(model, PreTrainedModel):
        return [*skipped, ("", "not a transformers model: call "
                           "amped.scaled_dot_product_attention from its attention")]  # fmt: skip
    try:
        model.set_attn_implementation(implementation_name(cfg))
    except (ValueError, ImportError) as error:  # a model without the registry
        attention = [n for n, m in model.named_modules() if type(m).__name__.endswith("Attention")]
        reason = f"{type(model).__name__} does not dispatch attention by name ({error})"
        return [*skipped, *((n, reason) for n in attention or [""])]
    return skipped
