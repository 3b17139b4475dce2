"""Every import inside cbkit runs down the layers declared in `LAYERS` (below), and no two modules import each
other, directly or round a loop; imports inside functions count the same as those at the top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import cbkit

PACKAGE = Path(cbkit.__file__).parent

# The layers, bottom first: a module imports from its own layer or the ones below, never above
# (this test checks every import; docs/ARCHITECTURE.md draws them).
LAYERS = (
    ("foundation", ("cbkit", "cbkit.jsonl", "cbkit.telemetry")),
    ("tasks", ("cbkit.tasks",)),
    ("models", ("cbkit.models",)),
    ("rollout", ("cbkit.rollout",)),
    ("train", ("cbkit.train",)),
    ("measure", ("cbkit.measure",)),
    ("trl", ("cbkit.trl",)),
    ("viz", ("cbkit.viz",)),
    ("teach", ("cbkit.teach",)),
    ("entry", ("cbkit.cli",)),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def cbkit_imports(path: Path) -> set[str]:
    """The cbkit modules a file imports, resolved to modules (``from cbkit.x import y`` counts ``cbkit.x.y``
    when that is a module, else ``cbkit.x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "cbkit":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "cbkit"}
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
GRAPH = {m: {d for d in cbkit_imports(p) if d != m} for m, p in MODULES.items()}


def layer_of(module: str) -> int:
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (rank, len(prefix))
    if best is None:
        raise AssertionError(f"{module} is in no layer: add its folder to LAYERS")
    return best[0]


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_import_runs_up_a_layer(module):
    mine = layer_of(module)
    upward = sorted(d for d in GRAPH[module] if layer_of(d) > mine)
    assert not upward, (f"{module} ({LAYERS[mine][0]}) imports {upward} from a layer above; move the shared "
                        "piece down, or the caller up")


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_loop_and_passes_a_tree():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_few_modules_sit_at_the_top():
    top = sorted(m for m, p in MODULES.items() if p.parent == PACKAGE and m != "cbkit")
    assert len(top) <= 8, top


def test_names_are_imported_from_their_home_not_from_a_module_that_re_exported_them():
    """`cbkit.rollout.continuous` is the CB backend; the engine's settings live in `engine_config` and the engine in
    `engine`, with no alias left behind (cbkit keeps none). Nothing in the package, the tests, the notebooks or the
    scripts imports anything but `ContinuousBackend` from it."""
    import json

    repo = PACKAGE.parent
    wrong = []
    for path in [*PACKAGE.rglob("*.py"), *(repo / "tests").glob("*.py"), *(repo / "scripts").rglob("*.py"),
                 *(repo / "notebooks").glob("*.ipynb")]:
        text = path.read_text()
        if path.suffix == ".ipynb":  # its code cells, without the shell and magic lines
            cells = ["".join(c["source"]) for c in json.loads(text)["cells"] if c["cell_type"] == "code"]
            text = "\n".join(x for x in "\n".join(cells).splitlines() if not x.lstrip().startswith(("!", "%")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module == "cbkit.rollout.continuous":
                names = {a.name for a in node.names} - {"ContinuousBackend"}
                if names:
                    wrong.append(f"{path.relative_to(repo)}: {sorted(names)}")
    assert not wrong, "import these from cbkit.rollout.engine_config or cbkit.rollout.engine: " + "; ".join(wrong)
