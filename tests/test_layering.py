"""The package layering (docs/architecture.md), checked on the source with `ast`.

- recxla.pipeline drives the sharded module only through its public surface: no attribute
  whose name starts with one underscore is read on anything but `self`/`cls`.
- The lower layers never import the layers above them, not even inside a function: recxla.ops
  nothing of recxla.distributed and up, recxla.distributed nothing of recxla.torchrec and up,
  recxla.torchrec / recxla.planner nothing of recxla.pipeline / recxla.train.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "recxla"

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
