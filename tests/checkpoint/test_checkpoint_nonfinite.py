"""No poisoned checkpoint: the writers refuse inf/NaN parameters and optimizer state.

``save_checkpoint``, Lightning's checkpoints through amped's plugin and Accelerate's
``save_state`` through amped's Accelerator check every floating tensor first and raise
``CheckpointError`` naming the first bad one; nothing is written.
``allow_nonfinite=True`` writes anyway.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from recipes_helpers import batches, optimizer, train
from torch import nn

import amped
from amped.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from amped.checkpoint.finite import first_nonfinite
from amped.recipes.lowp import FP8_RECIPE_NAMES


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.Linear(64, 8))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_a_non_finite_parameter_is_refused_and_nothing_is_written(tmp_path, bad):
    model = _model()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model.state_dict(), step=1)
    good = path.read_bytes()
    with torch.no_grad():
        model[2].weight[3, 4] = bad
    with pytest.raises(CheckpointError, match=r"state\['model'\]\['2.weight'\] holds") as info:
        save_checkpoint(path, model=model.state_dict(), step=2)
    assert "allow_nonfinite=True" in str(info.value)
    assert path.read_bytes() == good  # the previous checkpoint is intact
    assert [n for n in os.listdir(tmp_path) if n != "ckpt.pt"] == []  # no temporary left


def test_optimizer_state_is_checked_too_and_the_first_bad_tensor_is_named(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    opt.state[model[2].weight]["exp_avg_sq"][0, 0] = math.inf
    opt.state[model[3].bias]["exp_avg"][0] = math.nan
    with pytest.raises(
        CheckpointError, match=r"state\['optimizer'\]\['state'\]\[2\]\['exp_avg_sq'\]"
    ):
        save_checkpoint(tmp_path / "c.pt", model=model.state_dict(), optimizer=opt.state_dict())


def test_allow_nonfinite_writes_it_anyway(tmp_path):
    weights = torch.tensor([1.0, math.nan, math.inf])
    save_checkpoint(tmp_path / "c.pt", allow_nonfinite=True, weights=weights)
    loaded = load_checkpoint(tmp_path / "c.pt")["weights"]
    assert torch.equal(loaded.isnan(), weights.isnan()) and loaded[2] == math.inf


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor([1.0, math.nan]).to(torch.float8_e5m2),
        torch.tensor([1.0, math.inf], dtype=torch.bfloat16),
        torch.sparse_coo_tensor([[0, 2]], [1.0, math.nan], (4,)),
    ],
    ids=["float8", "bfloat16", "sparse"],
)
def test_every_floating_dtype_is_checked(tensor):
    assert first_nonfinite({"x": [1, tensor]})[0] == "state['x'][1]"
    assert first_nonfinite({"ints": torch.tensor([1, 2]), "ok": torch.ones(2)}) is None


@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param(r, marks=pytest.mark.slow) if r == "fp8-blockwise" else r
        for r in FP8_RECIPE_NAMES
    ],
)
def test_a_nan_parameter_of_an_fp8_recipe_is_refused_at_save(tmp_path, recipe):
    model = _model()
    setup = amped.prepare(model, optimizer("adamw", model.parameters()), recipe, base="bf16-pure")
    train(setup, batches(1))
    with torch.no_grad():
        setup.model[0].weight[0, 0] = math.nan
    with pytest.raises(CheckpointError, match=r"state\['model'\]\['0.weight'\] holds 1 NaN"):
        save_checkpoint(tmp_path / "c.pt", **setup.state_dict())
    assert not (tmp_path / "c.pt").exists()


def test_lightning_checkpoint_with_a_nan_weight_is_refused(tmp_path):
    L = pytest.importorskip("lightning")
    from integration_helpers import loader, loss_of, make_net, make_optimizer

    from amped.integrations.lightning import Precision

    class Poisoned(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_net()

        def training_step(self, batch, batch_idx):
            return loss_of(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return make_optimizer(self.parameters())

    def trainer(plugin):
        return L.Trainer(
            max_steps=1,
            accelerator="cpu",
            devices=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=False,
            enable_checkpointing=False,
            plugins=[plugin],
        )

    for allow in (False, True):
        module = Poisoned()
        run = trainer(Precision("bf16-mixed", device="cpu", allow_nonfinite=allow))
        run.fit(module, loader())
        with torch.no_grad():
            next(module.net.parameters())[0, 0] = math.nan
        path = tmp_path / f"l{allow}.ckpt"
        if allow:
            run.save_checkpoint(path)
            assert path.exists()
        else:
            with pytest.raises(CheckpointError, match=r"checkpoint\['state_dict'\]\['net\.0"):
                run.save_checkpoint(path)
            assert not path.exists()


def test_accelerate_save_state_with_a_nan_weight_is_refused(tmp_path):
    pytest.importorskip("accelerate")
    from integration_helpers import make_net, make_optimizer, reset_accelerate_state

    from amped.integrations.accelerate import Accelerator

    reset_accelerate_state()
    try:
        acc = Accelerator(recipe="bf16-mixed", cpu=True)
        net = make_net()
        net, _opt = acc.prepare(net, make_optimizer(net.parameters()))
        with torch.no_grad():
            next(net.parameters())[0, 0] = math.inf
        with pytest.raises(CheckpointError, match=r"save_state\['weights'\]\[0\]"):
            acc.save_state(tmp_path / "state")
        assert not (tmp_path / "state" / "model.safetensors").exists()
    finally:
        reset_accelerate_state()
