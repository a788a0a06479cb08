"""amped.Policy: torch's defaults as data, overrides by op, dtype and module, value
semantics, and each override's effect checked against a hand-written computation."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tolerances import BITWISE

import amped
from amped.policy import Cast
from amped.policy.ops import TORCH_OP_TABLES, registered_autocast_ops

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture
def cpu_policy():
    return amped.Policy.preset("torch", "cpu")


# --- defaults ----------------------------------------------------------------------------


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_default_lists_exactly_the_ops_torch_registers(device_type):
    # Every op the installed torch has an autocast kernel for is in the table, and the
    # default policy lists exactly those: a new torch release that adds an op fails here.
    registered = registered_autocast_ops(device_type)
    assert registered <= set(TORCH_OP_TABLES[device_type])
    policy = amped.Policy.preset("torch", device_type)
    assert set(policy.rules) == registered


def test_default_categories_follow_torch_source():
    cpu = amped.Policy.preset("torch", "cpu")
    cuda = amped.Policy.preset("torch", "cuda")
    assert cpu.cast_for("mm", BF16) is Cast.LOWER
    assert cpu.cast_for("cross_entropy_loss", BF16) is Cast.FP32
    assert cpu.cast_for("cat", BF16) is Cast.PROMOTE
    assert cpu.cast_for("softmax", BF16) is None  # torch's CPU list leaves softmax alone
    assert cuda.cast_for("softmax", FP16) is Cast.FP32_SET_OPT_DTYPE
    assert cuda.cast_for("norm", FP16) is Cast.FP32_APPEND_DTYPE
    assert cuda.cast_for("binary_cross_entropy", FP16) is Cast.BANNED


def test_strict_preset_adds_cuda_float32_list_on_cpu():
    strict = amped.Policy.preset("strict", "cpu")
    assert strict.cast_for("softmax", BF16) is Cast.FP32_SET_OPT_DTYPE
    assert strict.cast_for("layer_norm", BF16) is Cast.FP32
    assert strict.cast_for("exp", BF16) is Cast.FP32
    assert strict.cast_for("mm", BF16) is Cast.LOWER
    x = torch.randn(4, 8)
    with amped.autocast("cpu", policy="strict"):
        h = torch.mm(x, x.t())
        assert h.dtype == BF16
        assert torch.softmax(h, -1).dtype == FP32
        assert F.layer_norm(h, (4,)).dtype == FP32
        assert torch.exp(h).dtype == FP32
    with amped.autocast("cpu"):
        assert torch.softmax(torch.mm(x, x.t()), -1).dtype == BF16


# --- op overrides ------------------------------------------------------------------------


def test_op_moved_to_float32_matches_hand_computation(cpu_policy):
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    policy = cpu_policy.with_ops(fp32=["mm"])
    with amped.autocast("cpu", policy=policy):
        got = torch.mm(a.to(BF16), b)
        assert torch.matmul(a, b).dtype == BF16  # matmul is a separate op, still low
    torch.testing.assert_close(got, torch.mm(a.to(BF16).float(), b), **BITWISE)


def test_op_kept_untouched_is_not_cast_by_torch_either(cpu_policy):
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with amped.autocast("cpu", policy=cpu_policy.with_ops(keep=["linear"])):
        assert F.linear(a, b).dtype == FP32
        assert F.linear(a.to(BF16), b.to(BF16)).dtype == BF16


def test_promote_and_float32_low_out(cpu_policy):
    x = torch.randn(4, 16)
    policy = cpu_policy.with_ops(fp32_low_out=["layer_norm"], promote=["add"])
    with amped.autocast("cpu", policy=policy):
        h = torch.mm(x, torch.randn(16, 16))
        y = F.layer_norm(h, (16,))
        assert y.dtype == BF16
        assert torch.add(h, x).dtype == FP32
    torch.testing.assert_close(y, F.layer_norm(h.float(), (16,)).to(BF16), **BITWISE)


def test_per_dtype_rules(cpu_policy):
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    policy = cpu_policy.with_ops(fp32=["mm"], dtype=FP16)
    assert policy.cast_for("mm", FP16) is Cast.FP32
    assert policy.cast_for("mm", BF16) is Cast.LOWER
    with amped.autocast("cpu", dtype=FP16, policy=policy):
        assert torch.mm(a, b).dtype == FP32
    with amped.autocast("cpu", dtype=BF16, policy=policy):
        assert torch.mm(a, b).dtype == BF16
    # A move for both dtypes replaces an earlier per-dtype move of the same op.
    both = policy.with_ops(lower=["mm"])
    assert both.cast_for("mm", FP16) is Cast.LOWER


def test_user_function_added_to_low_precision_list(cpu_policy):
    @amped.autocast_op
    def gated(x, w):
        return torch.sigmoid(x) * (x @ w)

    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with amped.autocast("cpu", policy=cpu_policy.with_ops(lower=[gated])):
        got = gated(x, w)
    assert got.dtype == BF16
    xb, wb = x.to(BF16), w.to(BF16)
    torch.testing.assert_close(got, torch.sigmoid(xb) * (xb @ wb), **BITWISE)
    with amped.autocast("cpu"):  # unlisted: its inner ops are seen one by one
        assert gated(x, w).dtype == FP32  # sigmoid(fp32) * bf16 promotes


def test_custom_op_in_policy_by_object_and_by_name(cpu_policy):
    @torch.library.custom_op("amped_test::mul", mutates_args=())
    def mul(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * y

    x = torch.randn(8)
    for op in (mul, "amped_test::mul"):
        with amped.autocast("cpu", policy=cpu_policy.with_ops(lower=[op])):
            assert mul(x, x).dtype == BF16
            assert torch.ops.amped_test.mul(x, x).dtype == BF16
            torch.testing.assert_close(mul(x, x), x.to(BF16) * x.to(BF16), **BITWISE)


# --- module rules ------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.proj(x)))


@pytest.mark.parametrize("selector", ["head", nn.Linear], ids=["by-name", "by-type"])
def test_submodule_kept_in_float32(cpu_policy, selector):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 8)
    policy = cpu_policy.with_module(selector, "fp32")
    with amped.autocast("cpu", policy=policy):
        out = model(x)
    assert out.dtype == FP32
    if selector == "head":  # proj still runs in bfloat16; head in float32 on its output
        h = torch.relu(F.linear(x.to(BF16), model.proj.weight.to(BF16), model.proj.bias.to(BF16)))
        expected = F.linear(h.float(), model.head.weight, model.head.bias)
    else:
        expected = model.head(torch.relu(model.proj(x)))
    torch.testing.assert_close(out, expected, **BITWISE)


def test_submodule_skip_and_low(cpu_policy):
    model, x = Block(), torch.randn(2, 8)
    with amped.autocast("cpu", policy=cpu_policy.with_module("proj", "skip")):
        assert model.proj(x).dtype == BF16  # called directly: proj is the root, unnamed
        assert model(x).dtype == BF16  # head still low
    seen = {}
    model.head.register_forward_hook(lambda m, i, o: seen.update(head=o.dtype))
    with amped.autocast("cpu", policy=cpu_policy.with_module("proj", "skip")):
        model(x)
    assert seen["head"] == BF16
    loss_policy = cpu_policy.with_module(nn.Linear, "low").with_ops(fp32=["linear"])
    with amped.autocast("cpu", policy=loss_policy):
        assert model(x).dtype == BF16


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-process", "after-a-compile"])
def test_module_rules_leave_no_hooks_behind(cpu_policy, compiled):
    # After a compile in a module-rule region, the hooks stay installed (Dynamo guards on
    # the global hook dicts), idle: one set, whatever number of regions follow; until
    # torch._dynamo.reset() drops every graph. A set has two pre-hooks: the "fp32" rule's
    # positional inputs, then its keyword inputs.
    from torch.nn.modules import module as nn_module

    pre_hooks = 2

    torch._dynamo.reset()  # as in a process that compiled nothing
    policy = cpu_policy.with_module(nn.Linear, "fp32")
    with amped.autocast("cpu", policy=policy):
        pass  # removes the idle hooks an earlier test's compile may have left
    before = len(nn_module._global_forward_pre_hooks)
    with amped.autocast("cpu", policy=policy):
        assert len(nn_module._global_forward_pre_hooks) == before + pre_hooks
        if compiled:
            torch.compile(lambda x: x * 2, backend="eager")(torch.randn(2))
    assert len(nn_module._global_forward_pre_hooks) == before + pre_hooks * compiled
    for _ in range(2):
        with amped.autocast("cpu", policy=policy):
            assert len(nn_module._global_forward_pre_hooks) == before + pre_hooks
    assert len(nn_module._global_forward_pre_hooks) == before + pre_hooks * compiled
    torch._dynamo.reset()
    with amped.autocast("cpu", policy=policy):
        pass
    assert len(nn_module._global_forward_pre_hooks) == before


def test_module_rule_state_restored_when_forward_raises(cpu_policy):
    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    model = nn.Sequential(nn.Linear(8, 8), Boom())
    with amped.autocast("cpu", policy=cpu_policy.with_module(Boom, "skip")):
        with pytest.raises(ValueError, match="boom"):
            model(torch.randn(2, 8))
        assert torch.is_autocast_enabled("cpu")
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == BF16


# --- value semantics ---------------------------------------------------------------------


def test_policies_compare_hash_copy_and_pickle(cpu_policy):
    same = amped.Policy("cpu", dict(cpu_policy.rules))
    assert same == cpu_policy and hash(same) == hash(cpu_policy)
    changed = cpu_policy.with_ops(fp32=["mm"])
    assert changed != cpu_policy
    assert cpu_policy.cast_for("mm", BF16) is Cast.LOWER  # the original is unchanged
    assert copy.copy(changed) == changed and copy.deepcopy(changed) == changed
    assert pickle.loads(pickle.dumps(changed)) == changed
    assert {cpu_policy: 1}[same] == 1


def test_print_shows_the_tables(cpu_policy):
    text = str(cpu_policy.with_ops(fp32=["mm"], dtype=FP16).with_module("head", "fp32"))
    assert "Policy" in text and "lower (" in text and "fp32 (" in text and "promote (" in text
    assert "only under torch.float16:" in text and "head -> fp32" in text
    assert "linear" in text
    assert "Policy('cpu'" in repr(cpu_policy)


# --- errors ------------------------------------------------------------------------------


def test_bad_arguments_are_refused_with_clear_errors(cpu_policy):
    with pytest.raises(ValueError, match="Unknown op name 'matmull'"):
        cpu_policy.with_ops(fp32=["matmull"])
    with pytest.raises(TypeError, match="takes a list of ops"):
        cpu_policy.with_ops(fp32="mm")
    with pytest.raises(TypeError, match="unknown category 'fast'"):
        cpu_policy.with_ops(fast=["mm"])
    with pytest.raises(TypeError, match="ATen op name or a callable"):
        cpu_policy.with_ops(fp32=[3])
    with pytest.raises(ValueError, match="low dtypes"):
        cpu_policy.with_ops(fp32=["mm"], dtype=FP32)
    with pytest.raises(ValueError, match="No custom op 'nope::op'"):
        cpu_policy.with_ops(fp32=["nope::op"])
    with pytest.raises(ValueError, match="precision must be one of"):
        cpu_policy.with_module("head", "fp64")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="module selector"):
        cpu_policy.with_module(int, "fp32")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device types"):
        amped.Policy("tpu", {})
    with pytest.raises(ValueError, match="Unknown policy preset"):
        amped.Policy.preset("fastest", "cpu")
    # No default device type, as torch.autocast has none: a policy holds one device's lists.
    with pytest.raises(TypeError, match="device_type"):
        amped.Policy.preset("torch")  # type: ignore[call-arg]


# --- CUDA's categories, exercised on the CPU through a policy ------------------------------


def test_set_opt_dtype_and_append_dtype_categories(cpu_policy):
    # CUDA runs softmax/sum with dtype=float32 and norm with an appended float32 dtype;
    # the same categories on CPU must give exactly those calls' results.
    policy = cpu_policy.with_ops(
        fp32_set_opt_dtype=["softmax", "sum", "linalg_vector_norm"], fp32_append_dtype=["norm"]
    )
    x = torch.randn(4, 8).to(BF16)
    aten_norm = torch._C._VariableFunctions.norm  # torch.norm reaches it for sparse inputs
    with amped.autocast("cpu", policy=policy):
        soft, total, norm = torch.softmax(x, -1), x.sum(), aten_norm(x)
        norm_dim = aten_norm(x, 2, [1], False)
        vector_norm = torch.norm(x)  # Python: calls linalg_vector_norm
        explicit = torch.softmax(x, -1, dtype=torch.float64)  # a given dtype is respected
        integer_sum = torch.arange(4).sum()  # not eligible: untouched
    torch.testing.assert_close(soft, torch.softmax(x, -1, dtype=FP32), **BITWISE)
    torch.testing.assert_close(total, x.sum(dtype=FP32), **BITWISE)
    torch.testing.assert_close(norm, aten_norm(x, 2, dtype=FP32), **BITWISE)
    torch.testing.assert_close(norm_dim, aten_norm(x, 2, [1], False, dtype=FP32), **BITWISE)
    torch.testing.assert_close(vector_norm, torch.linalg.vector_norm(x, dtype=FP32), **BITWISE)
    assert explicit.dtype == torch.float64 and integer_sum.dtype == torch.int64


def test_banned_op_raises_torch_error(cpu_policy):
    p = torch.rand(4)
    banned = cpu_policy.with_ops(banned=["binary_cross_entropy"])
    with amped.autocast("cpu", policy=banned), pytest.raises(RuntimeError, match="unsafe"):
        F.binary_cross_entropy(p, p)
    F.binary_cross_entropy(p, p)  # fine outside the region
