"""What a conversion does with each column (`Plan`, from the schema file and the source's
columns) and how one block of source rows becomes rows of recxla's Parquet layout
(`convert_rows`).

Column roles when the schema does not name them (infer = true):
    label       a column named "label"
    timestamp   the one column of an Arrow timestamp type, if there is exactly one
    dense       float and bool columns
    sparse      integer and string columns (one id per row) and lists of them (a bag per row),
                each its own table t_<column>
    left out    anything else (lists of floats, structs, ...): listed in the conversion's report
Missing values: a null id is no id (an empty bag for a one-id column); a null dense value is 0;
a null label or timestamp is an error.
"""

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recxla.data.id_mapping import keys_of, map_keys
from recxla.data.parquet_layout import Layout, dense_column, sparse_column, weights_column
from recxla.data.schema import Schema, SparseSchema, TableSchema

OP = "recxla.data.convert"


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


def make_plan(schema: Schema, columns: pa.Schema, path: str) -> Plan:
    """The plan for a source whose columns are `columns` (first file `path`). ValueError
    naming the file and column for a column the schema names that is missing or of a type
    that cannot have its role."""
    types = {f.name: f.type for f in columns}
    where = f"{OP}: {path}"

    def need(col: str, role: str) -> pa.DataType:
        if col not in types:
            raise ValueError(f"{where}: column {col!r} ({role} in the schema) is not in the "
                             f"file; its columns are {list(types)}")
        return _base(types[col])

    label = schema.label or "label"
    if label not in types:
        raise ValueError(f"{where}: no label column: name it in the schema (label = ...); "
                         f"the columns are {list(types)}")
    lt = need(label, "label")
    if not _is_number(lt):
        raise ValueError(f"{where}: column {label!r}: the label must be 0/1 or a float, the "
                         f"column holds {lt}")
    timestamp = schema.timestamp
    if timestamp is None and schema.infer:
        stamps = [n for n, t in types.items() if pa.types.is_timestamp(t)]
        timestamp = stamps[0] if len(stamps) == 1 else None
    if timestamp is not None:
        tt = need(timestamp, "timestamp")
        if not (pa.types.is_integer(tt) or pa.types.is_timestamp(tt) or pa.types.is_date(tt)):
            raise ValueError(f"{where}: column {timestamp!r}: a timestamp must be an integer, "
                             f"date or timestamp column, got {tt}")
    taken = schema.named_columns() | {label, timestamp}
    sparse: List[Tuple[str, SparseSchema]] = list(schema.sparse)
    for feature, s in sparse:
        t = need(s.column, f"sparse feature {feature}")
        if s.separator is not None and not _is_id(t):
            raise ValueError(f"{where}: column {s.column!r} holds {t}: a separator splits "
                             "string columns only")
        inner = _base(t.value_type) if _is_list(t) else t
        if not _is_id(inner):
            raise ValueError(f"{where}: column {s.column!r} holds {t}: a sparse feature needs "
                             "integer or string ids (or lists of them)")
        if s.weights is not None:
            wt = need(s.weights, f"weights of {feature}")
            w_inner = wt.value_type if _is_list(wt) else wt
            if not _is_number(w_inner) or _is_list(wt) != _is_list(t) or s.separator:
                raise ValueError(f"{where}: column {s.weights!r} holds {wt}: the weights of "
                                 f"{feature} ({t}) must be {'lists of ' if _is_list(t) else ''}"
                                 "floats")
    dense = list(schema.dense) if schema.dense is not None else []
    for c in dense + list(schema.dense_log1p):
        if not _is_number(need(c, "dense")):
            raise ValueError(f"{where}: column {c!r} holds {types[c]}: dense features must be "
                             "numbers")
    left_out = []
    tables = dict(schema.tables)
    if schema.infer:
        for name, t in types.items():
            if name in taken:
                continue
            t = _base(t)
            inner = _base(t.value_type) if _is_list(t) else t
            if schema.dense is None and (pa.types.is_floating(t) or pa.types.is_boolean(t)):
                dense.append(name)
            elif _is_id(inner) and not any(f == name for f, _ in sparse):
                sparse.append((name, SparseSchema(column=name, table=f"t_{name}")))
                tables.setdefault(f"t_{name}", TableSchema())
            else:
                left_out.append(name)
    else:
        left_out = [n for n in types if n not in taken]
    features = [FeaturePlan(f, s.column, s.table, s.weights,
                            _is_list(_base(types[s.column])) or s.separator is not None,
                            s.separator) for f, s in sparse]
    if not features:
        raise ValueError(f"{where}: no sparse features: the schema names none and no column "
                         f"holds integer or string ids (columns: {list(types)})")
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
    return Plan(features, plans, dense, tuple(schema.dense_log1p), label, schema.label_kind,
                timestamp, left_out, types)


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


