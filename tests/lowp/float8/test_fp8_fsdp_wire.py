"""FP8 weights on the FSDP2 wire (amped.lowp.float8.fsdp_wire, amped.recipes.lowp_wire), in one
process: the gathered weight's semantics, the layer using it instead of casting again,
the global amax, which recipes get the wire, and an FSDP2 group of one rank
(tests/distributed/test_fp8_distributed.py runs 2 ranks: uneven shards, bytes on the wire, DCP)."""

from __future__ import annotations

import warnings

import pytest
import torch
from dist_launch import one_rank_group
from torch import nn

import amped
from amped.lowp import Float8Linear
from amped.lowp.convert import convert_layers
from amped.lowp.float8.cast import quantize
from amped.lowp.float8.config import FLOAT8_CONFIGS
from amped.lowp.float8.fsdp_wire import (
    GatheredFloat8Weight,
    gathered_fp8,
    global_amax,
    wire_refusal,
)
from amped.lowp.float8.gemm import scaled_mm
from amped.lowp.mx.block_config import BLOCK_CONFIGS
from amped.recipes.lowp_wire import wire_layers

E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize(
    "scaling, exact",
    [("tensorwise", True), ("delayed", True), ("rowwise", False), ("rowwise-gw-hp", False)],
)
def test_only_recipes_whose_backward_reuses_the_forward_cast_get_the_wire(scaling, exact):
    reason = wire_refusal(FLOAT8_CONFIGS[scaling])
    assert (reason is None) == exact
    if not exact:
        assert "backward" in reason or "grad-input" in reason


def _gathered(weight: torch.Tensor, scale: torch.Tensor | None = None) -> GatheredFloat8Weight:
    q = quantize(weight, E4M3, scale=scale)
    return GatheredFloat8Weight(q.data, q.scale, weight.dtype)


def test_the_gathered_weight_is_a_tensor_of_the_parameters_dtype_and_views_stay_fp8():
    torch.manual_seed(0)
    weight = torch.randn(6, 4, dtype=torch.bfloat16)
    gathered = _gathered(weight)
    assert (gathered.shape, gathered.dtype) == (weight.shape, torch.bfloat16)
    for view in (gathered.t(), gathered.detach(), torch.as_strided(gathered, (5, 4), (4, 1))):
        fp8 = gathered_fp8(view)
        assert fp8 is not None and fp8.data.dtype is E4M3
        assert torch.equal(fp8.scale, gathered.fp8_scale)
    bytes_t = gathered_fp8(gathered.t()).data.view(torch.uint8)  # FP8 has no equal on CPU
    assert torch.equal(bytes_t, gathered.fp8_data.view(torch.uint8).t())
    # any other op sees the dequantized weight, and returns a plain tensor
    dequantized = quantize(weight, E4M3).dequantize(torch.bfloat16)
    doubled = gathered * 2
    assert type(doubled) is torch.Tensor and torch.equal(doubled, dequantized * 2)
    assert gathered_fp8(weight) is None
    assert "GatheredFloat8Weight(shape=(6, 4)" in repr(gathered)


@pytest.mark.parametrize("scale", ["own", "other"])
def test_the_layer_uses_the_gathered_cast_instead_of_casting_again(scale):
    """A Float8Linear given an FP8 weight computes with those bytes and that scale; with
    the weight's own cast it is bitwise the layer on the bfloat16 weight, and the
    gradient reaching the weight is a plain bfloat16 tensor."""
    torch.manual_seed(0)
    plain = nn.Linear(16, 12, bias=False).to(torch.bfloat16)
    x = torch.randn(5, 16, dtype=torch.bfloat16, requires_grad=True)
    reference = Float8Linear.convert_(plain, FLOAT8_CONFIGS["tensorwise"])
    out = reference(x)
    out.float().sum().backward()

    layer = Float8Linear.convert_(nn.Linear(16, 12, bias=False), FLOAT8_CONFIGS["tensorwise"])
    own = quantize(plain.weight.detach(), E4M3).scale
    chosen = own if scale == "own" else own * 0.7  # a scale the layer would never pick
    layer.weight = nn.Parameter(_gathered(plain.weight.detach(), chosen))
    x2 = x.detach().clone().requires_grad_()
    out2 = layer(x2)
    out2.float().sum().backward()
    if scale == "own":
        assert torch.equal(out2, out) and torch.equal(x2.grad, x.grad)
        assert torch.equal(layer.weight.grad, plain.weight.grad)
    else:  # the given bytes and scale were used, not a cast of the layer's own
        wq = quantize(plain.weight.detach(), E4M3, scale=chosen)
        expected = scaled_mm(quantize(x.detach(), E4M3), wq.t(), torch.bfloat16, emulate=True)
        assert torch.equal(out2, expected) and not torch.equal(out2, out)
    grad = layer.weight.grad
    assert type(grad) is torch.Tensor and grad.dtype is torch.bfloat16


def test_global_amax_keeps_nan_and_inf_and_reads_an_empty_shard_as_zero():
    with one_rank_group() as group:
        values = torch.tensor([1.0, -3.0, 2.0], dtype=torch.bfloat16)
        assert global_amax(values, group).item() == 3.0
        assert global_amax(torch.tensor([1.0, float("inf")]), group).item() == float("inf")
        assert global_amax(torch.tensor([float("nan"), float("inf")]), group).isnan()
        assert global_amax(torch.empty(0, 4), group).item() == 0.0


