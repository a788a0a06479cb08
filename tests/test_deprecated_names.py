# rewrite: keep-file (this test names the old paths on purpose)
"""The names that moved stay importable from their old places for one release, each with
a DeprecationWarning naming the replacement, and resolve to what the new place gives."""

from __future__ import annotations

import importlib

import pytest
import torch

import amped
import amped.checkpoint
import amped.doctor
import amped.fp8
import amped.lowp
import amped.optim
from amped.lowp.convert import convert_layers
from amped.lowp.float8.config import FLOAT8_CONFIGS
from amped.lowp.mx.block_config import BLOCK_CONFIGS

MOVED = [
    ("amped.fp8", "Fp8Config", amped.lowp.Float8Config, "amped.lowp.Float8Config"),
    ("amped.fp8", "Float8Linear", amped.lowp.Float8Linear, "amped.lowp.Float8Linear"),
    ("amped.fp8", "FP8_CONFIGS", FLOAT8_CONFIGS, "amped.lowp.CONFIGS"),
    ("amped.fp8", "BLOCK_CONFIGS", BLOCK_CONFIGS, "amped.lowp.CONFIGS"),
    ("amped.recipes", "CompensatedAdamW", amped.optim.CompensatedAdamW, "amped.optim"),
    ("amped.recipes", "CompensatedSGD", amped.optim.CompensatedSGD, "amped.optim"),
    ("amped.recipes", "MasterWeightOptimizer", amped.optim.MasterWeightOptimizer, "amped.optim"),
    ("amped.recipes", "step_in_backward", amped.optim.step_in_backward, "amped.optim"),
    ("amped.scaling", "CheckpointError", amped.checkpoint.CheckpointError, "amped.checkpoint"),
    ("amped.scaling", "load_checkpoint", amped.checkpoint.load_checkpoint, "amped.checkpoint"),
    ("amped.scaling", "save_checkpoint", amped.checkpoint.save_checkpoint, "amped.checkpoint"),
    (
        "amped.doctor",
        "diagnose_fp8",
        amped.doctor.diagnose_low_precision,
        "amped.doctor.diagnose_low_precision",
    ),
]


@pytest.mark.parametrize(
    ("module", "name", "new", "instead"), MOVED, ids=[f"{m}.{n}" for m, n, *_ in MOVED]
)
def test_an_old_name_warns_and_gives_the_new_object(module, name, new, instead):
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{name} is deprecated.*{instead}"):
        old = getattr(importlib.import_module(module), name)
    assert old is new


@pytest.mark.parametrize("module", [amped.fp8, amped.doctor], ids=lambda m: m.__name__)
def test_an_unknown_name_is_still_an_attribute_error(module):
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        module.nothing  # noqa: B018


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)
    )


def test_the_old_conversion_keeps_its_signature():
    config = FLOAT8_CONFIGS["tensorwise"]
    with pytest.warns(DeprecationWarning, match="convert_to_low_precision"):
        convert_to_fp8 = amped.fp8.convert_to_fp8
    by_name, by_filter, new = _model(), _model(), _model()
    assert convert_to_fp8(by_name, config, ["2"]).names() == ["2"]
    chosen = convert_to_fp8(by_filter, config, module_filter=lambda m, n: n == "0").names()
    assert chosen == ["0"]
    convert_layers(new, config, ["2"])
    x = torch.randn(4, 64)
    torch.testing.assert_close(by_name(x), new(x), rtol=0, atol=0)


def test_prepare_takes_fp8_config_with_a_warning_and_config_without():
    config = BLOCK_CONFIGS["nvfp4"].replace(hadamard=False)
    setups = []
    for keyword in ("config", "fp8_config"):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if keyword == "fp8_config":
            with pytest.warns(DeprecationWarning, match="pass config="):
                setups.append(amped.prepare(model, optimizer, "nvfp4", fp8_config=config))
        else:
            setups.append(amped.prepare(model, optimizer, "nvfp4", config=config))
    for setup in setups:
        layers = setup.low_precision_layers.layers.values()
        assert {layer.block_config for layer in layers} == {config}
    model = _model()
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(TypeError, match="not both; pass config only"),
    ):
        amped.prepare(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            "nvfp4",
            config=config,
            fp8_config=config,
        )


def test_a_setups_old_attributes_warn_and_are_the_new_ones():
    model = _model()
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8-tensorwise")
    layers, base = setup.low_precision_layers, setup.low_precision_base
    assert layers is not None and base == "bf16-mixed"
    with pytest.warns(DeprecationWarning, match="TrainSetup.low_precision_layers"):
        assert setup.fp8_layers is layers
    with pytest.warns(DeprecationWarning, match="TrainSetup.low_precision_base"):
        assert setup.fp8_base == base
    with pytest.warns(DeprecationWarning, match="TrainSetup.low_precision_layers"):
        setup.fp8_layers = None
    with pytest.warns(DeprecationWarning, match="TrainSetup.low_precision_base"):
        setup.fp8_base = "bf16-master"
    assert setup.low_precision_layers is None and setup.low_precision_base == "bf16-master"


def test_float8_linears_old_config_attribute_warns_and_is_the_new_one():
    layer = amped.lowp.Float8Linear.convert_(torch.nn.Linear(16, 16), FLOAT8_CONFIGS["rowwise"])
    with pytest.warns(DeprecationWarning, match="Float8Linear.float8_config"):
        assert layer.fp8_config is FLOAT8_CONFIGS["rowwise"]
    with pytest.warns(DeprecationWarning, match="Float8Linear.float8_config"):
        layer.fp8_config = FLOAT8_CONFIGS["tensorwise"]
    assert layer.float8_config is FLOAT8_CONFIGS["tensorwise"]
