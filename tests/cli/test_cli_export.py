"""``amped export``: a factory and a checkpoint in, the exported folder out, and the exit
codes of docs/export.md."""

from __future__ import annotations

import pytest
import torch
from export_models import mlp_task

import amped
from amped.checkpoint import save_checkpoint
from amped.cli.main import main

FACTORY = "export_models:mlp_task"


@pytest.fixture
def checkpoint(tmp_path):
    """An MLP from the factory, prepared for mxfp8 and trained one step, saved."""
    model, batches, loss_fn = mlp_task(seed=0)
    setup = amped.prepare(model, torch.optim.AdamW(model.parameters()), "mxfp8")
    inputs, targets = batches[0]
    with setup.autocast():
        setup.backward(loss_fn(setup.model(inputs), targets))
    setup.step()
    path = tmp_path / "trained.pt"
    save_checkpoint(path, model=setup.model.state_dict(), step=1)
    return path


def _export(out, checkpoint, *extra):
    args = ["export", str(out), "--checkpoint", str(checkpoint), "--model", FACTORY]
    return main([*args, "--recipe", "mxfp8", *extra])


def test_export_writes_the_folder_and_refuses_to_overwrite_it(tmp_path, checkpoint, capsys):
    out = tmp_path / "served"
    assert _export(out, checkpoint, "--no-check") == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert "wrote" in capsys.readouterr().out
    assert _export(out, checkpoint, "--no-check") == 2
    assert "--force" in capsys.readouterr().err
    assert _export(out, checkpoint, "--no-check", "--force") == 0


def test_export_refuses_another_format_and_a_wrong_key(tmp_path, checkpoint, capsys):
    out = tmp_path / "served"
    assert _export(out, checkpoint, "--no-check", "--format", "nvfp4") == 2
    assert "--requantize" in capsys.readouterr().err
    assert _export(out, checkpoint, "--no-check", "--key", "weights") == 2
    assert "holds no 'weights' entry" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.slow
def test_export_checks_the_folder(tmp_path, checkpoint, capsys):
    out = tmp_path / "served"
    assert _export(out, checkpoint) == 0
    assert "checked bit for bit" in capsys.readouterr().out
