"""amped._internal: the shared helpers every layer uses."""

from __future__ import annotations

import collections
import json
import math

import pytest
import torch

from amped._internal import errors, jsonio, stats, torch_compat, trees


def test_errors_end_with_received_and_have_the_right_type() -> None:
    error = errors.value_error("n must be positive; pass 1 or more", "n", 0)
    assert isinstance(error, ValueError)
    assert str(error) == "n must be positive; pass 1 or more. Received: n=0 (of type int)"
    error = errors.type_error("dtype must be a torch.dtype.", "dtype", "fp16")
    assert isinstance(error, TypeError)
    assert str(error).endswith("Received: dtype='fp16' (of type str)")


Pair = collections.namedtuple("Pair", "a b")


def test_map_tensors_keeps_structure_and_other_leaves() -> None:
    x, y, z = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    data = {"p": Pair(x, "s"), "l": [y, 3, None], "t": (z,)}
    out = trees.map_tensors(lambda t: t * 10, data)
    assert isinstance(out["p"], Pair) and out["p"].b == "s"
    assert torch.equal(out["p"].a, x * 10)
    assert out["l"][1:] == [3, None] and isinstance(out["l"], list)
    assert isinstance(out["t"], tuple) and torch.equal(out["t"][0], z * 10)
    assert [t.numel() for t in trees.iter_tensors(data)] == [1, 2, 3]


def test_map_tensors_keeps_dict_subclasses() -> None:
    ordered = collections.OrderedDict(b=torch.ones(1), a=torch.ones(2))
    out = trees.map_tensors(torch.neg, ordered)
    assert type(out) is collections.OrderedDict and list(out) == ["b", "a"]
    counts = collections.defaultdict(list, x=torch.ones(1))
    out = trees.map_tensors(torch.neg, counts)
    assert type(out) is collections.defaultdict and out.default_factory is list
    assert torch.equal(out["x"], -torch.ones(1)) and out["missing"] == []


def test_quartiles_match_linear_interpolation() -> None:
    values = [4.0, 1.0, 3.0, 2.0, 10.0]
    q1, q2, q3 = stats.quartiles(values)
    ordered = sorted(values)

    def linear(q: float) -> float:  # numpy's default method, written out
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    assert (q1, q2, q3) == (linear(0.25), linear(0.5), linear(0.75))
    assert stats.median([1.0, 2.0, 3.0, 4.0]) == 2.5
    assert stats.quartiles([7.0]) == (7.0, 7.0, 7.0)
    assert stats.iqr(values) == q3 - q1
    with pytest.raises(ValueError, match="at least one value"):
        stats.median([])


def test_json_round_trips_infinities_and_nulls_nan() -> None:
    text = jsonio.to_json({"a": [1.0, math.inf, -math.inf, math.nan], "b": (2,)})
    assert json.loads(text) == {"a": [1.0, "inf", "-inf", None], "b": [2]}
    assert jsonio.from_json(text) == {"a": [1.0, math.inf, -math.inf, None], "b": [2]}


def test_torch_version_is_read_from_torch() -> None:
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    assert torch_compat.TORCH_VERSION[:2] == (major, minor)
    assert torch_compat.torch_at_least(major, minor)
    assert not torch_compat.torch_at_least(major + 1, 0)
    assert torch_compat._parse_version("2.4.0a0+git1234") == (2, 4, 0)
