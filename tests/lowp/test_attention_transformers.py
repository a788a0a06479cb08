"""transformers models (random weights) through amped's attention: GPT-2, Llama (GQA)
and BERT convert through the attention registry; with formats off they compute what
their SDPA attention computes (float32 reassociation: 1e-5 relative through two layers),
with FP8 they are cast; what cannot convert is listed with the reason."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from amped.integrations.transformers_attention import convert_attention
from amped.lowp.float8.cast import sqnr


def _model(kind):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=97)
        return GPT2LMHeadModel(cfg)
    if kind == "llama":
        cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=128, vocab_size=97,
                          max_position_embeddings=64)  # fmt: skip
        return LlamaForCausalLM(cfg)
    cfg = BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                     intermediate_size=128, vocab_size=97, max_position_embeddings=64)  # fmt: skip
    return BertModel(cfg)


def _output(model, ids, mask):
    out = model(input_ids=ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _batch():
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 33:] = 0  # one padded sequence
    return ids, mask


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_formats_off_the_converted_model_computes_what_sdpa_does(kind):
    model = _model(kind).eval()
    ours = copy.deepcopy(model)
    assert convert_attention(ours, "bf16") == []
    ids, mask = _batch()
    with torch.no_grad():
        torch.testing.assert_close(_output(ours, ids, mask), _output(model, ids, mask),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_fp8_attention_is_cast_and_trains(kind):
    model = _model(kind).eval()
    off, fp8 = copy.deepcopy(model), copy.deepcopy(model)
    convert_attention(off, "bf16")
    assert convert_attention(fp8, "fp8") == []
    ids, mask = _batch()
    ref, out = _output(off, ids, mask), _output(fp8, ids, mask)
    assert not torch.equal(ref, out)  # the casts ran
    assert sqnr(ref, out) > 15  # and stayed close (outputs of random models: 25-35 dB)
    out.float().pow(2).mean().backward()
    grads = [p.grad for p in fp8.parameters() if p.grad is not None]
    assert grads and all(bool(g.isfinite().all()) for g in grads)


def test_attention_dropout_runs_in_training_and_follows_the_seed():
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        n_positions=64,
        vocab_size=97,
        attn_pdrop=0.1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )  # only attention's
    model = GPT2LMHeadModel(cfg)
    convert_attention(model, "fp8")
    model.train()
    outs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        outs.append(_output(model, *_batch()))
    assert torch.equal(outs[0], outs[1])  # the same seed draws the same mask
    assert not torch.equal(outs[0], outs[2])  # another seed, another mask
    outs[2].float().pow(2).mean().backward()
    assert all(bool(p.grad.isfinite().all()) for p in model.parameters() if p.grad is not None)


def test_what_cannot_convert_is_listed_with_the_reason():
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)  # converts
            self.kv = torch.nn.MultiheadAttention(16, 2, add_bias_kv=True)  # does not

    skipped = dict(convert_attention(Mixed(), "fp8"))
    assert sorted(skipped) == ["", "kv"]
    assert "add_bias_kv" in skipped["kv"]
    assert "not a transformers model" in skipped[""]
