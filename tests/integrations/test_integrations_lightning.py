"""amped's Lightning and Fabric precision plugins against Lightning's own precision, the
hand-written loop, and Lightning's checkpointing."""

from __future__ import annotations

import collections
import logging

import pytest
import torch

pytest.importorskip("lightning")
import lightning as L
from integration_helpers import (
    STEPS_PER_EPOCH,
    batches,
    hand_loop,
    loader,
    loss_of,
    make_net,
    make_optimizer,
)
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixed
from lightning.pytorch.plugins.precision import MixedPrecision

import amped
from amped.integrations.lightning import FabricPrecision, Precision
from amped.recipes.registry import recipe_names

RECIPES = recipe_names()  # every registered recipe, fp32 first


class Module(L.LightningModule):
    def __init__(self, overflow_at=(), fused=False, schedule=False):
        super().__init__()
        self.net = make_net()
        self.losses: list[torch.Tensor] = []
        self.overflow_at = set(overflow_at)
        self.fused = fused
        self.schedule = schedule
        self.reports: list[amped.MemoryReport] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = loss_of(self(x), y)
        if self.current_epoch * STEPS_PER_EPOCH + batch_idx in self.overflow_at:
            loss = loss * float("inf")
        self.losses.append(loss.detach().clone())
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        plugin = self.trainer.precision_plugin
        if isinstance(plugin, Precision):
            self.reports.append(plugin.memory_report())

    def configure_optimizers(self):
        opt = make_optimizer(self.parameters(), fused=self.fused)
        if not self.schedule:
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(module, epochs=2, ckpt_path=None, **kwargs):
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        **kwargs,
    )
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return trainer


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    ("recipe", "theirs"),
    [
        ("bf16-mixed", lambda: None),  # Trainer(precision="bf16-mixed")
        # Trainer(precision="16-mixed") on CPU silently becomes bf16-mixed, so
        # Lightning's own float16 AMP plugin is built directly.
        ("fp16-mixed", lambda: MixedPrecision("16-mixed", "cpu")),
    ],
)
def test_lightning_matches_its_own_mixed_precision_bitwise(recipe, theirs):
    ref, ours = Module(schedule=True), Module(schedule=True)
    plugin = theirs()
    own = {"plugins": [plugin]} if plugin is not None else {"precision": "bf16-mixed"}
    fit(ref, gradient_clip_val=0.5, **own)
    fit(ours, plugins=[Precision(recipe, device="cpu")], gradient_clip_val=0.5)
    assert _equal(ref.losses, ours.losses)
    assert _equal(list(ref.parameters()), list(ours.parameters()))


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_in_lightning_is_the_hand_written_loop(recipe):
    # The plugin drives the same TrainSetup as the hand-written loop, in the same order,
    # so the losses and the memory figure are the loop's exactly (no tolerance needed).
    module = Module()
    fit(module, plugins=[Precision(recipe, device="cpu")])
    losses, setup, report = hand_loop(recipe)
    assert _equal(module.losses, losses)
    assert module.reports[-1] == report
    setup.teardown()  # the plugin tore its setup down when fit ended
    assert _equal(list(module.parameters()), list(setup.model.parameters()))
    assert {p.dtype for p in module.parameters()} == {torch.float32}


def test_lightning_clips_master_gradients_and_accumulates():
    module = Module()
    fit(
        module,
        plugins=[Precision("fp16-master", device="cpu")],
        gradient_clip_val=0.05,
        accumulate_grad_batches=STEPS_PER_EPOCH,
    )
    losses, setup, _ = hand_loop("fp16-master", clip=0.05, accumulate=STEPS_PER_EPOCH)
    setup.teardown()
    assert _equal(module.losses, losses)
    assert _equal(list(module.parameters()), list(setup.model.parameters()))


class SaveAfterFirstEpoch(L.Callback):
    """Checkpoints mid-run, as ModelCheckpoint would: the run goes on afterwards."""

    def __init__(self, path):
        self.path = path

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("recipe", ["fp16-mixed", "fp16-master", "bf16-pure-sr"])
def test_lightning_resume_is_bitwise_with_overflows(recipe, tmp_path):
    # Overflows are injected where a scaler skips them (fp16); bf16-pure-sr checks the
    # random stream of stochastic rounding resumes where it stopped.
    overflows = (1, 4) if recipe.startswith("fp16") else ()
    path = tmp_path / "mid.ckpt"
    whole = Module(overflows, schedule=True)
    trainer = fit(
        whole, plugins=[Precision(recipe, device="cpu")], callbacks=[SaveAfterFirstEpoch(path)]
    )
    if recipe.startswith("fp16"):
        # A skipped step does not advance the scheduler: 6 batches, 2 overflowed.
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        assert scheduler.last_epoch == 6 - len(overflows)
        assert trainer.precision_plugin.scaler.get_scale() == 65536.0 * 0.5 ** len(overflows)
    second = Module(overflows, schedule=True)
    resumed = fit(second, epochs=2, ckpt_path=path, plugins=[Precision(recipe, device="cpu")])
    assert _equal(whole.losses[STEPS_PER_EPOCH:], second.losses)
    assert (
        resumed.precision_plugin.scaler.state_dict() == trainer.precision_plugin.scaler.state_dict()
    )
    assert _equal(list(whole.parameters()), list(second.parameters()))


