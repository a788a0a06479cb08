"""The per-step probes of amped.lowp.health: what each cast shows of an inf or NaN.

An operand's probe is data its cast computed (an FP8 scale, MX scale bits, NVFP4's
tensor scale), so these tests run the casts the layers run (amped.lowp.float8.cast.quantize,
the delayed cast's propagate_nonfinite, amped.lowp.mx.block_cast.quantize_block in every
format and scale mode) on tensors with one inf, -inf or NaN at a seeded position, and
on finite tensors with the extremes (each dtype's largest value, 2**127, zeros): the
probe must flag exactly the first. The one documented exception: under MX ``ceil`` and
``even`` scales a finite block whose amax rounds up to 2**128 takes the inf block's
exponent and is flagged too. Then the batched test (any_nonfinite) must agree with
the probes one by one, and a real setup must name an operand fault as that operand.
Last, the total-underflow test (flushes_to_zero) must agree with the NVFP4 cast's own
elements on either side of the flush threshold.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch
from torch import nn

import amped
from amped.lowp.float8.cast import Float8Tensor, amax_of, cast_saturated, quantize
from amped.lowp.float8.delayed import propagate_nonfinite
from amped.lowp.health import (
    NVFP4_FLOOR_SCALE,
    Probe,
    any_nonfinite,
    floored,
    flushes_to_zero,
    probe_nonfinite,
    range_probe,
    record_gemm,
)
from amped.lowp.mx.block_cast import quantize_block
from amped.lowp.mx.block_format import BLOCK_FORMATS, SCALE_MODES
from amped.recipes.lowp import BLOCK_RECIPE_NAMES, FP8_RECIPE_NAMES
from amped.recipes.monitoring import NonFinite

E4M3 = torch.float8_e4m3fn


class _Collector:
    """A GemmObserver that keeps the probes it is given."""

    sampling = False

    def __init__(self) -> None:
        self.probes: list[tuple[str, Probe]] = []

    def observe(self, layer, role, probes, stats) -> None:
        self.probes += probes


def _operand_probe(quantized, scale_mode: str = "rceil") -> Probe:
    """The probe record_gemm makes of one quantized operand."""
    layer, collector = nn.Linear(1, 1), _Collector()
    layer.fp8_observer = collector
    output = torch.empty(0)  # no output probe
    record_gemm(layer, "forward", "output", output, {"x": (None, quantized)}, scale_mode=scale_mode)
    (name, probe), *rest = collector.probes
    assert name == "x" and not rest
    return probe


def _delayed(x: torch.Tensor) -> Float8Tensor:
    """Float8Linear's delayed cast: a scale from past steps, NaN for a non-finite amax."""
    scale = propagate_nonfinite(torch.tensor(64.0), amax_of(x).float())
    return Float8Tensor(cast_saturated(x, scale, E4M3), scale)


# name: (the cast, the MX scale mode record_gemm is told; "rceil" where it does not apply)
CASTS: dict[str, tuple[Callable[[torch.Tensor], object], str]] = {
    "fp8-tensorwise": (lambda x: quantize(x, E4M3), "rceil"),
    "fp8-tensorwise-e5m2-pow2": (
        lambda x: quantize(x, torch.float8_e5m2, power_of_2=True),
        "rceil",
    ),
    "fp8-rowwise": (lambda x: quantize(x, E4M3, "rowwise"), "rceil"),
    "fp8-rowwise-dim0": (lambda x: quantize(x, E4M3, "rowwise", dim=0), "rceil"),
    "fp8-delayed": (_delayed, "rceil"),
    "nvfp4-tile2d": (lambda x: quantize_block(x, BLOCK_FORMATS["nvfp4"], tile_2d=True), "rceil"),
}
for _fmt in BLOCK_FORMATS.values():
    for _mode in SCALE_MODES if _fmt.is_mx else ("rceil",):
        CASTS[f"{_fmt.name}-{_mode}"] = (
            lambda x, fmt=_fmt, mode=_mode: quantize_block(x, fmt, mode),
            _mode,
        )
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
OUTPUT_DTYPES = {**DTYPES, "float16": torch.float16}


