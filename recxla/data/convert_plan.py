"""What a conversion does with each column: `Plan`, from the schema file, the source's columns
and a sample of its first rows; `Plan.roles` says for every column what it became and why (the
command prints one line per column). recxla.data.convert_rows turns blocks of rows into the
layout by the plan.

Column roles when the schema does not name them (infer = true), each only where the evidence
is unambiguous:
    label       the column named "label"
    timestamp   the column named "timestamp" (integer, date or timestamp); else the one column
                of an Arrow timestamp type, if there is exactly one
    dense       float and bool columns
    sparse      integer and string columns (one id per row) and lists of them (a bag per row),
                each its own table t_<column>
    left out    anything else (lists of floats, structs, binary, a second timestamp-typed
                column, a "timestamp" of another type), with the reason
A string column of a typed source (Parquet, Iceberg, a transform's output) holds ids whatever
its values look like (zip codes such as "021" among "T8H1N"): whoever wrote it chose text. A CSV
column's type is only the reader's guess from its values, so there a string column whose
sampled values are at least half numbers but not all (one "abc" among floats) is no role at
all: an error naming the row and value, since it is either a number column with a bad value or
ids the schema should name ([sparse.<column>]). A dense column named in the schema whose values
are strings is an error naming the column (and the first value that is not a number).
An integer column inferred as ids whose ids look like a measure (recxla.data.id_counts.
flag_measures: more distinct values than half the rows) keeps its role, with a warning on its
line saying how to make it dense or keep it an id.
Missing values: a null id is no id (an empty bag for a one-id column); a null dense value is 0;
a null label or timestamp is an error.
"""

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recxla.data.parquet_layout import Layout
from recxla.data.schema import (
    DEFAULT_ROWS,
    DEFAULT_VOCAB_LIMIT,
    Schema,
    SparseSchema,
    TableSchema,
    history_table_problem,
)

OP = "recxla.data.convert"
TIMESTAMP_NAME = "timestamp"
# What pyarrow's CSV reader and float() take as a number (RE2 syntax).
_NUMBER = (r"^\s*[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|(?i:inf|infinity|nan))\s*$")


