"""Delimited text as `python -m recxla.data convert` reads it: CSV files (a header line,
comma-separated, UTF-8) and the Criteo TSV layout (recxla.data.convert_criteo), streamed as
Arrow tables a block of text at a time, so that a file larger than memory is never read whole.

A row with the wrong number of fields, a value that is not UTF-8 or one that does not parse as
its column's type is an error naming the file, the row, the line and the column.
"""

import os
import re
from typing import Iterator, List, Optional

import pyarrow as pa
import pyarrow.csv as pcsv

from recxla.data.errors import DataFormatError

OP = "recxla.data.convert"
# pyarrow's streaming CSV reader reads blocks of text ahead of the consumer on a background
# thread, up to a queue of 32 (Arrow's kDefaultBackgroundMaxQ, not an option), whatever the
# input's size. It is opened with use_threads=False: with threads it also parses as many blocks
# ahead as pyarrow's CPU pool has threads (pa.cpu_count(): the cores, or OMP_NUM_THREADS), each
# holding its text, parse and column buffers, which made the peak depend on the machine (36
# MiB with 2 threads, 54 MiB with 16, for the same file). Without, it holds at most
# CSV_BUFFERED_BLOCKS blocks: the queue, the block being read, the one being split into rows
# and the one being parsed (measured: 36.4 MiB of Arrow memory at 1 MiB blocks, on 2 and 16
# threads alike). Files are still converted in parallel (`workers`).
CSV_BLOCK_BYTES = 1 << 20
CSV_BUFFERED_BLOCKS = 32 + 3


def check_not_empty(path: str) -> None:
    if os.path.getsize(path) == 0:
        raise DataFormatError(f"{OP}: {path}: the file is empty")


def open_text(path: str):
    """The file's bytes (gzip-decompressed for .gz)."""
    if path.endswith(".gz"):
        import gzip

        return gzip.open(path, "rb")
    return open(path, "rb")


def csv_header(path: str) -> List[str]:
    """The column names of a CSV file's header line. DataFormatError naming the file for a
    header that is not UTF-8."""
    import csv

    with open_text(path) as f:
        first = f.readline()
    try:
        text = first.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataFormatError(f"{OP}: {path}: line 1 (the header): {first[:200]!r} is not UTF-8 "
                              f"text ({e.reason} at byte {e.start})") from None
    return next(csv.reader([text.rstrip("\r\n")]), [])


def check_csv_columns(path: str, columns: List[str]) -> None:
    """DataFormatError naming the file and the first of `columns` its header lacks."""
    names = set(csv_header(path))
    for c in columns:
        if c not in names:
            raise DataFormatError(f"{OP}: {path}: column {c!r} is not in the file (the first "
                                  f"file has it); its columns are {sorted(names)}")


def _line_of(path: str, text: str) -> Optional[int]:
    """1-based number of the first line of `path` whose text is `text` (after a bad row was
    found: pyarrow's streaming CSV reader does not know row numbers)."""
    want = text.encode()
    with open_text(path) as f:
        for i, line in enumerate(f, 1):
            if line.rstrip(b"\r\n") == want:
                return i
    return None


class _RaggedRow:
    """invalid_row_handler: remembers the first bad row and stops the reader."""

    def __init__(self):
        self.row = None

    def __call__(self, row):
        if self.row is None:
            self.row = row
        return "error"

    def error(self, path: str, header_lines: int, what: str) -> DataFormatError:
        r = self.row
        line = _line_of(path, r.text)
        where = "" if line is None else f"row {line - header_lines} (line {line}): "
        return DataFormatError(f"{OP}: {path}: {where}{r.actual_columns} {what}, expected "
                               f"{r.expected_columns}: {r.text[:200]!r}")


