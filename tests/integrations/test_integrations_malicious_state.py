"""A crafted pickle where amped's integrations keep the recipe's state runs no code.

Each test saves a real checkpoint through the real framework (Accelerate, Lightning,
Fabric, the transformers Trainer), puts a ``torch.save`` of an object whose
``__reduce__`` would create a marker folder where amped's state lives, and loads it:
the marker must not appear, and the error names the file.
"""

from __future__ import annotations

import os

import pytest
import torch
from integration_helpers import batches, loss_of, make_net, make_optimizer, reset_accelerate_state

from amped.checkpoint import CheckpointError


class Payload:
    """Unpickling this calls ``os.mkdir(marker)``: harmless, and visible afterwards."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def plant(path, marker) -> None:
    """Replace ``path`` by a ``torch.save`` of the payload, as an attacker would."""
    torch.save({"recipe": "fp16-mixed", "scaler": Payload(str(marker))}, path)


def params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


# --- Accelerate ------------------------------------------------------------------------


@pytest.fixture
def accelerate_state():
    pytest.importorskip("accelerate")
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def accelerate_run(recipe, save_to=None):
    from amped.integrations.accelerate import Accelerator

    reset_accelerate_state()
    acc = Accelerator(recipe=recipe, cpu=True)
    net = make_net()
    net, opt = acc.prepare(net, make_optimizer(net.parameters()))
    for x, y in batches():
        acc.backward(loss_of(net(x), y))
        opt.step()
        opt.zero_grad()
    if save_to is not None:
        acc.save_state(save_to)
    return acc, net


@pytest.mark.parametrize("recipe", ["fp16-mixed", "fp16-master"])
def test_accelerate_recipe_state_file_runs_no_code(accelerate_state, recipe, tmp_path):
    from amped.integrations.accelerate import RECIPE_STATE_NAME

    folder, marker = tmp_path / "state", tmp_path / "pwned"
    accelerate_run(recipe, save_to=folder)
    assert sorted(f for f in os.listdir(folder) if f.endswith(".pkl")) == ["random_states_0.pkl"]
    plant(folder / RECIPE_STATE_NAME, marker)
    acc, net = accelerate_run(recipe)
    before = params(net)
    with pytest.raises(CheckpointError, match=RECIPE_STATE_NAME) as raised:
        acc.load_state(folder)
    assert str(folder / RECIPE_STATE_NAME) in str(raised.value)
    assert not marker.exists()
    assert same(before, params(net))  # refused before Accelerate loaded anything


def test_accelerate_never_unpickles_a_planted_custom_checkpoint(accelerate_state, tmp_path):
    # Where an older amped (registered with register_for_checkpointing) kept its state,
    # and Accelerate unpickles with weights_only=False.
    folder, marker = tmp_path / "state", tmp_path / "pwned"
    accelerate_run("fp16-mixed", save_to=folder)
    plant(folder / "custom_checkpoint_0.pkl", marker)
    acc, net = accelerate_run("fp16-mixed")
    before = params(net)
    with pytest.raises(CheckpointError, match=r"custom_checkpoint_0\.pkl") as raised:
        acc.load_state(folder)
    assert str(folder / "custom_checkpoint_0.pkl") in str(raised.value)
    assert not marker.exists()
    assert same(before, params(net))


def test_accelerate_refuses_a_folder_without_the_recipe_state(accelerate_state, tmp_path):
    from amped.integrations.accelerate import RECIPE_STATE_NAME

    folder = tmp_path / "state"
    accelerate_run("fp16-mixed", save_to=folder)
    os.remove(folder / RECIPE_STATE_NAME)
    acc, _ = accelerate_run("fp16-mixed")
    with pytest.raises(CheckpointError, match=f"{RECIPE_STATE_NAME}.*is missing"):
        acc.load_state(folder)


# --- Lightning and Fabric --------------------------------------------------------------


def lightning_checkpoint(tmp_path):
    L = pytest.importorskip("lightning")
    from amped.integrations.lightning import CheckpointIO, Precision

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_net()

        def training_step(self, batch, batch_idx):
            return loss_of(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return make_optimizer(self.parameters())

    def trainer(epochs):
        return L.Trainer(
            max_epochs=epochs,
            accelerator="cpu",
            devices=1,
            enable_progress_bar=False,
            enable_model_summary=False,
            logger=False,
            enable_checkpointing=False,
            plugins=[Precision("fp16-mixed", device="cpu"), CheckpointIO()],
        )

    x = torch.cat([b[0] for b in batches()])
    y = torch.cat([b[1] for b in batches()])
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    first = trainer(1)
    first.fit(Module(), data)
    path = tmp_path / "mid.ckpt"
    first.save_checkpoint(path)
    return path, lambda module=None: trainer(2).fit(module or Module(), data, ckpt_path=path)


def test_lightning_plugin_state_runs_no_code(tmp_path):
    # The plugin's state lives inside Lightning's checkpoint, which amped's CheckpointIO
    # reads with weights_only=True: the state must be plain data (so nobody needs
    # weights_only=False for amped's sake), and a planted object is refused, named.
    path, resume = lightning_checkpoint(tmp_path)
    marker = tmp_path / "pwned"
    checkpoint = torch.load(path, weights_only=True)
    assert checkpoint["Precision"]["recipe"] == "fp16-mixed"
    checkpoint["Precision"] = {"recipe": "fp16-mixed", "scaler": Payload(str(marker))}
    torch.save(checkpoint, path)
    with pytest.raises(CheckpointError, match=r"refuses to build.*mkdir") as raised:
        resume()
    assert str(path) in str(raised.value)
    assert not marker.exists()


def test_lightning_checkpoint_io_resumes_a_clean_checkpoint(tmp_path):
    _, resume = lightning_checkpoint(tmp_path)
    resume()  # amped's CheckpointIO reads what Lightning wrote


def test_lightning_checkpoint_io_names_a_torn_file(tmp_path):
    path, resume = lightning_checkpoint(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="torn, truncated or corrupt") as raised:
        resume()
    assert str(path) in str(raised.value)


def test_fabric_plugin_state_runs_no_code(tmp_path):
    L = pytest.importorskip("lightning")
    from amped.integrations.lightning import CheckpointIO, FabricPrecision

    def fabric_state():
        plugin = FabricPrecision("fp16-mixed", device="cpu")
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin, CheckpointIO()])
        net = make_net()
        net, opt = fabric.setup(net, make_optimizer(net.parameters()))
        return fabric, {"model": net, "optimizer": opt, "precision": plugin}

    fabric, state = fabric_state()
    path, marker = tmp_path / "fabric.ckpt", tmp_path / "pwned"
    fabric.save(path, state)
    checkpoint = torch.load(path, weights_only=True)  # the plugin's state is plain data
    assert checkpoint["precision"]["recipe"] == "fp16-mixed"
    checkpoint["precision"] = {"recipe": "fp16-mixed", "scaler": Payload(str(marker))}
    torch.save(checkpoint, path)
    fabric, state = fabric_state()
    before = params(state["model"])
    with pytest.raises(CheckpointError, match=r"refuses to build.*mkdir") as raised:
        fabric.load(path, state)
    assert str(path) in str(raised.value)
    assert not marker.exists()
    assert same(before, params(state["model"]))


def test_checkpoint_io_refuses_a_planted_object_in_a_remote_file(tmp_path):
    # Not a local path: Lightning reads it (fsspec) and, for a URL, would default to
    # weights_only=False; amped's CheckpointIO always asks for weights_only=True.
    pytest.importorskip("lightning")
    fsspec = pytest.importorskip("fsspec")
    from amped.integrations.lightning import CheckpointIO

    path, marker = "memory://amped-test/planted.ckpt", tmp_path / "pwned"
    with fsspec.open(path, "wb") as file:
        torch.save({"Precision": {"scaler": Payload(str(marker))}}, file)
    with pytest.raises(CheckpointError, match=r"refuses to build.*mkdir") as raised:
        CheckpointIO().load_checkpoint(path)
    assert path in str(raised.value)
    assert not marker.exists()
