"""The import graph of omni-core, contrib_stages and the plugins: its circles and the arrows that
run back up the layers. ``python tests/layering.py`` prints both; tests/test_layering.py holds
them to the budget.

Both count every import: at module level, inside a function, and those under
``if TYPE_CHECKING:`` (a dependency a type checker follows is a dependency). A *circle* is a set
of modules that import each other, directly or through others (a strongly connected component of
more than one module). An *arrow back up* is an import from a module of a lower layer
(``LAYERS``) to one of a higher layer.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Where the packages are: (import name, folder holding it).
PACKAGES = [("omni_core", ROOT)] + [
    (pkg.name, pkg.parent)
    for top in [ROOT / "contrib_stages", *sorted((ROOT / "plugins").iterdir())]
    for pkg in sorted(top.glob("omni_*")) if (pkg / "__init__.py").exists()
]

#: omni-core's layers, lowest first: a module may import its own layer and those below. A
#: module is in the layer of its longest listed prefix; the distributions built on omni-core
#: (contrib_stages, the plugins) lie above all of it.
LAYERS: list[tuple[str, ...]] = [
    ("omni_core._compat", "omni_core._version", "omni_core.errors", "omni_core.files", "omni_core.logs", "omni_core.metrics",
     "omni_core.tracing"),
    ("omni_core.options", "omni_core.registry", "omni_core.hookspecs", "omni_core.contracts",
     "omni_core.capabilities"),
    ("omni_core.plugins",),
    ("omni_core.config",),
    ("omni_core.relay", "omni_core.encoding"),
    ("omni_core.plan",),
    ("omni_core.runtime", "omni_core.kits", "omni_core.batching", "omni_core.decode_loop"),
    ("omni_core.builtin",),
    ("omni_core.testing", "omni_core.plugin_check", "omni_core.scaffold"),
    ("omni_core.serve", "omni_core.cli"),
    ("omni_core",),  # the package's own __init__: its public API, re-exported from below
]


def modules() -> dict[str, Path]:
    out = {}
    for name, folder in PACKAGES:
        for path in sorted((folder / name).rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    if not level:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports(mods: dict[str, Path]) -> set[tuple[str, str]]:
    """Every import between the modules of ``mods``: at module level, inside functions, and
    type-only ones (under ``if TYPE_CHECKING:``)."""
    every: set[tuple[str, str]] = set()
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:  # `import a.b.c` of a name inside a.b
                    target = target.rpartition(".")[0]
                if target and target != module:
                    every.add((module, target))
    return every


def circles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(found)


def layer(module: str) -> int:
    if not module.startswith("omni_core"):
        return len(LAYERS)
    best, level = "", 0
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, level = prefix, i
    return level


def arrows_up(edges: set[tuple[str, str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, b in edges if layer(b) > layer(a))


def main() -> int:
    mods = modules()
    every = imports(mods)
    found, up = circles(every), arrows_up(every)
    print(f"{len(mods)} modules, {len(every)} imports")
    print(f"{len(found)} circle(s):")
    for component in found:
        print("   ", " <-> ".join(component))
    print(f"{len(up)} arrow(s) back up:")
    for a, b in up:
        print(f"    {a} -> {b}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
