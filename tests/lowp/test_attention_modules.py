"""``nn.MultiheadAttention`` through amped's attention: with every role off, a converted
module computes torch's MultiheadAttention (batch first or not, separate K/V dims,
causal, padding and float masks); parameters stay; what cannot convert is listed.

The tolerance: in float64 both compute the same function in a different order; each
sum of n terms (n at most 64 here) is within γ(n) = n·2**-53 of exact, relative to
the sum of magnitudes, which is O(1) here (unit-scale inputs and weights of
1/sqrt(fan_in)), through three matmuls and a softmax: far under 1e-12."""

from __future__ import annotations

import copy

import pytest
import torch

from amped.lowp.attention_modules import (
    LowPrecisionMultiheadAttention,
    convert_multihead_attention,
)

TOL = dict(rtol=0, atol=1e-12)


def _pair(**kwargs):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(32, 4, dtype=torch.float64, **kwargs)
    ours = copy.deepcopy(ref)
    assert convert_multihead_attention(ours, "bf16") == []
    return ref, ours


CASES = {
    "batch-first": dict(batch_first=True),
    "seq-first": dict(batch_first=False),
    "kdim-vdim": dict(batch_first=True, kdim=24, vdim=20),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_formats_off_it_computes_torchs_multihead_attention(case):
    kwargs = CASES[case]
    ref, ours = _pair(**kwargs)
    first = kwargs["batch_first"]
    g = torch.Generator().manual_seed(1)

    def x(t, e):
        return torch.randn((3, t, e) if first else (t, 3, e), generator=g, dtype=torch.float64)

    q, k, v = x(10, 32), x(12, kwargs.get("kdim", 32)), x(12, kwargs.get("vdim", 32))
    pad = torch.zeros(3, 12, dtype=torch.bool)
    pad[0, 7:] = True  # True: padded (torch's MultiheadAttention convention)
    band = torch.triu(torch.ones(10, 12, dtype=torch.bool), 3)
    float_pad = torch.zeros(pad.shape, dtype=torch.float64).masked_fill(pad, -torch.inf)
    masks = [{}, {"key_padding_mask": pad}, {"attn_mask": band},
             {"attn_mask": torch.randn(10, 12, generator=g, dtype=torch.float64),
              "key_padding_mask": float_pad}]  # fmt: skip
    for mask in masks:
        expected = ref(q, k, v, need_weights=False, **mask)[0]
        got = ours(q, k, v, need_weights=False, **mask)[0]
        torch.testing.assert_close(got, expected, **TOL, msg=str(list(mask)))


def test_causal_encoder_layer_trains_with_the_same_parameters():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True,
                                             dtype=torch.float64)  # fmt: skip
    ref = copy.deepcopy(layer)
    params = list(layer.parameters())
    assert convert_multihead_attention(layer, "bf16") == []
    assert isinstance(layer.self_attn, LowPrecisionMultiheadAttention)
    assert list(layer.parameters()) == params  # the same tensors: an optimizer keeps them
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(16, dtype=torch.float64)
    outs = [m(x, src_mask=mask, is_causal=True) for m in (layer, ref)]
    torch.testing.assert_close(outs[0], outs[1], **TOL)
    for out in outs:
        out.pow(2).sum().backward()
    for a, b in zip(layer.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, **TOL)


def test_fp8_is_cast_and_need_weights_is_refused():
    ref, ours = _pair(batch_first=True)
    convert_multihead_attention(ours, "fp8")
    x = torch.randn(2, 64, 32, dtype=torch.float64)
    assert not torch.equal(ours(x, x, x, need_weights=False)[0], ref(x, x, x)[0])
    with pytest.raises(NotImplementedError, match="need_weights=False"):
        ours(x, x, x)


def test_what_cannot_convert_is_listed_with_the_reason():
    class Custom(torch.nn.MultiheadAttention):
        pass

    model = torch.nn.ModuleDict({
        "plain": torch.nn.MultiheadAttention(16, 2),
        "custom": Custom(16, 2),
        "bias_kv": torch.nn.MultiheadAttention(16, 2, add_bias_kv=True),
    })  # fmt: skip
    skipped = dict(convert_multihead_attention(model, "fp8"))
    assert sorted(skipped) == ["bias_kv", "custom"]
    assert "subclasses nn.MultiheadAttention" in skipped["custom"]
    assert "add_bias_kv" in skipped["bias_kv"]
    assert type(model["plain"]) is LowPrecisionMultiheadAttention
    assert type(model["custom"]) is Custom
