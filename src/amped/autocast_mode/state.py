"""Per-thread state of amped's autocast regions, and the module rules' hooks.

torch keeps "is autocast on, and at which dtype" in thread-local C++ state, and model
code reads it (``torch.is_autocast_enabled()``). amped regions set that same state, so
the engine reads it back per op: a nested ``torch.autocast(enabled=False)`` in model
code turns amped's casting off there too. What torch has no place for lives here: the
policy of the innermost amped region per device type, and the one
:class:`~amped.autocast_mode.mode.AutocastMode` this thread has on the torch-function stack.

The mode is on the stack only while some open region's policy needs it. A policy with
exactly torch's op rules and no module rules (the default) does not: torch's C++
autocast, which the region switches on, applies those very rules, so the region costs
what ``torch.autocast`` costs and gives its results by construction. The engine runs
for such a policy too when :data:`~amped.autocast_mode.mode.TORCH_AUTOCAST_ALONGSIDE` is
off (the tests, checking amped's own casts) or inside :func:`engine_always`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from amped._internal import torch_compat
from amped.autocast_mode import compiling, dispatch, freshness, transparent
from amped.autocast_mode import mode as engine
from amped.autocast_mode.mode import AutocastMode
from amped.policy import Policy
from amped.policy.created import add_creation_listener
from amped.policy.ops import torch_default_rules
from amped.policy.policy import LOW_DTYPES

__all__ = ["Region", "current_policy", "engine_always", "enter", "exit", "needs_engine"]


class Region:
    """One open amped region: what it set, and the torch state it found on entry.

    Regions are kept in entry order and removed by identity, so a region held across a
    ``yield`` or ``await`` may exit before one opened after it: whatever it changed is
    handed to the next region above it on the same device (which will restore it), or
    restored at once if none is left above it.
    """

    __slots__ = (
        "cache_enabled",
        "depth",
        "device_type",
        "dtype",
        "enabled",
        "engine",
        "fast",
        "forced",
        "fresh",
        "policy",
        "saved",
    )

    def __init__(
        self,
        device_type: str,
        policy: Policy | None,
        enabled: bool,
        dtype: torch.dtype,
        cache_enabled: bool,
    ) -> None:
        self.device_type = device_type
        self.policy = policy  # None: a disabled region, or a device type without policies
        self.enabled = enabled
        self.dtype = dtype
        self.cache_enabled = cache_enabled
        self.engine = False  # runs the mode engine
        self.fast = False  # runs the fast path (kernels at the Autocast keys)
        self.forced = False  # opened inside engine_always()
        self.fresh = False  # holds the freshness hook (for torch's cache, in a lean mode)
        self.depth = 0  # the torch-function stack's depth on entry (eager engine regions)
        # (autocast enabled, autocast dtype) of its device, and the cache setting, on entry
        self.saved: tuple[bool, torch.dtype, bool] = (False, dtype, cache_enabled)


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.mode: AutocastMode | None = None
        self.spare_mode: AutocastMode | None = None
        self.runner: AutocastMode | None = None  # never pushed: runs Python ops' rules
        self.regions: list[Region] = []  # open regions, in entry order
        self.engine_always = 0
        self.forced = 0  # open engine regions entered inside engine_always()
        self.frames: list[tuple[torch.nn.Module, Any]] = []
        self.names: dict[int, str] = {}


_state = _ThreadState()


def current_policy(device_type: str) -> Policy | None:
    """The policy of the innermost enabled amped region for ``device_type`` on this thread."""
    for region in reversed(_state.regions):
        if region.device_type == device_type and region.policy is not None:
            return region.policy
    return None


def needs_engine(policy: Policy) -> bool:
    """Whether ``policy`` needs amped's mode, or torch's C++ autocast applies it as is.

    It does not when its rules are torch's own for its device type, under every low
    dtype, and it has no module rules; unless the engine is asked for everywhere
    (:data:`~amped.autocast_mode.mode.TORCH_AUTOCAST_ALONGSIDE` off, or
    :func:`engine_always`).
    """
    if not engine.TORCH_AUTOCAST_ALONGSIDE or _state.engine_always or policy.module_rules:
        return True
    equal = policy._engine_cache.get("torch_equal")
    if equal is None:
        equal = _torch_equal(policy)
    return not equal


def _torch_equal(policy: Policy) -> bool:
    torch_rules = torch_default_rules(policy.device_type)
    equal = all(policy.rules_for(dtype) == torch_rules for dtype in LOW_DTYPES)
    policy._engine_cache["torch_equal"] = equal
    return equal


def _prepare(policy: Policy) -> None:
    # Every look-up table the engine needs, built when the policy is made: a region
    # opened inside a compiled function then only reads them (Dynamo cannot build them).
    _torch_equal(policy)
    engine.prepare(policy)
    transparent.prepare_clones()  # once per process, about 1 ms


add_creation_listener(_prepare)


@contextlib.contextmanager
def engine_always() -> Iterator[None]:
    """Regions opened inside run amped's mode even for torch's own rules.

    For code that must see every op after amped's casts, from a mode below it (the
    doctor's tracer), whatever the policy.
    """
    _state.engine_always += 1
    try:
        yield
    finally:
        _state.engine_always -= 1


def enter(region: Region) -> None:
    """Open ``region`` on this thread: set torch's autocast state, and make its policy
    (if any) active for its device type."""
    st = _state
    dev = region.device_type
    policy = region.policy
    if policy is not None and policy.module_rules:
        _hooks.acquire()  # first: under torch.compile it may leave the graph to install
    region.saved = (
        torch.is_autocast_enabled(dev),
        torch.get_autocast_dtype(dev),
        torch.is_autocast_cache_enabled(),
    )
    torch.set_autocast_enabled(dev, region.enabled)
    torch.set_autocast_dtype(dev, region.dtype)
    torch.autocast_increment_nesting()
    torch.set_autocast_cache_enabled(region.cache_enabled)
    region.engine = policy is not None and needs_engine(policy)
    if st.engine_always and region.engine:
        region.forced = True
        st.forced += 1
    if region.engine and FAST_PATH and not torch.compiler.is_compiling():
        region.depth = torch_compat.len_torch_function_stack()  # (for switch_to_engine)
        dispatch.watch_compiles()  # first: it turns the fast path off if one went unheard
        if _fast_allowed(st):
            tables = dispatch.plan(cast(Policy, policy))
            if tables is not None:
                dispatch.register(cast(Policy, policy), tables)
                region.engine, region.fast = False, True
            # Either way torch's C++ autocast applies torch's own rules (on the fast path,
            # or in a lean mode), with torch's cache: keep it fresh (module rules' own
            # hook does that for them, one global hook call per module call).
            if not cast(Policy, policy).module_rules:
                region.fresh = True
                freshness.acquire()
    st.regions.append(region)
    if region.engine and st.mode is None:
        _push_mode(st)
    if st.mode is not None:
        _publish(st)
    if region.fast or dispatch._tls.active:
        _publish_fast(st)
    if region.fresh or st.mode is not None:
        _set_fresh(st)


def exit(region: Region) -> None:
    """Close ``region``, whichever position it holds among the open ones.

    The last region that needs the mode drops it and its cache; the last region of all
    clears the autocast caches, as ``torch.autocast`` does.
    """
    st = _state
    regions = st.regions
    enabled, dtype, cache_enabled = region.saved
    if regions and regions[-1] is region:  # the usual case: the innermost region exits
        regions.pop()
        above: list[Region] = []
    else:
        index = _index(regions, region)
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
        _hooks.release()
    last = torch.autocast_decrement_nesting() == 0
    if region.forced:
        st.forced -= 1
    had_mode = st.mode is not None
    if had_mode:
        if not any(r.engine for r in regions):
            _pop_mode(st)
        else:
            _publish(st)
    if region.fresh:
        freshness.release()
    if region.fast or dispatch._tls.active or any(r.fast for r in regions):
        _publish_fast(st)
    if region.fresh or had_mode:
        _set_fresh(st)
    if last:
        torch.clear_autocast_cache()
        clear_cache()
        dispatch.clear_cache()
        freshness.forget()


FAST_PATH = True
"""Run policies that the dispatcher can express without the mode (see
:mod:`amped.autocast_mode.dispatch`). Off: every non-default policy runs the mode."""


def _fast_allowed(st: _ThreadState) -> bool:
    return (
        not dispatch.compiled_once
        and not st.engine_always
        and engine.TORCH_AUTOCAST_ALONGSIDE
        and not torch.compiler.is_compiling()
    )


def _publish_fast(st: _ThreadState) -> None:
    # The fast-path tables of the innermost policy per device type; none while the mode
    # runs (it applies every open region's policy itself).
    active: dict[str, dispatch.KernelRules] = {}
    if st.mode is None:
        for region in st.regions:
            if region.policy is not None:
                rules = dispatch.kernel_rules(region.policy) if region.fast else None
                active[region.device_type] = rules or {}
    dispatch.set_active({dev: rules for dev, rules in active.items() if rules})


def _set_fresh(st: _ThreadState) -> None:
    # The freshness hook acts while torch's cache serves casts amped's rule covers: on
    # the fast path, and in a lean mode.
    mode = st.mode
    if mode is None:
        freshness.set_active(any(r.fast for r in st.regions))
    else:
        freshness.set_active(mode.lean)


def regions_open() -> bool:
    """Whether an amped region is open on this thread."""
    return bool(_state.regions)


def run_python_op(
    op: Callable[..., Any], func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Call ``func``, the function of the ``@amped.autocast_op`` ``op``, under the rule
    the open regions' policies give ``op``, applied as the mode applies it.

    For calls made where no mode is on the torch-function stack (the fast path, a parked
    lean mode): there the override protocol reaches nothing, so ``op`` asks here.
    """
    st = _state
    per_device = engine.merged_rules(_innermost_policies(st.regions)).get(op)
    if per_device is None:
        return func(*args, **kwargs)
    runner = st.runner
    if runner is None:
        runner = st.runner = AutocastMode()
    return runner.run_listed(func, per_device, args, kwargs)


