"""`convert`: a user's click log (Parquet, CSV or Criteo TSV) -> a recxla dataset folder that
the trainer reads with no other flags (`python -m recxla.train --data DIR`).

    convert(src, out, schema=None, fmt=None) -> DatasetSpec

What it writes (folder `out`):
    part-00000.parquet ...   one file per source file, recxla's layout (recxla.data.
                             parquet_layout): sparse:<feature> list<int64> of table rows,
                             dense:<j> float32, label float32, optional weights:<feature> and
                             timestamp int64; zstd; rows sorted by an id within row groups
                             (sort_by, "auto": the key that compresses best); the DatasetSpec
                             as JSON in every file's footer ("recxla.data.spec")
    vocab/<table>.parquet    the vocabulary of each vocab-mapped table (recxla.data.id_mapping)

How (docs/your-data.md for the user's view):
- Streaming: every file is read in blocks (Parquet: `rows_per_group` rows; CSV/TSV: 1 MiB of
  text, up to 35 of them read ahead: recxla.data.convert_csv.CSV_BUFFERED_BLOCKS) and
  written a row group at a time, so memory per worker is bounded by a row group and the
  blocks read ahead, whatever the input's size, plus the id counts of vocab tables (distinct
  ids, not rows).
- Two passes when a table needs its ids counted (mapping "vocab", or no mapping given: the
  default is a vocabulary when the table has at most `vocab_limit` distinct ids, else hashing
  into `default_rows` rows; counting stops at the limit), else one.
- In parallel over files: `workers` processes (fork), one source file each at a time.
- Row groups: `rows_per_group` rows each, by default chosen from the rows
  (`default_rows_per_group`): 64 groups of at least 1,024 rows (the trainer's default batch)
  and at most 65,536, and at least 16 groups whenever there are 16 rows, so that the trainer's
  held-out split (one group per rank on each side) works on the usual rank counts.
- The output folder (recxla.data.convert_output): written to a hidden temporary folder next to
  `out`, renamed to `out` only when every file and vocabulary is complete; on failure the
  temporary folder is removed. An existing `out` is replaced only when it is a dataset that
  convert wrote, and never when it holds the input.
"""

import contextlib
import multiprocessing as mp
import os
import shutil
import struct
import threading
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import pyarrow as pa
import pyarrow.parquet as pq

from recxla.data.convert_output import (
    check_output,
    install,
    output_error,
    temp_folder,
    writing,
)
from recxla.data.convert_plan import Plan, check_same_columns, make_plan
from recxla.data.convert_rows import convert_rows
from recxla.data.convert_csv import CSV_BLOCK_BYTES, check_csv_columns, check_utf8, open_text
from recxla.data.convert_source import list_sources, read_source, source_sample, source_schema
from recxla.data.errors import DataFormatError
from recxla.data.id_counts import (
    IdCounter,
    dataset_spec,
    flag_measures,
    merge_results,
    table_specs,
)
from recxla.data.parquet_layout import MAX_GROUP_ROWS, SPEC_KEY, default_rows_per_group
from recxla.data.parquet_writer import _FileSink, choose_sort
from recxla.data.schema import DatasetSpec, Schema, load_schema
from recxla.data.table_source import is_table_ref

OP = "recxla.data.convert"
_TRIAL_ROWS = 8192

_JOB: dict = {}  # the running conversion, inherited by forked workers


def _report(rows: int) -> None:
    q = _JOB.get("queue")
    if q is not None:
        q.put(rows)
    elif _JOB.get("bar") is not None:
        _JOB["bar"].update(rows)


def _blocks(i: int):
    """(row_base, table of source rows) of source file i."""
    job = _JOB
    path, plan = job["files"][i], job["plan"]
    if job["fmt"] == "parquet" and i:
        check_same_columns(plan, source_schema(path, "parquet"), path)
    elif job["fmt"] == "csv" and i:
        check_csv_columns(path, plan.columns)
    types = {c: plan.source_types[c] for c in plan.columns} if job["fmt"] == "csv" else None
    row_base = 0
    for t in read_source(path, job["fmt"], plan.columns, job["rows_per_group"], types):
        yield row_base, t
        row_base += t.num_rows
        _report(t.num_rows)
    if row_base == 0:
        raise DataFormatError(f"{OP}: {path}: the file holds no rows")


def _count_file(i: int) -> Tuple[int, Dict[str, Optional[pa.Table]]]:
    """The rows of file i, and the (key, id, count) of every counted table's ids in it; None
    for a table that passed its vocab_limit (it will be hashed)."""
    counter = IdCounter(_JOB["plan"])
    rows = 0
    for _, t in _blocks(i):
        rows += t.num_rows
        counter.add(t)
    return rows, counter.result()


