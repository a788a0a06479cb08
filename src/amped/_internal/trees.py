"""Walking nested containers of tensors: tuples, lists, dicts and namedtuples.

Other leaves (numbers, strings, None, arbitrary objects) are kept as they are; the
walkers do not look inside dataclasses or custom objects, which a caller that needs
them handles explicitly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["iter_tensors", "map_tensors"]


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``, depth first, in container order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with the same structure and each tensor replaced by ``fn(tensor)``.

    Lists stay lists, dicts keep their type and key order, namedtuples are rebuilt with
    their own class, other tuples (and tuple subclasses) become plain tuples of their
    type where it can be built from an iterable.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return [map_tensors(fn, item) for item in obj]
    if isinstance(obj, tuple):
        items = [map_tensors(fn, item) for item in obj]
        if hasattr(obj, "_fields"):  # a namedtuple: its constructor takes fields
            return type(obj)(*items)
        return tuple(items) if type(obj) is tuple else type(obj)(items)
    if isinstance(obj, dict):
        mapped = {key: map_tensors(fn, value) for key, value in obj.items()}
        return mapped if type(obj) is dict else type(obj)(mapped)
    return obj
