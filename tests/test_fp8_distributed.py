"""fp8-delayed on 2 gloo processes, each rank on its own data: DDP and FSDP2 (layers
converted before fully_shard). After every step the amax history holds the MAX of the
ranks' amaxes (one all-reduce per step), and every rank casts with the same scales."""

from __future__ import annotations

import pytest
import torch

import dist_launch
from dist_launch import TESTS, launch, wait_all

pytestmark = pytest.mark.slow  # two processes importing torch and FSDP2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, request):
    workdir = tmp_path_factory.mktemp("fp8")
    patch = pytest.MonkeyPatch()
    patch.setattr(dist_launch, "WORKER", TESTS / "dist_fp8_worker.py")
    try:
        wait_all(launch([], workdir))
    finally:
        patch.undo()
    return [torch.load(workdir / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_scales_are_equal_on_every_rank_and_come_from_the_max_amax(ranks, wrapper):
    r0, r1 = ranks[0][wrapper], ranks[1][wrapper]
    for step in range(len(r0["scale"])):
        for layer in range(2):
            assert torch.equal(r0["scale"][step][layer], r1["scale"][step][layer])
            assert torch.equal(r0["history"][step][layer], r1["history"][step][layer])
            local = torch.maximum(r0["pending"][step][layer], r1["pending"][step][layer])
            assert torch.equal(r0["history"][step][layer][:, 0], local)
    # the first step reduces each tensor's amax just in time (2 layers x 3 tensors) and
    # then the histories once; every later step: one all-reduce for the whole model
    assert r0["reduces"] == [7, 1, 1, 1]
    # the ranks saw different inputs, so the reduction mattered
    assert not torch.equal(r0["pending"][0][0][0], r1["pending"][0][0][0])
    for p0, p1 in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(p0, p1)
    assert all(torch.isfinite(torch.tensor(r0["loss"])))
