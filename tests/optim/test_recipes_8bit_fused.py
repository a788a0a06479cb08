"""CompensatedAdamW8bit's fused (compiled) step against its eager step."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from amped.optim import adamw8bit
from amped.optim.adamw8bit import CompensatedAdamW8bit


def _run(
    fused: bool,
    steps: int,
    decoupled: bool,
    maximize: bool = False,
    spread: bool = False,
    bounded: bool = True,
):
    g = torch.Generator().manual_seed(0)
    params = [
        nn.Parameter((torch.randn(64, 256, generator=g) * 0.05).bfloat16()),
        nn.Parameter((torch.randn(8192, generator=g) * 0.05).bfloat16()),
        nn.Parameter((torch.randn(300, 1024, generator=g) * 0.05).bfloat16()),  # 2 pieces
        nn.Parameter((torch.randn(100, generator=g) * 0.05).bfloat16()),  # eager: small
        nn.Parameter((torch.randn(3, 7, generator=g) * 0.05).bfloat16()),  # eager: small
    ]
    opt = CompensatedAdamW8bit(
        params,
        lr=1e-3,
        weight_decay=0.1,
        decoupled_weight_decay=decoupled,
        maximize=maximize,
        fused=fused,
        bounded=bounded,
    )
    grads = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            grad = torch.randn(p.shape, generator=grads)
            if spread:  # half the elements 1e4 times smaller: their v flushes to code 0
                small = torch.rand(p.shape, generator=grads) < 0.5
                grad = torch.where(small, grad * 1e-4, grad)
            p.grad = grad.bfloat16()
        opt.step()
    return params, opt


@pytest.mark.slow  # compiles the kernel (20-40 s on a loaded 2-core machine)
@pytest.mark.parametrize(
    ("decoupled", "maximize"),
    [(True, False), (False, False), (True, True)],
    ids=["adamw", "adam-l2", "adamw-maximize"],
)
def test_fused_step_is_the_eager_step_bitwise(decoupled: bool, maximize: bool) -> None:
    # Both steps round every float32 operation on its own (lerp as m + w * (g - m), a
    # correctly rounded sqrt), read the same map entries (decode computed in the kernel,
    # looked up eagerly), find codes by the same encode and draw the same random bits:
    # after five steps the weights, codes and scales are the same bits. A 300 x 1024
    # tensor steps in two pieces; the small tensors step eagerly in both.
    fused, opt_f = _run(True, 5, decoupled, maximize)
    eager, opt_e = _run(False, 5, decoupled, maximize)
    for p, q in zip(fused, eager, strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
        state_f, state_e = opt_f.state[p], opt_e.state[q]
        assert state_f.keys() == state_e.keys()
        for key, value in state_f.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, state_e[key]), key


@pytest.mark.slow  # compiles the kernel
def test_fused_step_is_the_eager_step_bitwise_where_the_bound_clamps() -> None:
    # Within a block, gradients 1e4 apart: the small ones' second moments flush to code
    # 0 (1e-8 of the block's largest) while their first moments survive, so the bound
    # clamps them (torchao's scheme steps them lr * m / eps). Clamped, both steps are
    # still the same bits.
    fused, _ = _run(True, 3, True, spread=True)
    eager, _ = _run(False, 3, True, spread=True)
    unbounded, _ = _run(False, 3, True, spread=True, bounded=False)
    for p, q in zip(fused, eager, strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
    # Three steps at lr 1e-3 with |m / (sqrt(v_hat) + eps)| / (1 - b1**t) <= 1 (the
    # bound's value at steps 1-3) move an element by 3e-3 and a bfloat16 ulp or two
    # (4e-4 here); torchao's scheme moves the flushed ones by lr * m / eps, about 1.
    start = _run(False, 0, True)[0][0].float()
    assert (eager[0].float() - start).abs().max() < 0.01
    assert (unbounded[0].float() - start).abs().max() > 0.1


def test_fused_must_be_a_bool_or_none() -> None:
    with pytest.raises(TypeError, match="fused"):
        CompensatedAdamW8bit([nn.Parameter(torch.ones(4))], fused="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("numel", "pieces"),
    [
        (4096, [(0, 4096)]),
        (1 << 18, [(0, 1 << 18)]),
        ((1 << 18) + 4096, [(0, 1 << 18), (1 << 18, (1 << 18) + 4096)]),
        ((1 << 18) + 1024, [(0, (1 << 18) + 1024)]),  # a short tail joins the piece before
        (3 << 18, [(0, 1 << 18), (1 << 18, 2 << 18), (2 << 18, 3 << 18)]),
    ],
    ids=["one-block-set", "one-piece", "tail-piece", "short-tail", "three"],
)
def test_pieces_cover_the_tensor_in_whole_blocks(numel: int, pieces: list) -> None:
    assert adamw8bit._pieces(numel) == pieces
    assert all(first % 256 == 0 and end - first >= 4096 for first, end in pieces)


@pytest.mark.slow  # compiles the kernel
def test_stepping_in_pieces_is_bitwise_stepping_at_once(monkeypatch) -> None:
    # Blocks are quantized independently and each element's random bits follow its
    # number, so cutting a tensor into pieces changes nothing.
    def run(piece: int):
        monkeypatch.setattr(adamw8bit, "_FUSED_PIECE", piece)
        g = torch.Generator().manual_seed(0)
        weight = nn.Parameter((torch.randn(64, 1024, generator=g) * 0.05).bfloat16())
        opt = CompensatedAdamW8bit([weight], lr=1e-3, fused=True)
        for _ in range(3):
            weight.grad = torch.randn(weight.shape, generator=g).bfloat16()
            opt.step()
        return weight, opt.state[weight]

    whole, whole_state = run(1 << 30)
    cut, cut_state = run(16384)  # four pieces
    assert torch.equal(whole, cut)
    for key, value in whole_state.items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(cut_state[key])), key
