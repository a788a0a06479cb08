"""The FP8 recipes on 2 gloo processes.

fp8-delayed, each rank on its own data, under DDP and FSDP2 (layers converted before
fully_shard): after every step the amax history holds the MAX of the ranks' amaxes, and
every rank casts with the same scales. FP8 and FP4 weights on the FSDP2 wire
(tests/helpers/dist_fp8_wire_worker.py, in one launch with tests/distributed/test_fsdp2_pure.py's
scenarios): bitwise one process's training with uneven shards, half the bytes of
bfloat16 (FP4: a quarter plus tile scales), DCP round trips, tuned plans, and the
recipes that keep bfloat16."""

from __future__ import annotations

import pytest
import torch
from dist_launch import FSDP2_DEADLINE_S, ranks_results

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("fsdp2")]  # one 2-rank launch


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One launch serves every 2-rank FSDP2 test (tests/helpers/dist_fsdp2_worker.py)."""
    workdir = tmp_path_factory.mktemp("fsdp2")
    return [r["fp8"] for r in ranks_results("dist_fsdp2_worker.py", workdir, FSDP2_DEADLINE_S)]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_scales_are_equal_on_every_rank_and_come_from_the_max_amax(ranks, wrapper):
    r0, r1 = ranks[0][wrapper], ranks[1][wrapper]
    for step in range(len(r0["scale"])):
        for layer in range(2):
            assert torch.equal(r0["scale"][step][layer], r1["scale"][step][layer])
            assert torch.equal(r0["history"][step][layer], r1["history"][step][layer])
            local = torch.maximum(r0["pending"][step][layer], r1["pending"][step][layer])
            assert torch.equal(r0["history"][step][layer][:, 0], local)
    # DDP: the first step reduces each tensor's amax just in time (2 layers x 3 tensors)
    # and then the histories once; every later step: one all-reduce for the whole model.
    # FSDP2 all-gathers the weights in FP8, reducing each weight's amax before each of
    # its all-gathers (2 layers x forward and backward), the inputs' and grad_outputs'
    # just in time at the first step (2 x 2), then the histories once.
    expected = [7, 1, 1, 1] if wrapper == "ddp" else [9, 5, 5, 5]
    assert r0["reduces"] == expected
    # the ranks saw different inputs, so the reduction mattered
    assert not torch.equal(r0["pending"][0][0][0], r1["pending"][0][0][0])
    for p0, p1 in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(p0, p1)
    assert all(torch.isfinite(torch.tensor(r0["loss"])))


# --- FP8 weights on the FSDP2 wire (tests/helpers/dist_fp8_wire_worker.py) ---------------------
#
# Every rank trains on the same global batch, so 2 ranks do one process's arithmetic
# (FSDP2's reduce-scatter averages two equal gradients exactly): the gathered FP8
# weight and its scale are bit for bit the unsharded layer's cast (the scale comes from
# the all-reduced amax of the shards, the cast is elementwise), and the parameters,
# losses and delayed-scaling buffers are compared bitwise.

WIRE_LAYERS = ["0", "3", "5"]


@pytest.fixture(scope="module")
def wire_ranks(tmp_path_factory):
    """One launch serves this module's wire tests and tests/distributed/test_fsdp2_pure.py."""
    workdir = tmp_path_factory.mktemp("fsdp2")
    return [r["wire"] for r in ranks_results("dist_fsdp2_worker.py", workdir, FSDP2_DEADLINE_S)]


def _differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]


@pytest.mark.parametrize("base", ["bf16-pure", "bf16-mixed"])
@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
def test_fp8_on_the_wire_trains_bitwise_as_one_process_with_uneven_shards(wire_ranks, recipe, base):
    rows = []
    for rank in wire_ranks:
        run = rank[f"equal/{recipe}/{base}"]
        assert run["wire_layers"] == WIRE_LAYERS
        control = run["control"]
        assert _differing(run["params"], control["params"]) == []
        assert _differing(run["buffers"], control["buffers"]) == []  # delayed scaling's
        assert run["losses"] == control["losses"]
        rows.append([run["rows"][f"{name}.weight"] for name in WIRE_LAYERS])
    assert rows == [[17, 25, 1], [16, 25, 0]]  # 33, 50 and 1 rows; rank 1's last is empty


