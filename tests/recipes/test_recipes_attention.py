"""``amped.prepare(..., attention=...)``: a model's attention converted under any recipe,
with the Linear formats or without them, and the modules it could not convert listed
on the setup with the reason."""

from __future__ import annotations

import pytest
import torch

import amped
from amped.lowp.attention_modules import LowPrecisionMultiheadAttention


class Encoder(torch.nn.Module):
    """Two causal encoder layers (nn.MultiheadAttention inside) and a head."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(64, 2, 64, dropout=0.0, batch_first=True)
        self.layers = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(64, 64)

    def forward(self, x):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.layers(x, mask=mask, is_causal=True))


def _forward_backward(setup):
    # (no optimizer step: the attention is in forward and backward; bf16-master's first
    # step builds its fused update, seconds on a CPU, which other tests measure)
    with setup.autocast():
        loss = setup.model(torch.randn(2, 32, 64)).float().pow(2).mean()
    setup.backward(loss)


@pytest.mark.parametrize("recipe", ["bf16-mixed", "bf16-master", "bf16-pure", "fp8-tensorwise"])
def test_prepare_converts_multihead_attention_under_any_recipe(recipe):
    torch.manual_seed(0)
    model = Encoder()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    setup = amped.prepare(model, optimizer, recipe, attention="fp8")
    attention = [m for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)]
    assert len(attention) == 2
    assert all(type(m) is LowPrecisionMultiheadAttention for m in attention)
    assert setup.attention.not_converted == ()
    assert str(setup.attention.config) == str(amped.lowp.attention_config.ATTENTION_CONFIGS["fp8"])
    _forward_backward(setup)
    assert all(bool(p.grad.isfinite().all()) for p in model.parameters() if p.grad is not None)
    if recipe.startswith("fp8"):  # the Linear formats too
        assert setup.low_precision_layers.names() == [
            "layers.layers.0.linear1",
            "layers.layers.0.linear2",
            "layers.layers.1.linear1",
            "layers.layers.1.linear2",
        ]


def test_prepare_converts_a_transformers_models_attention():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=32,
                                  vocab_size=50, attn_pdrop=0.0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 50, (2, 32), generator=torch.Generator().manual_seed(1))
    before = model(input_ids=ids).logits.detach()
    setup = amped.prepare(model, torch.optim.SGD(model.parameters()), "fp32", attention="fp8")
    assert setup.attention.not_converted == ()
    assert model.config._attn_implementation.startswith("amped-attention")
    after = model(input_ids=ids).logits
    assert not torch.equal(before, after)  # the attention's casts ran


def test_what_could_not_convert_is_on_the_setup():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))  # no attention it can find
    setup = amped.prepare(model, torch.optim.SGD(model.parameters()), attention="bf16")
    ((name, why),) = setup.attention.not_converted
    assert name == "" and "not a transformers model" in why
    assert "not converted: the model" in setup.attention.describe()


def test_a_bad_attention_config_is_refused_before_anything_changes():
    torch.manual_seed(0)
    model = Encoder()
    with pytest.raises(ValueError, match="config is an AttentionConfig or one of"):
        amped.prepare(model, torch.optim.SGD(model.parameters()), "bf16-master",
                      attention="fp9")  # fmt: skip
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not any(isinstance(m, LowPrecisionMultiheadAttention) for m in model.modules())
