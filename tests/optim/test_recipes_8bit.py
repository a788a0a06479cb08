"""bf16-pure-8bit: blockwise 8-bit Adam moments against torchao's AdamW8bit, state dicts,
resume, the recipe and its memory."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from recipes_helpers import batches, mlp, train

import amped
from amped.optim import quantized_state as q8
from amped.optim.adamw8bit import CompensatedAdamW8bit

torchao_optim = pytest.importorskip("torchao.optim")
from torchao.optim.quant_utils import quantize_8bit_with_qmap, scale_tensor  # noqa: E402
from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned  # noqa: E402

BF16_ULP = torch.finfo(torch.bfloat16).eps  # 2**-7: an ulp of a bfloat16 in [1, 2)


def _params(seed: int = 0) -> list[torch.Tensor]:
    """A quantized tensor (8192 elements), and a small one (64: float32 state)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 128, generator=g) * 0.05, torch.randn(64, generator=g) * 0.05]


def _grads(steps: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        [torch.randn(64, 128, generator=g).bfloat16(), torch.randn(64, generator=g).bfloat16()]
        for _ in range(steps)
    ]


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_dynamic_map_is_torchaos(signed: bool) -> None:
    theirs = torch.tensor(get_qmap_signed() if signed else get_qmap_unsigned())
    assert torch.equal(q8.dynamic_map(signed), theirs)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_quantize_is_torchaos_bitwise(signed: bool) -> None:
    g = torch.Generator().manual_seed(0)
    value = torch.randn(32, 256, generator=g) * torch.logspace(-8, 2, 32).view(-1, 1)
    value[3] = 0.0  # an all-zero block: the scale's floor
    value[5, :7] = q8.dynamic_map(signed)[100:107] * value[5].abs().max()  # near entries
    if not signed:
        value = value.abs()
    codes, scale = q8.quantize(value, signed)
    scaled, their_scale = scale_tensor(value, q8.BLOCK)
    their_codes = quantize_8bit_with_qmap(scaled, q8.dynamic_map(signed))
    assert torch.equal(scale, their_scale)
    assert torch.equal(codes, their_codes)
    assert codes.dtype is torch.uint8 and codes.shape == value.shape
    back = q8.dequantize(codes, scale, signed)
    # Round to nearest: at most half the widest gap of the map, or, at -1 (which the
    # signed map lacks: its lowest entry is -0.993), the distance to that entry; times
    # the block's scale; plus the float32 rounding of the decoded value (an ulp of it,
    # 2**-24 of the scale: 2**-17 of that error, bounded by 2**-14).
    qmap = q8.dynamic_map(signed)
    worst = max(qmap.diff().max() / 2, 1 + qmap[0] if signed else 0.0)
    assert ((back - value).abs() <= worst * scale.view(-1, 1) * (1 + 2**-14)).all()


@pytest.mark.parametrize(
    ("numel", "quantized"),
    [(4096, True), (8192, True), (4095, False), (4352, True), (4097, False), (256, False)],
    ids=["4096", "8192", "below", "17-blocks", "ragged", "small"],
)
def test_which_tensors_are_quantized(numel: int, quantized: bool) -> None:
    assert q8.quantizes(numel) is quantized


def _step_both(steps: int, stochastic_theirs: bool = False):
    ours = [nn.Parameter(p.bfloat16()) for p in _params()]
    theirs = [nn.Parameter(p.bfloat16()) for p in _params()]
    # torchao's scheme: bounded=False (the default bounds each step, see adamw8bit).
    opt = CompensatedAdamW8bit(ours, lr=1e-3, weight_decay=0.1, fused=False, bounded=False)
    ref = torchao_optim.AdamW8bit(
        theirs, lr=1e-3, weight_decay=0.1, bf16_stochastic_round=stochastic_theirs
    )
    for grads in _grads(steps):
        for p, q, grad in zip(ours, theirs, grads, strict=True):
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    return ours, theirs, opt, ref


