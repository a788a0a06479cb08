"""Entering and leaving amped regions: each region decides its :class:`Path` on entry.

The paths, what takes each and what it costs, and how regions meet ``torch.compile``
(with nothing process-wide): docs/engine.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from amped._internal import torch_compat
from amped.autocast_mode import compiling, dispatch, transparent
from amped.autocast_mode.mode import AutocastMode, merged_rules
from amped.autocast_mode.module_hooks import hooks
from amped.autocast_mode.state import STATE, EngineState, Path, Region, innermost_policies, kept
from amped.policy import Policy
from amped.policy.created import add_creation_listener
from amped.policy.ops import torch_default_rules
from amped.policy.policy import LOW_DTYPES

__all__ = ["current_path", "enter", "exit", "forced_path"]

_is_compiling = compiling.tracing
_push = torch_compat.push_torch_function_mode
_pop = torch_compat.pop_torch_function_mode


def torch_rules_only(policy: Policy) -> bool:
    """Whether ``policy``'s op rules are torch's own for its device type, under every
    low dtype (kept with the policy)."""
    device_type, rules = policy.device_type, policy.rules_for
    return kept(
        policy,
        "torch_equal",
        lambda: all(rules(dtype) == torch_default_rules(device_type) for dtype in LOW_DTYPES),
    )


def _prepare(policy: Policy) -> None:
    # Every look-up table the engine needs, built when the policy is made: a region
    # opened inside a compiled function then only reads them (Dynamo cannot build them).
    _unplain(policy)
    merged_rules({policy.device_type: policy})


add_creation_listener(_prepare)


def _choose_path(region: Region, st: EngineState) -> Path:
    policy = region.policy
    if policy is None or not (region.unplain or st.forced):  # torch's rules alone
        return Path.TORCH
    low_rules = any(r.precision == "low" for r in policy.module_rules)
    if st.forced is Path.MODE or low_rules or _is_compiling():
        return Path.MODE  # (compiling: enter() marks the policy traced)
    if st.traced and policy in compiling.traced(st):  # a compile on this thread traced it
        return Path.MODE
    route_all = st.forced is Path.KERNELS
    if torch_rules_only(policy) and not route_all:  # with "fp32" / "skip" module rules
        return Path.TORCH
    return Path.KERNELS if dispatch.plan(policy, route_all) is not None else Path.MODE


def current_path(device_type: str = "cpu") -> Path | None:
    """The path of the innermost open amped region for ``device_type`` on this thread
    (None: no region is open for it)."""
    return next((r.path for r in reversed(STATE.regions) if r.device_type == device_type), None)


@contextlib.contextmanager
def forced_path(path: Path | None, *, torch_alongside: bool | None = None) -> Iterator[None]:
    """Regions opened inside take ``path`` where the policy allows it: ``MODE`` always
    (the doctor's tracer, which must see every op after amped's casts from a mode below
    it); ``KERNELS`` (tests, benchmarks) routes every rule, torch's own too, through
    amped's kernels. ``torch_alongside=False`` (tests) keeps torch's C++ autocast out of
    every call the mode handles, so that every cast is amped's own; None keeps it as is."""
    st = STATE
    saved = (st.forced, st.torch_alongside)
    st.forced = path
    st.torch_alongside = st.torch_alongside if torch_alongside is None else torch_alongside
    try:
        yield
    finally:
        st.forced, st.torch_alongside = saved


def enter(region: Region) -> None:
    """Open ``region`` on this thread: set torch's autocast state, decide its path."""
    st = STATE
    dev = region.device_type
    policy = region.policy
    region.unplain = unplain = _unplain(policy)
    if unplain:  # (first: it may find Dynamo was reset, which frees the hooks)
        if _is_compiling():
            _prepare_while_tracing(policy)
        elif not compiling.listening():
            _listen_for_compiles()
    if policy is not None and policy.module_rules:
        hooks.acquire()
    region.saved = (
        torch.is_autocast_enabled(dev),
        torch.get_autocast_dtype(dev),
        torch.is_autocast_cache_enabled(),
    )
    torch.set_autocast_enabled(dev, region.enabled)
    torch.set_autocast_dtype(dev, region.dtype)
    torch.autocast_increment_nesting()
    torch.set_autocast_cache_enabled(region.cache_enabled)
    if policy is not None and not _is_compiling():
        region.depth = torch_compat.len_torch_function_stack()
    region.path = path = _choose_path(region, st)
    if path is Path.KERNELS:
        dispatch.register(policy, dispatch.plan(policy, st.forced is Path.KERNELS) or {})  # type: ignore[arg-type]
    st.regions.append(region)
    if path is Path.MODE and st.mode is None:
        _push_mode(st)
    if policy is not None or st.mode is not None or st.kernels:
        _publish(st)


