"""The doctor's FP8 check: per-layer SQNR of output, grad-input and grad-weight, cast
statistics, and a verified policy that keeps the layers FP8 breaks in bfloat16."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import amped
from amped.lowp import Float8Linear


class Outlier(nn.Module):
    """``bad`` sees an input channel at 1e6 that its weights ignore: the signal lives in
    the other channels, which one tensorwise (or per-row) FP8 scale flushes to zero."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bad, self.good, self.head = nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 4)
        with torch.no_grad():
            self.bad.weight[:, 0] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.good(torch.relu(self.bad(x)))))


def _inputs() -> torch.Tensor:
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    x[:, 0] = 1e6
    return x


def _loss(y: torch.Tensor) -> torch.Tensor:
    return y.float().pow(2).mean()


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-rowwise"])
def test_names_the_layer_fp8_breaks_and_a_verified_policy_keeps_it_out(recipe):
    model = Outlier()
    report = amped.doctor.diagnose_low_precision(model, _inputs(), _loss, recipe)
    assert [s.name for s in report.layers] == ["bad", "good"]
    assert report.not_converted == ["head"]
    bad, good = report.layer("bad"), report.layer("good")
    assert bad.keep_in_bf16 and bad.sqnr_fp8["output"] < 5  # the signal underflowed
    assert bad.casts[0].role == "input" and bad.casts[0].underflow > 0.9
    assert not good.keep_in_bf16 and good.worst_db >= 20
    for stat in (bad, good):  # bfloat16 alone is far more accurate on every GEMM
        assert all(stat.sqnr_bf16[k] > stat.sqnr_fp8[k] for k in stat.sqnr_fp8)
        # dynamic scales put the amax on the FP8 max (to float32 rounding), or up to 2x below
        assert all(0.9999 <= c.headroom < 2.0 for c in stat.casts)
    assert not report.healthy
    suggestion = report.suggestion
    assert suggestion is not None and suggestion.keep == ("bad",) and suggestion.verified
    assert suggestion.model_sqnr > report.model_sqnr + 20
    assert "keep bad in bfloat16" in str(report)
    # the policy does what it says in a real run
    assert not any(isinstance(m, Float8Linear) for m in model.modules())  # model untouched
    setup = amped.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.01), recipe, policy=suggestion.policy
    )
    assert setup.low_precision_layers.names() == ["good"]


def test_a_healthy_model_gets_no_suggestion():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.Linear(128, 4))
    report = amped.doctor.diagnose_low_precision(model, torch.randn(32, 64), _loss, "fp8-delayed")
    assert report.healthy and report.suggestion is None
    assert [s.name for s in report.layers] == ["0", "2"]
    assert all(s.worst_db >= 20 for s in report.layers)
    assert report.model_sqnr >= 20


def test_refuses_a_recipe_that_is_not_fp8():
    with pytest.raises(ValueError, match="checks an FP8 or block recipe"):
        amped.doctor.diagnose_low_precision(Outlier(), _inputs(), _loss, "bf16-mixed")