def read_csv(path: str, *, column_names=None, column_types=None, delimiter=",",
             header=True, what="fields", block_bytes=CSV_BLOCK_BYTES,
             include_columns=None) -> Iterator[pa.Table]:
    """The rows of a delimited text file, a block (`block_bytes` of text) at a time, holding at
    most CSV_BUFFERED_BLOCKS blocks of text (see there).
    DataFormatError naming the file, row and line for a row with the wrong number of fields,
    and naming the file and column for a value of the wrong type."""
    check_not_empty(path)
    ragged = _RaggedRow()
    read = pcsv.ReadOptions(block_size=block_bytes, column_names=column_names,
                            autogenerate_column_names=False, use_threads=False)
    parse = pcsv.ParseOptions(delimiter=delimiter, invalid_row_handler=ragged,
                              quote_char=False if delimiter == "\t" else '"')
    convert = pcsv.ConvertOptions(column_types=column_types or {},
                                  include_columns=include_columns or [])
    reader, failure = None, None
    try:
        reader = pcsv.open_csv(path, read_options=read, parse_options=parse,
                               convert_options=convert)
        for batch in reader:
            yield pa.Table.from_batches([batch])
    except pa.ArrowKeyError as e:  # an include_columns name the header lacks
        failure = f"{e}".strip('"')
    except pa.ArrowInvalid as e:
        failure = str(e)
    finally:
        # A reader left open after an error aborts the process at exit (its read-ahead
        # threads outlive the interpreter): close it before anything is raised.
        if reader is not None:
            reader.close()
        reader = None
    if failure is None:
        return
    if ragged.row is not None:
        raise ragged.error(path, 1 if header else 0, what)
    raise DataFormatError(f"{OP}: {path}: {_where_in_csv(path, failure, column_names, header)}")


_CELL = re.compile(r"In CSV column #(\d+): Row #(\d+): (.*)", re.S)


def _where_in_csv(path: str, failure: str, column_names, header: bool) -> str:
    """pyarrow's "In CSV column #c: Row #r: ..." as "row R (line r): column 'name': ...",
    with what fixed the column's type."""
    m = _CELL.match(failure)
    if m is None:
        return failure
    index, line, detail = int(m.group(1)), int(m.group(2)), m.group(3)
    names = list(column_names) if column_names else csv_header(path)
    name = names[index] if index < len(names) else f"#{index}"
    return f"row {line - (1 if header else 0)} (line {line}): column {name!r}: {_detail(detail)}"


_BAD_VALUE = re.compile(r"CSV conversion error to (.+?): invalid value (.*)", re.S)
_NUMBER_TYPES = ("int", "uint", "double", "float", "halffloat")


def _detail(detail: str) -> str:
    """pyarrow's reason for a bad cell, in the words of the first block's checks."""
    if "invalid UTF8" in detail:
        return ("a value is not UTF-8 text; recxla reads CSV files as UTF-8: re-encode the file "
                "(e.g. iconv -f latin1 -t utf-8)")
    m = _BAD_VALUE.match(detail)
    if m is None:
        return detail
    kind, value = m.group(1), m.group(2)
    what = "a number" if kind.startswith(_NUMBER_TYPES) else f"a {kind}"
    return (f"{value} is not {what} (the column holds {kind}: CSV column types are inferred "
            "from the first 1 MiB of the first file and then fixed for every file)")


def check_utf8(path: str, table: pa.Table, columns: List[str]) -> None:
    """DataFormatError naming the first row of one of `columns` of a CSV block that pyarrow
    read as binary: a value that is not UTF-8 (the column would otherwise be no id and no
    number, and be left out)."""
    for name in columns:
        col = table.column(name)
        if not pa.types.is_binary(col.type) and not pa.types.is_large_binary(col.type):
            continue
        for i, value in enumerate(col.to_pylist()):
            if value is None:
                continue
            try:
                value.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataFormatError(
                    f"{OP}: {path}: row {i + 1}: column {name!r}: {value[:100]!r} is not UTF-8 "
                    f"text ({e.reason} at byte {e.start}); recxla reads CSV files as UTF-8: "
                    "re-encode the file (e.g. iconv -f latin1 -t utf-8)") from None


def csv_first_block(path: str) -> pa.Table:
    """The first block (1 MiB of text) of a CSV file with its inferred column types: what
    fixes the types of every file (a column holding a value that is not UTF-8 is binary: see
    check_utf8)."""
    for table in read_csv(path):
        return table
    raise DataFormatError(f"{OP}: {path}: the file holds a header but no rows")