def switch_to_engine() -> None:
    """Move this thread's fast-path regions to the mode engine, now (torch.compile is
    starting: Dynamo guards on the mode stack, not on the fast path's state)."""
    st = _state
    for region in st.regions:
        if region.fast:
            region.fast, region.engine = False, True
        if region.fresh:
            region.fresh = False
            freshness.release()
    # The mode goes where it would have been pushed: at the stack depth the outermost
    # engine region found, below modes entered inside the region since (they pop
    # themselves on exit, and expect to be on top then).
    depth = min((r.depth for r in st.regions if r.engine), default=0)
    if st.mode is None and any(r.engine for r in st.regions):
        mode = st.spare_mode
        if mode is None:
            mode = st.spare_mode = AutocastMode()
        st.mode = mode
        mode.alone = depth == 0
    if st.mode is not None:
        lifted = []
        if not st.mode.on_stack:
            while torch_compat.len_torch_function_stack() > depth:
                lifted.append(_pop())
        _publish(st)  # pushed (unparked), as dispatch.compiled_once is set
        for above in reversed(lifted):
            _push(above)
    dispatch.set_active({})
    freshness.set_active(False)


def _push_mode(st: _ThreadState) -> None:
    if torch.compiler.is_compiling():  # Dynamo traces the context-manager protocol
        st.mode = AutocastMode()
        st.mode.__enter__()
        st.mode.on_stack = st.mode.traced = True
        return
    mode = st.spare_mode  # one instance per thread, reused region after region
    if mode is None:
        mode = st.spare_mode = AutocastMode()
    st.mode = mode
    # A mode below amped's (the doctor's tracer) must see every op after amped's casts.
    mode.alone = torch_compat.len_torch_function_stack() == 0
    # _publish, which runs next, pushes it (or parks it).


