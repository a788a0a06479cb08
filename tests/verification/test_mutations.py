"""Each planted bug (tests/helpers/verify_helpers.py) is flagged with the right layer
and GEMM role, by the right kind, and nothing else is flagged."""

from __future__ import annotations

import pytest
from verify_helpers import (
    AmpedRunning,
    FloorScales,
    GradOutputE5M2,
    InBf16,
    PerturbedGradInput,
    TensorScaleTwice,
    mlp,
    mlp_batch,
)

import amped
from amped.lowp.health import ROLES


def _flagged(report):
    return {(f.kind, f.layer, f.role) for f in report.flags}


@pytest.mark.slow
def test_i_a_layer_left_in_bf16_is_a_fallback_in_each_of_its_gemms():
    report = amped.verify(mlp(), mlp_batch(), recipe="fp8-rowwise", backend=InBf16("2"))
    assert _flagged(report) == {("fallback", "2", role) for role in ROLES}
    assert all("bfloat16" in f.message for f in report.flags)


@pytest.mark.slow
def test_ii_grad_output_in_e5m2_under_mxfp8_is_a_wrong_element_format():
    report = amped.verify(mlp(), mlp_batch(), recipe="mxfp8", backend=GradOutputE5M2("2"))
    assert _flagged(report) == {
        ("element_format", "2", "grad_input"),
        ("element_format", "2", "grad_weight"),
    }
    assert all("grad_output cast to e5m2" in f.message for f in report.flags)


def test_iii_nvfp4s_tensor_scale_applied_twice_puts_the_forward_outside_its_bound():
    report = amped.verify(mlp(), mlp_batch(), recipe="nvfp4", backend=TensorScaleTwice("0"))
    assert _flagged(report) == {("output_bound", "0", "forward")}


@pytest.mark.slow
def test_iv_floor_scales_where_rceil_is_claimed_are_named_as_floor():
    report = amped.verify(mlp(), mlp_batch(), recipe="mxfp8", backend=FloorScales("4"))
    assert {(layer, role) for _, layer, role in _flagged(report)} == {("4", role) for role in ROLES}
    assert {f.kind for f in report.flags} == {"scale_rule"}
    assert all("cast by floor scales" in f.message for f in report.flags)


@pytest.mark.slow
def test_v_one_output_element_just_beyond_its_bound_is_flagged_in_that_role_alone():
    clean = amped.verify(mlp(), mlp_batch(), recipe="fp8-rowwise")
    (gemm,) = [g for g in clean.gemms if (g.layer, g.role) == ("2", "grad_input")]
    # Twice the GEMM's largest bound (a few bfloat16 ulps of its outputs): beyond the
    # perturbed element's bound, whatever its own error was (at most that bound)
    backend = PerturbedGradInput("2", 2 * gemm.max_bound)
    report = amped.verify(mlp(), mlp_batch(), recipe="fp8-rowwise", backend=backend)
    assert _flagged(report) == {("output_bound", "2", "grad_input")}
    (flagged,) = [g for g in report.gemms if (g.layer, g.role) == ("2", "grad_input")]
    assert flagged.outside == 1  # the perturbed element, and it alone


@pytest.mark.slow
def test_another_recipe_than_the_one_claimed_is_named_role_by_role():
    """fp8-rowwise running where fp8-rowwise-gw-hp is claimed: its grad_input weight is
    rowwise where the claim has it tensorwise, and its grad_weight GEMM is cast where
    the claim keeps it in bfloat16; its forward is the claim's."""
    backend = AmpedRunning("fp8-rowwise")
    report = amped.verify(mlp(), mlp_batch(), recipe="fp8-rowwise-gw-hp", backend=backend)
    by_role = {(f.layer, f.role): f.kind for f in report.flags}
    for layer in ("0", "2", "4"):
        assert (layer, "forward") not in by_role
        assert by_role[(layer, "grad_weight")] == "element_format"
    assert by_role[("2", "grad_input")] == "scale_rule"
    assert by_role[("4", "grad_input")] == "scale_rule"
