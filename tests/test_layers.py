"""The package's layers: every import between exl3rt's sub-packages points down the stack (DESIGN: format → encode
→ cache → kernels → moe → runtime → integrations → cli), and no module imports another module's underscore names.
Read from the source (ast), type-checking-only imports aside, so that a new upward import fails here, not in a
reader's head."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "exl3rt"

#: bottom to top; a unit may import only units listed before it (and itself)
LAYERS = ("util", "data", "format", "env", "encode", "cache", "convert", "kernels", "moe", "evaluation", "runtime",
          "integrations", "models", "cli", "__init__")
#: upward imports kept on purpose, each inside a function: (importer file, imported unit). None: the transformers
#: integration registers itself on import or by an explicit register() (runtime's Exl3Config only names it)
ALLOWED_UP: set = set()


def _unit(parts: tuple[str, ...]) -> str:
    return parts[0].removesuffix(".py") if parts else "__init__"


def _imports(pkg: Path = PKG):
    """(file relative to the package, imported unit, imported names) for every import of exl3rt code."""
    for f in sorted(pkg.rglob("*.py")):
        rel = f.relative_to(pkg)
        here = list(rel.with_suffix("").parts)
        tree = ast.parse(f.read_text())
        typing_only = {id(n) for node in ast.walk(tree)
                       if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in typing_only or not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = here[:-1][:len(here) - node.level] if node.level > 1 else here[:-1]
                target = base + (node.module.split(".") if node.module else [])
                if not node.module:         # from .. import env: a module, or a name of the package (its version)
                    for a in node.names:
                        if a.name == "__version__":
                            continue
                        path = pkg.joinpath(*target, a.name)
                        if path.with_suffix(".py").exists() or path.is_dir():
                            yield str(rel), _unit(tuple(target + [a.name])), [], target + [a.name]
                        else:
                            yield str(rel), _unit(tuple(target)), [a.name], target
                    continue
            elif node.module and (node.module == "exl3rt" or node.module.startswith("exl3rt.")):
                target = node.module.split(".")[1:]
            else:
                continue
            yield str(rel), _unit(tuple(target)), [a.name for a in node.names], target


def test_every_import_between_units_points_down():
    order = {u: i for i, u in enumerate(LAYERS)}
    up = []
    for rel, unit, _, _ in _imports():
        src = _unit(Path(rel).parts)
        assert src in order and unit in order, f"{rel}: unit {src!r} or {unit!r} is not in LAYERS"
        if order[unit] > order[src] and (rel, unit) not in ALLOWED_UP:
            up.append(f"{rel} imports {unit}")
    assert not up, "upward imports: " + "; ".join(sorted(set(up)))


def test_no_module_imports_another_modules_underscore_names():
    bad = []
    for rel, _, names, target in _imports():
        here = list(Path(rel).with_suffix("").parts)
        if target == here:
            continue
        bad += [f"{rel}: {'.'.join(target)}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, "private names imported: " + "; ".join(bad)


def unit_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """unit -> the units it imports (type-checking imports aside), read from the source under ``pkg``."""
    graph: dict[str, set[str]] = {}
    for rel, unit, _, _ in _imports(pkg):
        src = _unit(Path(rel).parts)
        if src != unit:
            graph.setdefault(src, set()).add(unit)
    return graph


def test_no_cycle_between_units():
    graph = unit_graph()

    def reach(a):
        seen, todo = set(), [a]
        while todo:
            for b in graph.get(todo.pop(), ()):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    cycles = sorted({tuple(sorted((a, b))) for a in graph for b in reach(a) if a != b and a in reach(b)})
    assert not cycles, f"import cycles between units: {cycles}"


if __name__ == "__main__":      # the graph docs/architecture.md shows: python tests/test_layers.py [src/exl3rt]
    import sys

    rank = {u: i for i, u in enumerate(LAYERS)}
    g = unit_graph(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else PKG)
    for a in sorted(g, key=rank.get):
        print(f"{a:<12} -> {', '.join(sorted(g[a], key=rank.get))}")
