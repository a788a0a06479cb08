"""The package graph in docs/architecture.md, checked on the source: each package imports
only the packages it declares (``ALLOWED``), no modules import each other in a cycle,
and every use of a private torch API is in ``amped/_internal/torch_compat.py``.

Imports are read with ``ast``, so lazy imports inside functions and imports under
``TYPE_CHECKING`` count too: each is a dependency on that package all the same.
"""

from __future__ import annotations

import ast
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "amped"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"

_LIBRARY_BASE = {"_internal", "policy", "autocast_mode", "checkpoint", "scaling", "optim", "lowp"}

ALLOWED: dict[str, set[str]] = {
    "_internal": set(),
    "policy": {"_internal"},
    "autocast_mode": {"_internal", "policy"},
    "checkpoint": {"_internal"},
    "scaling": {"_internal", "checkpoint"},
    "optim": {"_internal"},
    "lowp": {"_internal", "autocast_mode"},
    "fp8": {"lowp"},
    "recipes": _LIBRARY_BASE,
    "tasks": _LIBRARY_BASE | {"recipes"},
    "doctor": _LIBRARY_BASE | {"recipes", "tasks"},
    "tuning": _LIBRARY_BASE | {"recipes", "tasks", "doctor"},
    "comparison": _LIBRARY_BASE | {"recipes", "tasks", "doctor", "tuning"},
    "verification": _LIBRARY_BASE | {"recipes", "tasks"},
    "exporting": _LIBRARY_BASE | {"recipes"},
    "integrations": _LIBRARY_BASE | {"recipes", "amped"},
    "cli": _LIBRARY_BASE
    | {
        "fp8",
        "recipes",
        "tasks",
        "doctor",
        "tuning",
        "comparison",
        "verification",
        "exporting",
        "integrations",
        "amped",
    },
    "amped": _LIBRARY_BASE
    | {"recipes", "tasks", "doctor", "tuning", "comparison", "verification", "exporting"},
    "__main__": {"cli"},
}
"""Package -> the amped packages its modules may import (its own always). ``amped`` is
the root package (``amped/__init__.py``, the public face: ``import amped`` or
``from amped import <re-exported name>`` reaches it); ``__main__`` starts the CLI.
``fp8`` is the deprecated alias of ``lowp``; ``scaling`` imports ``checkpoint`` only for
the checkpoint names it still re-exports, deprecated."""

UPWARD_ALLOWED = {
    ("amped.doctor.report", "amped.cli.doctor.html"),
    ("amped.recipes.attention", "amped.integrations.transformers_attention"),
}
"""The imports against the graph, each lazy: ``Report.save_html`` imports the CLI's page
renderer when called (its plot needs matplotlib, which only the CLI may import);
``prepare(..., attention=...)`` imports the transformers attention conversion when the
model is a transformers model (its registry needs transformers, which only the
integrations may import)."""

THIRD_PARTY: dict[str, set[str]] = {
    "integrations": {"torch", "lightning", "pytorch_lightning", "accelerate", "transformers"},
    "cli": {"torch", "rich", "matplotlib"},
    "verification": {"torch", "torchao", "transformer_engine"},
    # the file format, and the independent reader of the check (both imported when called)
    "exporting": {"torch", "safetensors", "compressed_tensors"},
}
"""Third-party packages each package may import; every other package: torch alone."""

TORCH_COMPAT = "amped._internal.torch_compat"


@dataclass(frozen=True)
class Module:
    name: str  # dotted, e.g. "amped.scaling.grad_scaler"; "amped.__init__" for the root
    path: Path
    tree: ast.Module

    @property
    def top(self) -> str:
        """The package whose rules apply: ``amped.lowp.mx.block_cast`` -> ``lowp``."""
        part = self.name.split(".")[1]
        return "amped" if part == "__init__" else part

    @property
    def package(self) -> str:
        return self.name if self.path.name == "__init__.py" else self.name.rpartition(".")[0]