def _write_file(i: int) -> int:
    """Convert source file i to part-<i>.parquet in the temporary folder; rows written."""
    job = _JOB
    plan: Plan = job["plan"]
    where = f"{OP}: {job['files'][i]}"
    blocks = (convert_rows(t, plan, job["specs"], job["vocabs"], where, row_base)
              for row_base, t in _blocks(i))
    return _write_part(os.path.join(job["tmp"], f"part-{i:05d}.parquet"), plan.layout(), blocks,
                       job["rows_per_group"], job["sort_by"], job["spec"], job["out"])


def _write_part(final: str, layout, blocks, rows_per_group: int, sort_by, spec: DatasetSpec,
                out: str) -> int:
    """Blocks of rows in the layout -> the part file `final`, `rows_per_group` rows a row
    group, sorted within groups by `sort_by` ("auto": the key that compresses best), the spec
    in its footer; rows written. A failed write is an OutputError naming `out`."""
    sink, pending, pending_rows, total = None, [], 0, 0

    def write(group: pa.Table):
        nonlocal sink
        try:
            if sink is None:
                # The sort key and encodings are chosen on a sample: the trial writes it twice
                # per candidate key (27 for Criteo), a cost paid once per file.
                trial = group.slice(0, _TRIAL_ROWS)
                choice = choose_sort(trial, layout, sort_by, "zstd", None)
                sink = _FileSink(final, layout, choice, "zstd", None, False)
            sink.write(group)
        except OSError as e:  # a full disk, a quota: named as the output's, not the input's
            raise output_error(out, e) from e

    try:
        for block in blocks:
            pending.append(block)
            pending_rows += block.num_rows
            total += block.num_rows
            while pending_rows >= rows_per_group:
                whole = pa.concat_tables(pending)
                write(whole.slice(0, rows_per_group))
                rest = pending_rows - rows_per_group
                pending, pending_rows = [whole.slice(rows_per_group)], rest
        if pending_rows:
            write(pa.concat_tables(pending))
        with writing(out):
            sink.writer.add_key_value_metadata({SPEC_KEY: spec.to_json()})
            sink.close()
            os.replace(sink.tmp_path, sink.final_path)
    except BaseException:
        if sink is not None:
            sink.abort()
        raise
    return total


def _write_vocabularies(tmp: str, out: str, specs, vocabs) -> None:
    """Create the temporary folder with the vocabulary files of the vocab tables."""
    with writing(out):
        os.makedirs(tmp)
        if vocabs:
            os.makedirs(os.path.join(tmp, "vocab"))
            for name, v in vocabs.items():
                v.save(os.path.join(tmp, specs[name].vocabulary))


