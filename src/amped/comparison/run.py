"""One recipe's run: build the task, prepare it for the recipe, train, measure, evaluate.

A step's time covers forward, backward, optimizer step and fetching the loss (one
device sync), not producing the batch. Memory is measured on the first step (training
state, exactly) and throughout (peak); see :mod:`amped.comparison.footprint`.
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from amped.comparison import interrupt
from amped.comparison.environment import synchronize
from amped.comparison.footprint import PeakMemory, StateBytes, grad_bytes, state_bytes
from amped.comparison.health import attach_monitor, health_note
from amped.comparison.layers import Conversion, LayerChoice
from amped.comparison.timing import step_stats
from amped.recipes import Recipe, TrainSetup
from amped.recipes import prepare as prepare_recipe
from amped.recipes.attention import AttentionConversion
from amped.tasks.errors import UsageError
from amped.tasks.factory import TaskFactory
from amped.tasks.task import Task, call_model, check_loss, count_samples, to_device

__all__ = [
    "OUT_OF_TIME",
    "CompareConfig",
    "Observer",
    "RecipeRun",
    "describe_task",
    "final_loss",
    "run_recipe",
    "window_mean",
]

OUT_OF_TIME = "--max-time reached"
LOSS_WINDOW = 10
"""Train-loss figures are the mean of this many steps (fewer when fewer ran)."""


def window_mean(losses: list[float], end: int) -> float | None:
    """Mean of the finite losses among the :data:`LOSS_WINDOW` steps up to step ``end``
    (1-based, inclusive): the one definition of every train-loss figure amped prints."""
    window = [v for v in losses[max(end - LOSS_WINDOW, 0) : end] if math.isfinite(v)]
    return sum(window) / len(window) if window else None


def final_loss(losses: list[float]) -> float | None:
    """The final train loss: :func:`window_mean` at the last step run."""
    return window_mean(losses, len(losses))


@dataclass(frozen=True)
class CompareConfig:
    """What to compare, and how long (``max_time``: seconds of training, or None)."""

    factory: TaskFactory
    recipes: tuple[Recipe, ...]
    steps: int
    batch_size: int | None
    device: torch.device
    seed: int
    max_time: float | None
    isolate_memory: bool = False  # measure each recipe's peak in its own process (CPU)
    threads: int | None = None  # torch threads, the same for every recipe
    threads_source: str | None = None  # who chose them: --threads, the task, torch
    layers: LayerChoice = field(default_factory=LayerChoice)  # --module-filter, --exclude
    conversions: tuple[Conversion, ...] = ()  # the FP8/block recipes' dry run
    attention: str | None = None  # --attention: every recipe's attention in this config
    attention_conversion: AttentionConversion | None = None  # its dry run on the model


@dataclass
class RecipeRun:
    """One recipe's run. ``status``: not_run, running, complete, stopped, interrupted, failed."""

    recipe: Recipe
    steps_requested: int
    steps_planned: int
    status: str = "not_run"
    stop_reason: str | None = None
    error: str | None = None
    error_traceback: str | None = None
    losses: list[float] = field(default_factory=list)
    loss_scales: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    samples: int = 0
    skipped_steps: int = 0
    final_loss_scale: float | None = None
    wall_s: float = 0.0
    state: StateBytes | None = None
    peak_memory_bytes: int | None = None
    peak_memory_kind: str | None = None
    evaluation: dict[str, float] | None = None
    task: dict[str, Any] | None = None
    health: str | None = None  # the FP8 recipes' GEMM health note (amped.comparison.health)

    def samples_per_s(self) -> float | None:
        """Throughput as ``results.json`` defines it: mean samples per step over the
        median step time, warm-up left out (:func:`amped.comparison.timing.step_stats`); None
        with no timed step (one step run)."""
        stats = step_stats(self.step_times)
        if len(self.step_times) < 2 or stats is None or stats.median <= 0 or not self.samples:
            return None  # no timed step: the only one is warm-up
        return self.samples / len(self.step_times) / stats.median


class Observer:
    """Hooks the progress display implements; each is a no-op here."""

    def warming_up(self, run: RecipeRun, compiles: str | None) -> None:
        """Called before a recipe's warm-up steps (``compiles``: what they compile, in
        words, or None; :mod:`amped.comparison.warmup`)."""

    def warmed_up(self, run: RecipeRun, warmup: Any) -> None:
        """Called after them, with the :class:`~amped.comparison.warmup.Warmup` they made."""

    def planning(self, runs: list[RecipeRun]) -> None:
        """Called before the short timing runs that fit the comparison to its budget."""

    def probing(self, run: RecipeRun) -> None:
        """Called before a recipe's memory probe, in a process of its own."""

    def planned(self, runs: list[RecipeRun], note: str) -> None:
        """Called when the steps per recipe are fixed (``runs[i].steps_planned``)."""

    def recipe_started(self, run: RecipeRun) -> None:
        """Called before a recipe's first step."""

    def step_done(self, run: RecipeRun) -> None:
        """Called after each step; the step's figures are the last in the run's lists."""

    def recipe_finished(self, run: RecipeRun) -> None:
        """Called when a recipe completes, stops, fails or is interrupted."""


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def run_recipe(
    config: CompareConfig,
    run: RecipeRun,
    observer: Observer,
    *,
    evaluate: bool = True,
    deadline: float | None = None,
) -> None:
    """Train ``run.recipe`` for ``run.steps_planned`` steps, filling in ``run``.

    With a ``deadline`` (a ``time.monotonic()`` value), a step after the first starts
    only if the previous step's time still fits before it; otherwise the recipe stops
    with the reason :data:`OUT_OF_TIME` (:mod:`amped.comparison.budget`).

    A recipe that raises is recorded as failed (the error in one line, and its
    traceback). KeyboardInterrupt marks it interrupted and propagates, as does
    UsageError (the task breaks its contract).
    """
    run.status = "running"
    observer.recipe_started(run)
    began = time.monotonic()
    try:
        _train(config, run, observer, evaluate, deadline)
    except KeyboardInterrupt:
        run.status, run.stop_reason = "interrupted", "interrupted"
        raise
    except UsageError as error:
        run.status, run.error = "failed", str(error)
        raise
    except (Exception, SystemExit) as error:  # user code calling sys.exit() fails its recipe
        run.status, run.error = "failed", _one_line(error)
        run.error_traceback = traceback.format_exc()
    finally:
        run.wall_s = time.monotonic() - began
        observer.recipe_finished(run)


