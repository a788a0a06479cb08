"""``amped.verify`` on clean runs: amped's own recipes and torchao's float8 and emulated
MXFP8 training, on a 4-layer MLP and a tiny transformers GPT-2. Every cast is the
reference's bit for bit (``mismatched == 0``), every GEMM output within its derived
bound (``outside == 0``), and nothing is flagged."""

from __future__ import annotations

import json

import pytest
import torch
from verify_helpers import gpt2, gpt2_batch, gpt2_loss, mlp, mlp_batch

import amped
from amped.lowp.health import ROLES

AMPED_RECIPES = ["fp8-tensorwise", "fp8-rowwise", "fp8-rowwise-gw-hp", "mxfp8", "nvfp4"]
TORCHAO_RECIPES = ["fp8-tensorwise", "fp8-rowwise", "fp8-rowwise-gw-hp", "mxfp8"]


def _assert_clean(report, layers):
    assert report.flags == ()
    assert report.ok
    assert report.layers == tuple(layers)
    for gemm in report.gemms:
        assert all(cast.mismatched == 0 for cast in gemm.casts), gemm
        assert gemm.outside == 0 and gemm.max_ratio <= 1.0, gemm
    # every role of every layer ran, but the first layer's grad_input (its input, the
    # batch, needs no gradient)
    expected = {(layer, role) for layer in layers for role in ROLES}
    ran = {(gemm.layer, gemm.role) for gemm in report.gemms}
    assert ran == expected - {(layers[0], "grad_input")} or ran == expected


@pytest.mark.parametrize(
    "recipe",
    [r if r in ("fp8-rowwise", "nvfp4") else pytest.param(r, marks=pytest.mark.slow)
     for r in AMPED_RECIPES],
)  # fmt: skip
def test_amped_recipes_on_an_mlp_verify_clean(recipe):
    report = amped.verify(mlp(), mlp_batch(), recipe=recipe)
    _assert_clean(report, ["0", "2"] if recipe == "nvfp4" else ["0", "2", "4"])
    low = [g for g in report.gemms if g.ran == "low precision"]
    # rowwise-gw-hp runs grad_weight in bfloat16 by design; every other GEMM is cast
    assert len(low) == len(report.gemms) - (3 if recipe == "fp8-rowwise-gw-hp" else 0)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", TORCHAO_RECIPES)
def test_torchao_on_an_mlp_verifies_clean(recipe):
    report = amped.verify(mlp(), mlp_batch(), recipe=recipe, backend="torchao")
    assert report.backend == "torchao"
    _assert_clean(report, ["0", "2", "4"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "recipe"),
    [
        ("torchao", "fp8-tensorwise"),
        ("torchao", "fp8-rowwise"),
        ("torchao", "mxfp8"),
        ("amped", "nvfp4"),
    ],
)
def test_a_tiny_gpt2_verifies_clean(backend, recipe):
    report = amped.verify(gpt2(), gpt2_batch(), recipe=recipe, backend=backend, loss_fn=gpt2_loss)
    blocks = [f"transformer.h.{i}.{p}" for i in range(2) for p in
              ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]  # fmt: skip
    assert report.flags == ()
    assert set(report.layers) <= set(blocks) and len(report.layers) >= 6
    assert len(report.gemms) == 3 * len(report.layers)
    assert all(g.outside == 0 and all(c.mismatched == 0 for c in g.casts) for g in report.gemms)


def test_the_users_model_is_left_as_it_was():
    model = mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    amped.verify(model, mlp_batch(), recipe="fp8-rowwise")
    assert all(type(m) in (torch.nn.Linear, torch.nn.GELU) for m in model[:])
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_verify_json_holds_the_schema_flags_and_every_gemm(tmp_path):
    report = amped.verify(mlp(), mlp_batch(), recipe="mxfp8")
    document = json.loads(report.save(tmp_path / "out").read_text())
    assert document["schema"] == "amped.verify/1"
    assert document["flags"] == [] and document["ok"] is True
    assert document["layers"] == ["0", "2", "4"]
    assert len(document["gemms"]) == len(report.gemms)
    first = document["gemms"][0]
    assert first["casts"][0]["ran"] == "e4m3 block32, e8m0 scale"
    assert first["casts"][0]["mismatched"] == 0


def test_a_recipe_it_cannot_verify_is_refused_with_the_ones_it_can():
    with pytest.raises(ValueError, match=r"fp8-rowwise.*Received: recipe='fp8-delayed'"):
        amped.verify(mlp(), mlp_batch(), recipe="fp8-delayed")
    with pytest.raises(ValueError, match="backend is one of"):
        amped.verify(mlp(), mlp_batch(), recipe="mxfp8", backend="jax")


def test_transformer_engine_is_refused_saying_why_where_not_installed():
    pytest.importorskip("torch")
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="Transformer Engine, which is not installed"):
            amped.verify(mlp(), mlp_batch(), recipe="fp8-tensorwise", backend="te")
    else:
        pytest.skip("Transformer Engine is installed: reading its casts needs a CUDA device")


def test_the_docstring_example_runs():
    import doctest
    import importlib

    module = importlib.import_module("amped.verification.verify")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0