def _place_mode(mode: AutocastMode) -> None:
    """Put ``mode`` on the torch-function stack, or park it off the stack if it is
    parkable (see :class:`AutocastMode`) and no module rule's hook holds it there."""
    if mode.parkable:
        if mode.on_stack and not mode.held:
            unstack(mode)
        return
    if not mode.on_stack:
        stack(mode)
    if not mode.backward_off:
        compiling.backward_autocast_off()
        mode.backward_off = True


def stack(mode: AutocastMode) -> None:
    """Push a parked mode (a module rule's hook, for the module it names)."""
    _push(mode)
    mode.on_stack = True


def unstack(mode: AutocastMode) -> None:
    """Park ``mode`` again; left on the stack if a mode entered since sits above it."""
    depth = torch_compat.len_torch_function_stack()
    if depth and torch_compat.get_function_stack_at(depth - 1) is mode:
        _pop()
        mode.on_stack = False


def _pop_mode(st: _ThreadState) -> None:
    mode = st.mode
    assert mode is not None  # called only while the mode is on the stack
    st.mode = None
    mode.cache.clear()  # (its policies stay: the next region's are most often the same)
    st.names = {}
    if torch.compiler.is_compiling():
        mode.__exit__(None, None, None)
        return
    mode.held = False
    if mode.on_stack:
        depth = torch_compat.len_torch_function_stack()
        if depth == 0 or torch_compat.get_function_stack_at(depth - 1) is not mode:
            raise RuntimeError(
                "amped's autocast mode was not on top of the torch-function mode stack "
                "when its last region closed: a mode entered inside the region is still "
                "open. Exit modes (and regions) in the reverse order of entering them."
            )
        _pop()
        mode.on_stack = False
    if mode.backward_off:
        mode.backward_off = False
        compiling.restore_backward_autocast()