def _run(fn, n: int, workers: int, total: Optional[int], desc: str, progress: bool) -> list:
    """fn(i) for i < n, in `workers` forked processes (in this one when 1); a progress bar of
    rows. Results in order of i."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="rows", unit_scale=True, desc=desc, dynamic_ncols=True)
    try:
        if workers <= 1 or n == 1:
            _JOB["bar"], _JOB["queue"] = bar, None
            return [fn(i) for i in range(n)]
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        _JOB["queue"] = queue

        def drain():
            while True:
                rows = queue.get()
                if rows is None:
                    return
                if bar is not None:
                    bar.update(rows)

        thread = threading.Thread(target=drain, daemon=True)
        thread.start()
        try:
            with ctx.Pool(min(workers, n)) as pool:
                return pool.map(fn, range(n), chunksize=1)
        finally:
            queue.put(None)
            thread.join()
            _JOB["queue"] = None
    finally:
        if bar is not None:
            bar.close()


def _total_rows(files: List[str], fmt: str) -> Optional[int]:
    if fmt != "parquet":
        return None
    try:
        return sum(pq.read_metadata(f).num_rows for f in files)
    except (OSError, pa.ArrowException):
        return None  # reported, naming the file, when the file is read


def _estimated_rows(files: List[str]) -> int:
    """Lines of text files, estimated from the first MiB's bytes per line and the files'
    sizes (a .gz file: its trailer's uncompressed size, modulo 4 GiB)."""
    with open_text(files[0]) as f:
        head = f.read(CSV_BLOCK_BYTES)
    per_line = max(1.0, len(head) / max(1, head.count(b"\n")))
    total = 0
    for path in files:
        size = os.path.getsize(path)
        if path.endswith(".gz") and size >= 4:
            with open(path, "rb") as f:
                f.seek(-4, os.SEEK_END)
                size = max(size, struct.unpack("<I", f.read(4))[0])
        total += size
    return max(1, int(total / per_line))


def convert(src, out, schema=None, fmt: Optional[str] = None, *, workers: Optional[int] = None,
            rows_per_group: Optional[int] = None, sort_by: Optional[str] = "auto",
            overwrite: bool = False, progress: bool = True, transforms: Sequence[str] = (),
            joins: Sequence[str] = (),
            on_roles: Optional[Callable[[List[str]], None]] = None) -> DatasetSpec:
    """Convert SRC (a file, or a folder of files of one format) into the dataset folder `out`.

    Args:
        src: path of a .parquet / .csv / Criteo TSV file, or a folder of them; or a table
            (an Iceberg reference "iceberg:<catalog>#<namespace>.<table>", or with
            `transforms` or `joins` a Parquet file or folder, bucketed or not), read as the
            trainer reads a raw table (recxla.data.read_time): joined, transformed, then
            converted; one part file per data file, in one process.
        out: the dataset folder to create: absent or an empty folder, or with `overwrite` a
            dataset that convert wrote (nothing else in it); never one that holds the input.
        schema: a schema file path, a parsed `recxla.data.schema.Schema`, or None (infer).
        fmt: "parquet", "csv" or "criteo-tsv"; None: from the file extension.
        workers: processes converting files in parallel (None: min(files, CPUs)).
        rows_per_group: rows per output row group (the unit of sharding and shuffling); None:
            `default_rows_per_group` of the rows (CSV/TSV without a counting pass: estimated
            from the files' sizes).
        sort_by: "auto", a sparse feature's name, or None (source order) within row groups.
        overwrite: replace an existing dataset at `out` (only once the new one is complete).
        progress: show a progress bar (tqdm) on stderr.
        transforms: "module:function" names applied to the rows (recxla.data.transforms).
        joins: "KEY=TABLE" feature tables joined into the rows (recxla.data.joins).
        on_roles: called with one line per column (its role and why, `column_roles`, with
            the warnings of the id counts: recxla.data.id_counts.flag_measures) once the ids
            are counted, before anything is written.
    Returns the DatasetSpec stored with the data.
    Raises FileNotFoundError, FileExistsError, ValueError / DataFormatError naming the file,
    the column and, where it applies, the row; ValueError naming `out` for an output it may
    not replace; recxla.data.convert_output.OutputError (an OSError) naming `out` when
    writing fails (a full disk). Nothing is left at `out` (or next to it) on failure.
    """
    out = os.fspath(out)
    if rows_per_group is not None and (not isinstance(rows_per_group, int) or isinstance(
            rows_per_group, bool) or rows_per_group < 1):
        raise ValueError(f"{OP}: rows_per_group must be None or an int >= 1, got "
                         f"{rows_per_group!r}")
    if is_table_ref(src) or transforms or joins:
        if fmt not in (None, "parquet", "iceberg"):
            raise ValueError(f"{OP}: transforms, joins and Iceberg tables read Parquet data, "
                             f"not fmt={fmt!r}")
        return _convert_table(os.fspath(src), out, schema, transforms, joins, rows_per_group,
                              sort_by, overwrite, progress, on_roles)
    files, fmt = list_sources(src, fmt)
    check_output(out, files, overwrite)
    plan = _plan(files, fmt, schema)
    if sort_by not in (None, "auto") and sort_by not in [f.name for f in plan.features]:
        raise ValueError(f"{OP}: sort_by must be None, 'auto' or a sparse feature "
                         f"({[f.name for f in plan.features]}), got {sort_by!r}")
    workers = min(len(files), os.cpu_count() or 1) if workers is None else workers
    total = _total_rows(files, fmt)
    tmp = temp_folder(out)
    _JOB.clear()
    _JOB.update(files=files, fmt=fmt, plan=plan, rows_per_group=rows_per_group or MAX_GROUP_ROWS,
                sort_by=sort_by, vocab_limit=plan.vocab_limit, tmp=tmp, out=out)
    try:
        with _installed(tmp, out):
            counts: Dict[str, Optional[pa.Table]] = {}
            if IdCounter(plan).counted:
                per_file = _run(_count_file, len(files), workers, total, "counting ids",
                                progress)
                total = sum(rows for rows, _ in per_file)
                counts = merge_results(plan, (c for _, c in per_file))
                flag_measures(plan, counts, total)
            if on_roles is not None:  # after the counts, which may add a warning to a line
                on_roles(plan.roles if fmt != "criteo-tsv" else _CRITEO_ROLES)
            if rows_per_group is None:
                _JOB["rows_per_group"] = default_rows_per_group(
                    total if total is not None else _estimated_rows(files))
            specs, vocabs = table_specs(plan, counts)
            spec = dataset_spec(plan, specs, f"{OP}: {src}")
            _JOB.update(specs=specs, vocabs=vocabs, spec=spec)
            _write_vocabularies(tmp, out, specs, vocabs)
            _run(_write_file, len(files), workers, total, "converting", progress)
    finally:
        _JOB.clear()
    return spec


@contextlib.contextmanager
def _installed(tmp: str, out: str) -> Iterator[None]:
    """Everything written in the block goes to the temporary folder `tmp`, renamed to `out`
    when the block ends; on any failure `tmp` is removed and `out` is left as it was."""
    try:
        yield
        with writing(out):
            install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _convert_table(src: str, out: str, schema, transforms, joins, rows_per_group, sort_by,
                   overwrite: bool, progress: bool, on_roles) -> DatasetSpec:
    """`convert` of a table read as the trainer reads a raw one: its planning pass counts the
    ids, then each data file's row groups, read again, become one part file."""
    from recxla.data.read_time import ReadTimeTable

    check_output(out, [] if is_table_ref(src) else [src], overwrite)
    table = ReadTimeTable(src, schema, transforms, joins)
    sources = [f for f in table.source.files if "://" not in f]
    for j in table.joiner.joins:
        sources += [f for f in j.source.files if "://" not in f]
    check_output(out, sources, overwrite)
    if on_roles is not None:
        on_roles(table.plan.roles)
    if sort_by not in (None, "auto") and sort_by not in table.spec.sparse_features:
        raise ValueError(f"{OP}: sort_by must be None, 'auto' or a sparse feature "
                         f"({list(table.spec.sparse_features)}), got {sort_by!r}")
    info = table.info
    if info.num_rows == 0:
        raise DataFormatError(f"{OP}: {src}: no rows are left after the transforms")
    rpg = rows_per_group or default_rows_per_group(info.num_rows)
    by_file: Dict[int, List[Tuple[int, int, int]]] = {}
    for fi, gi, rows in info.row_groups:
        if rows:
            by_file.setdefault(fi, []).append((fi, gi, rows))
    tmp = temp_folder(out)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=info.num_rows, unit="rows", unit_scale=True, desc="converting",
                   dynamic_ncols=True)

    def blocks(groups):
        for group in groups:
            t = table.read(*group)
            if bar is not None:
                bar.update(t.num_rows)
            yield t

    try:
        with _installed(tmp, out):
            _write_vocabularies(tmp, out, table.specs, table.vocabs)
            for part, groups in enumerate(by_file.values()):
                _write_part(os.path.join(tmp, f"part-{part:05d}.parquet"), info.layout,
                            blocks(groups), rpg, sort_by, table.spec, out)
    finally:
        if bar is not None:
            bar.close()
    return table.spec


