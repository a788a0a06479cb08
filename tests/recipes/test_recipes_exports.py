"""What ``amped.recipes`` and ``amped.lowp`` no longer export stays importable by module path
(the exported sets are pinned in test_public_api.py)."""

from __future__ import annotations

import torch

import amped.lowp
import amped.recipes


def test_internals_stay_importable_by_module_path():
    from amped.lowp.float8.cast import FP8_DTYPES, amax_to_scale
    from amped.lowp.float8.delayed import update_delayed_scaling
    from amped.lowp.float8.gemm import has_scaled_mm
    from amped.recipes.build import prepare
    from amped.recipes.o2 import MasterSetup, build_master_setup
    from amped.recipes.pure import PureSetup, build_pure_setup

    assert prepare is amped.recipes.prepare
    assert issubclass(MasterSetup, amped.recipes.TrainSetup)
    assert issubclass(PureSetup, amped.recipes.TrainSetup)
    assert (torch.float8_e4m3fn, torch.float8_e5m2) == FP8_DTYPES
    for function in (build_master_setup, build_pure_setup, amax_to_scale, has_scaled_mm):
        assert callable(function)
    assert callable(update_delayed_scaling) and not hasattr(amped.lowp, "update_delayed_scaling")