def _module(path: Path, root: Path) -> Module:
    parts = path.relative_to(root.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    if name == "amped":
        name = "amped.__init__"
    return Module(name, path, ast.parse(path.read_text(), filename=str(path)))


def _modules(root: Path = PACKAGE) -> list[Module]:
    return [_module(path, root) for path in sorted(root.rglob("*.py"))]


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


def _where(module: Module) -> str:
    """The module's path inside the ``amped`` folder: ``optim/fused.py``."""
    parts = module.path.parts
    return "/".join(parts[len(parts) - parts[::-1].index("amped") :])


def _package_of(dotted: str, packages: set[str]) -> str | None:
    """The package an ``amped...`` import reaches: ``amped.lowp.cast`` -> ``lowp``;
    ``import amped`` or a name the root re-exports (``from amped import autocast``) ->
    ``amped``; None for anything outside amped."""
    parts = dotted.split(".")
    if parts[0] != "amped":
        return None
    if len(parts) == 1 or parts[1] not in packages:
        return "amped"
    return parts[1]


def forbidden_edges(modules: list[Module]) -> list[str]:
    """Every import of an amped package its importer does not declare in ``ALLOWED``, and
    every module in a package ``ALLOWED`` does not know."""
    packages = {m.top for m in modules} - {"amped"}
    found = []
    for module in modules:
        if module.top not in ALLOWED:
            found.append(f"{module.path.name}: package {module.top!r} is not in ALLOWED")
            continue
        for line, dotted in _imported(module):
            reached = _package_of(dotted, packages)
            if (module.name, dotted.rpartition(".")[0]) in UPWARD_ALLOWED:
                continue
            if reached is None or reached == module.top or reached in ALLOWED[module.top]:
                continue
            found.append(f"{_where(module)}:{line} imports {dotted} ({module.top} -> {reached})")
    return found


def test_every_package_is_declared():
    unknown = sorted({m.top for m in MODULES} - set(ALLOWED))
    assert not unknown, (
        f"packages not in ALLOWED (add them, and to docs/architecture.md): {unknown}"
    )


def test_every_import_is_a_declared_edge():
    found = forbidden_edges(MODULES)
    assert not found, "imports outside the declared package graph:\n" + "\n".join(found)


def test_the_declared_graph_has_no_cycle():
    graph = {package: set(targets) - {package} for package, targets in ALLOWED.items()}
    assert _cycles(graph) == []


@pytest.fixture(scope="module")
def source_copy(tmp_path_factory) -> tuple[Path, list[Module]]:
    """A copy of ``src/amped`` and its modules, which pass the check."""
    copy = tmp_path_factory.mktemp("src") / "amped"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    modules = _modules(copy)
    assert forbidden_edges(modules) == [] and foreign_imports(modules) == []
    return copy, modules


@pytest.mark.parametrize(
    ("package", "planted"),
    [
        ("optim", "from amped.recipes import prepare"),
        ("lowp", "import amped.scaling.grad_scaler"),
        ("checkpoint", "from amped import autocast"),
        ("tuning", "from ..cli import main"),
        ("doctor", "import rich"),  # a third-party edge, checked below
    ],
)
def test_a_planted_forbidden_import_fails_the_check(source_copy, package, planted):
    """A copy of the source with one forbidden import added: the check finds exactly it."""
    copy, modules = source_copy
    path = copy / package / "planted.py"
    path.write_text(f"{planted}\n")
    modules = [*modules, _module(path, copy)]
    path.unlink()
    found = forbidden_edges(modules) + foreign_imports(modules)
    assert len(found) == 1 and found[0].startswith(f"{package}/planted.py:1 imports")


def _docs_table() -> dict[str, set[str]]:
    """The "may import" column of docs/architecture.md's package table."""
    table = {}
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`[\w.]+`", cells[0]):
            allowed = set(re.findall(r"`([\w.]+)`", cells[2]))
            table[cells[0].strip("`")] = allowed
    return table


def test_docs_architecture_shows_the_same_graph():
    documented = _docs_table()
    assert set(documented) == set(ALLOWED)
    for package, targets in ALLOWED.items():
        assert documented[package] == targets, f"{package}: docs say {documented[package]}"


def foreign_imports(modules: list[Module]) -> list[str]:
    """Imports of a third-party package the importer's package may not use."""
    stdlib = sys.stdlib_module_names
    found = []
    for module in modules:
        allowed = THIRD_PARTY.get(module.top, {"torch"})
        for line, dotted in _imported(module):
            top = dotted.split(".")[0]
            if top not in stdlib and top != "amped" and top not in allowed:
                found.append(f"{_where(module)}:{line} imports {dotted}")
    return found


def test_the_core_depends_on_torch_alone():
    found = foreign_imports(MODULES)
    assert not found, "imports outside the package's dependencies:\n" + "\n".join(found)


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


def test_the_import_reader_sees_relative_and_root_imports():
    source = "from ..cli import main\nfrom amped import autocast\nfrom . import casting\n"
    module = Module("amped.scaling.example", PACKAGE / "scaling" / "example.py", ast.parse(source))
    packages = {m.top for m in MODULES} - {"amped"}
    reached = [(dotted, _package_of(dotted, packages)) for _, dotted in _imported(module)]
    assert reached == [
        ("amped.cli.main", "cli"),
        ("amped.autocast", "amped"),
        ("amped.scaling.casting", "scaling"),
    ]
