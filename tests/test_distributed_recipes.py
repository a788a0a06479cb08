"""prepare() on an FSDP2-sharded model: the autocast recipes work, the weight-changing
ones are refused with the FSDP2 way to get master weights (a group of one rank)."""

from __future__ import annotations

import pytest
import torch

import amped
from dist_launch import one_rank_group

pytestmark = pytest.mark.slow  # importing FSDP2 takes seconds


@pytest.fixture
def sharded():
    from torch.distributed.fsdp import fully_shard

    with one_rank_group():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
        fully_shard(model)
        yield model


@pytest.mark.parametrize("recipe", ["bf16-master", "fp16-master", "bf16-pure", "bf16-pure-sr"])
def test_weight_changing_recipes_refuse_a_sharded_model(sharded, recipe):
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
    with setup.autocast():
        loss = setup.model(torch.randn(3, 8)).float().pow(2).mean()
    setup.backward(loss)
    assert setup.step()
