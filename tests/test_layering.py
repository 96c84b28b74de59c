"""The package layering (docs/architecture.md), checked on the source with `ast`.

- recxla.pipeline drives the sharded module only through its public surface: no attribute
  whose name starts with one underscore is read on anything but `self`/`cls`.
- The lower layers never import the layers above them, not even inside a function: recxla.ops
  nothing of recxla.distributed and up, recxla.distributed nothing of recxla.torchrec and up,
  recxla.torchrec / recxla.planner nothing of recxla.pipeline / recxla.train.
- recxla.reference is the tests' oracle: no module of recxla outside it imports it (the
  package's own modules and recxla.triton_kernels, i.e. triton_kernels/, included).
- recxla.data imports no other part of recxla.
- No import cycles between recxla's modules, counting imports inside functions too (not those
  under `if TYPE_CHECKING:`, which never run): every cycle found is listed, with the lines.
"""

import ast
import functools
from pathlib import Path
from typing import Dict, List, NamedTuple, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1] / "recxla"
# setup.py installs triton_kernels/ as recxla.triton_kernels.
PACKAGE_DIRS = ((ROOT, "recxla"), (ROOT.parent / "triton_kernels", "recxla.triton_kernels"))

# Underscore names that are public API of the object they are read on, not private state:
# collections.namedtuple's methods are spelled with an underscore so that they cannot clash
# with field names (batch_fields.py reads NamedTuple batches through them).
PUBLIC_UNDERSCORE_NAMES = {"_asdict", "_replace", "_fields", "_make"}

PIPELINE_AND_UP = ("recxla.pipeline", "recxla.train")
# Per lower package, the packages above it that it must not import.
UPPER_LAYERS = {
    "ops": ("recxla.distributed", "recxla.torchrec", "recxla.planner") + PIPELINE_AND_UP,
    "distributed": ("recxla.torchrec", "recxla.planner") + PIPELINE_AND_UP,
    "torchrec": PIPELINE_AND_UP,
    "planner": PIPELINE_AND_UP,
}


def _sources(package: str):
    return sorted((ROOT / package).rglob("*.py"))


def private_reads(path: Path):
    """(line, expression) of every `x._name` in the file with x not `self`/`cls`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") \
                or name in PUBLIC_UNDERSCORE_NAMES:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append((node.lineno, ast.unparse(node)))
    return found


def upward_imports(path: Path, upper=PIPELINE_AND_UP):
    """(line, module) of every import of one of the `upper` packages in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if any(name == up or name.startswith(up + ".") for up in upper):
                found.append((node.lineno, name))
                break
    return found


def test_checks_see_what_they_look_for(tmp_path):
    source = tmp_path / "example.py"
    source.write_text("def f(module, self):\n"
                      "    self._ok = module.public\n"
                      "    return module._router.start(), module.__class__, batch._asdict()\n"
                      "def g():\n"
                      "    from recxla.pipeline.micro_batches import even_sizes\n"
                      "    import recxla.train.loop\n"
                      "    from recxla import pipeline\n"
                      "    from recxla.torchrec import input_dist\n")
    assert private_reads(source) == [(3, "module._router")]
    assert upward_imports(source) == [(5, "recxla.pipeline.micro_batches"),
                                      (6, "recxla.train.loop"), (7, "recxla.pipeline")]


@pytest.mark.parametrize("path", _sources("pipeline"), ids=lambda p: p.name)
def test_pipeline_reads_no_private_attribute(path):
    reads = private_reads(path)
    assert not reads, (f"{path.relative_to(ROOT.parent)} reads private attributes {reads}: "
                       "give the object a public method or property for what it needs")


@pytest.mark.parametrize("package", sorted(UPPER_LAYERS))
def test_lower_layers_do_not_import_upper_ones(package):
    upper = UPPER_LAYERS[package]
    offenders = {str(path.relative_to(ROOT.parent)): found for path in _sources(package)
                 if (found := upward_imports(path, upper))}
    assert not offenders, f"recxla.{package} imports {upper}: {offenders}"


