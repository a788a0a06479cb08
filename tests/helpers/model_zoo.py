"""Real model code, built from small configs with random weights, for fidelity tests.

Each factory returns ``(model, run)`` where ``run(model)`` does one forward pass and
returns a scalar loss; the caller does backward and compares gradients. Inputs come
from a fixed seed so two calls see the same data.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Factory = Callable[[], tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]]


def _tokens(vocab: int, batch: int = 2, seq: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _lm_loss(model: nn.Module, ids: torch.Tensor, **extra) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, **extra).loss


def gpt2(attn: str) -> tuple[nn.Module, Callable]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=128, attn_implementation=attn
    )
    ids = _tokens(128)
    return GPT2LMHeadModel(config), lambda m: _lm_loss(m, ids)


def bert(attn: str) -> tuple[nn.Module, Callable]:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    ids = _tokens(128)
    return BertForMaskedLM(config), lambda m: _lm_loss(m, ids)


def llama(attn: str) -> tuple[nn.Module, Callable]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    ids = _tokens(128)
    return LlamaForCausalLM(config), lambda m: _lm_loss(m, ids)


def t5(attn: str) -> tuple[nn.Module, Callable]:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        num_layers=2,
        num_decoder_layers=2,
        d_model=64,
        d_kv=16,
        num_heads=4,
        d_ff=128,
        vocab_size=128,
        decoder_start_token_id=0,
        pad_token_id=0,
        attn_implementation=attn,
    )
    ids = _tokens(128)
    return T5ForConditionalGeneration(config), lambda m: m(input_ids=ids, labels=ids).loss


def vit(attn: str) -> tuple[nn.Module, Callable]:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
        num_labels=10,
        attn_implementation=attn,
    )
    g = torch.Generator().manual_seed(7)
    pixels = torch.randn(2, 3, 32, 32, generator=g)
    labels = torch.tensor([1, 7])
    return ViTForImageClassification(config), lambda m: m(pixel_values=pixels, labels=labels).loss


def transformer_encoder() -> tuple[nn.Module, Callable]:
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).train()
    x = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(3))
    return model, lambda m: m(x).float().pow(2).mean()


def multihead_attention() -> tuple[nn.Module, Callable]:
    model = nn.MultiheadAttention(64, 4, dropout=0.0)
    x = torch.randn(10, 2, 64, generator=torch.Generator().manual_seed(3))
    return model, lambda m: m(x, x, x)[0].float().pow(2).mean()


def lstm() -> tuple[nn.Module, Callable]:
    model = nn.LSTM(32, 48, num_layers=2, batch_first=True)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(3))
    return model, lambda m: m(x)[0].float().pow(2).mean()


def gru() -> tuple[nn.Module, Callable]:
    model = nn.GRU(32, 48, num_layers=2, batch_first=True)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(3))
    return model, lambda m: m(x)[0].float().pow(2).mean()


def cnn() -> tuple[nn.Module, Callable]:
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    ).train()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, 16, 16, generator=g)
    y = torch.randint(0, 10, (4,), generator=g)
    return model, lambda m: F.cross_entropy(m(x), y)


TRANSFORMERS: dict[str, Callable[[str], tuple[nn.Module, Callable]]] = {
    "gpt2": gpt2,
    "bert": bert,
    "llama": llama,
    "t5": t5,
    "vit": vit,
}

TORCH_NN: dict[str, Factory] = {
    "transformer_encoder": transformer_encoder,
    "multihead_attention": multihead_attention,
    "lstm": lstm,
    "gru": gru,
    "cnn": cnn,
}