@pytest.mark.slow  # torchao compiles its step (about 10 s)
def test_states_match_torchao_bitwise() -> None:
    # With decoupled decay the moments depend on the gradients alone, so both
    # optimizers' states follow the same sequence. torchao compiles its step, and
    # Inductor rounds lerp's multiply and add separately, as amped's step does (eager
    # and fused): the codes and the scales are the same bits.
    ours, theirs, opt, ref = _step_both(5)
    for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        state, their = opt.state[ours[0]], ref.state[theirs[0]][key]
        assert torch.equal(state[f"{key}_codes"], their.codes)
        assert torch.equal(state[f"{key}_scale"], their.scale)
        moment = opt.moments(ours[0])[0 if signed else 1]
        assert torch.equal(moment.view(-1), their.dequantize().view(-1))
    # The small tensor is not compared: amped keeps its moments in float32, torchao in
    # bfloat16 rounded to nearest each step (its rule), so they part by design; the
    # one-step test below covers its update.


@pytest.mark.slow  # torchao compiles its step
def test_one_step_matches_torchao_within_one_ulp() -> None:
    # torchao rounds the new weight to nearest, amped stochastically: of the two
    # bfloat16 neighbours of the (equal up to float32 rounding) float32 result, amped
    # writes one and torchao the nearer one, so they differ by at most one ulp.
    ours, theirs, _, _ = _step_both(1)
    for p, q, start in zip(ours, theirs, _params(), strict=True):
        ulp = BF16_ULP * torch.exp2(torch.floor(torch.log2(q.float().abs())))
        assert ((p.float() - q.float()).abs() <= ulp).all()
        assert not torch.equal(p, start.bfloat16())  # the step moved the weights


def _train_model(model: nn.Module, opt: CompensatedAdamW8bit, data) -> None:
    for x, y in data:
        F.cross_entropy(model(x.bfloat16()).float(), y).backward()
        opt.step()
        opt.zero_grad()


def _wide(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 8)).bfloat16()


@pytest.mark.parametrize(
    ("compensation", "fused"),
    [
        ("stochastic", False),
        ("kahan", False),
        pytest.param("stochastic", None, marks=pytest.mark.slow),  # compiles the kernel
    ],
    ids=["stochastic", "kahan", "stochastic-fused"],
)
def test_checkpoint_resume_is_bitwise(compensation: str, fused: bool | None) -> None:
    data = batches(6)
    model = _wide()
    opt = CompensatedAdamW8bit(model.parameters(), lr=1e-3, compensation=compensation, fused=fused)
    _train_model(model, opt, data[:3])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    _train_model(model, opt, data[3:])

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = _wide(seed=5)
    resumed.load_state_dict(saved["model"])
    again = CompensatedAdamW8bit(
        resumed.parameters(), lr=1e-3, compensation=compensation, fused=fused
    )
    again.load_state_dict(saved["opt"])
    _train_model(resumed, again, data[3:])
    for p, q in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)
        for key, value in opt.state[p].items():
            other = again.state[q][key]
            if isinstance(value, torch.Tensor):
                assert other.dtype == value.dtype and torch.equal(other, value), key
            else:
                assert other == value


def test_state_keys_and_dtypes() -> None:
    model = _wide()
    opt = CompensatedAdamW8bit(model.parameters(), fused=False)
    _train_model(model, opt, batches(1))
    big, bias = opt.state[model[0].weight], opt.state[model[0].bias]
    assert {k: v.dtype for k, v in big.items() if isinstance(v, torch.Tensor)} == {
        "exp_avg_codes": torch.uint8,
        "exp_avg_scale": torch.float32,
        "exp_avg_sq_codes": torch.uint8,
        "exp_avg_sq_scale": torch.float32,
    }
    assert big["exp_avg_scale"].numel() == model[0].weight.numel() // 256
    assert {k: v.dtype for k, v in bias.items() if isinstance(v, torch.Tensor)} == {
        "exp_avg": torch.float32,
        "exp_avg_sq": torch.float32,
    }
    assert big["step"] == 1


