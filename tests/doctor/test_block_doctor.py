"""The doctor's FP8 diagnosis for the block recipes: per-layer SQNR, block cast
statistics, and a verified keep-in-bf16 policy for the layer a block format breaks (an
outlier channel flushes the rest of its block)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from test_doctor_fp8 import Outlier, _inputs, _loss

import amped
from amped.doctor.lowp import FP4_THRESHOLD_DB
from amped.lowp.mx.block_linear import BlockLinear


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4", "nvfp4"])
def test_names_the_layer_a_block_format_breaks_and_a_verified_policy_keeps_it_out(recipe):
    model = Outlier()
    report = amped.doctor.diagnose_low_precision(model, _inputs(), _loss, recipe)
    bad = report.layer("bad")
    assert bad.keep_in_bf16 and bad.worst_db < 5  # channel 0 flushes its block
    assert bad.casts[0].dtype == recipe and bad.casts[0].underflow > 0.1
    assert all(c.headroom >= 1.0 for c in bad.casts)  # rceil scales never saturate
    suggestion = report.suggestion
    assert suggestion is not None and "bad" in suggestion.keep and suggestion.verified
    setup = amped.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.01), recipe, policy=suggestion.policy
    )
    assert "bad" not in setup.low_precision_layers.names()
    assert not isinstance(model.bad, BlockLinear)


@pytest.mark.parametrize(("recipe", "threshold"), [("mxfp8", 20.0), ("mxfp4", FP4_THRESHOLD_DB)])
def test_a_healthy_model_gets_no_suggestion(recipe, threshold):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.Linear(128, 4))
    report = amped.doctor.diagnose_low_precision(model, torch.randn(32, 64), _loss, recipe)
    assert report.threshold_db == threshold
    assert report.healthy and report.suggestion is None
    assert [s.name for s in report.layers] == ["0", "2"]
    assert all(s.worst_db >= threshold for s in report.layers)