def test_fused_optimizer_with_clipping_is_refused():
    with pytest.raises(RuntimeError, match="fused=True"):
        fit(
            Module(fused=True),
            epochs=1,
            plugins=[Precision("fp16-mixed", device="cpu")],
            gradient_clip_val=1.0,
        )


def test_bad_arguments_fail_at_construction():
    with pytest.raises(ValueError, match="Unknown recipe"):
        Precision("bf17-mixed")
    with pytest.raises(ValueError, match="policy is for device 'cuda'"):
        Precision("bf16-mixed", policy=amped.Policy.preset("torch", "cuda"), device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            Precision("bf16-mixed", policy=amped.Policy.preset("torch", "cuda"))
    with pytest.raises(ValueError, match="Received both `precision="):
        L.Trainer(precision="bf16-mixed", plugins=[Precision("bf16-mixed", device="cpu")])
    wrapped = torch.nn.Linear(2, 2)  # what connect() gets from DDP/FSDP: not the LightningModule
    with pytest.raises(ValueError, match="single-device strategy"):
        Precision("bf16-master", device="cpu").connect(
            wrapped, [make_optimizer(wrapped.parameters())], []
        )
    with pytest.raises(ValueError, match="Unknown recipe"):
        FabricPrecision("O9")
    with pytest.raises(ValueError, match="policy is for device 'cuda'"):
        FabricPrecision("bf16-mixed", policy=amped.Policy.preset("torch", "cuda"), device="cpu")
    with pytest.raises(ValueError, match="Received both"):
        L.Fabric(precision="bf16-mixed", plugins=[FabricPrecision("bf16-mixed", device="cpu")])


def fabric_run(plugin, recipe=None):
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = make_net()
    opt = make_optimizer(net.parameters())
    if isinstance(plugin, FabricPrecision) and recipe not in ("bf16-mixed", "fp16-mixed", "fp32"):
        net, opt = plugin.prepare(net, opt)
    net, opt = fabric.setup(net, opt)
    losses = []
    for _ in range(2):
        for x, y in batches():
            loss = loss_of(net(x), y)
            losses.append(loss.detach().clone())
            fabric.backward(loss)
            fabric.clip_gradients(net, opt, max_norm=0.5)
            opt.step()
            opt.zero_grad()
    return losses, list(net.parameters())


@pytest.mark.parametrize(
    ("recipe", "theirs"), [("bf16-mixed", "bf16-mixed"), ("fp16-mixed", "16-mixed")]
)
def test_fabric_matches_its_own_mixed_precision_bitwise(recipe, theirs):
    ref = fabric_run(FabricMixed(theirs, "cpu"))
    ours = fabric_run(FabricPrecision(recipe, device="cpu"), recipe)
    assert _equal(ref[0], ours[0])
    assert _equal(ref[1], ours[1])


Pair = collections.namedtuple("Pair", "x ids")


def _structure(data):
    """Container types, tensor dtypes and other leaves, for comparing two walks."""
    if isinstance(data, torch.Tensor):
        return data.dtype
    if isinstance(data, dict):
        return type(data), {k: _structure(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data), [_structure(v) for v in data]
    return data


@pytest.mark.parametrize(
    ("recipe", "theirs"), [("bf16-mixed", "bf16-mixed"), ("fp16-mixed", "16-mixed")]
)
def test_fabric_converts_nested_inputs_and_outputs_as_its_own_mixed_precision(recipe, theirs):
    f64, ids = torch.ones(2, dtype=torch.float64), torch.arange(2)
    data = {
        "pair": Pair(torch.ones(2), ids),
        "list": [torch.ones(2, dtype=torch.float16), (f64, "tag", None)],
        "ordered": collections.OrderedDict(a=torch.ones(2), n=3),
    }
    ours, ref = FabricPrecision(recipe, device="cpu"), FabricMixed(theirs, "cpu")
    cast_in = ours.convert_input(data)
    assert _structure(cast_in) == _structure(ref.convert_input(data))
    assert type(cast_in["pair"]) is Pair and cast_in["pair"].ids is ids
    assert _structure(ours.convert_output(cast_in)) == _structure(ref.convert_output(cast_in))


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_in_fabric_is_the_hand_written_loop(recipe):
    plugin = FabricPrecision(recipe, device="cpu")
    losses, _ = fabric_run(plugin, recipe)
    ref, _, report = hand_loop(recipe, clip=0.5)
    assert _equal(losses, ref)
    assert plugin.memory_report() == report
    if recipe in ("fp32", "bf16-mixed", "fp16-mixed"):
        return
    unprepared = FabricPrecision(recipe, device="cpu")
    with pytest.raises(RuntimeError, match=r"precision.prepare\(model, optimizer\)"):
        L.Fabric(accelerator="cpu", devices=1, plugins=[unprepared]).setup(make_net())


def test_fsdp_strategy_takes_the_fsdp_plugin_type():
    from lightning.pytorch.strategies import FSDPStrategy

    from amped.integrations.lightning import FSDPPrecision

    plugin = FSDPPrecision("bf16-mixed", device="cpu")
    strategy = FSDPStrategy(precision_plugin=plugin)
    assert strategy.precision_plugin is plugin
    assert strategy.mixed_precision_config.param_dtype is torch.bfloat16  # as Lightning sets it
    with pytest.raises(TypeError, match="FSDPPrecision"):
        FSDPStrategy(precision_plugin=Precision("bf16-mixed", device="cpu"))
    with pytest.raises(ValueError, match="Under FSDP use an autocast recipe"):
        FSDPPrecision("bf16-master", device="cpu")


def test_fabric_fsdp_strategy_takes_the_fsdp_plugin_type():
    from lightning.fabric.strategies import FSDPStrategy

    from amped.integrations.lightning import FabricFSDPPrecision

    plugin = FabricFSDPPrecision("fp16-mixed", device="cpu")
    strategy = FSDPStrategy(precision=plugin)
    assert strategy.precision is plugin
    assert strategy.mixed_precision_config.param_dtype is torch.float16  # as Fabric sets it
    with pytest.raises(TypeError, match="FSDPPrecision"):
        FSDPStrategy(precision=FabricPrecision("bf16-mixed", device="cpu"))
    with pytest.raises(ValueError, match="Under FSDP use an autocast recipe"):
        FabricFSDPPrecision("bf16-pure", device="cpu")


@pytest.mark.parametrize("recipe", ["fp16-mixed", "fp16-master", "bf16-pure-sr"])
def test_fabric_resume_is_bitwise_with_overflows(recipe, tmp_path):
    overflows = {1, 4} if recipe.startswith("fp16") else set()

    def run(steps, load=None, save=None):
        plugin = FabricPrecision(recipe, device="cpu")
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
        net = make_net()
        opt = make_optimizer(net.parameters())
        if recipe != "fp16-mixed":
            net, opt = plugin.prepare(net, opt)
        net, opt = fabric.setup(net, opt)
        state = {"model": net, "optimizer": opt, "precision": plugin}
        if load is not None:
            fabric.load(load, state)
        losses = []
        for step in steps:
            x, y = batches()[step % STEPS_PER_EPOCH]
            loss = loss_of(net(x), y) * (float("inf") if step in overflows else 1.0)
            losses.append(loss.detach().clone())
            fabric.backward(loss)
            # An overflowed step's norm is inf: Fabric raises on it unless told not to.
            fabric.clip_gradients(net, opt, max_norm=0.5, error_if_nonfinite=False)
            opt.step()
            opt.zero_grad()
        if save is not None:
            fabric.save(save, state)
        plugin.teardown()
        return losses, list(net.parameters()), plugin

    whole = run(range(6))
    first = run(range(3), save=tmp_path / "mid.ckpt")
    second = run(range(3, 6), load=tmp_path / "mid.ckpt")
    assert _equal(whole[0], first[0] + second[0])
    assert _equal(whole[1], second[1])
    assert whole[2].scaler.state_dict() == second[2].scaler.state_dict()


def test_the_policy_applies_inside_lightnings_training_step():
    seen = []

    class Probe(Module):
        def forward(self, x):
            out = self.net(x)
            seen.append(out.dtype)
            return out

    # The last Linear (module "net.3") kept in float32 by the policy: its output says so.
    policy = amped.Policy.preset("torch", "cpu").with_module("net.3", "fp32")
    fit(Probe(), epochs=1, plugins=[Precision("bf16-mixed", policy=policy, device="cpu")])
    fit(Probe(), epochs=1, plugins=[Precision("bf16-mixed", device="cpu")])
    assert seen == [torch.float32] * STEPS_PER_EPOCH + [torch.bfloat16] * STEPS_PER_EPOCH


@pytest.mark.parametrize("recipe", ["bf16-master", "bf16-pure"])
def test_lightning_names_the_recipe_and_reports_the_training_state_after_fit(recipe, caplog):
    module = Module()
    plugin = Precision(recipe, device="cpu")
    assert repr(plugin) == f"Precision({recipe!r}, device='cpu')"
    with caplog.at_level(logging.INFO):
        fit(module, epochs=1, plugins=[plugin])
    assert f"amped: training with recipe {recipe!r}" in caplog.text
    # fit ended: the model is float32 again, and memory_report() is still the state
    # the recipe trained with (the last one measured during fit), not the float32 model's.
    assert {p.dtype for p in module.parameters()} == {torch.float32}
    assert plugin.memory_report() == module.reports[-1]
    assert plugin.memory_report() != amped.memory_report(
        module, make_optimizer(module.parameters())
    )