def exit(region: Region) -> None:
    """Close ``region``, whichever position it holds among the open ones (the last
    ``MODE`` region drops the mode; the last of all clears the caches, as torch's)."""
    st = STATE
    regions = st.regions
    enabled, dtype, cache_enabled = region.saved
    if region not in regions:  # (a Region compares by identity)
        raise RuntimeError(
            "This amped.autocast region is not open on this thread: it was exited "
            "already, or entered on another thread. Exit each region once, on the "
            f"thread that entered it. Received: region for device_type={region.device_type!r}"
        )
    index = regions.index(region)  # usually the last: the innermost region exits
    above = regions[index + 1 :]
    del regions[index]
    same_device = [r for r in above if r.device_type == region.device_type]
    if same_device:  # the next region up on this device restores what this one found
        nxt = same_device[0]
        nxt.saved = (enabled, dtype, nxt.saved[2])
    else:
        torch.set_autocast_enabled(region.device_type, enabled)
        torch.set_autocast_dtype(region.device_type, dtype)
    if above:
        above[0].saved = (*above[0].saved[:2], cache_enabled)
    else:
        torch.set_autocast_cache_enabled(cache_enabled)
    if region.policy is not None and region.policy.module_rules:
        hooks.release()
    last = torch.autocast_decrement_nesting() == 0
    if st.mode is not None and not any(r.path is Path.MODE for r in regions):
        _pop_mode(st)
    if region.policy is not None or st.mode is not None or st.kernels:
        _publish(st)
    if last:
        torch.clear_autocast_cache()
        st.cache.clear()


def _publish(st: EngineState) -> None:
    # Make the open regions' policies active: in the mode (every one), or as the fast
    # path's kernel tables (the innermost region's per device type), and for the hooks.
    regions = st.regions
    if not regions:  # the last region closed
        st.ruled, st.kernels = {}, {}
        compiling.mark_for_guards(st, False)
        return
    active = innermost_policies(regions)
    unplain = regions[0].unplain if len(regions) == 1 else any(r.unplain for r in regions)
    st.ruled = {dev: p for dev, p in active.items() if p.module_rules} if unplain else {}
    compiling.mark_for_guards(st, unplain)
    mode = st.mode
    if mode is not None:
        st.kernels = {}
        # (Policy.__eq__ cannot be traced: under torch.compile, another object refreshes.)
        current = mode.policies
        same = active.keys() == current.keys() and all(active[k] is current[k] for k in active)
        if not same and (_is_compiling() or active != current):
            mode.refresh(active)
        return
    kernels: dict[str, Any] = {}
    for region in regions:
        if region.policy is not None:
            on = region.path is Path.KERNELS
            rules = dispatch.kernel_rules(region.policy, st.forced is Path.KERNELS) if on else {}
            kernels[region.device_type] = rules
    st.kernels = {dev: rules for dev, rules in kernels.items() if rules}


def _unplain(policy: Policy | None) -> bool:
    # A policy other than torch's own rules alone: it needs the mark for Dynamo's guards.
    return policy is not None and (bool(policy.module_rules) or not torch_rules_only(policy))


def _push_mode(st: EngineState) -> None:
    if _is_compiling():  # Dynamo traces the context-manager protocol
        _prepare_while_tracing(None)
        st.mode = AutocastMode(st.torch_alongside)
        st.mode.__enter__()
        return
    transparent.prepare_clones()  # once per process, about 1 ms
    mode = st.spare_mode  # one instance per thread, reused region after region
    if mode is None or mode.alongside is not st.torch_alongside:
        mode = st.spare_mode = AutocastMode(st.torch_alongside, st.cache)
    st.mode = mode
    _push(mode)
    if mode.backward_token is None:
        mode.backward_token = compiling.backward_autocast_off()


@compiling.once_while_tracing
def _prepare_while_tracing(traced: Policy | None) -> bool:
    # Run for real while Dynamo traces (it cannot build the clones, nor register kernels
    # or hooks), and not guarded on: the graph must not depend on whether it ran before.
    # ``traced``: later regions of this policy take MODE, to pass the graph's guards.
    transparent.prepare_clones()
    _listen_for_compiles()
    if traced is not None:
        compiling.traced(STATE).add(traced)
        if traced.module_rules:
            hooks.install_traced()
    return True


def _pop_mode(st: EngineState) -> None:
    mode = st.mode
    st.mode = None
    st.names = {}
    if _is_compiling():
        mode.__exit__(None, None, None)
        return
    depth = torch_compat.len_torch_function_stack()
    if depth == 0 or torch_compat.get_function_stack_at(depth - 1) is not mode:
        raise RuntimeError(
            "amped's autocast mode was not on top of the torch-function mode stack "
            "when its last region closed: a mode entered inside the region is still "
            "open. Exit modes (and regions) in the reverse order of entering them."
        )
    _pop()
    token, mode.backward_token = mode.backward_token, None
    compiling.restore_backward_autocast(token)


# torch.compile: hearing when Dynamo starts, and moving this thread's regions then.


def _listen_for_compiles() -> None:
    # (Again at each region that may need it: torch._dynamo.reset() drops the callback,
    # and every graph: then no policy is traced any more, and the hooks may go.)
    if compiling.listen(_on_compile_start):
        hooks.traced = False


def _on_compile_start() -> None:
    hooks.compile_started()  # a graph may trace them: they stay installed
    st = STATE
    if st.regions:
        transparent.prepare_clones()  # Dynamo cannot build them while tracing
        _move_to_mode(st)


def _move_to_mode(st: EngineState) -> None:
    """Move this thread's regions to the mode now (a compile is starting)."""
    traced = compiling.traced(st)
    for region in st.regions:
        if region.unplain:
            region.path = Path.MODE
            traced.add(region.policy)  # type: ignore[arg-type]
    if st.mode is None and any(r.path is Path.MODE for r in st.regions):
        # The mode goes where it would have been pushed: at the stack depth the
        # outermost such region found, below modes entered inside the region since.
        depth = min(r.depth for r in st.regions if r.path is Path.MODE)
        lifted = []
        while torch_compat.len_torch_function_stack() > depth:
            lifted.append(_pop())
        _push_mode(st)
        for above in reversed(lifted):
            _push(above)
    _publish(st)