def _pairs(fp8: list[tuple[int, str]], other: list[tuple[int, str]]) -> list[tuple]:
    assert len(fp8) == len(other)  # the same groups, in the same order
    return list(zip(fp8, other, strict=True))


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
def test_fp8_weights_take_half_the_bytes_of_bfloat16_on_the_wire(wire_ranks, recipe):
    for rank in wire_ranks:
        fp8, bf16 = rank[f"equal/{recipe}/bf16-pure"]["wire"], rank["wire/bf16-pure"]
        pairs = _pairs(fp8, bf16)
        # forward and backward all-gather each layer (the root's LayerNorm: once)
        assert len(pairs) == 1 + 2 * len(WIRE_LAYERS)
        for (fp8_bytes, fp8_dtype), (bf16_bytes, bf16_dtype) in pairs:
            assert bf16_dtype == "torch.bfloat16"
            if fp8_dtype == "torch.uint8":  # an FP8 layer's weight (FP8 bytes)
                assert 2 * fp8_bytes == bf16_bytes
            else:  # the LayerNorm, not converted
                assert (fp8_bytes, fp8_dtype) == (bf16_bytes, bf16_dtype)
        # every rank sends its padded shard: 17 x 64, 25 x 33 and 1 x 50 bytes
        assert sorted({b for b, d in fp8 if d == "torch.uint8"}) == [50, 825, 1088]


def test_fp8_weights_take_a_quarter_of_the_bytes_of_float32_shards(wire_ranks):
    for rank in wire_ranks:
        fp8 = rank["equal/fp8-tensorwise/bf16-mixed"]["wire"]
        pairs = _pairs(fp8, rank["wire/bf16-mixed"])
        for (fp8_bytes, fp8_dtype), (fp32_bytes, fp32_dtype) in pairs:
            assert fp32_dtype == "torch.float32"
            factor = 4 if fp8_dtype == "torch.uint8" else 1
            assert factor * fp8_bytes == fp32_bytes


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
def test_dcp_round_trip_keeps_the_fp8_wire_and_resumes_bitwise(wire_ranks, recipe):
    for rank in wire_ranks:
        run = rank[f"dcp/{recipe}"]
        saved, loaded = run["saved"], run["loaded"]
        assert saved.keys() == loaded.keys()
        for name, tensors in saved.items():
            for key, value in tensors.items():
                other = loaded[name][key]
                if torch.is_tensor(value):
                    assert value.dtype == other.dtype and torch.equal(value, other), (name, key)
                else:
                    assert value == other, (name, key)
        assert run["resumed_losses"] == run["losses"]
        assert _differing(run["resumed_params"], run["params"]) == []
        assert run["wire_layers"] == WIRE_LAYERS
        assert {d for _, d in run["resumed_wire"]} == {"torch.uint8", "torch.bfloat16"}


def test_rowwise_keeps_bfloat16_on_the_wire_says_why_and_matches_one_process(wire_ranks):
    for rank in wire_ranks:
        run = rank["rowwise"]
        assert len(run["warnings"]) == 1
        assert "backward casts it again along the other dim" in run["warnings"][0]
        assert "Received: layers=['0', '3', '5']" in run["warnings"][0]
        assert run["wire_layers"] == []
        assert {d for _, d in run["wire"]} == {"torch.bfloat16"}
        assert _differing(run["params"], run["control"]["params"]) == []


def test_blockwise_keeps_bfloat16_on_the_wire_says_why_and_matches_one_process(wire_ranks):
    """fp8-blockwise under FSDP2: each rank casts the whole all-gathered weight in
    128x128 tiles, the same bits as one process."""
    for rank in wire_ranks:
        run = rank["blockwise"]
        assert len(run["warnings"]) == 1
        assert "cast in 128x128 tiles" in run["warnings"][0]
        assert run["wire_layers"] == []
        assert {d for _, d in run["wire"]} == {"torch.bfloat16"}
        assert _differing(run["params"], run["control"]["params"]) == []
        assert run["losses"] == run["control"]["losses"]


