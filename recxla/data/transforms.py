"""Last-mile feature engineering at read time: user functions over Arrow record batches of a
table's raw columns, run by the reader (in its worker processes or Ray tasks) after the
feature tables are joined and before ids are mapped to rows.

A transform is named "module:function" (an importable module, e.g. one next to the job's
working folder) or "path/to/file.py:function". It is called as `function(batch)` with a
`pyarrow.RecordBatch` of every column (the table's and the joined ones; strings as `string`,
lists as `list`, from Parquet and Iceberg alike) and returns a
`pyarrow.RecordBatch` or `pyarrow.Table`: the same columns with some derived (bucketize a float
into an id, hash-cross two ids, truncate a sequence), columns dropped, rows filtered out. Several
are applied in the order given. The columns it returns take their roles (label, dense, sparse
feature with a table of its own) by the rules of a conversion (docs/your-data.md), or from the
schema file.

A transform must be a function of its batch alone (no state kept between calls, randomness
drawn from the rows, e.g. a hash of an id): the reader runs it once to plan the epoch (rows
per unit, vocabularies) and again on every read, in whichever process reads, and a different
result the second time is an error, not another batch. Its identity (name and a digest of its
module's source and of the job's own modules it uses at module level) is part of the data's
fingerprint, so a job resumed with an edited transform, or an edited helper module of it, fails
instead of reading other rows. A transform that raises, or calls sys.exit, is an error naming
it: it never ends the job quietly.
"""

import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import site
import sys
from typing import List, Optional, Sequence, Tuple

import pyarrow as pa

OP = "recxla.data.transforms"


class TransformError(ValueError):
    """A transform raised, or returned something other than a RecordBatch or Table."""


class Transform:
    """A loaded transform: `name` ("module:function"), `fn`, and `digest` (of its module's
    source, or of its code when there is none). Picklable: a worker process loads the
    function again by its name (or file), so it need not be importable by pickle."""

    def __init__(self, name: str):
        self.name = name
        self.fn, self.file = _load(name)
        self.digest = _digest(self.fn)

    def __call__(self, batch: pa.RecordBatch, where: str) -> pa.Table:
        try:
            out = self.fn(batch)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - user code, named and re-raised
            raise TransformError(f"{OP}: transform {self.name} raised on {where}: "
                                 f"{type(e).__name__}: {e}") from e
        if isinstance(out, pa.RecordBatch):
            return pa.Table.from_batches([out])
        if isinstance(out, pa.Table):
            return out
        raise TransformError(f"{OP}: transform {self.name} returned {type(out).__name__} on "
                             f"{where}; a transform returns a pyarrow.RecordBatch or "
                             "pyarrow.Table")

    def __getstate__(self):
        return {"name": self.name, "file": self.file, "digest": self.digest}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.fn, _ = _load(self.name, state["file"])


def _load(name: str, file: Optional[str] = None):
    """(the function, the file it came from) of "module:function" or "file.py:function".
    `file`: where the module was found before (a worker process that cannot import it by
    name, e.g. one started in another folder, loads it from there)."""
    if not isinstance(name, str) or ":" not in name:
        raise ValueError(f"{OP}: a transform is named module:function or file.py:function, got "
                         f"{name!r}")
    module_name, _, attr = name.rpartition(":")
    if not module_name or not attr.isidentifier():
        raise ValueError(f"{OP}: transform {name!r}: name it module:function or "
                         "file.py:function")
    if module_name.endswith(".py"):
        # `file`: the absolute path found when first loaded (a worker may run elsewhere).
        module = _from_file(name, file or os.path.abspath(module_name))
    else:
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # a module next to the job, as `python -m` finds
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if file is None or not os.path.isfile(file):
                raise ValueError(f"{OP}: transform {name!r}: no module {module_name!r} ({e}); "
                                 "run from the folder that holds it, or name its file "
                                 "(path/to/file.py:function)") from e
            module = _from_file(name, file)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's module failed to load
            raise TransformError(f"{OP}: transform {name!r}: importing {module_name} raised "
                                 f"{type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{OP}: transform {name!r}: {module_name} has no function {attr!r}")
    return fn, getattr(module, "__file__", None)


