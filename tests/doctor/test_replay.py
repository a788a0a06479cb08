"""``amped.doctor.replay``: a recorded step reruns on the CPU to the same first
non-finite bits (or the same total underflow: module, role, tensor, first value lost),
every GEMM output bitwise; the bisection names the injected cause and its fix reruns
finite (and, for an underflow, not flushed to zero); a clean capture replays bitwise
(the negative control); a bundle of another version, recipe or model is refused, and
nothing in a bundle is executed."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest
import torch
from recorder_helpers import (
    FAULT_STEP,
    TINY,
    mlp,
    record_mlp_nvfp4_underflow,
    record_mlp_underflow,
    record_run,
)
from repo_paths import ROOT
from torch import nn

import amped
from amped.checkpoint.bundle import BundleError, read_bundle, write_bundle
from amped.doctor.replay import PARTS

MAX_BUNDLE_BYTES = 5 * 1024 * 1024  # the recorder's promise on the tiny GPT


def _size(folder) -> int:
    return sum(path.stat().st_size for path in folder.iterdir())


# --- the built-in tiny GPT, each fault at step 2 (slow) ---------------------------------

# fault: (recipe, helper fault, flagged role, flagged tensor, part that fixes it or None)
SCENARIOS = {
    "nvfp4-hadamard-overflow": ("nvfp4", "hadamard", "grad_weight", "grad_output", PARTS[1]),
    "fp8-delayed-inf-overflow": ("fp8-delayed", "inf", "grad_input", "grad_output", None),
    "fp8-delayed-scale-underflow": ("fp8-delayed", "scale", "grad_input", "grad_output", PARTS[2]),
    # the input of an amax of TINY rounds to zero whole in NVFP4 (and in the MXFP8 of the
    # element-format rerun, whose rceil scales stop at 2**-127 and multiply by 1 there):
    # the forward GEMM in bfloat16 keeps it
    "nvfp4-scale-underflow": ("nvfp4", "underflow", "forward", "input", PARTS[4]),
}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    runs: dict[str, tuple] = {}

    def run(key: str):
        if key not in runs:
            recipe, fault, *_ = SCENARIOS[key]
            folder = tmp_path_factory.mktemp(key)
            runs[key] = record_run(folder, recipe, fault, capture_step=1)
        return runs[key]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(SCENARIOS))
def test_an_injected_fault_replays_bit_for_bit_and_its_cause_is_named(recorded, key):
    _, fault, role, tensor, part = SCENARIOS[key]
    monitor, name = recorded(key)
    capture, failure = monitor.recorder.bundles  # the clean steps wrote no other bundle
    reason = "underflow" if fault == "underflow" else "nonfinite"
    assert (capture.name, failure.name) == ("step1-capture", f"step{FAULT_STEP}-{reason}")
    assert _size(capture) <= MAX_BUNDLE_BYTES and _size(failure) <= MAX_BUNDLE_BYTES
    # the negative control: a clean step replays bitwise, nothing non-finite
    clean = amped.doctor.replay(capture)
    assert clean.recorded is None and clean.replayed is None and clean.reproduced
    assert len(clean.bitwise) >= 3 and all(clean.bitwise.values())
    result = amped.doctor.replay(failure)
    assert result.reproduced and all(result.bitwise.values())
    found = result.replayed
    assert (found["module"], found["role"], found["tensor"]) == (name, role, tensor)
    assert found == result.recorded
    if SCENARIOS[key][1] == "inf":  # the helper wrote inf at row 3, column 5 of [tokens, 256]
        assert found["element"] == {
            "part": "values",
            "index": 3 * 256 + 5,
            "bits": "0x7f80",
            "value": "inf",
        }
        assert result.fix is None and "came into the layer non-finite" in result.cause
        assert not any(trial.finite for trial in result.trials)
        return
    fixed = [trial for trial in result.trials if trial.finite and not trial.flushed]
    assert fixed[0].part == part and part in result.cause
    kept = f"its {tensor} not flushed to zero, " if fault == "underflow" else ""
    db = f"{fixed[0].sqnr_db:.0f} dB"
    assert result.fix == f"{role} of {name} {fixed[0].change}: {kept}finite, {db} against float32"
    if fault == "underflow":  # the recorded input: TINY times the layer's activations
        tensors, _ = read_bundle(failure)
        lost = tensors[f"{name}/input"].reshape(-1)
        index = int(torch.nonzero(lost)[0, 0])
        assert found["element"]["index"] == index
        assert found["element"]["value"] == repr(float(lost[index]))
        assert 0 < lost.abs().max() <= TINY * 1.01  # bfloat16's rounding of the scaling
        assert all(trial.flushed for trial in result.trials if trial.part in PARTS[:4])


@pytest.mark.slow
def test_a_fresh_process_replays_the_bundle(recorded):
    monitor, _ = recorded("nvfp4-hadamard-overflow")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    command = [
        sys.executable,
        "-m",
        "amped",
        "doctor",
        "--replay",
        str(monitor.recorder.bundles[1]),
        "--json",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["reproduced"] and result["replayed"] == result["recorded"]
    assert all(result["bitwise"].values()) and result["fix"] is not None


# --- a small MLP under delayed scaling (fast) -------------------------------------------


@pytest.fixture
def underflow(tmp_path):
    return record_mlp_underflow(tmp_path)


def test_a_scale_underflow_replays_and_dynamic_scaling_fixes_it(underflow, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("nothing in a bundle is unpickled")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    result = amped.doctor.replay(underflow[1])
    assert result.reproduced and all(result.bitwise.values())
    found = result.replayed
    assert (found["module"], found["role"], found["tensor"]) == ("2", "grad_input", "grad_output")
    assert found["element"]["part"] == "scale" and found["element"]["bits"] == "0x00000000"
    assert result.fix is not None and result.fix.startswith("grad_input of 2 with dynamic scaling")
    control = amped.doctor.replay(underflow[0])
    assert control.replayed is None and all(control.bitwise.values())


def _rewrite(folder, **changes) -> None:
    """Write the bundle again, validly, with ``changes`` to its document."""
    tensors, document = read_bundle(folder)
    for key in ("schema", "sha256", "tensors_sha256"):
        document.pop(key)
    write_bundle(folder, tensors, {**document, **changes})


def test_another_version_recipe_or_model_is_refused_naming_what_differs(underflow):
    capture = underflow[0]
    with pytest.raises(BundleError, match="recipe 'fp8-delayed', not 'fp8-rowwise'"):
        amped.doctor.replay(capture, recipe="fp8-rowwise")
    other = mlp()
    other[2] = nn.Linear(64, 32)
    with pytest.raises(
        BundleError, match=r"Module '2' .* \(32, 64\); the bundle recorded \(64, 64\)"
    ):
        amped.doctor.replay(capture, model=other)
    with pytest.raises(BundleError, match="no module '2'"):
        amped.doctor.replay(capture, model=nn.Sequential(nn.Linear(64, 64)))
    _rewrite(capture, amped_version="0.0.1")
    with pytest.raises(BundleError, match=f"amped 0.0.1, this is amped {amped.__version__}"):
        amped.doctor.replay(capture)
    _rewrite(
        capture, amped_version=amped.__version__, layers={"2": {"config": {"kind": "os.system"}}}
    )
    with pytest.raises(BundleError, match="config of '2' is not one amped reads"):
        amped.doctor.replay(capture)


def test_a_truncated_bundle_is_refused(underflow):
    tensors = underflow[1] / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:1000])
    with pytest.raises(BundleError, match="truncated or changed: 1000 bytes"):
        amped.doctor.replay(underflow[1])


def test_a_total_nvfp4_underflow_replays_and_bfloat16_keeps_it(tmp_path):
    (capture, failure), _, x = record_mlp_nvfp4_underflow(tmp_path)
    assert failure.name == f"step{FAULT_STEP}-underflow"
    result = amped.doctor.replay(failure)
    assert result.reproduced and len(result.bitwise) == 3 and all(result.bitwise.values())
    index = int(torch.nonzero(x.reshape(-1))[0, 0])  # the input as the GEMM took it
    lost = x.reshape(-1)[index].to(torch.bfloat16)
    assert result.replayed == {
        "module": "0",
        "role": "forward",
        "tensor": "input",
        "element": {
            "part": "values",
            "index": index,
            "bits": f"0x{int(lost.view(torch.int16)) & 0xFFFF:04x}",
            "value": repr(float(lost)),
        },
    }
    fixed = [trial for trial in result.trials if trial.finite and not trial.flushed]
    assert fixed[0].part == PARTS[4] and result.fix.startswith(
        "forward of 0 forward in bfloat16: its input not flushed to zero, finite"
    )
    control = amped.doctor.replay(capture)
    assert control.recorded is None and control.replayed is None and all(control.bitwise.values())
