"""The files `python -m recxla.data convert` reads: which files and format, their columns, and
their rows as a stream of Arrow tables of bounded size (a file larger than memory is never
read whole).

    parquet      pyarrow.parquet.ParquetFile.iter_batches (one row group's pages at a time)
    csv          pyarrow.csv.open_csv, a header line, comma-separated, UTF-8, column types
                 inferred from the first block of the first file and then fixed for every
                 file (a value that is not UTF-8, or that does not parse as its column's type,
                 is an error naming the file, the row, the line and the column), see
                 recxla.data.convert_csv
    criteo-tsv   the Criteo Kaggle / Terabyte layout, see recxla.data.convert_criteo
"""

import os
from typing import Dict, Iterator, List, Optional, Tuple

import pyarrow as pa
import pyarrow.parquet as pq

from recxla.data.convert_criteo import CRITEO_SCHEMA, read_criteo
from recxla.data.convert_csv import check_not_empty, csv_first_block, read_csv
from recxla.data.errors import DataFormatError

OP = "recxla.data.convert"
FORMATS = ("parquet", "csv", "criteo-tsv")
_EXTENSIONS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "criteo-tsv"}


def format_of(path: str) -> Optional[str]:
    name = path[:-3] if path.endswith(".gz") else path
    return _EXTENSIONS.get(os.path.splitext(name)[1].lower())


def list_sources(src, fmt: Optional[str]) -> Tuple[List[str], str]:
    """The files of SRC (a file, or a folder's files of the format, by name) and the format
    (given, or from the extension). FileNotFoundError / ValueError naming SRC."""
    src = os.fspath(src)
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"{OP}: format must be one of {FORMATS}, got {fmt!r}")
    if os.path.isdir(src):
        names = sorted(n for n in os.listdir(src) if not n.startswith((".", "_")))
        files = [os.path.join(src, n) for n in names if os.path.isfile(os.path.join(src, n))
                 and (fmt is None and format_of(n) is not None or fmt is not None
                      and (format_of(n) == fmt or fmt == "criteo-tsv"))]
        if not files:
            raise DataFormatError(f"{OP}: {src}: the folder holds no {fmt or 'parquet/csv'} "
                                  "files")
    elif os.path.isfile(src):
        files = [src]
    else:
        raise FileNotFoundError(f"{OP}: {src}: no such file or folder")
    if fmt is None:
        found = {format_of(f) for f in files}
        if len(found) != 1 or None in found:
            raise ValueError(f"{OP}: {src}: cannot tell the format from the name(s); pass "
                             f"--format ({', '.join(FORMATS)})")
        fmt = found.pop()
    return files, fmt


SAMPLE_ROWS = 65536


def source_sample(path: str, fmt: str) -> Tuple[pa.Schema, Optional[pa.Table]]:
    """The columns of the first source file and its first rows, on which column roles are
    inferred and checked (CSV: the first block, which fixed the types; Parquet: up to
    SAMPLE_ROWS rows of its string columns; Criteo: no sample, the layout is fixed)."""
    if fmt == "csv":
        table = csv_first_block(path)
        return table.schema, table
    columns = source_schema(path, fmt)
    if fmt != "parquet":
        return columns, None
    strings = [f.name for f in columns if pa.types.is_string(f.type) or pa.types.is_large_string(
        f.type) or (pa.types.is_dictionary(f.type) and pa.types.is_string(f.type.value_type))]
    if not strings:
        return columns, None
    for t in read_source(path, fmt, strings, SAMPLE_ROWS):
        return columns, t
    return columns, None


def source_schema(path: str, fmt: str) -> pa.Schema:
    """The columns of one source file (Criteo: the fixed layout after parsing)."""
    check_not_empty(path)
    if fmt == "parquet":
        try:
            return pq.read_schema(path)
        except (OSError, pa.ArrowException) as e:
            raise DataFormatError(f"{OP}: {path}: not a readable Parquet file: {e}") from None
    if fmt == "csv":
        return csv_first_block(path).schema
    return CRITEO_SCHEMA


def read_source(path: str, fmt: str, columns: List[str], rows: int,
                column_types: Optional[Dict[str, pa.DataType]] = None) -> Iterator[pa.Table]:
    """The rows of `path` (only `columns`), in tables of at most about `rows` rows (CSV:
    blocks of text). DataFormatError naming the file for unreadable input."""
    check_not_empty(path)
    if fmt == "parquet":
        try:
            # pre_buffer (pyarrow's default) reads every row group's column chunks ahead: a
            # 12M-row file then peaked at 295 MB instead of 15 MB; streaming means one block.
            f = pq.ParquetFile(path, pre_buffer=False)
            for batch in f.iter_batches(batch_size=rows, columns=columns):
                yield pa.Table.from_batches([batch])
        except (OSError, pa.ArrowException) as e:
            raise DataFormatError(f"{OP}: {path}: unreadable Parquet: {e}") from None
    elif fmt == "csv":
        yield from read_csv(path, column_types=column_types, include_columns=columns)
    else:
        for t in read_criteo(path):
            yield t.select(columns)
