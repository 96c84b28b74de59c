"""The Criteo Kaggle / Terabyte click logs (TSV): 40 tab-separated fields per line, no header:

    label      0 or 1
    int_0 ... int_12   integer counts, possibly missing (empty)
    cat_0 ... cat_25   32-bit ids as 8 hex digits, possibly missing (empty)

Read as TorchRec's Criteo utilities read them (torchrec/datasets/criteo.py, `tsv_to_npys`'s
row_mapper: `int(x or "0")` and `int(x or "0", 16)`): a missing value is 0, categoricals are
the integers their hex digits spell. Stored as:

    dense int_j    log(max(x, 0) + 1), float32: missing -> log(1) = 0. (The DLRM reference
                   clips negatives to 0 the same way; TorchRec's tsv_to_npys instead shifts
                   every value by the file's smallest value minus 2 before the log, which
                   depends on the whole file and cannot be computed while streaming.)
    sparse cat_i   one id per sample, table t_cat_i, by default `modulo`: row = id % rows,
                   what TorchRec's in-memory Criteo dataset does (`sparse % hashes`), with
                   rows = the schema's default_rows (100,000, TorchRec's DLRM example default)
                   unless the schema gives the table's rows or another mapping.
"""

import dataclasses
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recxla.data.convert_csv import read_csv
from recxla.data.errors import DataFormatError
from recxla.data.schema import Schema, SparseSchema, TableSchema

OP = "recxla.data.convert"
INT_FEATURES = tuple(f"int_{j}" for j in range(13))
CAT_FEATURES = tuple(f"cat_{i}" for i in range(26))
COLUMNS = ("label",) + INT_FEATURES + CAT_FEATURES
# After parsing: categoricals are int64 (their hex value), integers stay int64 with nulls.
CRITEO_SCHEMA = pa.schema([("label", pa.int64())] + [(c, pa.int64()) for c in INT_FEATURES]
                          + [(c, pa.int64()) for c in CAT_FEATURES])
_TEXT_TYPES = {"label": pa.int64(), **{c: pa.int64() for c in INT_FEATURES},
               **{c: pa.string() for c in CAT_FEATURES}}

_HEX = np.full(256, 255, dtype=np.uint8)
_HEX[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


def parse_hex(strings: pa.Array, where: str, row_base: int) -> np.ndarray:
    """Hex strings ("" for missing) -> int64 [n] (missing -> 0, as TorchRec's
    `int(x or "0", 16)`). DataFormatError naming `where` and the 1-based row for a value that
    is not 1 to 16 hex digits."""
    strings = strings.cast(pa.large_string())
    n = len(strings)
    lens = pc.binary_length(strings).to_numpy()
    bad = int(np.argmax(lens > 16)) if n and lens.max() > 16 else None
    value = np.zeros(n, dtype=np.uint64)
    if bad is None and n:
        # Left-padded with "0" to 16 digits, the digits form one [n, 16] byte matrix.
        padded = pc.utf8_lpad(strings, width=16, padding="0")
        bufs = padded.buffers()
        first = int(np.frombuffer(bufs[1], np.int64)[padded.offset])
        data = np.frombuffer(bufs[2], np.uint8)[first:first + 16 * n]
        if data.size != 16 * n:  # a multi-byte character: not hex
            bad = int(np.argmax(pc.binary_length(padded).to_numpy() != 16))
        else:
            digits = _HEX[data.reshape(n, 16)]
            wrong = (digits == 255).any(axis=1)
            if wrong.any():
                bad = int(np.argmax(wrong))
            for k in range(16):
                value <<= np.uint64(4)
                value |= digits[:, k]
    if bad is not None:
        raise DataFormatError(f"{where}: row {row_base + bad + 1}: {strings[bad].as_py()!r} is "
                              "not a hex id (1 to 16 hex digits)")
    return value.view(np.int64)


def read_criteo(path: str) -> Iterator[pa.Table]:
    """The rows of a Criteo TSV file as tables of CRITEO_SCHEMA, a block at a time."""
    row_base = 0
    for t in read_csv(path, column_names=list(COLUMNS), column_types=_TEXT_TYPES,
                      delimiter="\t", header=False, what="tab-separated fields"):
        cols = [pc.fill_null(t.column("label").combine_chunks(), 0)]  # as int(x or "0")
        cols += [t.column(c).combine_chunks() for c in INT_FEATURES]
        for c in CAT_FEATURES:
            strings = pc.fill_null(t.column(c).combine_chunks(), "")
            cols.append(pa.array(parse_hex(strings, f"{OP}: {path}: column {c}", row_base)))
        row_base += t.num_rows
        yield pa.Table.from_arrays(cols, schema=CRITEO_SCHEMA)


def criteo_schema(user: Schema) -> Schema:
    """The fixed Criteo schema, with the user schema's table settings (rows, dim, pooling,
    mapping, shared tables) and defaults; a table without a mapping gets `modulo`."""
    fixed = {"label": None, "dense": None, "timestamp": None}
    for key in fixed:
        if getattr(user, key) is not None:
            raise ValueError(f"recxla.data.convert: criteo-tsv has a fixed layout (label, "
                             f"int_0..int_12, cat_0..cat_25); the schema may not set {key}")
    given = dict(user.sparse)
    unknown = set(given) - set(CAT_FEATURES)
    if unknown:
        raise ValueError(f"recxla.data.convert: criteo-tsv's sparse features are cat_0 ... "
                         f"cat_25; the schema names {sorted(unknown)}")
    sparse = tuple((c, given.get(c, SparseSchema(column=c, table=f"t_{c}")))
                   for c in CAT_FEATURES)
    tables = dict(user.tables)
    for _, s in sparse:
        tables.setdefault(s.table, TableSchema())
    tables = {n: t if t.mapping is not None else dataclasses.replace(t, mapping="modulo")
              for n, t in tables.items()}
    return dataclasses.replace(user, label="label", label_kind="binary", dense=INT_FEATURES,
                               dense_log1p=INT_FEATURES, infer=False, sparse=sparse,
                               tables=tuple(tables.items()))
