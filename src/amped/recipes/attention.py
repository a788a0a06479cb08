"""``amped.prepare(..., attention=...)``: a model's attention through amped's
low-precision attention, and what could not be converted.

Two kinds of attention convert: every ``nn.MultiheadAttention``
(:mod:`amped.lowp.attention_modules`), and a transformers model's attention layers
through its attention-implementation registry
(:func:`amped.integrations.transformers_attention.convert_attention`: GPT-2, Llama,
BERT, ...). A transformers model is recognised by its class (transformers is imported
only when the model is one), and only then is that integration imported: the one
import from the recipes layer up into the integrations (declared in
tests/test_architecture.py). Any other attention (a model calling
``F.scaled_dot_product_attention`` itself) is not found; it is listed as such.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from amped.lowp.attention_config import AttentionConfig, resolve_config
from amped.lowp.attention_modules import (
    LowPrecisionMultiheadAttention,
    convert_multihead_attention,
)

__all__ = [
    "AttentionConversion",
    "attention_modules",
    "convert_model_attention",
    "is_transformers_model",
]


@dataclass(frozen=True)
class AttentionConversion:
    """What ``amped.prepare(..., attention=...)`` did to a model's attention.

    Attributes:
        config: the attention config the converted modules run.
        not_converted: ``(module name, reason)`` for each attention module left as it
            was ("" names the whole model); empty when all converted.
    """

    config: AttentionConfig
    not_converted: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        """One line: the config, and how many modules were left (with the first)."""
        text = f"attention {self.config}"
        if not self.not_converted:
            return text + ", every attention module converted"
        name, why = self.not_converted[0]
        more = len(self.not_converted) - 1
        return f"{text}; not converted: {name or 'the model'} ({why})" + (
            f" and {more} more" if more else ""
        )


def is_transformers_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (by its classes' names and
    modules: transformers is not imported)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers.")
        for cls in type(model).__mro__
    )


def attention_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules of a converted model that may run amped's attention, by name: each
    ``LowPrecisionMultiheadAttention``, and in a transformers model each module whose
    class name ends in ``Attention`` (those that call the attention registry pass
    themselves to it; a wrapper around one never reports)."""
    transformers = is_transformers_model(model)
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, LowPrecisionMultiheadAttention)
        or (transformers and type(m).__name__.endswith("Attention"))
    }


def convert_model_attention(
    model: torch.nn.Module, attention: str | AttentionConfig
) -> AttentionConversion:
    """Convert ``model``'s attention to ``attention`` (a preset name or a config), in
    place; see the module doc for what converts."""
    cfg = resolve_config(attention)
    if is_transformers_model(model):
        # the one upward import (module doc); transformers is installed: model is one
        from amped.integrations.transformers_attention import convert_attention

        return AttentionConversion(cfg, tuple(convert_attention(model, cfg)))
    skipped = convert_multihead_attention(model, cfg)
    found = any(isinstance(m, torch.nn.MultiheadAttention) for m in model.modules())
    if not found:
        why = ("no nn.MultiheadAttention and not a transformers model: call "
               "amped.scaled_dot_product_attention from the model's attention")  # fmt: skip
        skipped.append(("", why))
    return AttentionConversion(cfg, tuple(skipped))
