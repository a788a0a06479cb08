"""amped.export: the file holds the training grid, compressed-tensors reads it back as
that grid, and the served forward gives the training forward's logits."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from export_models import mlp, tiny_gpt2, tiny_llama, trained

import amped
from amped.exporting.check import ExportCheckError, check_export
from amped.exporting.formats import EXPORT_FORMATS
from amped.exporting.grid import layer_grid, low_precision_layers
from amped.lowp.mx.block_cast import quantize_block

MODELS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


def _export(setup, path, **kwargs):
    """Export, keeping NVFP4's one documented warning (a tensor scale that does not
    survive the reciprocal compressed-tensors stores) as the return value."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folder = amped.export(setup, path, **kwargs)
    inexact = [w for w in caught if "does not round-trip" in str(w.message)]
    return folder, inexact


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4", "nvfp4", "fp8-blockwise"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_round_trip_reads_back_the_training_grid_and_logits(tmp_path, model_name, recipe):
    setup = trained(MODELS[model_name](), recipe)
    folder, inexact = _export(setup, tmp_path / "out")  # check=True: raises on a mismatch
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    if recipe != "nvfp4":
        assert not inexact  # MX scales are powers of two: the logits were bitwise
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == setup.model.config.model_type  # copied through
    quant = config["quantization_config"]
    layers = low_precision_layers(setup.model)
    from safetensors.torch import load_file

    if recipe == "fp8-blockwise":  # the keys transformers' FineGrainedFP8Config reads
        assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == [128, 128]
        assert quant["modules_to_not_convert"] == ["lm_head"]
    else:
        from compressed_tensors.quantization import QuantizationConfig

        assert quant["format"] == EXPORT_FORMATS[recipe].compression
        assert quant["config_groups"]["group_0"]["targets"] == list(layers)
        QuantizationConfig.model_validate(quant)  # compressed-tensors' own parser
    tensors = load_file(str(folder / "model.safetensors"))
    state = setup.model.state_dict()
    for key, value in tensors.items():  # the layers kept in high precision: as they are
        if key.rpartition(".")[0] not in layers:
            assert value.dtype == state[key].dtype and torch.equal(value, state[key])
    head = "lm_head.weight" if model_name == "llama" else "transformer.wte.weight"
    assert head in tensors


