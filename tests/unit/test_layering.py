"""The package's layering, checked over every import statement of ``pscluster/``.

Layers, lowest first: base (errors, environ, spec, task_config, footprint) → runtime → metrics → views (widgets) →
control plane (cluster) → front (the package, magics, labserver and the other top-level modules). A module
imports its own layer and the layers below it, never above; every import counts: module level, inside
functions and under ``if TYPE_CHECKING:``. No import cycle between modules, no two modules of one name,
importing the runtime (code that runs on engines) loads nothing of IPython, Jupyter, ipyparallel or plotly, and
the layout in the maintainers' documentation (``docs/maintainers.md``) lists every module.
"""

import ast
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pscluster"
BASE = {"pscluster.errors", "pscluster.environ", "pscluster.spec", "pscluster.task_config", "pscluster.footprint"}
LAYERS = ("base", "runtime", "metrics", "views", "control plane", "front")
PACKAGES = {"pscluster.runtime": 1, "pscluster.metrics": 2, "pscluster.widgets": 3, "pscluster.cluster": 4}
FORBIDDEN = ("IPython", "ipyparallel", "ipywidgets", "ipykernel", "jupyter", "anywidget", "plotly")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    if module in BASE:
        return 0
    for package, level in PACKAGES.items():
        if module == package or module.startswith(package + "."):
            return level
    return 5


def imports(module: str) -> list[tuple[str, int]]:
    """``(imported pscluster module, line)`` of every import statement in ``module``, wherever it stands."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:  # `from x import y` where y is a submodule: an edge to the submodule
                found.append((f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source,
                              node.lineno))
    return [(target, line) for target, line in found if target == "pscluster" or target.startswith("pscluster.")]


EDGES = {module: imports(module) for module in MODULES}


def test_every_import_goes_to_the_same_layer_or_below():
    offending = [f"{a} -> {b} (line {line}): {LAYERS[layer(a)]} imports {LAYERS[layer(b)]}"
                 for a, edges in EDGES.items() for b, line in edges if layer(b) > layer(a)]
    assert not offending, "imports up the layers:\n" + "\n".join(offending)


def test_views_import_no_runtime_nor_control_plane():
    offending = [f"{a} -> {b} (line {line})" for a, edges in EDGES.items() if layer(a) == 3
                 for b, line in edges if layer(b) in (1, 4)]
    assert not offending, "views read the run store and the objects handed to them:\n" + "\n".join(offending)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first search, iterative)."""
    state = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if root in state:
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            child = next(stack[-1], None)
            if child is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif child not in state:
                state[child] = 1
                path.append(child)
                stack.append(iter(sorted(graph.get(child, ()))))
    return None


def test_no_import_cycle():
    graph = defaultdict(set)
    for a, edges in EDGES.items():
        graph[a] |= {b for b, _ in edges if b != a}
    cycles = []
    while (cycle := find_cycle(graph)) is not None:  # report each cycle, then break it to look for more
        cycles.append(" -> ".join(cycle))
        graph[cycle[-2]].discard(cycle[-1])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_find_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_two_modules_share_a_name():
    """Names compared without a plural ``s``: ``checkpoint.py`` and ``checkpoints.py`` are one name; a
    package's folder is a module name too."""
    owners = defaultdict(list)
    for module in MODULES:
        if module != "pscluster" and not module.endswith(".__main__"):
            owners[module.rpartition(".")[2].removesuffix("s")].append(module)
    shared = [", ".join(modules) for modules in owners.values() if len(modules) > 1]
    assert not shared, "modules sharing a name:\n" + "\n".join(shared)


PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def test_runtime_imports_no_notebook_or_control_plane_modules():
    runtime = [m for m in MODULES if layer(m) == 1 and not m.endswith(".__main__")]
    assert len(runtime) > 10
    # A fresh interpreter: this test process has IPython loaded already.
    done = subprocess.run([sys.executable, "-c", PROBE, *runtime], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    offending = sorted(m for m in loaded if m.startswith(FORBIDDEN))
    assert not offending, f"importing the runtime loaded {offending}"
    assert "torch" in loaded and "zmq" in loaded  # the probe did import the runtime


def test_the_side_panel_s_server_extension_loads_no_torch():
    """JupyterLab imports the server extension at its start: torch (seconds of CPU) waits until a kernel wants it."""
    done = subprocess.run([sys.executable, "-c", PROBE, "pscluster.labserver"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout))
    assert "pscluster" in loaded and "tornado" in loaded and "torch" not in loaded


def test_documented_layout_lists_every_module():
    """The layout in ``docs/maintainers.md`` names every module of the package, each where it is, and no other (a
    subpackage's folder stands for its ``__init__.py``)."""
    page = (PACKAGE.parent / "docs" / "maintainers.md").read_text()
    block = page.split("## Layout", 1)[1].split("```", 2)[1]
    listed, folders = set(), []
    for line in block.splitlines():
        name = line.strip().split(" ", 1)[0]
        if not name:
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        del folders[depth:]
        if name.endswith("/"):
            folders.append(name)
        elif name.endswith(".py"):
            listed.add("".join(folders) + name)
    on_disk = {str(p.relative_to(PACKAGE.parent)) for p in MODULES.values()
               if p.name != "__init__.py" or p.parent == PACKAGE}
    assert listed == on_disk, (f"not in docs/maintainers.md's layout: {sorted(on_disk - listed)}; "
                               f"listed but absent: {sorted(listed - on_disk)}")
