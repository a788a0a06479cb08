"""The bf16-pure recipes on FSDP2 (2 gloo processes, tests/helpers/dist_fsdp_worker.py).

Every rank trains on the same global batch, so the 2-rank run does the same arithmetic
as one process: the gradients all-gathered weights give are the control's, FSDP2's
reduce-scatter averages two equal bfloat16 gradients (halving and adding them is
exact), and the optimizers step each shard elementwise, numbering the stochastic
rounding's random bits and the 8-bit state's blocks by the unsharded tensor. So the
parameters, the 8-bit moments and which state each parameter keeps are compared
bitwise. (With each rank on its half of the batch the gradients are summed in
bfloat16 in another order than one process sums them, and no bitwise claim holds.)
"""

from __future__ import annotations

import pytest
import torch
from dist_launch import FSDP2_DEADLINE_S, ranks_results

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fsdp2")]  # one 2-rank launch

RECIPES = ("bf16-pure", "bf16-pure-sr", "bf16-pure-8bit")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One launch serves this module and tests/distributed/test_fp8_distributed.py's wire tests."""
    workdir = tmp_path_factory.mktemp("fsdp2")
    return [r["pure"] for r in ranks_results("dist_fsdp2_worker.py", workdir, FSDP2_DEADLINE_S)]


def _control(ranks: list[dict], key: str) -> dict:
    """The one-process control of scenario ``key`` (one rank runs it)."""
    (control,) = [rank[key]["control"] for rank in ranks if "control" in rank[key]]
    return control


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ (dtype or any bit)."""
    assert a.keys() == b.keys()
    return [
        name for name in a if a[name].dtype != b[name].dtype or not torch.equal(a[name], b[name])
    ]


@pytest.mark.parametrize("recipe", RECIPES)
def test_two_ranks_train_bitwise_as_one_process(ranks, recipe):
    run = ranks[0][f"equal/{recipe}"]
    control = _control(ranks, f"equal/{recipe}")
    assert _equal(run["params"], control["params"]) == []
    assert _equal(ranks[1][f"equal/{recipe}"]["params"], control["params"]) == []
    assert run["losses"] == control["losses"]
    # the shards were lowered: FSDP2 keeps (and all-gathers) bfloat16
    assert set(run["local_dtype"].values()) == {"torch.bfloat16"}


@pytest.mark.parametrize("recipe", ["bf16-pure", "bf16-pure-sr"])
def test_the_fused_step_on_shards_is_bitwise_that_of_one_process(ranks, recipe):
    control = _control(ranks, f"fused/{recipe}")
    for rank in ranks:
        assert _equal(rank[f"fused/{recipe}"]["params"], control["params"]) == []


@pytest.mark.parametrize("recipe", RECIPES)
def test_state_precision_is_that_of_one_process(ranks, recipe):
    control = _control(ranks, f"equal/{recipe}")
    for rank in ranks:
        assert rank[f"equal/{recipe}"]["state"] == control["state"]


def test_8bit_states_follow_the_unsharded_tensor(ranks):
    run = ranks[0]["equal/bf16-pure-8bit"]
    state, control = run["state"], _control(ranks, "equal/bf16-pure-8bit")["state"]
    # 8-bit where the whole tensor has >= 4096 elements in blocks of 256, on any mesh:
    # 0.weight (68 x 64) has blocks shared by the ranks, 9.weight (33 x 256) 17 rows on
    # rank 0 and 16 on rank 1; biases and the norm keep float32 moments.
    for name in ("0.weight", "3.weight", "5.weight", "7.weight", "9.weight"):
        assert state[name]["exp_avg_codes"] == "torch.uint8", name
    for name in ("0.bias", "2.weight", "3.bias", "9.bias"):
        assert state[name]["exp_avg"] == "torch.float32", name
    for name, moments in _control(ranks, "equal/bf16-pure-8bit")["moments"].items():
        for rank in ranks:
            got = rank["equal/bf16-pure-8bit"]["moments"][name]
            assert all(torch.equal(m, c) for m, c in zip(got, moments, strict=True)), name
    assert state == control


@pytest.mark.parametrize("recipe", RECIPES)
def test_dcp_round_trip_is_bitwise_and_resumes_the_run(ranks, recipe):
    for rank in ranks:
        run = rank[f"dcp/{recipe}"]
        saved, loaded = run["saved"], run["loaded"]
        assert saved.keys() == loaded.keys()
        for name, tensors in saved.items():
            assert tensors.keys() == loaded[name].keys(), name
            for key, value in tensors.items():
                other = loaded[name][key]
                if torch.is_tensor(value):
                    assert value.dtype == other.dtype and torch.equal(value, other), (name, key)
                else:
                    assert value == other, (name, key)
        # The random stream came back too: the resumed run goes on bit for bit.
        assert run["resumed_losses"] == run["losses"]
        assert _equal(run["resumed_params"], run["params"]) == []


def test_bf16_pure_all_gathers_half_the_bytes_of_float32_shards(ranks):
    wire = ranks[0]["wire"]
    assert wire["bf16-mixed"]["dtypes"] == ["torch.float32"]
    for recipe in ("bf16-pure", "bf16-pure-8bit"):
        assert wire[recipe]["dtypes"] == ["torch.bfloat16"]
        assert 2 * wire[recipe]["bytes"] == wire["bf16-mixed"]["bytes"]
    # forward and backward each all-gather every parameter (FSDP2 reshards after
    # forward); each rank sends its padded shard, at least half the parameters
    assert wire["bf16-pure"]["bytes"] >= 2 * 2 * wire["params"] // 2


@pytest.mark.parametrize("recipe", RECIPES)
def test_memory_report_counts_the_shards_each_rank_holds(ranks, recipe):
    """Each rank's report counts its local shards: the ranks' parameters and gradients
    add up to one process's exactly, at the same bytes per parameter. The moments do
    too where the recipe keeps them elementwise; 8-bit scales are kept by rows on
    shards (docs/distributed.md), so a shard of short rows holds a few more bytes."""
    control = _control(ranks, f"equal/{recipe}")["memory"]
    reports = [rank[f"equal/{recipe}"]["memory"] for rank in ranks]
    for key in ("num_params", "params", "grads"):
        assert sum(r[key] for r in reports) == control[key], key
    for report in reports:
        assert report["num_params"] < control["num_params"]  # a shard, not the model
        assert report["bytes_per_param"]["params"] == control["bytes_per_param"]["params"]
    state = sum(r["optimizer_state"] for r in reports)
    if recipe == "bf16-pure-8bit":
        assert control["optimizer_state"] < state < 1.01 * control["optimizer_state"]
    else:
        assert state == control["optimizer_state"]
