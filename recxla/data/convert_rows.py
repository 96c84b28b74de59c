"""One block of source rows -> rows of recxla's Parquet layout (`convert_rows`), for the Plan of
recxla.data.convert_plan.

    sparse:<feature>   ids -> table rows by the table's mapping (recxla.data.id_mapping);
                       a null id is no id (an empty bag for a one-id column)
    weights:<feature>  float32, 1 where the feature has no weights column; a null weight is 1
    dense:<j>          float32; a null is 0; dense_log1p columns as log(max(x, 0) + 1)
    label              float32: 0/1 (label_kind "binary") or any finite float ("float")
    timestamp          int64 (dates: days, timestamps: the unit's ticks since the epoch)

Every stored float must be finite in float32: a NaN or an infinity (or a float64 beyond
float32's range, which becomes one) trains to a loss of nan, so it is an error naming the file,
the column, the row and the value; a null stays the documented 0 (or weight 1).
"""

from typing import Dict, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recxla.data.convert_plan import Plan
from recxla.data.id_mapping import keys_of, map_keys
from recxla.data.parquet_layout import dense_column, sparse_column, weights_column


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


def _float32(x: np.ndarray, rows: np.ndarray, where: str, column: str, what: str,
             row_base: int, stored: Optional[np.ndarray] = None) -> np.ndarray:
    """`stored` (default x; float64) as float32; ValueError naming the row and the value x of
    the first element whose x or float32 value is not finite. rows: the 0-based row in the
    block of each element of x."""
    stored = x if stored is None else stored
    with np.errstate(over="ignore", invalid="ignore"):
        y = stored.astype(np.float32)
    bad = ~np.isfinite(y) | ~np.isfinite(x)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{where}: row {row_base + int(rows[i]) + 1}: column {column!r}: {what} "
                         f"{float(x[i])!r} is not a finite float32 (it would train to a loss "
                         "of nan; leave the value empty (null) for the documented default, "
                         "or fix the row)")
    return y


def _weights(t: pa.Table, f, col: pa.Array, lengths: np.ndarray, keep, where: str,
             row_base: int) -> np.ndarray:
    """float32 per-id weights of feature f, aligned with its kept ids."""
    if f.weights is None:
        return np.ones(int(lengths.sum()), dtype=np.float32)
    wcol = t.column(f.weights).combine_chunks()
    n = len(wcol)
    if f.is_list:
        wlen = pc.fill_null(pc.list_value_length(wcol), 0).to_numpy()
        raw_len = pc.fill_null(pc.list_value_length(col), 0).to_numpy()
        if not np.array_equal(wlen, raw_len):
            raise ValueError(f"{where}: row {_first_row(wlen != raw_len, row_base)}: "
                             f"column {f.weights!r} has {wlen[wlen != raw_len][0]} weights "
                             f"for the {raw_len[wlen != raw_len][0]} ids of {f.column!r}")
        w = pc.fill_null(pc.cast(wcol.flatten(), pa.float64()), 1.0).to_numpy()
        w = _float32(w, np.repeat(np.arange(n), wlen), where, f.weights, "weight", row_base)
        return w[keep] if keep is not None else w
    w = pc.fill_null(pc.cast(wcol, pa.float64()), 1.0).to_numpy()
    return _float32(w, np.arange(n), where, f.weights, "weight", row_base)[lengths > 0]


def convert_rows(t: pa.Table, plan: Plan, tables: Dict, vocabs: Dict, where: str,
                 row_base: int) -> pa.Table:
    """Source rows (a table of plan.columns) -> a table of the layout's schema.

    tables: table name -> final TableSpec (mapping, rows); vocabs: table name -> Vocabulary.
    row_base: rows of the file before this block. ValueError naming `where`, the column and
    the 1-based row of the file for a bad label, a missing timestamp, a dense value or weight
    that is not finite, or weights whose bags differ from the ids'.
    """
    layout = plan.layout()
    cols: Dict[str, pa.Array] = {}
    n = t.num_rows
    for f in plan.features:
        spec = tables[f.table]
        col = t.column(f.column).combine_chunks()
        lengths, ids, keep = id_bags(col, f.is_list, f.separator)
        keys = keys_of(ids, spec.id_type)
        rows = map_keys(spec, keys, vocabs.get(f.table), f"{where}: column {f.column!r}")
        cols[sparse_column(f.name)] = _list_array(lengths, rows, pa.int64())
        if layout.weighted:
            w = _weights(t, f, col, lengths, keep, where, row_base)
            cols[weights_column(f.name)] = _list_array(lengths, w, pa.float32())
    for j, c in enumerate(plan.dense):
        x = pc.fill_null(pc.cast(t.column(c), pa.float64()), 0.0).to_numpy()
        with np.errstate(invalid="ignore"):
            stored = np.log1p(np.maximum(x, 0.0)) if c in plan.log1p else x
        cols[dense_column(j)] = pa.array(
            _float32(x, np.arange(n), where, c, "dense value", row_base, stored))
    label = t.column(plan.label).combine_chunks()
    if label.null_count:
        bad = ~label.is_valid().to_numpy(zero_copy_only=False)
        raise ValueError(f"{where}: row {_first_row(bad, row_base)}: column {plan.label!r}: "
                         "the label is missing")
    if plan.label_positive is not None:
        if pa.types.is_dictionary(label.type):
            label = label.cast(label.type.value_type)
        label = pc.equal(label, pa.scalar(plan.label_positive, label.type))
    y = pc.cast(label, pa.float64()).to_numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        bad = ~np.isfinite(y.astype(np.float32)) if plan.label_kind == "float" else (
            (y != 0) & (y != 1))
    if bad.any():
        kind = "a finite float32" if plan.label_kind == "float" else (
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