# ---------------------------------------------------------------------------------------------
# The module graph: every import of a recxla module, resolved to the module it loads


class Import(NamedTuple):
    line: int
    target: str  # the recxla module (or package) the statement loads
    guarded: bool  # under `if TYPE_CHECKING:`: never runs


def find_modules(package_dirs=PACKAGE_DIRS) -> Dict[str, Path]:
    """Dotted module name -> source file, for every .py file under the package folders."""
    modules = {}
    for folder, prefix in package_dirs:
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([prefix] + parts)] = path
    return modules


@functools.lru_cache(maxsize=None)
def _bound_names(path: Path) -> frozenset:
    """Names a package's __init__ binds at its top level (imports, assignments, defs)."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return frozenset(names)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """(node, guarded) for every import statement, at any depth."""
    stack = [(tree, False)]
    while stack:
        node, guarded = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, guarded
        for child in ast.iter_child_nodes(node):
            inside = guarded or (isinstance(node, ast.If) and _is_type_checking(node.test)
                                 and child in node.body)
            stack.append((child, inside))


def module_imports(name: str, modules: Dict[str, Path]) -> List[Import]:
    """The recxla modules that module `name` imports, with the line of each statement.

    `from package import x` loads package.x when that is a module; a name the package's
    __init__ does not bind (and no module `__getattr__` provides) is a submodule too, e.g. the
    compiled `recxla._C`, a leaf of the graph.
    """
    path = modules[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node, guarded in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules or base not in modules:
                    targets.append(sub if sub in modules else base)
                    continue
                init = modules[base]
                bound = _bound_names(init) if init.name == "__init__.py" else {alias.name}
                is_attribute = alias.name in bound or "__getattr__" in bound
                targets.append(base if is_attribute or alias.name == "*" else sub)
        found += [Import(node.lineno, target, guarded) for target in targets
                  if (target == "recxla" or target.startswith("recxla.")) and target != name]
    return sorted(set(found))


def import_graph(modules: Dict[str, Path]) -> Dict[str, List[Import]]:
    return {name: module_imports(name, modules) for name in modules}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def import_cycles(graph: Dict[str, List[Import]], limit: int = 200) -> List[str]:
    """Every elementary cycle of the graph's runtime imports (guarded ones left out), at most
    `limit`, each as "a (line 3) -> b (lines 7, 9) -> a": module a imports b on line 3, b
    imports a on lines 7 and 9. Each cycle starts at its smallest module.

    Found per strongly connected component (Tarjan), then enumerated by a search from each
    member through the members after it (each cycle once)."""
    edges: Dict[str, Dict[str, List[int]]] = {}
    for module, imports in graph.items():
        for imp in imports:
            if not imp.guarded and imp.target in graph:
                edges.setdefault(module, {}).setdefault(imp.target, []).append(imp.line)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack = set()
    components = []

    def connect(v):  # recursion depth: the longest import chain, far below the limit
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, {})):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for component in sorted(components, key=min):
        members = sorted(component)
        for i, start in enumerate(members):
            allowed = set(members[i:])
            path = [start]

            def extend(v):
                for w in sorted(edges.get(v, {})):
                    if len(cycles) >= limit:
                        return
                    if w == start:
                        cycles.append(list(path))
                    elif w in allowed and w not in path:
                        path.append(w)
                        extend(w)
                        path.pop()

            extend(start)
    def step(a, b):
        lines = edges[a][b]
        return f"{a} (line{'s' if len(lines) > 1 else ''} {', '.join(map(str, lines))})"

    return [" -> ".join([step(a, b) for a, b in zip(cycle, cycle[1:] + cycle[:1])] + cycle[:1])
            for cycle in cycles]


def foreign_imports(graph, package: str, allowed: Tuple[str, ...] = ()) -> Dict[str, list]:
    """module -> [(line, target)] for the modules inside `package` that import recxla modules
    outside it (other than those inside `allowed`)."""
    offenders = {}
    for module, imports in graph.items():
        if not _within(module, package):
            continue
        bad = [(i.line, i.target) for i in imports if not _within(i.target, package)
               and not any(_within(i.target, a) for a in allowed)]
        if bad:
            offenders[module] = bad
    return offenders


def importers_of(graph, package: str) -> Dict[str, list]:
    """module -> [(line, target)] for the modules outside `package` that import it."""
    return {module: bad for module, imports in graph.items() if not _within(module, package)
            and (bad := [(i.line, i.target) for i in imports if _within(i.target, package)])}


@pytest.fixture(scope="module")
def graph():
    return import_graph(find_modules())


def test_graph_sees_what_it_looks_for(tmp_path):
    pkg = tmp_path / "recxla"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from recxla.a import f\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\n"
                              "from recxla import _C, b\n"
                              "if TYPE_CHECKING:\n"
                              "    from recxla.sub import c\n"
                              "def f():\n"
                              "    return 1\n")
    (pkg / "b.py").write_text("def g():\n"
                              "    from recxla import f\n")  # a name the __init__ binds
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from . import d\nfrom ..a import f\n")
    (pkg / "sub" / "d.py").write_text("import recxla.sub.c\n")
    modules = find_modules(((pkg, "recxla"),))
    g = import_graph(modules)
    assert g["recxla.a"] == [Import(2, "recxla._C", False), Import(2, "recxla.b", False),
                             Import(4, "recxla.sub.c", True)]
    assert g["recxla.b"] == [Import(2, "recxla", False)]
    assert g["recxla.sub.c"] == [Import(1, "recxla.sub.d", False), Import(2, "recxla.a", False)]
    assert import_cycles(g) == [
        "recxla (line 1) -> recxla.a (line 2) -> recxla.b (line 2) -> recxla",
        "recxla.sub.c (line 1) -> recxla.sub.d (line 1) -> recxla.sub.c",
    ]
    assert foreign_imports(g, "recxla.sub") == {"recxla.sub.c": [(2, "recxla.a")]}
    assert importers_of(g, "recxla.sub") == {"recxla.a": [(4, "recxla.sub.c")]}


def test_reference_is_imported_by_nothing_but_itself(graph):
    """recxla.reference is the tests' oracle; production code imports the contracts and its
    own torch paths from recxla.ops (docs/architecture.md)."""
    offenders = importers_of(graph, "recxla.reference")
    assert not offenders, f"these modules import recxla.reference, the tests' oracle: {offenders}"


def test_data_imports_no_other_recxla_package(graph):
    offenders = foreign_imports(graph, "recxla.data")
    assert not offenders, f"recxla.data imports other parts of recxla: {offenders}"


def test_no_import_cycles(graph):
    cycles = import_cycles(graph)
    listed = "".join(f"\n  {cycle}" for cycle in cycles)
    assert not cycles, f"{len(cycles)} import cycle(s) between recxla's modules:{listed}"


# The modules of recxla that the kernels may import: leaves that import nothing of recxla.
KERNEL_LEAVES = ("recxla.formats", "recxla.cluster_hash", "recxla.copy_runs_layout")


def test_kernels_are_leaves():
    """triton_kernels/ (recxla.triton_kernels) imports nothing of recxla but each other and
    KERNEL_LEAVES (the wire formats, the clustering hash, the runs), which import nothing of
    recxla: the ops call the kernels, never the other way round."""
    graph = import_graph(find_modules())
    offenders = {name: [(i.line, i.target) for i in imports
                        if not i.target.startswith("recxla.triton_kernels")
                        and i.target not in KERNEL_LEAVES]
                 for name, imports in graph.items() if name.startswith("recxla.triton_kernels")}
    offenders = {name: found for name, found in offenders.items() if found}
    assert not offenders, f"kernels import more of recxla than its leaves: {offenders}"
    for leaf in KERNEL_LEAVES:
        assert not graph[leaf], f"{leaf} is a leaf and imports {graph[leaf]}"