def test_under_a_mixed_precision_policy_the_wire_casts_what_the_layer_would_have(wire_ranks):
    """float32 shards that FSDP2 all-gathers as bfloat16: the wire casts the bfloat16
    value of the weight, so it trains as FSDP2 without the wire (all-gathering bfloat16
    and casting in the layer), bit for bit, on half the bytes."""
    for rank in wire_ranks:
        wire, control = rank["mixed"]["wire"], rank["mixed"]["control"]
        assert wire["wire_layers"] == WIRE_LAYERS and control["wire_layers"] == []
        assert _differing(wire["params"], control["params"]) == []
        assert wire["losses"] == control["losses"]
        for (fp8_bytes, fp8_dtype), (bf16_bytes, bf16_dtype) in _pairs(
            wire["wire"], control["wire"]
        ):
            assert bf16_dtype == "torch.bfloat16"
            assert (2 if fp8_dtype == "torch.uint8" else 1) * fp8_bytes == bf16_bytes


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
def test_with_each_rank_on_its_own_data_the_wire_changes_only_the_bytes(wire_ranks, recipe):
    """Each rank on half the batch: FSDP2's reduce-scatter sums gradients one process
    never rounds apart, so the control is the same 2-rank run with the wire taken off
    (FSDP2 all-gathering bfloat16, the layer casting): bitwise, delayed scaling's state
    included."""
    losses = []
    for rank in wire_ranks:
        wire, control = rank[f"split/{recipe}"]["wire"], rank[f"split/{recipe}"]["control"]
        assert wire["wire_layers"] == WIRE_LAYERS and control["wire_layers"] == []
        assert _differing(wire["params"], control["params"]) == []
        assert _differing(wire["buffers"], control["buffers"]) == []
        assert wire["losses"] == control["losses"]
        losses.append(wire["losses"])
    assert losses[0] != losses[1]  # the ranks did see different data


# --- NVFP4 weights on the FSDP2 wire (amped.lowp.mx.fsdp_block_wire) ------------------------


def test_nvfp4_on_the_wire_trains_bitwise_as_one_process(wire_ranks):
    """Layers of 64 and 32 rows (32 and 16 per rank: whole 16x16 tiles) all-gather
    FP4; the one of 48 rows (24 per rank: its tiles would straddle the ranks) keeps
    bfloat16 and says why. Stochastic rounding and the Hadamard transform included."""
    for rank in wire_ranks:
        run = rank["nvfp4"]
        assert run["wire_layers"] == ["0", "2"]
        assert run["rows"] == {"0.weight": 32, "2.weight": 16, "4.weight": 24}
        assert len(run["warnings"]) == 1
        message = run["warnings"][0]
        assert "48 rows do not split into 2 equal shards of whole 16-row tiles" in message
        assert "Received: layers=['4']" in message
        control = run["control"]
        assert _differing(run["params"], control["params"]) == []
        assert _differing(run["buffers"], control["buffers"]) == []  # the rounding's draws
        assert run["losses"] == control["losses"]


def test_nvfp4_weights_take_a_quarter_of_the_bytes_of_bfloat16_plus_tile_scales(wire_ranks):
    for rank in wire_ranks:
        pairs = _pairs(rank["nvfp4"]["wire"], rank["nvfp4"]["plain_wire"])
        assert len(pairs) == 2 * 3  # forward and backward, each layer
        fp4 = 0
        for (got, got_dtype), (bf16, bf16_dtype) in pairs:
            assert bf16_dtype == "torch.bfloat16"
            if got_dtype == "torch.uint8":  # packed E2M1, then one E4M3 byte per tile
                rows, cols = bf16 // 2 // 64, 64
                assert got == bf16 // 4 + (rows // 16) * (cols // 16)
                fp4 += 1
            else:  # the 48-row layer
                assert (got, got_dtype) == (bf16, bf16_dtype)
        assert fp4 == 4
        assert sorted({b for b, d in rank["nvfp4"]["wire"] if d == "torch.uint8"}) == [516, 1032]


def test_a_tuned_plan_converted_before_fully_shard_gets_the_wire(wire_ranks):
    """``plan.convert(model)``, ``fully_shard``, ``prepare(model, optimizer, plan)``: the
    plan's fp8-tensorwise and nvfp4 layers all-gather FP8 and FP4, its fp8-rowwise layer
    keeps bfloat16 (with the warning), and the run is one process's bit for bit."""
    for rank in wire_ranks:
        run = rank["plan"]
        assert run["wire_layers"] == ["0", "2"]
        assert len(run["warnings"]) == 1 and "Received: layers=['4']" in run["warnings"][0]
        assert {d for _, d in run["wire"]} == {"torch.uint8", "torch.bfloat16"}
        control = run["control"]
        assert _differing(run["params"], control["params"]) == []
        assert run["losses"] == control["losses"]
