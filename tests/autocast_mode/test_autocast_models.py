"""Real models: loss and every parameter gradient under amped.autocast are bitwise equal
to torch.autocast (bfloat16 on CPU; float16 where the CPU kernels exist)."""

from __future__ import annotations

import model_zoo
import pytest
import torch
from tolerances import BITWISE

import amped
from amped.autocast_mode.engine import forced_path
from amped.autocast_mode.state import Path

pytest.importorskip("transformers")


def _train_step(model, run, region):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # dropout masks, if any, are the same on both sides
    with region:
        loss = run(model)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().clone(), grads


def _assert_bitwise_step(model, run, dtype):
    try:
        expected_loss, expected = _train_step(model, run, torch.autocast("cpu", dtype=dtype))
    except RuntimeError as error:
        # torch.autocast itself cannot run this model here (oneDNN has no bf16/fp16 LSTM
        # primitive on some CPUs): amped, faithful, fails the same way.
        with pytest.raises(RuntimeError, match=str(error)[:40]):
            _train_step(model, run, amped.autocast("cpu", dtype=dtype))
        return
    loss, grads = _train_step(model, run, amped.autocast("cpu", dtype=dtype))
    assert loss.dtype == expected_loss.dtype
    torch.testing.assert_close(loss, expected_loss, **BITWISE)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], **BITWISE, msg=f"grad of {name}")
    assert torch.isfinite(loss)


@pytest.fixture(params=[False, True], ids=["default-policy-passthrough", "engine=forced"])
def amped_only(request):
    """``engine=forced``: torch's C++ autocast never runs inside amped's region, so every
    cast in the step is the engine's own. ``default-policy-passthrough``: the default
    policy needs no engine and torch's autocast does the casts (see test_autocast_op_lists)."""
    if request.param:
        with forced_path(Path.MODE, torch_alongside=False):
            yield request.param
    else:
        yield request.param


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", sorted(model_zoo.TRANSFORMERS))
def test_transformers_model_is_bitwise_equal(name, attn, amped_only):
    torch.manual_seed(0)
    model, run = model_zoo.TRANSFORMERS[name](attn)
    model.train()
    _assert_bitwise_step(model, run, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", sorted(model_zoo.TORCH_NN))
def test_torch_nn_model_is_bitwise_equal(name, dtype, amped_only):
    if amped_only and name in {"lstm", "gru"}:
        pytest.skip(
            "nn.LSTM/nn.GRU call one C++ composite (aten::lstm / aten::gru) whose inner "
            "linear/mkldnn_rnn_layer casts only torch's C++ autocast can make; amped leaves "
            "them to it (torch_alongside=False keeps it out), which the other id covers"
        )
    torch.manual_seed(0)
    model, run = model_zoo.TORCH_NN[name]()
    _assert_bitwise_step(model, run, dtype)


def test_lstm_runs_in_low_precision_with_lstm_in_the_policy():
    # Where torch.autocast fails on nn.LSTM (see above), listing the whole-sequence
    # ``lstm`` op as low precision makes it run: weights, input and state are cast to
    # bfloat16 once and torch's plain bfloat16 LSTM kernel runs.
    torch.manual_seed(0)
    model, run = model_zoo.lstm()
    policy = amped.Policy.preset("torch", "cpu").with_ops(lower=["lstm"])
    with amped.autocast("cpu", policy=policy):
        out = model(torch.randn(2, 9, 32))[0]
    assert out.dtype == torch.bfloat16
    loss_low, grads_low = _train_step(model, run, amped.autocast("cpu", policy=policy))
    loss_fp32, _ = _train_step(model, run, amped.autocast("cpu", enabled=False))
    # bfloat16 keeps 8 significant bits (relative rounding 2**-8 ~ 0.4%); over 9 steps of
    # a 2-layer LSTM the loss stays within 5% of float32.
    torch.testing.assert_close(loss_low.float(), loss_fp32, rtol=0.05, atol=0.0)
    for name, grad in grads_low.items():
        assert grad.dtype == torch.float32 and torch.isfinite(grad).all(), name
