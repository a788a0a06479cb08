"""``amped.monitor(setup, record=DIR)``: what a bundle holds is what the step's GEMMs
took and gave, for the layers concerned only; when it is written (first non-finite,
loss spike, total underflow, capture) and when it is refused."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from recorder_helpers import FAULT_STEP, TINY, record_mlp_nvfp4_underflow
from torch import nn

import amped
from amped.checkpoint.bundle import read_bundle, tensor_digest


def _setup(folder, recipe="fp8-tensorwise", record=True):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64, bias=False), nn.GELU(), nn.Linear(64, 16)
    )
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0), recipe)
    monitor = amped.monitor(setup, record=folder if record else None)
    return setup, monitor


def _backward(setup, seed: int, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed))
    with setup.autocast():
        loss = setup.model(x).float().pow(2).mean() * scale
    setup.backward(loss)
    return loss


def _finish(setup) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        setup.step()
    setup.zero_grad()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def test_capture_holds_what_each_gemm_took_and_gave(tmp_path):
    setup, monitor = _setup(tmp_path)
    seen: dict[str, torch.Tensor] = {}
    layer = setup.model[2]
    layer.register_forward_pre_hook(lambda m, a: seen.update(x=a[0]))
    layer.register_forward_hook(lambda m, a, out: seen.update(out=out))
    layer.register_full_backward_pre_hook(lambda m, g: seen.update(go=g[0]))
    _backward(setup, seed=1)
    folder = monitor.capture()
    grad_weight = layer.weight.grad.to(torch.bfloat16)  # the GEMM's bfloat16 output, exactly
    _finish(setup)
    tensors, document = read_bundle(folder)
    assert document["reason"] == "capture" and document["recipe"] == "fp8-tensorwise"
    assert document["amped_version"] == amped.__version__
    assert set(document["layers"]) == {"0", "2"} == set(document["plan"])
    assert document["layers"]["2"]["roles"] == ["forward", "grad_input", "grad_weight"]
    # the input in the GEMM's dtype (autocast's bfloat16), the weight, the grad_output
    assert torch.equal(_bits(tensors["2/input"]), _bits(seen["x"].to(torch.bfloat16)))
    assert torch.equal(_bits(tensors["2/weight"]), _bits(layer.weight))
    assert torch.equal(_bits(tensors["2/grad_output"]), _bits(seen["go"]))
    # the GEMM outputs' bits: the layer's output (no bias) and its weight's gradient
    outputs = document["layers"]["2"]["outputs"]
    assert outputs["forward"] == tensor_digest(seen["out"])
    assert outputs["grad_weight"] == tensor_digest(grad_weight)


def test_the_first_non_finite_writes_a_bundle_of_that_layer_only(tmp_path):
    setup, monitor = _setup(tmp_path)

    def poison(module, args):
        x = args[0].clone()
        x[3, 5] = float("inf")
        return (x,)

    for step in range(3):
        handle = setup.model[2].register_forward_pre_hook(poison) if step == 1 else None
        _backward(setup, seed=step)
        _finish(setup)
        if handle is not None:
            handle.remove()
    assert [path.name for path in monitor.recorder.bundles] == ["step1-nonfinite"]
    tensors, document = read_bundle(monitor.recorder.bundles[0])
    assert set(document["layers"]) == {"2"}
    assert {name.split("/")[0] for name in tensors} == {"2"}
    first = document["first_nonfinite"]
    assert (first["module"], first["role"], first["tensor"]) == ("2", "forward", "input")
    # bfloat16 inf is 0x7f80; the input is [32, 64]
    assert first["element"] == {
        "part": "values",
        "index": 3 * 64 + 5,
        "bits": "0x7f80",
        "value": "inf",
    }


@pytest.mark.slow  # 13 steps
def test_a_loss_spike_writes_a_bundle_and_steady_losses_do_not(tmp_path):
    setup, monitor = _setup(tmp_path)
    for step in range(12):  # lr=0: the loss moves only with the batch
        _backward(setup, seed=step)
        _finish(setup)
    assert monitor.recorder.bundles == []
    loss = _backward(setup, seed=12, scale=100.0)
    _finish(setup)
    assert [path.name for path in monitor.recorder.bundles] == ["step12-loss_spike"]
    document = json.loads((monitor.recorder.bundles[0] / "bundle.json").read_text())
    assert document["loss"] == float(loss.detach())
    rule = document["spike"]
    assert document["loss"] > rule["median"] + rule["k"] * rule["sigma"]
    assert set(document["layers"]) == {"0", "2"}  # a loss names no layer


def test_capture_is_refused_outside_a_step_or_without_recording(tmp_path):
    setup, monitor = _setup(tmp_path)
    with pytest.raises(RuntimeError, match=r"after setup\.backward"):
        monitor.capture()
    _backward(setup, seed=0)
    with pytest.raises(ValueError, match="converted layers"):
        monitor.capture(["4"])
    monitor.detach()
    plain = amped.monitor(setup)
    with pytest.raises(RuntimeError, match="record=DIR"):
        plain.capture()


def test_a_bundle_that_cannot_be_written_warns_and_training_goes_on(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    setup, monitor = _setup(blocked)

    def poison(module, args):
        return (args[0] * float("inf"),)

    setup.model[2].register_forward_pre_hook(poison)
    _backward(setup, seed=0)
    with pytest.warns(RuntimeWarning) as caught:  # the write's, then the skipped step's
        assert setup.step() is False  # skipped, as without recording
    messages = [str(w.message) for w in caught]
    assert any("could not write the nonfinite bundle of step 0" in m for m in messages)
    assert monitor.recorder.bundles == []


def test_a_total_nvfp4_underflow_writes_a_bundle_and_healthy_steps_none(tmp_path):
    bundles, messages, x = record_mlp_nvfp4_underflow(tmp_path)
    # steps 0 and 1 are healthy NVFP4 steps: only the capture of step 1 is written
    assert [path.name for path in bundles] == ["step1-capture", f"step{FAULT_STEP}-underflow"]
    tensors, document = read_bundle(bundles[1])
    assert document["reason"] == "underflow" and list(document["layers"]) == ["0"]
    event = document["total_underflow"]
    assert (event["module"], event["role"], event["tensor"]) == ("0", "forward", "input")
    taken = tensors["0/input"]  # what the forward GEMM took: x in bfloat16, all below TINY
    assert torch.equal(taken, x.to(torch.bfloat16)) and 0 < taken.abs().max() <= TINY
    index = int(torch.nonzero(taken.reshape(-1))[0, 0])
    assert event["element"]["index"] == index
    assert event["element"]["value"] == repr(float(taken.reshape(-1)[index]))
    (message,) = messages  # warned once, naming the GEMM
    assert f"a total underflow at step {FAULT_STEP}: module '0', forward GEMM, its input" in message


def test_only_operands_at_the_nvfp4_floor_are_judged_for_a_total_underflow(tmp_path, monkeypatch):
    # An all-zero weight keeps its tensor scale at the floor every step: the recorder
    # judges that one operand (a pass over it), no other NVFP4 operand of the step,
    # and writes no bundle (nothing non-zero was lost).
    from amped.recipes import recorder

    judged = []
    real = recorder.flushes_to_zero

    def counting(high, tensor_scale):
        judged.append(tuple(high.shape))
        return real(high, tensor_scale)

    monkeypatch.setattr(recorder, "flushes_to_zero", counting)
    setup, monitor = _setup(tmp_path, "nvfp4")
    with torch.no_grad():
        setup.model[0].weight.zero_()  # nvfp4 converts layer "0" alone (bf16_last)
    for step in range(2):
        _backward(setup, step)
        _finish(setup)
    assert judged == [(64, 64)] * 2  # layer "0"'s weight, once a step
    assert monitor.recorder.bundles == []
