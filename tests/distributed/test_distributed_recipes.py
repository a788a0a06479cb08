"""prepare() on an FSDP2-sharded model: the autocast and bf16-pure recipes work, the
master recipes are refused with the FSDP2 way to get master weights (a group of one
rank; tests/distributed/test_fsdp2_pure.py runs bf16-pure on 2 ranks)."""

from __future__ import annotations

import pytest
import torch
from dist_launch import one_rank_group

import amped

pytestmark = pytest.mark.slow  # importing FSDP2 takes seconds


@pytest.fixture
def sharded():
    from torch.distributed.fsdp import fully_shard

    with one_rank_group():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
        fully_shard(model)
        yield model


@pytest.mark.parametrize("recipe", ["bf16-master", "fp16-master"])
def test_master_recipes_refuse_a_sharded_model(sharded, recipe):
    before = {name: (p.dtype, p.to_local().dtype) for name, p in sharded.named_parameters()}
    optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
    refusal = r"MixedPrecisionPolicy.*Received: type\(0.weight\)=<class '[\w.]*\.DTensor'>"
    with pytest.raises(ValueError, match=refusal):
        amped.prepare(sharded, optimizer, recipe)
    after = {name: (p.dtype, p.to_local().dtype) for name, p in sharded.named_parameters()}
    assert after == before  # refused before anything changed


@pytest.mark.parametrize("recipe", ["fp32", "bf16-mixed", "fp16-mixed"])
def test_autocast_recipes_train_a_sharded_model(sharded, recipe):
    setup = amped.prepare(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1), recipe)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))  # not the test order's
    with setup.autocast():
        loss = setup.model(x).float().pow(2).mean()
    setup.backward(loss)
    assert setup.step()


@pytest.mark.parametrize("ran", [False, True], ids=["fresh", "after-a-forward"])
@pytest.mark.parametrize("recipe", ["bf16-pure", "bf16-pure-sr", "bf16-pure-8bit"])
def test_pure_recipes_lower_the_shards_and_train(sharded, recipe, ran):
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=0.1)
    if ran:  # FSDP2 reads its dtypes and makes its all-gather buffers at the first forward
        sharded(torch.randn(3, 8))
    setup = amped.prepare(sharded, optimizer, recipe)
    shards = {name: p.to_local().dtype for name, p in sharded.named_parameters()}
    assert set(shards.values()) == {torch.bfloat16}  # the storage, not just the DTensor
    with setup.autocast():
        loss = setup.model(torch.randn(3, 8)).float().pow(2).mean()
    setup.backward(loss)
    before = {name: p.full_tensor().clone() for name, p in sharded.named_parameters()}
    assert setup.step()
    after = {name: p.full_tensor() for name, p in sharded.named_parameters()}
    assert all(not torch.equal(before[name], after[name]) for name in before)


def test_pure_recipes_refuse_shards_not_on_dim_0():
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    with one_rank_group():
        model = torch.nn.Sequential(torch.nn.Linear(8, 4))
        fully_shard(model, shard_placement_fn=lambda param: Shard(1 if param.dim() == 2 else 0))
        optimizer = torch.optim.AdamW(model.parameters())
        with pytest.raises(ValueError, match=r"dim 0 .*Received: 0.weight.placements="):
            amped.prepare(model, optimizer, "bf16-pure")


def test_optimizer_in_backward_refuses_sharded_parameters(sharded):
    setup = amped.prepare(sharded, torch.optim.AdamW(sharded.parameters()), "bf16-pure-8bit")
    with pytest.raises(ValueError, match=r"FSDP2.*setup\.step"):
        amped.optim.step_in_backward(setup.optimizer)


def test_teardown_gives_the_shards_float32_weights_back(sharded):
    setup = amped.prepare(sharded, torch.optim.AdamW(sharded.parameters(), lr=0.1), "bf16-pure")
    with setup.autocast():
        loss = setup.model(torch.randn(3, 8)).float().pow(2).mean()
    setup.backward(loss)
    setup.step()
    expected = setup.fp32_state_dict()  # each weight plus its compensation
    setup.teardown()
    for name, param in sharded.named_parameters():
        assert param.to_local().dtype == torch.float32, name
        assert torch.equal(param.full_tensor(), expected[name].full_tensor()), name
    out = sharded(torch.randn(3, 8))  # FSDP2 all-gathers the float32 shards again
    assert out.dtype == torch.float32
