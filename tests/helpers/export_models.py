"""Tiny models trained a few steps under a recipe, for the export tests."""

from __future__ import annotations

import torch

import amped


def tiny_gpt2() -> torch.nn.Module:
    """GPT-2 with 128 wide embeddings (its Conv1D layers 128 x 384, 128 x 512: whole
    128x128 tiles for fp8-blockwise)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2, n_embd=128, n_head=2, n_positions=32, vocab_size=128, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=32, bos_token_id=0,
        eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def mlp() -> torch.nn.Module:
    """Two 64x64 layers the FP8 and block recipes convert, and an output head they keep."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 32),
    )  # fmt: skip


def trained(model: torch.nn.Module, recipe: str, steps: int = 2) -> amped.TrainSetup:
    """``model`` prepared for ``recipe`` and trained ``steps`` AdamW steps on random
    tokens (a language model) or random inputs (the MLP)."""
    torch.manual_seed(0)
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), recipe)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        if hasattr(model, "config"):
            ids = torch.randint(128, (2, 16), generator=generator)
            with setup.autocast():
                loss = setup.model(input_ids=ids, labels=ids).loss
        else:
            x = torch.randn(4, 64, generator=generator)
            with setup.autocast():
                loss = setup.model(x).square().mean()
        setup.backward(loss)
        setup.step()
        setup.zero_grad()
    return setup


def mlp_task(
    seed: int = 0,
) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]], object]:
    """:func:`mlp` as an amped task (``--model export_models:mlp_task``): random inputs
    drawn from ``seed``, a squared-error loss."""
    generator = torch.Generator().manual_seed(seed)
    batches = [(torch.randn(4, 64, generator=generator), torch.zeros(4, 32)) for _ in range(4)]
    return mlp(), batches, torch.nn.functional.mse_loss
