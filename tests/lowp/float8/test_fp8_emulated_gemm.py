"""Which GEMM the emulation runs (amped.lowp.float8.emulated_gemm): the choice, its overrides,
and what each path computes, checked on the results' bits."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from fp8_helpers import forced_emulated_gemm
from repo_paths import ROOT

from amped.lowp.convert import convert_layers
from amped.lowp.float8.cast import quantize, sqnr
from amped.lowp.float8.config import FLOAT8_CONFIGS
from amped.lowp.float8.emulated_gemm import ENV_VAR, emulated_gemm, set_emulated_gemm
from amped.lowp.mx.block_config import BLOCK_CONFIGS

SRC = str(ROOT / "src")  # the tree under test, not an installed amped


@pytest.fixture
def unset(monkeypatch):
    """No override by function or environment variable, restored after."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    previous = set_emulated_gemm(None)
    yield monkeypatch
    set_emulated_gemm(previous)


def _auto_in_subprocess(env: dict[str, str]) -> str:
    code = (
        "from amped.lowp.float8.emulated_gemm import emulated_gemm; g = emulated_gemm('cpu'); "
        "print(g.dtype, g.chosen_by, g.reason, sep='|')"
    )
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR} | env | {"PYTHONPATH": SRC}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


@pytest.mark.slow  # a fresh process imports torch: seconds
def test_a_cpu_whose_onednn_may_not_use_avx512_takes_float32_gemms():
    """ONEDNN_MAX_CPU_ISA=AVX2 is what an AVX2 CPU looks like to oneDNN (no bfloat16
    matmul): the automatic choice is float32, decided from the capabilities."""
    dtype, chosen_by, reason = _auto_in_subprocess({"ONEDNN_MAX_CPU_ISA": "AVX2"}).split("|")
    assert (dtype, chosen_by) == ("torch.float32", "auto")
    assert "oneDNN" in reason


def test_the_environment_variable_and_the_function_override_the_choice(unset):
    auto = emulated_gemm("cpu")
    assert auto.chosen_by == "auto" and auto.dtype in (torch.bfloat16, torch.float32)
    unset.setenv(ENV_VAR, "float32")
    assert emulated_gemm("cpu")[:2] == (torch.float32, "env")
    unset.setenv(ENV_VAR, "BF16")  # spelled in any case
    assert emulated_gemm("cpu")[:2] == (torch.bfloat16, "env")
    assert set_emulated_gemm("float32") is None
    assert emulated_gemm("cpu")[:2] == (torch.float32, "set")  # the function wins
    assert set_emulated_gemm("auto") == "float32"
    assert emulated_gemm("cpu") == auto  # "auto" set: the environment is not read
    set_emulated_gemm(None)
    assert emulated_gemm("cpu")[:2] == (torch.bfloat16, "env")
    assert emulated_gemm("cpu").as_dict() == {
        "dtype": "bfloat16",
        "chosen_by": "env",
        "reason": f"{ENV_VAR}=bf16",
    }


def test_unknown_choices_are_refused_saying_what_is_allowed(unset):
    with pytest.raises(ValueError, match=r"auto, bf16, float32.*Received: choice='fp16'"):
        set_emulated_gemm("fp16")  # type: ignore[arg-type]
    unset.setenv(ENV_VAR, "fp8")
    with pytest.raises(ValueError, match=rf"auto, bf16, float32.*{ENV_VAR}='fp8'"):
        emulated_gemm("cpu")


@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_each_path_computes_its_documented_bits(granularity, emulated_gemm):
    """A layer's output under bfloat16 input: on the float32 path the float32 GEMM of
    the FP8 values, the scales applied to its float32 sums, rounded once to bfloat16;
    on the bfloat16 path a bfloat16 GEMM (its sums rounded to bfloat16) and then the
    scales (tensorwise; rowwise scales are folded into the operands, exact)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 128, bias=False)
    ref = copy.deepcopy(linear)
    convert_layers(linear, FLOAT8_CONFIGS[granularity], [""])
    x = torch.randn(64, 256, dtype=torch.bfloat16) * 3
    out = linear(x)
    rowwise = granularity == "rowwise"
    a = quantize(x, torch.float8_e4m3fn, granularity, power_of_2=rowwise)
    b = quantize(ref.weight, torch.float8_e4m3fn, granularity, power_of_2=rowwise)
    inv_a, inv_b = a.scale.reciprocal(), b.scale.reciprocal().t()
    if rowwise:  # the operands dequantized (power-of-two scales: exact)
        va, vb = a.data.float() * inv_a, (b.data.float() * inv_b.t()).t()
        sums = va.to(emulated_gemm) @ vb.to(emulated_gemm)
        expected = sums.to(torch.bfloat16)
    else:
        va, vb = a.data.to(emulated_gemm), b.data.to(emulated_gemm).t()
        sums = (va @ vb).float()
        expected = (sums * inv_a * inv_b).to(torch.bfloat16)
    assert torch.equal(out, expected)


RECIPE_CONFIGS = {
    **{f"fp8-{name}": FLOAT8_CONFIGS[name] for name in ("tensorwise", "rowwise", "rowwise-gw-hp")},
    **{name: BLOCK_CONFIGS[name] for name in ("mxfp8", "mxfp4", "nvfp4")},
}


@pytest.mark.parametrize("recipe", list(RECIPE_CONFIGS))
def test_both_paths_give_the_same_layer_up_to_summation_order_and_rounding(recipe):
    """One layer (the same casts on both paths; through a stack, a bfloat16 ulp of
    difference in one layer's output can move the next layer's FP8 cast of it by a
    whole FP8 step): output and gradients differ only by the float32 summation order and
    the bfloat16 path's extra rounding of its sums (at most 2**-9 relative, 48 dB, per
    entry), so >= 40 dB apart."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256))
    convert_layers(model, RECIPE_CONFIGS[recipe], ["0"])
    x = torch.randn(96, 128, dtype=torch.bfloat16)
    grad = torch.randn(96, 256, dtype=torch.bfloat16)
    results = {}
    for path in ("bf16", "float32"):
        layers = copy.deepcopy(model)
        inp = x.clone().requires_grad_()
        with forced_emulated_gemm(path):
            out = layers(inp)
            out.backward(grad)
        results[path] = [out, inp.grad, *(p.grad for p in layers.parameters())]
    for ours, theirs in zip(results["float32"], results["bf16"], strict=True):
        assert ours.dtype == theirs.dtype
        assert sqnr(theirs, ours) >= 40


def test_docstring_example_runs(unset):
    import doctest

    from amped.lowp.float8 import emulated_gemm as module

    result = doctest.testmod(module)
    assert result.failed == 0 and result.attempted > 0
