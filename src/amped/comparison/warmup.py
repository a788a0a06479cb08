"""The warm-up phase: each recipe's first steps, compiles included, before the clock.

Some recipes compile kernels the first time they step in a process: the fused
optimizer steps (bf16-master, fp16-master, the bf16-pure recipes), and the FP8 and
block recipes' casts of large operands. Compiling takes seconds to minutes, or less
when Inductor loads the kernel from its on-disk cache, once per process. A first
step that includes it is no measure of the steps after it, so before ``--max-time``'s
clock runs, each recipe trains :data:`WARMUP_STEPS` steps on a model of its own,
timed and then discarded: the planning, the probes' budget and every step time then
see compiled kernels. A recipe that fails here is recorded as failed, and not run
again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from amped.comparison.run import CompareConfig, Observer, RecipeRun, run_recipe
from amped.lowp.float8.compiled_cast import compiled_kernels
from amped.recipes import Recipe

__all__ = ["FIRST_COMPILE_S", "WARMUP_STEPS", "Warmup", "compiled_part", "expected", "warm_up"]

WARMUP_STEPS = 2
"""Steps of each recipe before the clock: two, since SGD's second step is the first
that runs the compensated optimizers' fused kernel."""


FIRST_COMPILE_S: dict[str, tuple[float, float]] = {
    "the fused 8-bit AdamW step": (186.0, 51.0),
    "the fused compensated optimizer step": (76.0, 20.0),
    "the fused master-weight step": (74.0, 20.0),
}
"""First steps (seconds) of the compiled paths, in an empty Inductor cache and in a
warm one, measured by ``benchmarks/first_step.py --threads 1`` on a 2-core AMD EPYC
(Zen 4) that other processes kept busy (load average 14 to 17): what the warm-up
announces before it starts. A quiet or larger machine takes less. (The FP8 and block
casts, compiled only for operands of 2**18 elements or more, took 50 s cold and 10 s
warm there: they are named once compiled.)"""


def expected(compiles: str | None) -> str | None:
    """``about 3 min the first time, 51 s once cached``, or None when not measured."""
    times = FIRST_COMPILE_S.get(compiles or "")
    if times is None:
        return None
    cold, warm = (f"{t / 60:.0f} min" if t >= 90 else f"{t:.0f} s" for t in times)
    return f"about {cold} the first time on a busy 2-core CPU, {warm} once cached"


@dataclass(frozen=True)
class Warmup:
    """One recipe's warm-up: what it compiles (in words, None: nothing) and the seconds
    its :data:`WARMUP_STEPS` steps took, compiles and the model's build included."""

    recipe: str
    compiles: str | None
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "compiles": self.compiles, "s": round(self.seconds, 3)}

    def line(self) -> str:
        """The progress line: ``compiling the fused AdamW step: 14 s``."""
        what = f"compiling {self.compiles}" if self.compiles else "warm-up"
        return f"{what}: {self.seconds:.1f} s"


def compiled_part(recipe: Recipe) -> str | None:
    """What ``recipe`` compiles on its first steps in a process, in words, or None
    (for the FP8 and block recipes, known only after them: see :func:`warm_up`)."""
    if recipe.weights == "low-with-masters":
        return "the fused master-weight step"
    if recipe.quantized_state:
        return "the fused 8-bit AdamW step"
    if recipe.compensation is not None:
        return "the fused compensated optimizer step"
    return None


def warm_up(config: CompareConfig, run: RecipeRun, observer: Observer) -> Warmup:
    """Train ``run.recipe`` for :data:`WARMUP_STEPS` steps and forget them; a recipe that
    fails is marked failed in ``run``. KeyboardInterrupt and UsageError propagate."""
    what = compiled_part(run.recipe)
    observer.warming_up(run, what)
    trial = RecipeRun(run.recipe, WARMUP_STEPS, WARMUP_STEPS)
    kernels = compiled_kernels()
    began = time.monotonic()
    run_recipe(config, trial, Observer(), evaluate=False)
    casts = compiled_kernels() - kernels  # the FP8 casts of operands large enough
    if casts:
        what = f"{casts} FP8 cast kernel(s)" + (f" and {what}" if what else "")
    warmup = Warmup(run.recipe.name, what, time.monotonic() - began)
    if trial.status == "failed":
        run.status, run.error = trial.status, trial.error
        run.error_traceback = trial.error_traceback
    observer.warmed_up(run, warmup)
    return warmup