def _base(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_id(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or _is_string(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


@dataclasses.dataclass(frozen=True)
class FeaturePlan:
    name: str
    column: str
    table: str
    weights: Optional[str]
    is_list: bool
    separator: Optional[str] = None
    history_of: Optional[str] = None  # a user history of this candidate feature's items


@dataclasses.dataclass
class TablePlan:
    """A table as the schema gives it; mapping None: chosen after counting the ids."""

    name: str
    features: Tuple[str, ...]
    schema: TableSchema
    id_type: str
    weighted: bool


@dataclasses.dataclass
class Plan:
    features: List[FeaturePlan]
    tables: Dict[str, TablePlan]
    dense: List[str]
    log1p: Tuple[str, ...]
    label: str
    label_kind: str
    timestamp: Optional[str]
    left_out: List[str]
    source_types: Dict[str, pa.DataType]
    roles: List[str] = dataclasses.field(default_factory=list)  # "column 'c': role: why"
    vocab_limit: int = DEFAULT_VOCAB_LIMIT
    default_rows: int = DEFAULT_ROWS
    label_positive: Optional[object] = None  # the label's value stored as 1 (schema)
    inferred: Tuple[str, ...] = ()  # the sparse features inferred (no schema entry)

    @property
    def columns(self) -> List[str]:
        """The source columns read."""
        cols = [self.label] + ([self.timestamp] if self.timestamp else []) + self.dense
        for f in self.features:
            cols += [f.column] + ([f.weights] if f.weights else [])
        return list(dict.fromkeys(cols))

    def layout(self) -> Layout:
        return Layout(features=tuple(f.name for f in self.features), num_dense=len(self.dense),
                      weighted=any(t.weighted for t in self.tables.values()),
                      request_ids=False, timestamp=self.timestamp is not None)


def _numbers(values: pa.Array) -> np.ndarray:
    """bool [n]: which strings read as a number (null and "" as not)."""
    if len(values) == 0:
        return np.zeros(0, dtype=bool)
    got = pc.match_substring_regex(values, _NUMBER)
    return pc.fill_null(got, False).to_numpy(zero_copy_only=False)


def _check_numbers(sample: Optional[pa.Table], col: str, where: str, dense: bool) -> None:
    """ValueError naming the first value of `col` in the sample (the file's first rows) that
    is not a number, where the column is numbers but for a few (dense: for any)."""
    if sample is None or col not in sample.column_names:
        return
    values = sample.column(col).combine_chunks()
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if not _is_string(values.type):
        return
    present = pc.fill_null(pc.not_equal(values, ""), False).to_numpy(zero_copy_only=False)
    numbers = _numbers(values)
    others = present & ~numbers
    if not others.any() or not (dense or 2 * numbers.sum() >= present.sum()):
        return
    i = int(np.argmax(others))
    if dense:
        why = "the schema names it dense: every value must be a number or empty"
    else:
        why = (f"{int(numbers.sum()):,} of the first {int(present.sum()):,} values are numbers, "
               "so the column's role is unclear: fix the row if it holds numbers, or name it "
               f"in the schema ([sparse.{col}]) if it holds ids")
    raise ValueError(f"{where}: row {i + 1}: column {col!r}: {values[i].as_py()!r} is not a "
                     f"number ({why})")


def _timestamp(schema: Schema, types: Dict[str, pa.DataType], where: str, need
               ) -> Tuple[Optional[str], str, Dict[str, str]]:
    """(the timestamp column or None, why, {column: why left out} for timestamp candidates
    not taken)."""
    def fits(t):
        return pa.types.is_integer(t) or pa.types.is_timestamp(t) or pa.types.is_date(t)

    skipped: Dict[str, str] = {}
    if schema.timestamp is not None:
        tt = need(schema.timestamp, "timestamp")
        if not fits(tt):
            raise ValueError(f"{where}: column {schema.timestamp!r}: a timestamp must be an "
                             f"integer, date or timestamp column, got {tt}")
        return schema.timestamp, "the schema's timestamp", skipped
    if not schema.infer:
        return None, "", skipped
    named = schema.named_columns()  # a role the schema gives is never overridden
    typed = [n for n, t in types.items() if pa.types.is_timestamp(_base(t)) and n not in named]
    chosen, why = None, ""
    if TIMESTAMP_NAME in types and TIMESTAMP_NAME not in named:
        t = _base(types[TIMESTAMP_NAME])
        if fits(t):
            chosen, why = TIMESTAMP_NAME, f"named {TIMESTAMP_NAME!r} ({t})"
        else:
            skipped[TIMESTAMP_NAME] = (f"named {TIMESTAMP_NAME!r} but holds {t}, not an "
                                       "integer, date or timestamp (name its role in the "
                                       "schema)")
    if chosen is None and len(typed) == 1:
        chosen, why = typed[0], f"the only column of a timestamp type ({types[typed[0]]})"
    for n in typed:
        if n != chosen:
            skipped[n] = (f"a column of a timestamp type; the timestamp is {chosen!r}" if chosen
                          else f"one of {len(typed)} columns of a timestamp type {typed}: name "
                          "one in the schema (timestamp = ...)")
    return chosen, why, skipped


def make_plan(schema: Schema, columns: pa.Schema, path: str,
              sample: Optional[pa.Table] = None, text: bool = False) -> Plan:
    """The plan for a source whose columns are `columns` (first file `path`), `sample` its
    first rows (or None: value checks skipped); `text`: a CSV source, whose column types the
    reader guessed from the values. ValueError naming the file and column for a column the
    schema names that is missing or of a type that cannot have its role, and naming the row
    and value for a text column of numbers but for a few (see the module doc)."""
    types = {f.name: f.type for f in columns}
    where = f"{OP}: {path}"
    roles: Dict[str, List[str]] = {n: [] for n in types}

    def need(col: str, role: str) -> pa.DataType:
        if col not in types:
            raise ValueError(f"{where}: column {col!r} ({role} in the schema) is not in the "
                             f"file; its columns are {list(types)}")
        return _base(types[col])

    label = schema.label or "label"
    if schema.label is not None:
        lt = need(label, "the label")
    elif label not in types:
        raise ValueError(f"{where}: no label column: name it in the schema (label = ...); "
                         f"the columns are {list(types)}")
    else:
        lt = _base(types[label])
    positive = schema.label_positive
    if positive is not None and not (_is_string(lt) if isinstance(positive, str)
                                     else pa.types.is_integer(lt)):
        raise ValueError(f"{where}: column {label!r} holds {lt}: label_positive = "
                         f"{positive!r} compares with "
                         + ("strings" if isinstance(positive, str) else "integers"))
    if positive is None and not _is_number(lt):
        raise ValueError(f"{where}: column {label!r}: the label must be 0/1 or a float, the "
                         f"column holds {lt}"
                         + ("; name the positive value with label_positive = \"...\" in the "
                            "schema" if _is_string(lt) else ""))
    roles[label].append("label: " + ("the schema's label" if schema.label else
                                     f"named {label!r}")
                        + ("" if positive is None else f", 1 where it is {positive!r}, else 0"))
    timestamp, ts_why, skipped = _timestamp(schema, types, where, need)
    if timestamp is not None:
        roles[timestamp].append(f"timestamp: {ts_why}")
    taken = schema.named_columns() | {label, timestamp} | set(skipped)
    sparse: List[Tuple[str, SparseSchema]] = list(schema.sparse)
    inferred: List[str] = []
    for feature, s in sparse:
        t = need(s.column, f"sparse feature {feature}")
        if s.separator is not None and not _is_id(t):
            raise ValueError(f"{where}: column {s.column!r} holds {t}: a separator splits "
                             "string columns only")
        inner = _base(t.value_type) if _is_list(t) else t
        if not _is_id(inner):
            raise ValueError(f"{where}: column {s.column!r} holds {t}: a sparse feature needs "
                             "integer or string ids (or lists of them)")
        history = "" if s.history_of is None else f", a history of {s.history_of}'s items"
        roles[s.column].append(f"sparse feature {feature} (table {s.table}{history}): the "
                               f"schema's [sparse.{feature}]")
        if s.weights is not None:
            wt = need(s.weights, f"weights of {feature}")
            w_inner = wt.value_type if _is_list(wt) else wt
            if not _is_number(w_inner) or _is_list(wt) != _is_list(t) or s.separator:
                raise ValueError(f"{where}: column {s.weights!r} holds {wt}: the weights of "
                                 f"{feature} ({t}) must be {'lists of ' if _is_list(t) else ''}"
                                 "floats")
            roles[s.weights].append(f"weights of {feature}: the schema's [sparse.{feature}]")
    dense = list(schema.dense) if schema.dense is not None else []
    for c in dense + list(schema.dense_log1p):
        t = need(c, "dense")
        _check_numbers(sample, c, where, dense=True)
        if not _is_number(t):
            raise ValueError(f"{where}: column {c!r} holds {types[c]}: dense features must be "
                             "numbers" + (" (cast it in a transform, or leave it out of the "
                                          "schema's dense: it is then a column of ids)"
                                          if _is_string(t) else ""))
    for j, c in enumerate(dense):
        log = ", stored as log(max(x, 0) + 1)" if c in schema.dense_log1p else ""
        roles[c].append(f"dense {j}: the schema's dense{log}")
    for c in schema.ignore:
        if c in roles:
            roles[c].append("left out: the schema's ignore")
    left_out = []
    tables = dict(schema.tables)
    for name, t in types.items():
        if name in skipped:
            left_out.append(name)
            roles[name].append(f"left out: {skipped[name]}")
        if name in taken:
            continue
        t = _base(t)
        inner = _base(t.value_type) if _is_list(t) else t
        if not schema.infer:
            left_out.append(name)
            roles[name].append("left out: the schema names it nowhere (infer = false)")
        elif pa.types.is_floating(t) or pa.types.is_boolean(t):
            if schema.dense is None:
                roles[name].append(f"dense {len(dense)}: {t}, inferred")
                dense.append(name)
            else:
                left_out.append(name)
                roles[name].append(f"left out: {t}, not in the schema's dense")
        elif _is_id(inner) and not any(f == name for f, _ in sparse):
            if _is_string(t) and text:
                _check_numbers(sample, name, where, dense=False)
            sparse.append((name, SparseSchema(column=name, table=f"t_{name}")))
            inferred.append(name)
            tables.setdefault(f"t_{name}", TableSchema())
            bag = "lists of " if _is_list(t) else ""
            roles[name].append(f"sparse feature {name} (table t_{name}): {bag}{inner} ids, "
                               "inferred")
        else:
            left_out.append(name)
            roles[name].append(f"left out: {t} is neither ids nor a number")
    features = [FeaturePlan(f, s.column, s.table, s.weights,
                            _is_list(_base(types[s.column])) or s.separator is not None,
                            s.separator, s.history_of) for f, s in sparse]
    if not features:
        raise ValueError(f"{where}: no sparse features: the schema names none and no column "
                         f"holds integer or string ids (columns: {list(types)})")
    names = [f.name for f in features]
    for f in features:
        if f.history_of is not None and (f.history_of not in names or f.history_of == f.name):
            raise ValueError(f"{where}: [sparse.{f.name}] history_of = {f.history_of!r}: not "
                             f"another sparse feature; the sparse features are {names}")
    plans: Dict[str, TablePlan] = {}
    for name, ts in tables.items():
        fs = [f for f in features if f.table == name]
        strings = any(f.separator is not None or _is_string(
            _base(types[f.column]).value_type if f.is_list else _base(types[f.column]))
            for f in fs)
        if strings and ts.mapping == "modulo":
            raise ValueError(f"{where}: table {name}: mapping \"modulo\" needs integer ids; "
                             f"{[f.column for f in fs]} hold strings")
        plans[name] = TablePlan(name, tuple(f.name for f in fs), ts,
                                "string" if strings else "int",
                                any(f.weights is not None for f in fs))
    for f in features:
        table = plans[f.table]
        problem = f.history_of and history_table_problem(f.name, f.table, table.features,
                                                         table.weighted)
        if problem:
            raise ValueError(f"{where}: [sparse.{f.name}]: {problem}")
    lines = [f"column {n!r}: " + ("; ".join(r) if r else "left out") for n, r in roles.items()]
    return Plan(features, plans, dense, tuple(schema.dense_log1p), label, schema.label_kind,
                timestamp, left_out, types, lines, schema.vocab_limit, schema.default_rows,
                positive, tuple(inferred))


def check_same_columns(plan: Plan, columns: pa.Schema, path: str) -> None:
    """ValueError naming the file and column where another source file's types differ."""
    types = {f.name: f.type for f in columns}
    for c in plan.columns:
        if c not in types:
            raise ValueError(f"{OP}: {path}: column {c!r} is not in the file (the first file "
                             "has it)")
        if not types[c].equals(plan.source_types[c]):
            raise ValueError(f"{OP}: {path}: column {c!r} holds {types[c]}, the first file's "
                             f"holds {plan.source_types[c]}")
