"""The package is layered: each module imports only its own layer and the layers below,
its modules import one another without a cycle, counting imports inside functions too
(only `if TYPE_CHECKING:` blocks are left out), and no module is over 400 lines. The
layers are those of docs/design.md ("Layers and module map")."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "aotgrad"
MAX_LINES = 400

# Bottom to top, as in docs/design.md. Modules in one layer may import each other (without
# a cycle), except the two passes, which do not import each other.
LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("_jax_internals", "collector", "errors", "jit_key", "devices", "loss_scale", "targets", "xla_buffers"),
    "core IR": ("interpret", "signature", "partition.rules", "partition.costs", "partition.graph",
                "partition.zeros", "partition.shards", "partition.schedule", "partition.ties", "provenance", "trace"),
    "passes": ("partition", "partition.budget_value", "partition.flow", "partition.split", "partition.boundaries", "partition.fusion", "partition.order", "partition.peak_arrays", "partition.peak", "partition.traffic", "partition.blends", "partition.budget", "partition.scan_levels",
               "partition.vjp", "partition.named_outputs", "partition.scan", "partition.min_cut",
               "autocast", "autocast.context", "autocast.policy", "autocast.counts", "autocast.bodies", "autocast.rewrite",
               "autocast.transform"),
    "pipeline": ("config", "compilation_cache", "pipeline"),
    "runtime": ("hooks", "anomaly", "segments", "runtime", "entry"),
    "api": ("nnx", "api", "api.stages", "api.cache", "api.function", "api.fwd_bwd"),
    "tools": ("report", "export", "export.blob", "export.programs", "export.loaded", "export.build",
              "planning", "planning.place", "planning.steps", "planning.hlo_text", "planning.library_calls", "planning.async_excess", "planning.loops", "planning.measure", "planning.land", "planning.table",
              "planning.build"),
    "face": ("",),
}
INDEPENDENT = ("partition", "autocast")  # passes that must not import each other


def _modules() -> dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of the package (a package by its __init__)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its file (functions
    included, `if TYPE_CHECKING:` bodies not). `from p import m` of a module `p.m` counts
    as importing `p.m`; the parent packages Python runs first are not counted."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit_one(other)
                continue
            visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in modules else source)
        visit(node)

    visit(ast.parse(path.read_text(), str(path)))
    out = set()
    for target in found:
        while target and target not in modules:  # `import a.b.c` of a name inside a.b
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = dfs(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = dfs(node)
            if found:
                return found
    return None


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "aotgrad.api" in graph["aotgrad"]  # the face imports everything public
    assert graph["aotgrad.errors"] == set()


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "aotgrad modules import each other in a cycle: " + " -> ".join(cycle)


def test_find_cycle_reports_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _layer_of() -> dict[str, int]:
    return {("aotgrad." + m).rstrip("."): i for i, mods in enumerate(LAYERS.values()) for m in mods}


def test_every_module_has_a_layer():
    layer = _layer_of()
    missing = sorted(set(_modules()) - set(layer))
    assert not missing, (f"modules without a layer: {missing}; add each to LAYERS here and to the "
                         f"layer table of docs/design.md")
    assert not set(layer) - set(_modules()), f"LAYERS names modules that do not exist: {set(layer) - set(_modules())}"


def test_imports_go_down_the_layers():
    layer, names = _layer_of(), list(LAYERS)
    up = [f"{m} ({names[layer[m]]}) imports {t} ({names[layer[t]]})"
          for m, targets in sorted(import_graph().items()) for t in sorted(targets) if layer[t] > layer[m]]
    assert not up, "imports that go up a layer:\n" + "\n".join(up)


def test_the_passes_do_not_import_each_other():
    def pass_of(m: str) -> str | None:
        return next((p for p in INDEPENDENT if m == f"aotgrad.{p}" or m.startswith(f"aotgrad.{p}.")), None)
    across = [f"{m} imports {t}" for m, targets in sorted(import_graph().items()) for t in sorted(targets)
              if pass_of(m) and pass_of(t) and pass_of(m) != pass_of(t)]
    assert not across, "the passes import each other: " + "; ".join(across)


def test_no_module_over_the_line_limit():
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"
