"""Optimizer state laid out flat: many parameters' state tensors as views of one tensor.

The fused step (:mod:`amped.optim.fused`) updates a chunk of parameters in one
kernel over flat rows. A chunk's gradients and weights are gathered into work rows
and its weights scattered back (copies); its state need not be, if each state
tensor of the chunk's parameters lies right after the previous one in memory: the
chunk's state is then one slice of memory, which the kernel reads and writes in
place. That saves six of AdamW's nine copies.

So the compensated optimizers create the state of the parameters that start
stepping together as views of one new tensor per device, dtype and state key, in
parameter order (:func:`allocate`), and lay loaded state out the same way
(:func:`lay_out`). :func:`flat` finds the slice, or says that there is none (a
parameter without a gradient in between, state replaced by hand): the step then
gathers, as it always may. Only contiguous parameters' state is laid out flat; a
parameter in another memory format (channels_last) keeps state in its own format, and
a tensor subclass (FSDP2's DTensor) state of its own kind.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from amped._internal.torch_compat import foreach_copy_

__all__ = ["allocate", "flat", "lay_out", "plain"]

Request = tuple[torch.Tensor, str, bool]  # (parameter, state key, zero-filled)


def allocate(state: dict[torch.Tensor, dict], requests: Sequence[Request]) -> None:
    """Create ``state[param][key]`` for each request, shaped like ``param``: zeros, or
    uninitialized where ``zero`` is False. Requests of one device, dtype and key share
    one tensor, in the order given."""
    batches: dict[tuple[torch.device, torch.dtype, str, bool], list[torch.Tensor]] = {}
    for param, key, zero in requests:
        if plain(param) and param.is_contiguous():
            batches.setdefault((param.device, param.dtype, key, zero), []).append(param)
        elif zero:
            state[param][key] = torch.zeros_like(param, memory_format=torch.preserve_format)
        else:
            state[param][key] = torch.empty_like(param, memory_format=torch.preserve_format)
    for (device, dtype, key, zero), params in batches.items():
        total = sum(param.numel() for param in params)
        make = torch.zeros if zero else torch.empty
        whole = make(total, dtype=dtype, device=device)
        for param, view in zip(params, _views(whole, params), strict=True):
            state[param][key] = view


def lay_out(
    state: dict[torch.Tensor, dict], params: Iterable[torch.Tensor], keys: Sequence[str]
) -> None:
    """Move each ``key``'s tensors of ``params`` (in that order) into one new tensor per
    device and dtype, values kept; one key at a time, so that at most one key's state
    is held twice. Tensors that are not contiguous or not shaped like their
    parameter are left where they are."""
    params = [p for p in params if p in state and plain(p) and p.is_contiguous()]
    for key in keys:
        batches: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for param in params:
            value = state[param].get(key)
            if (
                isinstance(value, torch.Tensor)
                and value.shape == param.shape
                and value.is_contiguous()
            ):
                batches.setdefault((value.device, value.dtype), []).append(param)
        for (device, dtype), members in batches.items():
            whole = torch.empty(sum(p.numel() for p in members), dtype=dtype, device=device)
            views = _views(whole, members)
            foreach_copy_(views, [state[p][key] for p in members])
            for param, view in zip(members, views, strict=True):
                state[param][key] = view


def plain(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a plain tensor or parameter (not a subclass such as FSDP2's
    DTensor, whose state must stay of its kind)."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter)


def flat(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``parts`` as one flat tensor over their own memory, if each is contiguous and
    starts where the previous one ends, all in one storage; else None."""
    first = parts[0]
    size = first.element_size()
    start, numel = first.data_ptr(), 0
    for part in parts:
        if part.data_ptr() != start + numel * size or not part.is_contiguous():
            return None
        numel += part.numel()
    storage = first.untyped_storage()
    base = storage.data_ptr()
    if any(p.untyped_storage().data_ptr() != base for p in parts[1:]):
        return None  # neighbouring allocations, not one tensor
    whole = torch.empty(0, dtype=first.dtype, device=first.device)
    return whole.set_(storage, first.storage_offset(), (numel,), (1,))


def _views(whole: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    parts = whole.split([param.numel() for param in params])
    return [part.view(param.shape) for part, param in zip(parts, params, strict=True)]