def _out_of_time(run: RecipeRun, deadline: float | None) -> bool:
    """Whether the next step, taking as long as the last, would end after ``deadline``."""
    if deadline is None or not run.step_times:
        return False
    return time.monotonic() + run.step_times[-1] > deadline


def _train(
    config: CompareConfig,
    run: RecipeRun,
    observer: Observer,
    evaluate: bool,
    deadline: float | None,
) -> None:
    task = config.factory.build(
        batch_size=config.batch_size, seed=config.seed, device=config.device
    )
    run.task = describe_task(task, config.factory.spec)
    model = task.model.to(config.device)
    setup = prepare(model, task.optimizer(model), run.recipe, config.layers, config.attention)
    health = attach_monitor(setup)
    peak = PeakMemory(config.device)
    peak.start()
    batches = iter(task.batches)
    for _ in range(run.steps_planned):
        batch = next(batches, None)
        if batch is None:
            run.status, run.stop_reason = "stopped", "data ran out"
            break
        if _out_of_time(run, deadline):
            run.status, run.stop_reason = "stopped", OUT_OF_TIME
            break
        inputs, targets = to_device(batch, config.device)
        _train_step(setup, task, inputs, targets, run, peak, config)
        observer.step_done(run)
        interrupt.check()
    else:
        run.status = "complete"
    run.peak_memory_bytes, run.peak_memory_kind = peak.peak_bytes(), peak.kind
    run.health = health_note(health)
    run.final_loss_scale = setup.scaler.get_scale() if run.recipe.loss_scaling else None
    if evaluate:
        run.evaluation = _evaluate(setup, task, config.device)


def prepare(
    model: torch.nn.Module, optimizer: Any, recipe: Recipe, layers: LayerChoice,
    attention: str | None = None,
) -> TrainSetup:  # fmt: skip
    """:func:`amped.prepare`, with the layers ``--module-filter``/``--exclude`` chose
    for an FP8 or block recipe, and ``--attention``'s config for the attention."""
    chosen = layers.filter_for(model, recipe)
    if chosen is None:
        return prepare_recipe(model, optimizer, recipe, attention=attention)
    return prepare_recipe(model, optimizer, recipe, module_filter=chosen, attention=attention)


def _train_step(
    setup: TrainSetup,
    task: Task,
    inputs: Any,
    targets: Any,
    run: RecipeRun,
    peak: PeakMemory,
    config: CompareConfig,
) -> None:
    # Training state is measured after the first step the optimizer took: a skipped
    # step (overflow) leaves lazily created optimizer state (AdamW's moments) missing.
    measure = run.state is None
    last = len(run.step_times) + 1 == run.steps_planned
    began = time.perf_counter()
    with setup.autocast():
        outputs = call_model(setup.model, inputs)
        loss = check_loss(task.loss_fn(outputs, targets), config.factory.spec)
    peak.sample()
    scale = setup.scaler.get_scale() if run.recipe.loss_scaling else None
    setup.backward(loss)
    peak.sample()
    grads = grad_bytes(setup.model) if measure else 0
    stepped = setup.step()
    peak.sample()
    if measure and (stepped or last):
        run.state = state_bytes(setup.model, setup.optimizer, grads)
    setup.zero_grad()
    value = float(loss.item())
    synchronize(config.device)
    run.step_times.append(time.perf_counter() - began)
    run.losses.append(value)
    run.samples += count_samples(inputs) or 0
    run.skipped_steps += not stepped
    if scale is not None:
        run.loss_scales.append(scale)


def _evaluate(setup: TrainSetup, task: Task, device: torch.device) -> dict[str, float] | None:
    """The task's held-out metrics for the trained model, under the recipe's autocast."""
    if task.evaluate is None:
        return None
    model = setup.model
    was_training = model.training

    def predict(inputs: Any) -> Any:
        with torch.no_grad(), setup.autocast():
            return call_model(model, to_device(inputs, device))

    model.eval()
    try:
        metrics = task.evaluate(predict)
    finally:
        model.train(was_training)
    return {k: float(metrics[k]) for k in ("loss", "accuracy") if k in metrics}


def describe_task(task: Task, spec: str) -> dict[str, Any]:
    """The task as recorded in ``results.json``."""
    return {
        "name": task.name,
        "description": task.description,
        "factory": spec,
        "model": type(task.model).__name__,
        "parameters": sum(p.numel() for p in task.model.parameters()),
        "details": task.details,
    }