def _tensor(dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(32, 64, generator=generator).to(dtype)


def _probe_of(cast: str, x: torch.Tensor) -> Probe:
    make, mode = CASTS[cast]
    return _operand_probe(make(x), mode)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cast", CASTS, ids=str)
def test_an_inf_or_nan_anywhere_is_flagged(cast, dtype):
    for seed, value in enumerate((math.inf, -math.inf, math.nan) * 3):
        x = _tensor(DTYPES[dtype], seed)
        position = random.Random(seed).randrange(x.numel())
        x.view(-1)[position] = value
        assert probe_nonfinite(_probe_of(cast, x)), (value, position)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cast", CASTS, ids=str)
def test_finite_tensors_are_not_flagged_up_to_the_extremes(cast, dtype):
    torch_dtype = DTYPES[dtype]
    largest = torch.finfo(torch_dtype).max
    assert not probe_nonfinite(_probe_of(cast, torch.zeros(32, 64, dtype=torch_dtype)))
    for extreme in (2.0**127, -(2.0**127), largest, -largest, 1e-38):
        x = _tensor(torch_dtype, 0)
        x[5, 7] = extreme
        flagged = probe_nonfinite(_probe_of(cast, x))
        rounds_to_2_128 = abs(extreme) > 2.0**127  # the documented MX ceil/even edge
        expected = rounds_to_2_128 and cast.endswith(("-ceil", "-even"))
        assert flagged == expected, extreme


def test_ceil_scales_flag_from_just_above_2_to_the_127():
    fmt = BLOCK_FORMATS["mxfp8"]
    x = torch.zeros(32)
    x[0] = 2.0**127
    assert not probe_nonfinite(_operand_probe(quantize_block(x, fmt, "ceil"), "ceil"))
    x[0] = torch.nextafter(torch.tensor(2.0**127), torch.tensor(math.inf))
    assert probe_nonfinite(_operand_probe(quantize_block(x, fmt, "ceil"), "ceil"))
    assert not probe_nonfinite(_operand_probe(quantize_block(x, fmt, "rceil"), "rceil"))


def test_batched_test_agrees_with_the_probes_one_by_one():
    clean, bad = [], []
    for index, cast in enumerate(CASTS):
        x = _tensor(torch.float32 if index % 2 else torch.bfloat16, index)
        clean.append(_probe_of(cast, x))
        x[index % 32, index] = (math.inf, math.nan, -math.inf)[index % 3]
        bad.append(_probe_of(cast, x))
    for values in (
        torch.aminmax(torch.randn(8)),
        torch.aminmax(torch.ones(3, dtype=torch.bfloat16)),
    ):
        clean.append(Probe("range", tuple(values)))
    bad.append(Probe("range", tuple(torch.aminmax(torch.tensor([1.0, math.nan])))))
    assert not any(probe_nonfinite(p) for p in clean) and all(probe_nonfinite(p) for p in bad)
    assert not bool(any_nonfinite(clean))
    rng = random.Random(0)
    for _ in range(40):
        chosen = rng.sample(clean, 5) + rng.sample(bad, rng.choice((0, 0, 1, 2)))
        rng.shuffle(chosen)
        assert bool(any_nonfinite(chosen)) == any(probe_nonfinite(p) for p in chosen)


@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=str)
def test_an_output_with_an_inf_or_nan_is_flagged(dtype):
    """range_probe, the probe of a GEMM's output and of an unprobed gradient."""
    for seed, value in enumerate((math.inf, -math.inf, math.nan) * 3):
        x = _tensor(OUTPUT_DTYPES[dtype], seed)
        position = random.Random(seed).randrange(x.numel())
        x.view(-1)[position] = value
        probe = range_probe(x)
        assert probe is not None and probe_nonfinite(probe), (value, position)
    both = _tensor(OUTPUT_DTYPES[dtype], 0)
    both[0, 0], both[1, 1] = math.inf, -math.inf  # a sum of inf and -inf is NaN: flagged too
    assert range_probe(both) is not None


