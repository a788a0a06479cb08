"""The layering in docs/architecture.md, checked on the source: no module imports a layer
above its own, no modules import each other in a cycle, and every use of a private torch
API is in ``amped/_internal/torch_compat.py``.

Imports are read with ``ast``, so lazy imports inside functions and imports under
``TYPE_CHECKING`` count too: each is a dependency on that layer all the same.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "amped"

LAYERS = (
    "_internal",
    "policy",
    "autocast_mode",
    "scaling",
    "fp8",
    "recipes",
    "tasks",
    "doctor",
    "tuning",
    "comparison",
    "integrations",
    "cli",
)
"""Lowest first; a module may import its own layer and the ones before it."""

FACE = {"__init__": len(LAYERS) - 2, "__main__": len(LAYERS) - 1}
"""Top-level modules, as the layer whose imports they may make: ``amped/__init__.py``
re-exports the library (everything below the CLI), ``amped/__main__.py`` starts the CLI."""

TORCH_COMPAT = "amped._internal.torch_compat"

UPWARD_ALLOWED = {("amped.doctor.report", "amped.cli.doctor.html")}
"""The one upward import: ``Report.save_html`` imports the CLI's page renderer when
called (its plot needs matplotlib, which only the CLI may import)."""

# Third-party packages each layer may import: the core depends on torch alone.
THIRD_PARTY = {
    "integrations": {"torch", "lightning", "pytorch_lightning", "accelerate", "transformers"},
    "cli": {"torch", "rich", "matplotlib"},
}


@dataclass(frozen=True)
class Module:
    name: str  # dotted, e.g. "amped.scaling.grad_scaler"
    path: Path
    tree: ast.Module

    @property
    def layer(self) -> int:
        part = self.name.split(".")[1]
        return LAYERS.index(part) if part in LAYERS else FACE[part]

    @property
    def package(self) -> str:
        return self.name if self.path.name == "__init__.py" else self.name.rpartition(".")[0]


def _modules() -> list[Module]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name == "amped":
            name = "amped.__init__"
        found.append(Module(name, path, ast.parse(path.read_text(), filename=str(path))))
    return found


MODULES = _modules()


def _imported(module: Module) -> list[tuple[int, str]]:
    """(line, dotted name) of everything the module imports; ``from a import b`` gives
    ``a.b``, since ``b`` may be a submodule."""
    package = "amped" if module.name == "amped.__init__" else module.package
    names = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return names


def _layer_of(dotted: str) -> int | None:
    """The layer an ``amped...`` import reaches; ``import amped`` alone is the whole face."""
    parts = dotted.split(".")
    if parts[0] != "amped":
        return None
    if len(parts) == 1 or parts[1] not in LAYERS:
        return FACE["__init__"]  # the root package, or a name it re-exports
    return LAYERS.index(parts[1])


def test_every_module_is_in_a_layer():
    unknown = [m.name for m in MODULES if m.name.split(".")[1] not in (*LAYERS, *FACE)]
    assert not unknown, f"modules outside every layer (add them to docs/architecture.md): {unknown}"


def test_no_layer_imports_one_above_it():
    upward = []
    for module in MODULES:
        for line, dotted in _imported(module):
            reached = _layer_of(dotted)
            if (module.name, dotted.rpartition(".")[0]) in UPWARD_ALLOWED:
                continue
            if reached is not None and reached > module.layer:
                upward.append(f"{module.path.relative_to(PACKAGE)}:{line} imports {dotted}")
    assert not upward, "lower layers import upper ones:\n" + "\n".join(upward)


def test_the_core_depends_on_torch_alone():
    stdlib = sys.stdlib_module_names
    foreign = []
    for module in MODULES:
        part = module.name.split(".")[1]
        allowed = THIRD_PARTY.get(part, {"torch"})
        for line, dotted in _imported(module):
            top = dotted.split(".")[0]
            if top not in stdlib and top != "amped" and top not in allowed:
                foreign.append(f"{module.path.relative_to(PACKAGE)}:{line} imports {dotted}")
    assert not foreign, "imports outside the layer's dependencies:\n" + "\n".join(foreign)


NAMES = {m.name.removesuffix(".__init__") for m in MODULES} | {"amped"}


def _module_graph() -> dict[str, set[str]]:
    """Module -> the amped modules it imports (a package counts as its ``__init__``)."""
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        name = module.name.removesuffix(".__init__")
        targets = graph.setdefault(name, set())
        for _, dotted in _imported(module):
            if dotted.split(".")[0] != "amped":
                continue
            while dotted not in NAMES:  # ``from pkg import Name``: the package
                dotted = dotted.rpartition(".")[0]
            if dotted != name:
                targets.add(dotted)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _package_edges_removed(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    # A package's __init__ importing its own submodules, which import names back from
    # the package's other modules through it, is how Python packages re-export: an edge
    # from a submodule to its own package is kept only if the package is not above it.
    return {
        node: {t for t in targets if not node.startswith(t + ".")}
        for node, targets in graph.items()
    }


def test_no_import_cycles():
    cycles = _cycles(_package_edges_removed(_module_graph()))
    assert not cycles, "modules that import each other in a cycle:\n" + "\n".join(
        " <-> ".join(group) for group in cycles
    )


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _is_private(dotted: str) -> bool:
    """``torch._C``, ``torch.utils._pytree.tree_map``, ``grad_scaler._refresh...``:
    any segment after ``torch`` with a leading underscore, dunders aside."""
    return any(
        part.startswith("_") and not (part.startswith("__") and part.endswith("__"))
        for part in dotted.split(".")[1:]
    )


def _torch_aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the torch object it is bound to, from the module's imports."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    local = alias.asname or alias.name.split(".")[0]
                    aliases[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.split(".")[0] != "torch":
                continue
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    # Names bound by assignment to a torch object (``compiler = torch.compiler``), to a
    # fixed point: their attributes are that object's.
    changed = True
    while changed:
        changed = False
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
                continue
            target, chain = node.targets[0], _dotted(node.value)
            if isinstance(target, ast.Name) and chain and chain[0] in aliases:
                bound = ".".join([aliases[chain[0]], *chain[1:]])
                if aliases.get(target.id) != bound and target.id not in aliases:
                    aliases[target.id] = bound
                    changed = True
    return aliases


def _dotted(node: ast.expr) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _private_torch_uses(module: Module) -> list[str]:
    aliases = _torch_aliases(module.tree)
    uses = []
    for node in ast.walk(module.tree):
        target = None
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
            for dotted in (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [f"{node.module}.{a.name}" for a in node.names]
            ):
                if dotted.startswith("torch.") and _is_private(dotted):
                    target = dotted
        elif isinstance(node, ast.Call) and _dotted(node.func) == ["getattr"] and node.args:
            chain = _dotted(node.args[0])
            name = node.args[1] if len(node.args) > 1 else None
            if chain and chain[0] in aliases and isinstance(name, ast.Constant):
                target = ".".join([aliases[chain[0]], *chain[1:], str(name.value)])
                target = target if _is_private(target) else None
        if target:
            uses.append(f"{module.path.relative_to(PACKAGE)}:{node.lineno} uses {target}")
    for node in ast.walk(module.tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = _dotted(node)
        if chain and chain[0] in aliases:
            dotted = ".".join([aliases[chain[0]], *chain[1:]])
            if _is_private(dotted):
                uses.append(f"{module.path.relative_to(PACKAGE)}:{node.lineno} uses {dotted}")
    return uses


def _outermost_only(uses: list[str]) -> list[str]:
    """``torch._C._nn.linear`` is also seen as ``torch._C._nn`` and ``torch._C``: keep the
    longest chain per line."""
    kept = []
    for use in sorted(set(uses), key=len, reverse=True):
        if not any(other.startswith(use + ".") for other in kept):
            kept.append(use)
    return sorted(kept)


def test_private_torch_apis_are_used_only_in_torch_compat():
    uses = []
    for module in MODULES:
        if module.name != TORCH_COMPAT:
            uses += _private_torch_uses(module)
    uses = _outermost_only(uses)
    assert not uses, (
        "private torch APIs outside amped/_internal/torch_compat.py (wrap each there, in "
        "the section of its layer):\n" + "\n".join(uses)
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import torch\ntorch._C._nn.linear", ["torch._C._nn.linear"]),
        ("import torch\ntorch.nn.functional.linear", []),
        ("import torch\ntorch.__version__", []),
        ("import torch._dynamo", ["torch._dynamo"]),
        ("from torch.utils._pytree import tree_map", ["torch.utils._pytree.tree_map"]),
        (
            "from torch.amp import grad_scaler\ngrad_scaler._refresh_per_optimizer_state()",
            ["torch.amp.grad_scaler._refresh_per_optimizer_state"],
        ),
        ("import torch as t\nx: t._ops.OpOverload", ["torch._ops.OpOverload"]),
        ("import torch\ngetattr(torch._C, '_fft')", ["torch._C._fft"]),
        ("import torch\ngetattr(torch, 'float8_e4m3fn')", []),
        ("x = object()\nx._private", []),
        (
            "import torch\nc = torch.compiler\nc._is_compiling_flag",
            ["torch.compiler._is_compiling_flag"],
        ),
        (
            "from torch.nn.modules import module\nm = module\nm._global_forward_hooks",
            ["torch.nn.modules.module._global_forward_hooks"],
        ),
    ],
)
def test_the_private_api_check_sees_every_spelling(source, expected):
    module = Module("amped.scaling.example", PACKAGE / "scaling" / "example.py", ast.parse(source))
    found = [use.split(" uses ")[1] for use in _outermost_only(_private_torch_uses(module))]
    assert found == expected


def test_the_layer_check_sees_relative_and_root_imports():
    source = "from ..cli import main\nfrom amped import autocast\nfrom . import casting\n"
    module = Module("amped.scaling.example", PACKAGE / "scaling" / "example.py", ast.parse(source))
    reached = [(dotted, _layer_of(dotted)) for _, dotted in _imported(module)]
    assert reached == [
        ("amped.cli.main", LAYERS.index("cli")),
        ("amped.autocast", FACE["__init__"]),
        ("amped.scaling.casting", LAYERS.index("scaling")),
    ]
