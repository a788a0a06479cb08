"""The block recipes (mxfp8, mxfp4, nvfp4) through ``amped.prepare``: bases, layer
choice (the nvfp4 recipe's last layers in bfloat16), each nvfp4 part switched off by a
keyword, bitwise checkpoint resume (stochastic rounding's seed and draw count
included), and one-line errors for what they cannot do."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from recipes_helpers import roundtrip, train

import amped
from amped.lowp.float8.config import FLOAT8_CONFIGS
from amped.lowp.mx.block_config import BLOCK_CONFIGS
from amped.lowp.mx.block_linear import BlockLinear

BLOCK = ["mxfp8", "mxfp4", "nvfp4"]
BASES = ["bf16-mixed", "bf16-master", "bf16-pure", "bf16-pure-sr"]


class Net(nn.Module):
    """Four 64-wide blocks and a head: five layers, four of them convertible."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.norm, self.head = nn.LayerNorm(64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + F.gelu(block(x))
        return self.head(self.norm(x))


def _data(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(48, 64, generator=g), torch.randint(0, 10, (48,), generator=g))
            for _ in range(steps)]  # fmt: skip


def _prepare(recipe, seed=0, **kw):
    model = Net(seed)
    return amped.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), recipe, **kw)


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("recipe", BLOCK)
def test_every_block_recipe_trains_on_every_base(recipe, base):
    setup = _prepare(recipe, base=base)
    assert (
        setup.recipe.name == recipe
        and setup.recipe.weights == amped.recipes.registry.resolve_recipe(base).weights
    )
    assert all(isinstance(setup.model.blocks[i], BlockLinear) for i in range(3))
    losses = [train(setup, _data(1, seed))[-1] for seed in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))


def test_nvfp4_keeps_its_last_layers_in_bf16_unless_told_not_to():
    assert _prepare("nvfp4").low_precision_layers.names() == ["blocks.0", "blocks.1", "blocks.2"]
    full = BLOCK_CONFIGS["nvfp4"].replace(bf16_last=0.0)
    names = _prepare("nvfp4", config=full).low_precision_layers.names()
    assert names == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert _prepare("mxfp8").low_precision_layers.names() == names


@pytest.mark.parametrize("part", ["weight_2d", "stochastic_rounding", "hadamard"])
def test_each_nvfp4_part_switches_off_by_keyword_and_changes_training(part):
    data = _data(2)
    off = BLOCK_CONFIGS["nvfp4"].replace(**{part: False})
    setup = _prepare("nvfp4", config=off)
    assert all(
        getattr(m.block_config, part) is False for m in setup.low_precision_layers.layers.values()
    )
    full = _prepare("nvfp4")
    train(setup, data)
    train(full, data)
    assert not torch.equal(setup.model.blocks[0].weight, full.model.blocks[0].weight)


def test_stochastic_rounding_seed_changes_the_draws_and_is_fixed_by_it():
    data = _data(2)
    runs = [_prepare("nvfp4", config=BLOCK_CONFIGS["nvfp4"].replace(seed=s)) for s in (0, 0, 1)]
    for setup in runs:
        train(setup, data)
    weights = [r.model.blocks[0].weight for r in runs]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])


@pytest.mark.parametrize("base", ["bf16-mixed", "bf16-pure-sr"])
@pytest.mark.parametrize("recipe", BLOCK)
def test_checkpoint_resume_is_bitwise(recipe, base):
    data = _data(6)
    setup = _prepare(recipe, base=base)
    train(setup, data[:3])
    saved = roundtrip(setup.state_dict())
    if recipe == "nvfp4":
        assert saved["model"]["blocks.0.fp8_rng"].tolist() == [0, 3]  # seed 0, 3 backwards
    train(setup, data[3:])
    fresh = _prepare(recipe, seed=5, base=base)
    fresh.load_state_dict(saved)
    train(fresh, data[3:])
    for (key, ours), theirs in zip(
        fresh.model.state_dict().items(), setup.model.state_dict().values(), strict=True
    ):
        assert torch.equal(ours, theirs), key


def test_bad_input_is_refused_in_one_line():
    def one_line(error):
        assert "\n" not in str(error.value)

    with pytest.raises(ValueError, match="float16 autocast is refused") as e:
        _prepare("mxfp8", base="fp16-mixed")
    one_line(e)
    model = Net().to(torch.bfloat16)
    with pytest.raises(ValueError, match="pass the model in float32") as e:
        amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), "nvfp4")
    one_line(e)
    with pytest.raises(ValueError, match=r"BlockConfig in nvfp4") as e:
        _prepare("nvfp4", config=BLOCK_CONFIGS["mxfp4"])
    one_line(e)
    with pytest.raises(ValueError, match=r"Float8Config") as e:
        _prepare("fp8-rowwise", config=BLOCK_CONFIGS["mxfp8"])
    with pytest.raises(ValueError, match="FP8 and block recipes only"):
        _prepare("bf16-mixed", config=FLOAT8_CONFIGS["rowwise"])
    with pytest.raises(ValueError, match="Stochastic rounding is for E2M1") as e:
        BLOCK_CONFIGS["mxfp8"].replace(stochastic_rounding=True)
    one_line(e)
    with pytest.raises(ValueError, match="16x16 weight tiles are NVFP4's"):
        BLOCK_CONFIGS["mxfp4"].replace(weight_2d=True)
    odd = nn.Sequential(nn.Linear(48, 48), nn.Linear(48, 10))
    with pytest.raises(ValueError, match=r"dims not multiples of 32") as e:
        amped.prepare(odd, torch.optim.SGD(odd.parameters(), lr=0.1), "mxfp8")
    one_line(e)


def test_block_recipes_are_opt_in_and_named_in_compare():
    assert not set(BLOCK) & set(amped.recipes.registry.RECIPES)
    assert all(amped.recipes.registry.resolve_recipe(name).fp8 == name for name in BLOCK)
    pytest.importorskip("rich")
    from amped.comparison.setup import parse_recipes

    assert [r.name for r in parse_recipes("bf16,mxfp8,nvfp4")] == ["bf16-mixed", "mxfp8", "nvfp4"]