LOADS = [
    ("llama", "mxfp8"),
    ("llama", "nvfp4"),
    ("llama", "fp8-blockwise"),
    ("gpt2", "fp8-blockwise"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model_name", "recipe"), LOADS)
def test_transformers_loads_the_export_on_a_cpu(tmp_path, model_name, recipe):
    """transformers' from_pretrained reads the folder and dequantizes each weight (on a
    CPU: compressed-tensors' decompressor; fine-grained FP8's own dequantization) to the
    training grid's values, and runs. GPT-2's Conv1D layers load only in DeepSeek's
    layout (stored transposed, as GPT-2 keeps them); see docs/export.md."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    setup = trained(MODELS[model_name](), recipe)
    folder = amped.export(setup, tmp_path / "out", check=False)
    loaded = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu")
    ids = torch.randint(128, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), setup.autocast():
        logits = loaded(ids).logits
    assert logits.shape == (2, 8, 128) and torch.isfinite(logits).all()
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj" if model_name == "llama" else "transformer.h.0.mlp.c_fc"
    weight = loaded.get_submodule(name).weight  # decompressed by the first forward
    fmt = EXPORT_FORMATS[recipe]
    if recipe == "fp8-blockwise":  # the format's description: E4M3 x per-tile scale_inv
        tile = tensors[f"{name}.weight_scale_inv"].repeat_interleave(128, 0)
        tile = tile.repeat_interleave(128, 1)[: weight.shape[0], : weight.shape[1]]
        expected = tensors[f"{name}.weight"].float() * tile
    else:
        grid = layer_grid(name, setup.model.get_submodule(name), fmt).weight
        if recipe == "mxfp8":
            expected = grid.block_values(weight.dtype)
        else:  # compressed-tensors: e * (scale / global_scale), rounded to bfloat16
            scale = grid.scale.float().repeat_interleave(16, 1)
            expected = grid.elements * (scale / tensors[f"{name}.weight_global_scale"])
    assert torch.equal(weight, expected.to(weight.dtype))


@pytest.mark.slow
def test_an_nvfp4_tensor_scale_lost_in_its_reciprocal_warns_naming_the_layer(tmp_path):
    amax = torch.tensor(1.0234375)  # t = amax / 2688, and 1 / (1 / t) != t in float32
    tensor_scale = amax / (448.0 * 6.0)
    assert 1.0 / (1.0 / tensor_scale.double()).float() != tensor_scale
    model = mlp()
    with torch.no_grad():
        model[0].weight.clamp_(-1, 1)[0, 0] = amax
    setup = amped.prepare(model, torch.optim.SGD(model.parameters()), "nvfp4")  # layer 0
    batch = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    # the model alone: a float32 forward, where one ulp of the scale shows in the logits
    with pytest.warns(UserWarning, match=r"round-trip exactly for layers \['0'\]"):
        folder = amped.export(setup.model, tmp_path / "out", inputs=[batch])
    assert (folder / "model.safetensors").is_file()


@pytest.mark.slow
def test_the_check_refuses_a_file_off_the_grid(tmp_path):
    setup = trained(mlp(), "mxfp8", steps=1)
    folder = amped.export(setup, tmp_path / "out", inputs=[torch.randn(4, 64)])
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors["0.weight_scale"][0, 0] += 1  # one block read back at twice its scale
    save_file(tensors, str(folder / "model.safetensors"))
    fmt = EXPORT_FORMATS["mxfp8"]
    grids = [layer_grid(n, layer, fmt) for n, layer in low_precision_layers(setup.model).items()]
    with pytest.raises(ExportCheckError, match="Layer '0'"):
        check_export(folder, setup.model, grids, fmt, [torch.randn(4, 64)], setup.autocast)


def test_the_file_holds_the_forward_cast_of_each_weight(tmp_path):
    setup = trained(mlp(), "nvfp4", steps=1)
    folder = amped.export(setup, tmp_path / "out", check=False)
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    layer = setup.model[0]
    cast = quantize_block(layer.weight.detach(), layer.block_config.format, tile_2d=True)
    assert torch.equal(tensors["0.weight_scale"].view(torch.uint8), cast.scale_bits)
    expected = 1.0 / cast.tensor_scale.double()  # compressed-tensors: the reciprocal
    assert tensors["0.weight_global_scale"].item() == pytest.approx(expected.item(), rel=2**-24)
    low = tensors["0.weight_packed"] & 0x0F  # the even elements (compressed-tensors' order)
    magnitude = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])[(low & 7).long()]
    even = torch.where(low >= 8, -magnitude, magnitude)
    assert torch.equal(even, cast.elements[:, 0::2])
    assert torch.equal(tensors["4.weight"], setup.model[4].weight)  # the head: float32


def test_an_existing_folder_is_kept_without_force(tmp_path):
    setup = trained(mlp(), "mxfp8", steps=1)
    target = tmp_path / "out"
    target.mkdir()
    (target / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="force=True"):
        amped.export(setup, target, check=False)
    assert [p.name for p in target.iterdir()] == ["mine.txt"]
    amped.export(setup, target, check=False, force=True)
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]


def test_another_format_is_a_requantization_refused_without_the_flag(tmp_path):
    setup = trained(mlp(), "fp8-rowwise", steps=1)
    with pytest.raises(ValueError, match="requantize=True"):
        amped.export(setup, tmp_path / "a", "nvfp4", check=False)
    with pytest.raises(ValueError, match="no export format of its own"):
        amped.export(setup, tmp_path / "b", check=False)
    with pytest.warns(UserWarning, match="Re-quantizing"):
        amped.export(setup, tmp_path / "c", "nvfp4", check=False, requantize=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_shape_the_format_cannot_hold_is_named_and_nothing_is_written(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(80, 80), torch.nn.Linear(80, 16))
    setup = trained(model, "fp8-rowwise", steps=0)  # 80 = 5 x 16: no blocks of 32
    refused = pytest.raises(ValueError, match=r"layer '0' cannot be stored.*\(80, 80\)")
    with refused, pytest.warns(UserWarning, match="Re-quantizing"):
        amped.export(setup, tmp_path / "out", "mxfp8", check=False, requantize=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 192), torch.nn.Linear(192, 16))
    setup = trained(model, "fp8-blockwise", steps=0)  # 192: one and a half 128-tiles
    with pytest.raises(ValueError, match=r"layer '0' cannot be stored.*\(192, 64\)"):
        amped.export(setup, tmp_path / "out", check=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_failed_export_leaves_no_folder(tmp_path):
    setup = trained(mlp(), "mxfp8", steps=1)
    with pytest.raises(ValueError, match="multiple"):  # the check's forward: width 63
        amped.export(setup, tmp_path / "out", inputs=[torch.randn(4, 63)])
    assert list(tmp_path.iterdir()) == []


def test_a_model_without_low_precision_layers_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no low-precision layers"):
        amped.export(mlp(), tmp_path / "out")
    with pytest.raises(TypeError, match="TrainSetup"):
        amped.export("model", tmp_path / "out")