@pytest.mark.parametrize("dtype", OUTPUT_DTYPES, ids=str)
def test_a_finite_output_is_never_flagged_even_when_its_sum_overflows(dtype):
    """On the CPU the sum is read first; finite values summing past the dtype's range
    (here every element at the largest value, of one sign or of both) must not make a
    false "non-finite": the exact re-check clears them."""
    torch_dtype = OUTPUT_DTYPES[dtype]
    largest = torch.finfo(torch_dtype).max
    for sign in (1, -1):
        x = torch.full((32, 64), sign * largest, dtype=torch_dtype)
        assert not math.isfinite(float(x.sum()))  # the detector fires: the re-check decides
        assert range_probe(x) is None
    halves = torch.full((32, 64), largest, dtype=torch_dtype)
    halves[16:] = -largest  # float32 partial sums reach +inf and -inf: NaN (float16: 0)
    assert range_probe(halves) is None
    assert range_probe(torch.zeros(32, 64, dtype=torch_dtype)) is None
    assert range_probe(_tensor(torch_dtype, 3)) is None


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "mxfp8"])
def test_finite_outputs_summing_past_float32s_range_are_not_named(recipe):
    """A forward GEMM whose output is finite (2**121 each) but sums past float32's range:
    the step is taken, nothing is named, and no non-finite element is counted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 16, bias=False))
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0), recipe)
    health = amped.monitor(setup, every=1)
    with torch.no_grad():
        setup.model[0].weight.fill_(2.0**55)
        setup.model[1].weight.fill_(2.0**-70)  # the head (bfloat16): outputs of 2**57
    outputs = []
    setup.model[0].register_forward_hook(lambda _m, _i, out: outputs.append(out.detach()))
    with setup.autocast():
        out = setup.model(torch.full((8, 64), 2.0**60))
    loss = (out.float() * 2.0**-57).sum()  # finite: 128 elements of 1
    assert torch.isfinite(outputs[0]).all() and not torch.isfinite(outputs[0].sum())
    setup.backward(loss)
    assert setup.step()
    assert health.first_nonfinite is None
    assert health.read()["0"]["forward"]["nonfinite"] == 0


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16)
    )


@pytest.mark.filterwarnings("ignore:amped.monitor:RuntimeWarning")
@pytest.mark.parametrize("recipe", FP8_RECIPE_NAMES + BLOCK_RECIPE_NAMES)
def test_an_operand_fault_is_named_as_that_operand(recipe):
    """An inf or NaN in the model's input (layer 0's input), or in a weight: named as that
    operand of that layer's forward GEMM, at that step, which is skipped."""
    faults = [("input", value) for value in (math.inf, -math.inf, math.nan)]
    faults.append(("weight", math.inf))
    for tensor, value in faults:
        model = _model()
        setup = amped.prepare(model, torch.optim.AdamW(model.parameters()), recipe)
        health = amped.monitor(setup, every=50)
        generator = torch.Generator().manual_seed(1)
        taken = []
        for step in range(3):
            x = torch.randn(16, 64, generator=generator)
            if step == 1 and tensor == "input":
                x[3, 5] = value
            saved = setup.model[0].weight.detach().clone()
            if step == 1 and tensor == "weight":
                with torch.no_grad():
                    setup.model[0].weight[2, 9] = value
            with setup.autocast():
                loss = setup.model(x).float().pow(2).mean()
            setup.backward(loss)
            taken.append(setup.step())
            setup.zero_grad()
            if step == 1 and tensor == "weight":
                with torch.no_grad():
                    setup.model[0].weight.copy_(saved)
        assert health.first_nonfinite == NonFinite(1, "0", "forward", tensor), (tensor, value)
        assert taken == [True, False, True]
        assert all(torch.isfinite(p).all() for p in setup.model.parameters())


# --- total underflow: an NVFP4 cast that makes a non-zero operand all zero ------------

# The flush threshold: a block scale at its 2**-6 floor times the floored tensor scale
# (1e-30 / 2688, float32) is about 5.81e-36, and E2M1 rounds magnitudes up to 0.25 (its
# midpoint to 0.5, ties to the even 0) to zero: amaxes around 0.25 * 5.81e-36 = 1.45e-36
# decide, and from 1e-30 up the tensor scale is no longer at its floor.
AMAXES = (0.0, 1e-38, 1e-36, 1.4e-36, 1.46e-36, 1e-35, 3e-35, 1e-31, 2e-30, 1.0)


@pytest.mark.parametrize("tile_2d", [False, True], ids=["1x16", "16x16"])
@pytest.mark.parametrize("amax", AMAXES, ids=str)
def test_flushes_to_zero_agrees_with_the_casts_elements(amax, tile_2d):
    x = _tensor(torch.float32, seed=3)
    x = x * (amax / x.abs().max())
    cast = quantize_block(x, BLOCK_FORMATS["nvfp4"], tile_2d=tile_2d)
    probe = _operand_probe(cast)
    assert probe.floor == NVFP4_FLOOR_SCALE
    all_zero = bool(torch.count_nonzero(x)) and not bool(torch.count_nonzero(cast.elements))
    assert flushes_to_zero(x, cast.tensor_scale) == all_zero
    flags = floored([probe])
    assert flags is not None and flags.tolist() == [amax <= 1e-30]
    assert not all_zero or amax <= 1.46e-36  # a flush needs the floors (see above)


def test_only_nvfp4_probes_carry_the_floor():
    x = torch.zeros(32, 64)  # every scale at its clamp
    probes = [_probe_of(cast, x) for cast in CASTS if not cast.startswith("nvfp4")]
    assert all(probe.floor == 0.0 for probe in probes) and floored(probes) is None