def id_bags(col: pa.Array, is_list: bool, separator: Optional[str] = None
            ) -> Tuple[np.ndarray, pa.Array, Optional[np.ndarray]]:
    """(lengths int64 [n], the ids without nulls, mask of the kept flat elements or None).
    With a separator, a string column's values are bags: "a|b" -> [a, b], "" -> []."""
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    if separator is not None:
        if not pa.types.is_string(col.type):  # CSV inferred integers: no bag had two ids
            col = col.cast(pa.string())
        col = pc.split_pattern(pc.if_else(pc.equal(col, ""), None, col), separator)
    if not is_list:
        valid = col.is_valid()
        return (valid.to_numpy(zero_copy_only=False).astype(np.int64), col.filter(valid), None)
    if pa.types.is_dictionary(col.type.value_type):
        col = pc.cast(col, pa.list_(col.type.value_type.value_type))
    lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy().astype(np.int64)
    flat = col.flatten()
    if not flat.null_count:
        return lengths, flat, None
    keep = flat.is_valid().to_numpy(zero_copy_only=False)
    owner = np.repeat(np.arange(len(col)), lengths)
    return np.bincount(owner[keep], minlength=len(col)).astype(np.int64), flat.filter(keep), keep


def _list_array(lengths: np.ndarray, values: np.ndarray, dtype) -> pa.Array:
    offsets = np.zeros(lengths.size + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, dtype))


def _first_row(mask: np.ndarray, row_base: int) -> int:
    return row_base + int(np.argmax(mask)) + 1


def convert_rows(t: pa.Table, plan: Plan, tables: Dict, vocabs: Dict, where: str,
                 row_base: int) -> pa.Table:
    """Source rows (a table of plan.columns) -> a table of the layout's schema.

    tables: table name -> final TableSpec (mapping, rows); vocabs: table name -> Vocabulary.
    ValueError naming `where`, the column and the 1-based row of the file for a bad label,
    timestamp, or weights whose bags differ from the ids'.
    """
    layout = plan.layout()
    cols: Dict[str, pa.Array] = {}
    for f in plan.features:
        spec = tables[f.table]
        col = t.column(f.column).combine_chunks()
        lengths, ids, keep = id_bags(col, f.is_list, f.separator)
        keys = keys_of(ids, spec.id_type)
        rows = map_keys(spec, keys, vocabs.get(f.table), f"{where}: column {f.column!r}")
        cols[sparse_column(f.name)] = _list_array(lengths, rows, pa.int64())
        if not layout.weighted:
            continue
        if f.weights is None:
            w = np.ones(int(lengths.sum()), dtype=np.float32)
        elif f.is_list:
            wcol = t.column(f.weights).combine_chunks()
            wlen = pc.fill_null(pc.list_value_length(wcol), 0).to_numpy()
            raw_len = pc.fill_null(pc.list_value_length(col), 0).to_numpy()
            if not np.array_equal(wlen, raw_len):
                raise ValueError(f"{where}: row {_first_row(wlen != raw_len, row_base)}: "
                                 f"column {f.weights!r} has {wlen[wlen != raw_len][0]} weights "
                                 f"for the {raw_len[wlen != raw_len][0]} ids of {f.column!r}")
            w = pc.fill_null(pc.cast(wcol.flatten(), pa.float32()), 1.0).to_numpy()
            w = w[keep] if keep is not None else w
        else:
            wcol = pc.fill_null(pc.cast(t.column(f.weights).combine_chunks(), pa.float32()), 1.0)
            w = wcol.to_numpy()[lengths > 0]
        cols[weights_column(f.name)] = _list_array(lengths, w, pa.float32())
    for j, c in enumerate(plan.dense):
        x = pc.fill_null(pc.cast(t.column(c), pa.float64()), 0.0).to_numpy()
        if c in plan.log1p:
            x = np.log1p(np.maximum(x, 0.0))
        cols[dense_column(j)] = pa.array(x.astype(np.float32))
    label = t.column(plan.label).combine_chunks()
    if label.null_count:
        bad = ~label.is_valid().to_numpy(zero_copy_only=False)
        raise ValueError(f"{where}: row {_first_row(bad, row_base)}: column {plan.label!r}: "
                         "the label is missing")
    y = pc.cast(label, pa.float64()).to_numpy()
    bad = ~np.isfinite(y) if plan.label_kind == "float" else (y != 0) & (y != 1)
    if bad.any():
        kind = "a finite float" if plan.label_kind == "float" else (
            "0 or 1 (label_kind = \"binary\"; set label_kind = \"float\" for a regression "
            "target)")
        raise ValueError(f"{where}: row {_first_row(bad, row_base)}: column {plan.label!r}: "
                         f"label {float(y[bad][0])!r} is not {kind}")
    cols["label"] = pa.array(y.astype(np.float32))
    if plan.timestamp is not None:
        ts = t.column(plan.timestamp).combine_chunks()
        if ts.null_count:
            bad = ~ts.is_valid().to_numpy(zero_copy_only=False)
            raise ValueError(f"{where}: row {_first_row(bad, row_base)}: column "
                             f"{plan.timestamp!r}: the timestamp is missing")
        if pa.types.is_date32(ts.type):
            ts = ts.cast(pa.int32())
        cols["timestamp"] = ts.cast(pa.int64())
    schema = layout.arrow_schema()
    return pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)
