"""One conversion for every low-precision format: ``convert_to_low_precision`` with one
layer selector, ``module_filter_fn``, and the named configs of every format in one
mapping, ``amped.lowp.CONFIGS``."""

from __future__ import annotations

import pytest
import torch

from amped.lowp import (
    CONFIGS,
    BlockConfig,
    BlockLinear,
    Float8Config,
    Float8Linear,
    convert_to_low_precision,
)
from amped.lowp.convert import convert_layers
from amped.lowp.float8.config import FLOAT8_CONFIGS
from amped.lowp.mx.block_config import BLOCK_CONFIGS


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)
    )


def test_configs_hold_every_named_config_of_every_format():
    assert CONFIGS == {**FLOAT8_CONFIGS, **BLOCK_CONFIGS}
    assert len(CONFIGS) == len(FLOAT8_CONFIGS) + len(BLOCK_CONFIGS)
    assert all(isinstance(c, Float8Config | BlockConfig) for c in CONFIGS.values())


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "mxfp8", "nvfp4"])
def test_one_selector_chooses_the_layers_for_every_format(name):
    config = CONFIGS[name].replace(bf16_last=0.0) if name == "nvfp4" else CONFIGS[name]
    model, reference = _model(), _model()
    layers = convert_to_low_precision(model, config, module_filter_fn=lambda m, n: n in ("0", "2"))
    assert layers.names() == ["0", "2"]
    kind = BlockLinear if isinstance(config, BlockConfig) else Float8Linear
    assert all(isinstance(m, kind) for m in layers.layers.values())
    convert_layers(reference, config, layers.names())  # the same layers, by name
    x = torch.randn(4, 64)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_no_selected_layer_says_why_each_stayed_out():
    with pytest.raises(ValueError, match="rejected by module_filter"):
        convert_to_low_precision(_model(), CONFIGS["mxfp8"], module_filter_fn=lambda m, n: False)


def test_a_config_of_another_kind_is_a_type_error():
    with pytest.raises(TypeError, match="Float8Config or a BlockConfig"):
        convert_to_low_precision(_model(), "tensorwise")  # type: ignore[arg-type]
