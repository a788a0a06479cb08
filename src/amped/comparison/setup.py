"""What a comparison runs, checked before it starts: recipes, device, task and threads.

Every argument is checked before any training starts (and the task built once, which
also checks its contract), so a mistake costs a second, not a run. ``amped compare``
and :func:`amped.compare` share these checks and their messages.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from amped.comparison.dtypes import recipe_for_dtype
from amped.comparison.environment import default_device, resolve_device
from amped.comparison.layers import LayerChoice, dry_run
from amped.comparison.run import CompareConfig
from amped.comparison.timing import CpuLoad
from amped.lowp.attention_config import resolve_config
from amped.recipes import Recipe
from amped.recipes.attention import convert_model_attention
from amped.recipes.registry import RECIPES, resolve_recipe
from amped.tasks.errors import UsageError
from amped.tasks.factory import as_factory

__all__ = ["choose_threads", "make_config", "parse_recipes"]

_LOAD_SAMPLE_S = 0.5  # how long the CPU load is sampled before choosing threads


def parse_recipes(text: str | Sequence[str | Recipe]) -> tuple[Recipe, ...]:
    """``--recipes``: comma-separated names or aliases, or ``all``; duplicates dropped.

    A dtype name as torch spells it (``bfloat16``, ``float16``, ``float32``) or its short
    alias stands for that dtype's mixed recipe (``fp32`` for float32). A sequence of
    names or :class:`~amped.recipes.Recipe` objects is taken as it is listed.
    """
    if not isinstance(text, str):
        return _listed(text)
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise UsageError(f"--recipes names no recipe. Received: --recipes {text!r}")
    if [n.lower() for n in names] == ["all"]:
        return tuple(RECIPES.values())
    chosen: list[Recipe] = []
    for name in names:
        try:
            recipe = resolve_recipe(recipe_for_dtype(name) or name)
        except ValueError as error:
            what = str(error).split(" Received: ")[0]  # the flag, not the argument, received
            raise UsageError(f"{what} Received: --recipes {text!r}") from None
        if recipe not in chosen:
            chosen.append(recipe)
    return tuple(chosen)


def _listed(recipes: Sequence[str | Recipe]) -> tuple[Recipe, ...]:
    chosen: list[Recipe] = []
    for item in recipes:
        for one in (item,) if isinstance(item, Recipe) else parse_recipes(str(item)):
            if one not in chosen:
                chosen.append(one)
    if not chosen:
        raise UsageError(f"recipes names no recipe. Received: recipes={list(recipes)!r}")
    return tuple(chosen)


def make_config(
    *,
    recipes: str | Sequence[str | Recipe],
    model: str | Callable[..., Any] | None,
    steps: int,
    batch_size: int | None,
    device: str | torch.device | None,
    seed: int,
    max_time: float | None,
    threads: int | None,
    isolate_memory: bool,
    module_filter: str | None = None,
    exclude: str | None = None,
    attention: str | None = None,
) -> CompareConfig:
    """Check every argument, and build the task once (which also checks its contract).

    Sets torch's thread count (:func:`choose_threads`) once, before any recipe: the same
    for every one. The caller restores it.
    """
    chosen = parse_recipes(recipes)
    resolved = resolve_device(str(device) if device is not None else default_device())
    factory = as_factory(model)
    task = factory.check(batch_size=batch_size, seed=seed, device=resolved)
    layers = LayerChoice(module_filter, exclude)
    conversions = dry_run(task.model, chosen, layers)  # every recipe checked on the model
    attention_conversion = None
    if attention is not None:  # the conversion on a copy: what converts, what does not
        try:
            attention_config = resolve_config(attention)
        except ValueError as error:
            raise UsageError(f"--attention: {error}") from None
        model = copy.deepcopy(task.model)
        attention_conversion = convert_model_attention(model, attention_config)
    count, source = choose_threads(threads, task.threads, resolved)
    torch.set_num_threads(count)
    return CompareConfig(
        factory=factory,
        recipes=chosen,
        steps=steps,
        batch_size=batch_size,
        device=resolved,
        seed=seed,
        max_time=max_time or None,
        isolate_memory=isolate_memory,
        threads=count,
        threads_source=source,
        layers=layers,
        conversions=tuple(conversions),
        attention=attention,
        attention_conversion=attention_conversion,
    )


def choose_threads(
    given: int | None, task_threads: int | None, device: torch.device
) -> tuple[int, str]:
    """The CPU threads for torch, and who chose them: ``--threads``, else the task's
    choice (on a CPU), else torch's default, or 1 on a busy CPU (:func:`_threads_for_load`)."""
    threads = torch.get_num_threads()
    if given is not None:
        return given, "--threads"
    if task_threads is not None and device.type == "cpu":
        return task_threads, "the task's choice"
    if device.type == "cpu" and threads > 1:
        return _threads_for_load(threads)
    return threads, "torch's default"


def _threads_for_load(threads: int) -> tuple[int, str]:
    """torch's default thread count, or 1 when other processes keep the cores busy:
    with more threads than free cores, each op's barrier waits for a preempted thread
    (docs/compare.md, ``--threads``)."""
    load = CpuLoad(threads).start()
    time.sleep(_LOAD_SAMPLE_S)
    machine = load.stop()
    if not machine["busy"]:
        return threads, "torch's default"
    others = machine["other_processes_cores"]
    used = f"{others:.1f} of {machine['cores']} cores" if others is not None else "the cores"
    return 1, (
        f"amped: other processes used {used} at the start, so 1 thread instead of "
        f"torch's {threads}; --threads N chooses"
    )