def test_fp8_layers_converted_before_prepare_keep_float32_scaling_state_under_bf16_pure():
    """bf16-pure lowers every float32 buffer; delayed scaling's amax histories and scales
    are the casts' state and stay float32, as when prepare converts the layers itself."""

    def run(convert_first: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        if convert_first:
            convert_layers(model, FLOAT8_CONFIGS["delayed"], ["0", "2"])
        setup = _prepare(model, "fp8-delayed", "bf16-pure")
        for step in range(3):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
            with setup.autocast():
                loss = setup.model(x).float().pow(2).mean()
            setup.backward(loss)
            setup.step()
            setup.zero_grad()
        return {**dict(model.named_parameters()), **dict(model.named_buffers())}

    first, later = run(convert_first=True), run(convert_first=False)
    assert first["0.fp8_scale"].dtype is torch.float32
    for name, value in later.items():
        assert first[name].dtype == value.dtype and torch.equal(first[name], value), name


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 33), nn.GELU(), nn.Linear(33, 8))


def _train(setup: amped.TrainSetup, steps: int) -> None:
    features = setup.model[0].in_features
    for step in range(steps):
        x = torch.randn(8, features, generator=torch.Generator().manual_seed(step))
        with setup.autocast():
            loss = setup.model(x).float().pow(2).mean()
        setup.backward(loss)
        setup.step()
        setup.zero_grad()


def _prepare(model: nn.Module, recipe: str, base: str) -> amped.TrainSetup:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    setup = amped.prepare(model, optimizer, recipe, base=base, module_filter=lambda m, n: True)
    if hasattr(setup.optimizer, "fused"):
        setup.optimizer.fused = False
    return setup


@pytest.mark.slow  # importing FSDP2 takes seconds
@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
def test_prepare_installs_the_wire_on_sharded_fp8_layers_and_teardown_removes_it(recipe):
    """(A group of one rank all-gathers nothing: FSDP2 keeps whole parameters there. The
    2-rank tests in tests/distributed/test_fp8_distributed.py measure the wire.)"""
    from torch.distributed.fsdp import fully_shard

    control = _prepare(_model(), recipe, "bf16-pure")
    _train(control, 2)
    with one_rank_group():
        model = _model()
        convert_layers(model, FLOAT8_CONFIGS[recipe.removeprefix("fp8-")], ["0", "2"])
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        setup = _prepare(model, recipe, "bf16-pure")
        assert wire_layers(model) == ["0", "2"]
        _train(setup, 2)
        for name, param in model.named_parameters():
            assert torch.equal(param.full_tensor(), control.model.get_parameter(name)), name
        setup.teardown()  # float32 shards back, all-gathered as they are
        assert wire_layers(model) == []
        assert {p.to_local().dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.slow  # importing FSDP2 takes seconds
@pytest.mark.parametrize("recipe", ["fp8-rowwise", "mxfp8"])
def test_other_recipes_keep_their_dtype_on_the_wire_and_say_why(recipe):
    from torch.distributed.fsdp import fully_shard

    with one_rank_group():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))  # MX: 32s
        config = FLOAT8_CONFIGS.get(recipe.removeprefix("fp8-")) or BLOCK_CONFIGS[recipe]
        convert_layers(model, config, ["0"])
        fully_shard(model[0])
        fully_shard(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            setup = _prepare(model, recipe, "bf16-pure")
        messages = [str(w.message) for w in caught if "FSDP2 all-gathers" in str(w.message)]
        assert len(messages) == 1 and "Received: layers=['0']" in messages[0]
        assert wire_layers(model) == []
        _train(setup, 1)


def test_a_conv1d_layer_uses_its_gathered_weight_transposed():
    """transformers' Conv1D stores its weight ``[in, out]`` (FSDP2 shards the input
    features); the layer takes the gathered weight's transpose, still FP8."""
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(0)
    plain = conv1d(12, 16).to(torch.bfloat16)  # 16 in, 12 out
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    reference = Float8Linear.convert_(plain, FLOAT8_CONFIGS["tensorwise"])
    expected = reference(x)
    layer = Float8Linear.convert_(conv1d(12, 16).to(torch.bfloat16), FLOAT8_CONFIGS["tensorwise"])
    layer.weight = nn.Parameter(_gathered(plain.weight.detach()))
    layer.bias = nn.Parameter(plain.bias.detach().clone())
    out = layer(x)
    out.float().sum().backward()
    assert torch.equal(out, expected)
    assert layer.weight.grad.shape == (16, 12) and layer.weight.grad.dtype is torch.bfloat16


@pytest.mark.slow  # importing FSDP2 takes seconds
def test_a_shard_fsdp2_replaces_on_taking_it_up_is_reported_not_assumed_wired(monkeypatch):
    """FSDP2 may swap a shard's local tensor when it takes it up (CPU offload pins a
    copy, which needs an accelerator): simulated here by a reset that does that."""
    from torch.distributed.fsdp import fully_shard

    import amped.recipes.lowp_wire as fp8_wire
    from amped._internal.torch_compat import dtensor_local, set_dtensor_local

    original = fp8_wire.fsdp_reset_sharded_params

    def replacing(module: nn.Module) -> None:
        weight = getattr(module, "weight", None)
        if weight is not None:  # a plain copy, as pin_memory() returns
            set_dtensor_local(weight, dtensor_local(weight).as_subclass(torch.Tensor).clone())
        original(module)

    monkeypatch.setattr(fp8_wire, "fsdp_reset_sharded_params", replacing)
    with one_rank_group():
        model = _model()
        convert_layers(model, FLOAT8_CONFIGS["tensorwise"], ["0", "2"])
        fully_shard(model[0])
        fully_shard(model)
        with pytest.warns(UserWarning, match=r"FSDP2 replaced its local shard.*layers=\['0'\]"):
            setup = _prepare(model, "fp8-tensorwise", "bf16-pure")
        assert wire_layers(model) == ["2"]  # the root's own layer kept its shard
        _train(setup, 1)