def _from_file(name: str, path: str):
    """The module of a transform's file, loaded once per process."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{OP}: transform {name!r}: {path}: no such file")
    key = "recxla_transform_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    module = sys.modules.get(key)
    if module is None:
        spec = importlib.util.spec_from_file_location(key, path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's module failed to load
            raise TransformError(f"{OP}: transform {name!r}: loading {path} raised "
                                 f"{type(e).__name__}: {e}") from e
        sys.modules[key] = module
    return module


@functools.lru_cache(maxsize=1)
def _installed_roots() -> Tuple[str, ...]:
    """Folders of code that is not the job's own: the interpreter's library, the installed
    packages, and recxla itself."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, *site.getsitepackages(),
             site.getusersitepackages(),
             os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots if r)


def _is_user_module(module) -> bool:
    """A module of the job's own source (a transform's helper), not of an installed package."""
    path = getattr(module, "__file__", None)
    if not path or not path.endswith(".py"):
        return False
    path = os.path.realpath(path)
    return not any(path.startswith(root) for root in _installed_roots())


def _helper_modules(module) -> list:
    """The job's own modules that `module` uses at module level (`import helpers`, `from
    helpers import f`), and theirs, by name: what else decides what a transform computes."""
    found = {}
    stack = [module]
    while stack:
        for value in list(vars(stack.pop()).values()):
            owner = getattr(value, "__module__", None)
            dep = value if inspect.ismodule(value) else (
                sys.modules.get(owner) if isinstance(owner, str) else None)
            if dep is not None and dep is not module and dep.__name__ not in found \
                    and _is_user_module(dep):
                found[dep.__name__] = dep
                stack.append(dep)
    return [found[name] for name in sorted(found)]


def _digest(fn) -> str:
    """sha1 of the source of `fn`'s module (or its code, where there is no source) and of the
    job's own modules it uses (_helper_modules)."""
    module = inspect.getmodule(fn)
    helpers = _helper_modules(module) if module is not None else []
    try:
        text = inspect.getsource(module).encode()
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        text = code.co_code + repr(code.co_consts).encode() if code is not None else \
            repr(fn).encode()
    h = hashlib.sha1(text)
    for module in helpers:
        try:
            h.update(module.__name__.encode() + b"\0" + inspect.getsource(module).encode())
        except (OSError, TypeError):
            pass  # no source to read: nothing that could be edited
    return h.hexdigest()[:16]


def load_transforms(names: Sequence[str]) -> List[Transform]:
    """The transforms named, in order (ValueError / FileNotFoundError naming the one that
    cannot be loaded)."""
    return [Transform(n) for n in names]


def plain_type(t: pa.DataType) -> pa.DataType:
    """An Arrow type with its 64-bit-offset forms made plain: large_string -> string,
    large_binary -> binary, large_list<x> -> list<x> (inside lists too)."""
    if pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_large_binary(t):
        return pa.binary()
    if pa.types.is_large_list(t) or pa.types.is_list(t):
        return pa.list_(plain_type(t.value_type))
    return t


def as_batch(table: pa.Table) -> pa.RecordBatch:
    """A table's rows as one RecordBatch (what a transform is given), its columns in one set
    of types whatever the source: Iceberg's readers give large_string and large_list where
    Parquet's give string and list, and a transform written against one would fail on the
    other (plain_type)."""
    schema = pa.schema([f.with_type(plain_type(f.type)) for f in table.schema],
                       metadata=table.schema.metadata)
    if schema != table.schema:
        table = table.cast(schema)
    table = table.combine_chunks()
    batches = table.to_batches()
    if not batches:
        return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in table.schema],
                                          schema=table.schema)
    return batches[0]


def apply_transforms(transforms: Sequence[Transform], table: pa.Table, where: str) -> pa.Table:
    """`table` through every transform in order; TransformError naming the transform and
    `where` (the file and row group)."""
    for t in transforms:
        table = t(as_batch(table), where)
    return table


def identity(transforms: Sequence[Transform]) -> List[str]:
    """What the data's fingerprint holds of the transforms: name and digest, in order."""
    return [f"{t.name}#{t.digest}" for t in transforms]