_push = torch_compat.push_torch_function_mode
_pop = torch_compat.pop_torch_function_mode


def _index(regions: list[Region], region: Region) -> int:
    for i in range(len(regions) - 1, -1, -1):
        if regions[i] is region:
            return i
    raise RuntimeError(
        "This amped.autocast region is not open on this thread: it was exited already, "
        "or entered on another thread. Exit each region once, on the thread that "
        f"entered it. Received: region for device_type={region.device_type!r}"
    )


def clear_cache() -> None:
    """Drop this thread's cached low-precision weight copies."""
    if _state.mode is not None:
        _state.mode.cache.clear()
    if _state.runner is not None:
        _state.runner.cache.clear()


def _identical(a: dict[str, Policy], b: dict[str, Policy]) -> bool:
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


_is_compiling = torch.compiler.is_dynamo_compiling


def _innermost_policies(regions: list[Region]) -> dict[str, Policy]:
    # device type -> the policy of the innermost region with one
    if len(regions) == 1 and regions[0].policy is not None:  # the usual case
        return {regions[0].device_type: regions[0].policy}
    active = {}
    for region in regions:
        if region.policy is not None:
            active[region.device_type] = region.policy
    return active


def _publish(st: _ThreadState) -> None:
    mode = st.mode
    assert mode is not None  # called only while a region is open
    active = _innermost_policies(st.regions)
    # (Policy.__eq__ cannot be traced: under torch.compile, another object refreshes.)
    if (
        not _identical(active, mode.policies) and (_is_compiling() or active != mode.policies)
    ) or mode.alongside is not engine.TORCH_AUTOCAST_ALONGSIDE:
        mode.policies = active
        mode.refresh()
    # After a compile that may meet a region, Dynamo must find on the stack the mode it
    # traced: module rules keep their lean mode, unparked; other policies the full mode.
    compiled = dispatch.compiled_once
    lean = FAST_PATH and mode.alone and not st.forced and (not compiled or mode.module_rules)
    if lean is not mode.lean or compiled is mode.may_park:
        mode.set_lean(lean, park=not compiled)
    if not mode.traced:
        _place_mode(mode)


# Module rules' hooks; they read this module's thread state (imported last: a cycle).
from amped.autocast_mode.module_hooks import hooks as _hooks  # noqa: E402
