"""``amped.compare``: the comparison of ``amped compare`` as a library call.

The same checks, runs, budget and figures as the command (which calls the same
functions), returned as a :class:`~amped.comparison.result.CompareResult` instead of
printed: it renders nothing and writes nothing unless asked (``result.save(path)``).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from amped._internal.errors import type_error, value_error
from amped.comparison.budget import Budget
from amped.comparison.compare import run_comparison
from amped.comparison.result import CompareResult
from amped.comparison.run import CompareConfig, Observer
from amped.comparison.setup import make_config
from amped.recipes import Recipe
from amped.tasks.factory import DEFAULT_FACTORY

__all__ = ["compare"]

PEAK_MEMORY = ("own-process", "in-process")
MAX_SEED = 2**64 - 1  # the largest seed torch.manual_seed takes


def compare(
    recipes: str | Sequence[str | Recipe] = "all",
    *,
    model: str | Callable[..., Any] | None = None,
    steps: int = 200,
    batch_size: int | None = None,
    device: str | torch.device | None = None,
    seed: int = 0,
    max_time: float | None = 120.0,
    threads: int | None = None,
    peak_memory: str | None = None,
    module_filter: str | None = None,
    exclude: str | None = None,
    attention: str | None = None,
    observer: Observer | None = None,
) -> CompareResult:
    """Train one task once per recipe (fp32 first) and compare speed, memory and loss.

    The arguments are ``amped compare``'s options (docs/compare.md), and so are their
    defaults, but two: nothing is printed or written, and ``peak_memory`` defaults to
    what the factory allows.

    Args:
        recipes: comma-separated recipe names, aliases or dtype names, or ``"all"``; or
            a sequence of names and :class:`~amped.recipes.Recipe` objects.
        model: the task factory (the contract of :mod:`amped.tasks`): the function, a
            ``"module:function"`` or ``"path/to/file.py:function"`` spec, or None for
            the built-in tiny GPT on Python's own standard library.
        steps: training steps per recipe (fewer if ``max_time`` cuts them).
        batch_size: passed to the factory (None: its default).
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` (None: CUDA if available).
        seed: seeds weights, data and dropout, the same for every recipe.
        max_time: seconds for the whole comparison, memory probes included; None or 0:
            no limit.
        threads: torch's CPU threads (None: the task's choice, else torch's, or 1 on a
            busy CPU); restored when the call returns.
        peak_memory: ``"own-process"`` (each recipe's peak memory measured in a process
            of its own, on a CPU: the factory must be importable there by name),
            ``"in-process"``, or None: own-process when the factory is importable by
            name (a module-level function, not one defined in ``__main__``).
        module_filter: the layers the FP8 and block recipes may convert, a regular
            expression or comma-separated names (``--module-filter``); None: every
            layer the recipe's config admits.
        exclude: layers they must leave alone, in the same form (``--exclude``).
        attention: every recipe's attention in this low-precision attention config (a
            preset of :data:`amped.lowp.attention_config.ATTENTION_CONFIGS`,
            ``--attention``): ``amped.prepare(..., attention=...)``; what it could not
            convert is in ``results.json``'s ``attention``. None: attention as it is.
        observer: an :class:`~amped.comparison.run.Observer` told of each phase and step
            (a progress display).

    Returns:
        A :class:`~amped.comparison.result.CompareResult`: ``.recipes`` holds each
        recipe's losses, speed, memory and notes; ``.to_dict()`` is the ``results.json``
        document ``amped compare`` writes; ``.save(path)`` writes it.

    Raises:
        ValueError: an unknown recipe or device, a bad count, or a task that breaks the
            factory contract (an ``amped.tasks.errors.UsageError``).
        TypeError: a model instead of a factory, an argument of the wrong type, or a
            factory returning the wrong kind of thing.
        RuntimeError: the task failed in float32 before training
            (``amped.tasks.errors.RunError``).

    A recipe that raises is recorded as failed (``status`` and ``error`` in its entry)
    and the others still run. Ctrl-C stops at the next step boundary and returns what
    was measured, with ``partial`` true.

    Example:
        >>> import amped
        >>> result = amped.compare("fp32,bf16", steps=2, max_time=None,
        ...                        peak_memory="in-process")
        >>> [r["name"] for r in result.recipes], result.recipes[1]["steps_done"]
        (['fp32', 'bf16-mixed'], 2)
    """
    _check_arguments(steps, batch_size, seed, max_time, threads, peak_memory)
    previous = torch.get_num_threads()
    try:
        budget = Budget(max_time or None)  # counts from here: the check included
        own = peak_memory == "own-process"
        config = make_config(
            recipes=recipes,
            model=model,
            steps=steps,
            batch_size=batch_size,
            device=device,
            seed=seed,
            max_time=max_time,
            threads=threads,
            isolate_memory=own,
            module_filter=module_filter,
            exclude=exclude,
            attention=attention,
        )
        if peak_memory is None:
            config = replace(config, isolate_memory=config.factory.reloadable)
        elif own and not config.factory.reloadable:
            raise value_error(
                "peak_memory='own-process' loads the factory by name in a process of its "
                "own, which cannot load this one (a lambda, a nested function or one "
                "defined in __main__); define it at a module's top level, or pass "
                "peak_memory='in-process'",
                "model",
                config.factory.spec,
            )
        comparison = run_comparison(config, observer, budget)
    finally:
        torch.set_num_threads(previous)
    return CompareResult.of(comparison, _command(config, recipes, threads))


def _check_arguments(
    steps: object,
    batch_size: object,
    seed: object,
    max_time: object,
    threads: object,
    peak_memory: object,
) -> None:
    for name, value, low in (("steps", steps, 1), ("seed", seed, 0)):
        _check_int(name, value, low)
    for name, value in (("batch_size", batch_size), ("threads", threads)):
        if value is not None:
            _check_int(name, value, 1)
    if not isinstance(seed, bool) and isinstance(seed, int) and seed > MAX_SEED:
        raise value_error("seed is in [0, 2**64 - 1] (torch.manual_seed's range)", "seed", seed)
    if max_time is not None and not (
        isinstance(max_time, int | float) and not isinstance(max_time, bool) and max_time >= 0
    ):
        raise value_error("max_time is seconds >= 0, or None for no limit", "max_time", max_time)
    if peak_memory is not None and peak_memory not in PEAK_MEMORY:
        raise value_error(
            f"peak_memory is one of {', '.join(map(repr, PEAK_MEMORY))} or None",
            "peak_memory",
            peak_memory,
        )


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise type_error(f"{name} is an int", name, value)
    if value < low:
        raise value_error(f"{name} is an int >= {low}", name, value)


def _command(
    config: CompareConfig, recipes: str | Sequence[str | Recipe], threads: int | None
) -> list[str]:
    """The ``amped compare`` command line that repeats this comparison."""
    names = recipes if isinstance(recipes, str) else ",".join(r.name for r in config.recipes)
    command = ["amped", "compare", "--recipes", names, "--steps", str(config.steps)]
    if config.factory.spec != DEFAULT_FACTORY:
        command += ["--model", config.factory.spec]
    if config.batch_size is not None:
        command += ["--batch-size", str(config.batch_size)]
    command += ["--device", str(config.device), "--seed", str(config.seed)]
    command += ["--max-time", f"{config.max_time or 0:g}"]
    if threads is not None:
        command += ["--threads", str(threads)]
    command += ["--peak-memory", "own-process" if config.isolate_memory else "in-process"]
    if config.attention is not None:
        command += ["--attention", config.attention]
    return command
