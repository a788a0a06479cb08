"""The monitor where users see it: amped compare's notes, the Lightning callback, and
amped's Accelerate Accelerator (its trackers), each with the flight recorder."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from torch import nn

import amped
from amped.cli.main import main


def _fp8_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


FACTORY = textwrap.dedent(
    """
    import torch
    from torch import nn
    import torch.nn.functional as F

    def task(batch_size=16, seed=0):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
        g = torch.Generator().manual_seed(seed)
        def batches():
            while True:
                x = torch.randn(batch_size, 64, generator=g)
                yield x, (x[:, 0] > 0).long()
        return model, batches(), F.cross_entropy
    """
)


@pytest.mark.slow  # a whole `amped compare` (report and plots included): 5 s
def test_compare_notes_the_fp8_recipes_gemm_health(tmp_path, capsys):
    factory = tmp_path / "fp8_task.py"
    factory.write_text(FACTORY)
    args = ["compare", "--model", f"{factory}:task", "--recipes", "fp32,fp8-tensorwise"]
    args += ["--steps", "3", "--max-time", "0", "--peak-memory", "in-process", "--json"]
    assert main([*args, "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    results = json.loads(capsys.readouterr().out)
    notes = {r["name"]: r["notes"] for r in results["recipes"]}
    health = [n for n in notes["fp8-tensorwise"] if n.startswith("GEMM health")]
    assert health and "no inf/NaN" in health[0] and "audit: every layer ran FP8" in health[0]
    assert not any(n.startswith("GEMM health") for n in notes["fp32"])


def test_lightning_callback_logs_the_counters(tmp_path):
    L = pytest.importorskip("lightning")
    from lightning.pytorch.loggers import CSVLogger

    from amped.integrations.lightning import Precision
    from amped.integrations.lightning_health import HealthCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _fp8_net()

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    inputs = torch.randn(64, 64)
    inputs[16 * 2 + 3, 5] = float("inf")  # the third batch's forward cast meets an inf
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs), batch_size=16)
    callback = HealthCallback(every=2, record=tmp_path / "bundles")
    trainer = L.Trainer(
        max_steps=4,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
        plugins=[Precision("fp8-tensorwise", device="cpu")],
        callbacks=[callback],
    )
    trainer.fit(Module(), data)
    logged = trainer.logged_metrics
    assert "amped/net.0/forward/underflow_fraction" in logged
    assert callback.monitor is not None and callback.monitor.sampled_steps == 2
    assert float(logged["amped/nonfinite_steps"]) == 1.0
    # The flight recorder went with it: the step's bundle replays to the same inf.
    (bundle,) = callback.monitor.recorder.bundles
    assert bundle.name == "step2-nonfinite"
    replayed = amped.doctor.replay(bundle)
    assert replayed.reproduced and replayed.replayed["module"] == "net.0"


def test_accelerate_tracker_gets_the_counters(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate.tracking import GeneralTracker
    from integration_helpers import reset_accelerate_state

    from amped.integrations.accelerate import Accelerator

    class Recorder(GeneralTracker):
        name, requires_logging_directory, logged = "recorder", False, []

        def __init__(self):
            super().__init__()

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            pass

        def log(self, values, step=None, **kwargs):
            self.logged.append((step, dict(values)))

    reset_accelerate_state()
    try:
        acc = Accelerator(recipe="fp8-tensorwise", cpu=True, log_with=[Recorder()])
        acc.init_trackers("run")
        net = _fp8_net()
        net, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
        health = acc.monitor(every=1, record=tmp_path / "bundles")
        for step in range(3):
            x = torch.randn(8, 64)
            x[3, 5] = float("inf") if step == 2 else x[3, 5]
            acc.backward(net(x).float().pow(2).mean())
            opt.step()
            opt.zero_grad()
        metrics = acc.log_health(step=3)
        tracker = acc.get_tracker("recorder", unwrap=True)
        assert tracker.logged[-1] == (3, metrics)
        assert "amped/0/grad_weight/amax" in metrics and health.step == 3
        # The flight recorder went with it: the step's bundle replays to the same inf.
        (bundle,) = health.recorder.bundles
        assert bundle.name == "step2-nonfinite"
        replayed = amped.doctor.replay(bundle)
        assert replayed.reproduced and replayed.replayed["module"] == "0"
    finally:
        reset_accelerate_state()


def test_accelerate_backward_hands_the_loss_to_the_recorder(tmp_path):
    # The loss-spike rule reads the losses backward sees: 12 steady steps, then one
    # loss scaled by 1e6 (its gradients stay finite) writes the spike's bundle.
    pytest.importorskip("accelerate")
    from integration_helpers import reset_accelerate_state

    from amped.integrations.accelerate import Accelerator

    reset_accelerate_state()
    try:
        acc = Accelerator(recipe="fp8-tensorwise", cpu=True)
        net = _fp8_net()
        net, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.0))
        health = acc.monitor(every=50, record=tmp_path / "bundles")
        for step in range(13):
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
            loss = net(x).float().pow(2).mean() * (1e6 if step == 12 else 1.0)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
        assert [path.name for path in health.recorder.bundles] == ["step12-loss_spike"]
    finally:
        reset_accelerate_state()
