"""Attention dropout, torch's semantics: P times ``keep / (1 - p)`` before ``P·V``, the
mask drawn from the default generator's state, the same mask in backward.

Against a float64 reference that applies the same mask (rebuilt from the call's seed
by :func:`amped.lowp.attention_dropout.keep_mask`) with autograd: in float64 the two
compute the same function in a different order; each sum of n terms (n at most 96 here)
is within γ(n) = n·2**-53 (about 1e-14) of exact relative to its magnitudes, which are
O(1) (unit normal inputs, P at most 1/(1 - p) = 2), through four matmuls and a softmax:
far under 1e-12. A wrong or shifted mask moves values by O(1)."""

from __future__ import annotations

import math

import pytest
import torch
from attention_helpers import run

import amped
from amped.lowp.attention_dropout import Dropout, keep_mask

P = 0.5
BLOCK = 32  # tiles of 32: a 96 x 96 mask is 3 x 3 tiles


def _reference(q, k, v, keep, is_causal):
    s = (q @ k.mT) / math.sqrt(q.shape[-1])
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    return (torch.softmax(s, dim=-1) * keep / (1 - P)) @ v


@pytest.mark.parametrize("is_causal", [False, True], ids=["no-mask", "causal"])
def test_output_and_gradients_are_the_reference_with_the_same_mask(is_causal):
    q, k, v, grad = torch.randn(4, 1, 2, 96, 16, dtype=torch.float64).unbind(0)
    cfg = amped.lowp.AttentionConfig(block_size=BLOCK)  # every role off
    torch.manual_seed(3)
    ours = run(amped.scaled_dot_product_attention, q, k, v, grad, dropout_p=P,
               is_causal=is_causal, config=cfg)  # fmt: skip
    torch.manual_seed(3)  # the seed the call drew
    seed = Dropout.draw(P, (1, 2, 96, 96), torch.device("cpu")).seed
    keep = keep_mask(seed, P, (1, 2, 96, 96), BLOCK)
    assert 0.4 < keep.float().mean() < 0.6  # 18432 draws: 1 - p within 13 sigma
    expected = run(lambda *a, **kw: _reference(*a, keep, is_causal), q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)


def test_each_call_draws_a_new_mask_and_a_seed_repeats_it():
    q, k, v = torch.randn(3, 1, 2, 64, 16).unbind(0)
    torch.manual_seed(0)
    a = amped.scaled_dot_product_attention(q, k, v, dropout_p=P, config="fp8")
    b = amped.scaled_dot_product_attention(q, k, v, dropout_p=P, config="fp8")
    torch.manual_seed(0)
    c = amped.scaled_dot_product_attention(q, k, v, dropout_p=P, config="fp8")
    assert not torch.equal(a, b)
    assert torch.equal(a, c)