def _plan(files: List[str], fmt: str, schema) -> Plan:
    """The plan of a conversion (schema: a path, a Schema or None)."""
    if schema is None:
        schema = Schema()
    elif not isinstance(schema, Schema):
        schema = load_schema(schema)
    if fmt == "criteo-tsv":
        from recxla.data.convert_criteo import criteo_schema

        schema = criteo_schema(schema)
    columns, sample = source_sample(files[0], fmt)
    if fmt == "csv":  # the columns it will read or infer a role for must be text
        named = schema.named_columns()
        check_utf8(files[0], sample, [c for c in columns.names if c not in schema.ignore and (
            schema.infer or c in named)])
    return make_plan(schema, columns, files[0], sample, text=fmt == "csv")


_CRITEO_ROLES = ["columns: the Criteo layout (label, int_0..int_12 dense, log(max(x, 0) + 1); "
                 "cat_0..cat_25 sparse, hex ids)"]


def column_roles(src, schema=None, fmt: Optional[str] = None) -> List[str]:
    """One line per source column: the role a conversion gives it and why ("column 'ts':
    timestamp: named 'timestamp' (int64)"), from the first rows alone (no id counts, so none
    of the warnings `convert` adds from them). Raises what `convert` raises for the columns."""
    files, fmt = list_sources(src, fmt)
    if fmt == "criteo-tsv":
        return _CRITEO_ROLES
    return _plan(files, fmt, schema).roles


def left_out_columns(src, schema=None, fmt: Optional[str] = None) -> List[str]:
    """The source columns a conversion leaves out (no role in the schema, none inferred)."""
    files, fmt = list_sources(src, fmt)
    if fmt == "criteo-tsv":
        return []
    return _plan(files, fmt, schema).left_out
