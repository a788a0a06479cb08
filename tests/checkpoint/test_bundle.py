"""Replay bundles: safetensors bytes written in plain Python, a JSON document with
digests; every tensor round-trips bit for bit, and a damaged bundle is refused."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from amped.checkpoint.bundle import BundleError, read_bundle, write_bundle


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=generator)
    x[0, 1], x[2, 3] = float("inf"), float("nan")
    return {
        "layer/input": x.to(torch.bfloat16),
        "layer/weight": x,
        "layer/fp8": x.clamp(-400, 400).nan_to_num().to(torch.float8_e4m3fn),
        "layer/state/fp8_rng": torch.tensor([7, 3]),
        "layer/state/fp8_started": torch.tensor(True),
        "layer/empty": torch.zeros(0, 4),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8) if t.numel() else t


def test_round_trip_is_bitwise_and_never_unpickles(tmp_path, monkeypatch):
    tensors = _tensors()
    write_bundle(tmp_path / "b", tensors, {"recipe": "nvfp4", "step": 3})

    def refuse(*args, **kwargs):
        raise AssertionError("a bundle is never unpickled")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    back, document = read_bundle(tmp_path / "b")
    assert document["recipe"] == "nvfp4" and document["step"] == 3
    assert document["schema"] == "amped.replay/1"
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(_bits(back[name]), _bits(tensor)), name


def test_the_safetensors_library_reads_the_file(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = _tensors()
    write_bundle(tmp_path / "b", tensors, {})
    loaded = safetensors_torch.load_file(str(tmp_path / "b" / "tensors.safetensors"))
    for name, tensor in tensors.items():
        assert torch.equal(_bits(loaded[name]), _bits(tensor)), name


def _damage_json(folder, **changes) -> None:
    path = folder / "bundle.json"
    document = json.loads(path.read_text())
    document.update(changes)
    path.write_text(json.dumps(document))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate", "truncated or changed"),
        ("flip", "truncated or changed"),
        ("edit", "changed after it was written"),
        ("missing", "is not a replay bundle"),
        ("schema", "schema 'other/1'"),
    ],
)
def test_a_damaged_bundle_is_refused_naming_what_differs(tmp_path, damage, message):
    folder = write_bundle(tmp_path / "b", _tensors(), {"recipe": "nvfp4"})
    tensors = folder / "tensors.safetensors"
    blob = tensors.read_bytes()
    if damage == "truncate":
        tensors.write_bytes(blob[:-10])
    elif damage == "flip":
        tensors.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    elif damage == "edit":
        _damage_json(folder, recipe="fp8-delayed")
    elif damage == "missing":
        tensors.unlink()
    else:
        _damage_json(folder, schema="other/1")
    with pytest.raises(BundleError, match=message):
        read_bundle(folder)
