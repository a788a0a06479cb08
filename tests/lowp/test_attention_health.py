"""The counters an attention role reports (:mod:`amped.lowp.attention_health`), on casts
whose outcome is known: amped's e4m3 cast with a scale of 1 (amax given as 448)."""

from __future__ import annotations

import math

import torch

from amped.lowp.attention_cast import operand_cast
from amped.lowp.attention_health import RoleHealth
from amped.lowp.health import STATS


class Recorder:
    """An observer as amped.monitor's Monitor is one: what it is handed, kept."""

    sampling = True

    def __init__(self):
        self.seen = []

    def observe(self, layer, role, probes, stats):
        self.seen.append((role, [name for name, _ in probes], stats))


def test_counts_of_a_cast_with_underflow_and_saturation():
    layer = torch.nn.Module()
    layer.fp8_observer = Recorder()
    health = RoleHealth(layer)
    # 1 exact; 2**-12 below e4m3's smallest subnormal (2**-9): underflows; 0; 600 past
    # 448: clamped (saturated); 470 clamped to 448 by less than 12.5%: not counted
    x = torch.tensor([1.0, 2.0**-12, 0.0, 600.0, 470.0]).reshape(1, 1, 1, 5)
    cast = operand_cast(x, "e4m3", "head", 32, amax=torch.full((1, 1, 1, 1), 448.0))
    assert cast.flatten().tolist() == [1.0, 0.0, 0.0, 448.0, 448.0]
    health.cast("o", x, cast)
    health.output("o", torch.tensor([[1.0, math.nan]]))
    health.report(("s", "o"))
    ((role, probes, stats),) = layer.fp8_observer.seen  # s ran nothing: not reported
    assert role == "attn.o" and probes == ["output"]
    counts = dict(zip(STATS, stats.tolist(), strict=True))
    assert counts == {"nonfinite": 1, "underflow": 1, "nonzero": 4, "saturated": 1,
                      "elements": 5, "scale_clamps": 0, "amax": 600.0}  # fmt: skip


def test_without_an_observer_nothing_is_counted():
    health = RoleHealth(torch.nn.Module())
    assert not health.on
    health.cast("s", torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4))
    assert health.stats == {} and health.probes == {}