def test_seeded_stochastic_rounding_is_reproducible() -> None:
    runs = []
    for seed in (0, 0, 1):
        model = _wide()
        opt = CompensatedAdamW8bit(model.parameters(), seed=seed, fused=False)
        _train_model(model, opt, batches(3))
        runs.append(torch.cat([p.float().flatten() for p in model.parameters()]))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_small_updates_survive_stochastic_rounding() -> None:
    # An update of a quarter ulp, 100 times: round-to-nearest would keep the weight;
    # stochastic rounding moves it by 25 ulps on average (each element binomial, sd 4.3
    # ulps; the mean of 4096 elements, sd 0.07). The gradient is positive: a block whose
    # largest first moment is negative stores it 0.7% small (the signed map ends at
    # -0.993), which compounds over steps into a smaller update.
    weight = nn.Parameter(torch.full((64, 64), 1.5, dtype=torch.bfloat16))
    opt = CompensatedAdamW8bit([weight], lr=BF16_ULP / 4, weight_decay=0.0, fused=False)
    for _ in range(100):
        weight.grad = torch.ones_like(weight)  # Adam's step is lr, downwards
        opt.step()
    moved = (1.5 - weight.float().mean()) / BF16_ULP
    assert 24.5 < moved < 25.5


def test_recipe_builds_the_8bit_optimizer_and_trains() -> None:
    model = mlp()
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "bf16-pure-8bit")
    assert isinstance(setup.optimizer, CompensatedAdamW8bit)
    assert amped.recipes.registry.resolve_recipe("pure-bf16-8bit").quantized_state
    losses = train(setup, batches(40))
    assert sum(losses[-5:]) < sum(losses[:5])
    assert all(p.dtype is torch.bfloat16 for p in setup.model.parameters())


def test_recipe_keeps_sgd_momentum_in_bfloat16() -> None:
    model = mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    setup = amped.prepare(model, sgd, "bf16-pure-8bit")
    assert isinstance(setup.optimizer, amped.optim.CompensatedSGD)
    assert setup.optimizer.defaults["compensation"] == "stochastic"


def test_quantized_state_needs_low_weights() -> None:
    with pytest.raises(ValueError, match="weights='low'"):
        amped.recipes.Recipe(
            "x",
            dtype=torch.bfloat16,
            weights="low-with-masters",
            autocast=True,
            loss_scaling=False,
            aliases=(),
            summary="",
            quantized_state=True,
        )


def test_step_parameter_needs_a_gradient() -> None:
    weight = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="gradient"):
        CompensatedAdamW8bit([weight]).step_parameter(weight)


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=256, n_head=4, n_positions=128, vocab_size=1024)
    return GPT2LMHeadModel(config)


@pytest.mark.slow  # transformers' import and a GPT-2 step: about 7 s
def test_memory_report_is_exact_and_under_6_1_bytes_per_param() -> None:
    model = _gpt2()
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters()), "bf16-pure-8bit")
    ids = torch.randint(0, 1024, (2, 16), generator=torch.Generator().manual_seed(0))
    setup.backward(setup.model(input_ids=ids, labels=ids).loss)
    setup.step()
    report = amped.memory_report(setup.model, setup.optimizer)
    params = list(setup.model.parameters())  # tied embedding once
    # Expected from the rule alone: 1 byte a moment element plus a float32 scale per
    # 256 for the quantized tensors, float32 moments for the others.
    expected = sum(
        2 * p.numel() + 8 * p.numel() // 256 if q8.quantizes(p.numel()) else 8 * p.numel()
        for p in params
    )
    assert report.params == report.grads == 2 * sum(p.numel() for p in params)
    assert report.optimizer_state == expected
    assert report.masters == 0
    assert report.bytes_per_param <= 6.1
    assert set(report.state_by_key) == {
        "exp_avg_codes",
        "exp_avg_scale",
        "exp_avg_sq_codes",
        "exp_avg_sq_scale",
        "exp_avg",
        "exp_avg_sq",
    }
