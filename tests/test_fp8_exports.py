"""``amped.fp8`` exports what converting a model and checking its numerics needs; the
building blocks stay importable from their modules."""

from __future__ import annotations

import torch

import amped.fp8

EXPECTED = {
    "FP8_CONFIGS",
    "CastRule",
    "DelayedScaling",
    "Float8Linear",
    "Fp8Config",
    "Fp8Layers",
    "Fp8Tensor",
    "ModuleFilter",
    "convert_to_fp8",
    "default_module_filter",
    "plan_fp8",
    "quantize",
    "scaled_mm",
    "sqnr",
}


def test_all_is_exactly_the_public_api():
    assert set(amped.fp8.__all__) == EXPECTED
    for name in amped.fp8.__all__:
        assert getattr(amped.fp8, name) is not None, name


def test_building_blocks_stay_importable_by_module_path():
    from amped.fp8.cast import FP8_DTYPES, amax_to_scale
    from amped.fp8.delayed import update_delayed_scaling
    from amped.fp8.gemm import has_scaled_mm

    assert (torch.float8_e4m3fn, torch.float8_e5m2) == FP8_DTYPES
    assert callable(amax_to_scale) and callable(update_delayed_scaling) and callable(has_scaled_mm)
    assert not hasattr(amped.fp8, "update_delayed_scaling")
