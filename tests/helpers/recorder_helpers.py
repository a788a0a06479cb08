"""The built-in tiny GPT trained a few steps under a recording monitor, with one fault
injected at one step into one converted layer (the recorder and replay tests).

Faults (``fault=``):

- ``"inf"``: an overflow, an inf written into one element of the grad_output the
  layer receives (the grad-weight GEMM's input; the grad-input GEMM takes it first).
- ``"hadamard"`` (NVFP4): an overflow that the recipe makes: 16 finite values
  ``V * signs`` in one column of the layer's grad_output, on the 16 tokens of one
  Hadamard block (chosen among the step's blocks so that the product without the
  rotation stays finite, see :func:`_quiet_block`). The random Hadamard transform adds
  them into one value of ``16 V / 4``, past float32's largest (``16 V`` overflows in its
  float32 butterfly), so the grad-weight GEMM's grad_output cast holds an inf.
- ``"scale"`` (delayed scaling): a scale underflow, the grad_output's delayed scale
  set to 0 before the step (the history's amax pushed the scale below float32).
- ``"underflow"`` (NVFP4): a total underflow, the layer's input scaled to an amax of
  :data:`TINY` (in bfloat16, representable): NVFP4's tensor scale floors the amax at
  1e-30 and its block scales at 2**-6, so each element becomes at most
  ``1e-36 / (2**-6 * 1e-30 / 2688) = 0.17``, below E2M1's 0.25 midpoint: all zero
  (rounding to nearest; the recipe rounds the grad_output stochastically, which keeps
  some of a tiny grad_output, so the input carries the fault).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import amped
from amped.tasks import tiny_gpt

V = 2.5e37  # 16 V > float32's max 3.4e38 > V * (|sum| < 13.6): see _quiet_block
BATCH = 2
FAULT_STEP = 2
TINY = 1e-36  # an NVFP4 operand below 1.45e-36 rounds to zero whole (see "underflow")


def _quiet_block(x: torch.Tensor, signs: torch.Tensor) -> int:
    """The 16-token block whose signed sum ``sum_t signs_t x[t, k]`` is smallest in
    magnitude over every feature ``k``: the grad-weight entries the fault makes without
    the rotation are ``V`` times these sums, finite below ``3.4e38 / V = 13.6``."""
    blocks = x.float().unflatten(0, (-1, 16))  # [blocks, 16, features]
    sums = (blocks * signs.view(1, 16, 1)).sum(1).abs().amax(1)
    return int(sums.argmin())


def record_run(
    folder: Path,
    recipe: str,
    fault: str | None = None,
    *,
    steps: int = 3,
    capture_step: int | None = None,
    layer_index: int = 0,
) -> tuple[amped.recipes.Monitor, str]:
    """Train ``steps`` steps with ``fault`` at :data:`FAULT_STEP`; returns the monitor
    and the name of the layer the fault went into."""
    task = tiny_gpt.build(batch_size=BATCH)
    model = task.model
    setup = amped.prepare(model, task.make_optimizer(model), recipe)
    assert setup.low_precision_layers is not None
    name = list(dict(setup.low_precision_layers.layers))[layer_index]
    layer = model.get_submodule(name)
    monitor = amped.monitor(setup, record=folder)
    step = {"now": 0}
    seen: dict[str, torch.Tensor] = {}

    def keep_input(module, args):
        seen["x"] = args[0].detach().reshape(-1, args[0].shape[-1])
        if step["now"] == FAULT_STEP and fault == "underflow":
            x = args[0]
            return (x * (TINY / x.detach().abs().amax().float()).to(x.dtype),)
        return None

    def corrupt(module, grad_output):
        if step["now"] != FAULT_STEP or fault not in ("inf", "hadamard"):
            return None
        grad = grad_output[0].clone()
        rows = grad.view(-1, grad.shape[-1])
        if fault == "inf":
            rows[3, 5] = float("inf")
        else:
            signs = layer.hadamard_signs()
            block = _quiet_block(seen["x"], signs)
            rows[16 * block : 16 * block + 16, 7] = (V * signs).to(rows.dtype)
        return (grad,)

    layer.register_forward_pre_hook(keep_input)
    layer.register_full_backward_pre_hook(corrupt)
    for index, (x, y) in zip(range(steps), task.batches, strict=False):
        step["now"] = index
        if fault == "scale" and index == FAULT_STEP:
            with torch.no_grad():
                layer.fp8_scale[2] = 0.0
        with setup.autocast():
            loss = task.loss_fn(setup.model(x), y)
        setup.backward(loss)
        if capture_step == index:
            monitor.capture()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the monitor's skip warning
            setup.step()
        setup.zero_grad()
    return monitor, name


def mlp() -> torch.nn.Sequential:
    """A small MLP; under the FP8 recipes its layers "0" and "2" are converted."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)]
    return torch.nn.Sequential(*layers, torch.nn.GELU(), torch.nn.Linear(64, 16))


def record_mlp_underflow(folder: Path) -> list[Path]:
    """:func:`mlp` under fp8-delayed, two steps: a capture at step 0, and the bundle of a
    grad_output scale that underflowed to 0 in layer "2" at step 1."""
    model = mlp()
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), "fp8-delayed")
    monitor = amped.monitor(setup, record=folder)
    for step in range(2):
        if step == 1:
            with torch.no_grad():
                model[2].fp8_scale[2] = 0.0
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        with setup.autocast():
            loss = setup.model(x).float().pow(2).mean()
        setup.backward(loss)
        if step == 0:
            monitor.capture()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            setup.step()
        setup.zero_grad()
    assert monitor.recorder is not None
    return monitor.recorder.bundles


def record_mlp_nvfp4_underflow(folder: Path) -> tuple[list[Path], list[str], torch.Tensor]:
    """:func:`mlp` under nvfp4 (layer "0" converted), three steps, a capture at step 1
    and, at step 2, an input of an amax of :data:`TINY`, which layer "0"'s forward casts
    to all zeros. Returns the bundles, the monitor's warnings and the step-2 input."""
    model = mlp()
    setup = amped.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), "nvfp4")
    monitor = amped.monitor(setup, record=folder)
    messages = []
    for step in range(3):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
        if step == FAULT_STEP:
            x = x * (TINY / x.abs().amax())
        x.requires_grad_()  # so that layer "0" runs its grad-input GEMM too
        with setup.autocast():
            loss = setup.model(x).float().pow(2).mean()
        setup.backward(loss)
        if step == 1:
            monitor.capture()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            setup.step()
        messages += [str(w.message) for w in caught]
        setup.zero_grad()
    assert monitor.recorder is not None
    return monitor.recorder.bundles, messages, x.detach()
