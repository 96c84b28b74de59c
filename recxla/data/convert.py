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
  text, up to 35 of them read ahead: recxla.data.convert_source.CSV_BUFFERED_BLOCKS) and
  written a row group at a time, so memory per worker is bounded by a row group and the
  blocks read ahead, whatever the input's size, plus the id counts of vocab tables (distinct
  ids, not rows).
- Two passes when a table needs its ids counted (mapping "vocab", or no mapping given: the
  default is a vocabulary when the table has at most `vocab_limit` distinct ids, else hashing
  into `default_rows` rows; counting stops at the limit), else one.
- In parallel over files: `workers` processes (fork), one source file each at a time.
- Nothing half-written: files go to a hidden temporary folder next to `out`, renamed to `out`
  only when every file and vocabulary is complete; on failure the temporary folder is removed.
"""

import multiprocessing as mp
import os
import re
import shutil
import threading
import uuid
from typing import Dict, List, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from recxla.data.convert_plan import Plan, check_same_columns, convert_rows, id_bags, make_plan
from recxla.data.convert_source import list_sources, read_source, source_schema
from recxla.data.errors import DataFormatError
from recxla.data.id_mapping import Vocabulary, count_ids, keys_of, merge_counts
from recxla.data.parquet_layout import SPEC_KEY
from recxla.data.parquet_writer import _FileSink, choose_sort
from recxla.data.schema import DatasetSpec, Schema, TableSpec, load_schema

OP = "recxla.data.convert"
DEFAULT_ROWS_PER_GROUP = 65536
_TRIAL_ROWS = 8192
_COMPACT_ROWS = 1 << 20  # merge a table's partial counts once they hold this many entries

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
    types = {c: plan.source_types[c] for c in plan.columns} if job["fmt"] == "csv" else None
    row_base = 0
    for t in read_source(path, job["fmt"], plan.columns, job["rows_per_group"], types):
        yield row_base, t
        row_base += t.num_rows
        _report(t.num_rows)
    if row_base == 0:
        raise DataFormatError(f"{OP}: {path}: the file holds no rows")


def _count_file(i: int) -> Dict[str, Optional[pa.Table]]:
    """(key, id, count) of every counted table's ids in file i; None for a table that passed
    its vocab_limit (it will be hashed)."""
    plan: Plan = _JOB["plan"]
    counted = _JOB["counted"]
    limit = _JOB["vocab_limit"]
    parts: Dict[str, List[pa.Table]] = {name: [] for name in counted}
    for _, t in _blocks(i):
        for f in plan.features:
            if parts.get(f.table) is None:
                continue
            tp = plan.tables[f.table]
            _, ids, _ = id_bags(t.column(f.column).combine_chunks(), f.is_list, f.separator)
            # uint64 ids above 2**63 keep their bits (their key) as int64.
            raw = ids.cast(pa.large_string()) if tp.id_type == "string" else ids.cast(
                pa.int64(), safe=False)
            parts[f.table].append(count_ids(keys_of(ids, tp.id_type), raw))
        for name, p in parts.items():
            # A table with no mapping given is counted only up to the limit.
            bound = _COMPACT_ROWS if counted[name] == "vocab" else min(_COMPACT_ROWS, 2 * limit)
            if p is not None and sum(x.num_rows for x in p) > bound:
                merged = merge_counts(p)
                over = counted[name] is None and merged.num_rows > limit
                parts[name] = None if over else [merged]
    return {name: None if p is None else merge_counts(p) if p else None for name, p in
            parts.items()}


def _write_file(i: int) -> int:
    """Convert source file i to part-<i>.parquet in the temporary folder; rows written."""
    job = _JOB
    plan: Plan = job["plan"]
    path = job["files"][i]
    layout = plan.layout()
    rpg = job["rows_per_group"]
    final = os.path.join(job["tmp"], f"part-{i:05d}.parquet")
    sink, pending, pending_rows, total = None, [], 0, 0
    where = f"{OP}: {path}"

    def write(group: pa.Table):
        nonlocal sink
        if sink is None:
            # The sort key and encodings are chosen on a sample: the trial writes it twice per
            # candidate key (27 for Criteo), a cost paid once per file.
            trial = group.slice(0, _TRIAL_ROWS)
            choice = choose_sort(trial, layout, job["sort_by"], "zstd", None)
            sink = _FileSink(final, layout, choice, "zstd", None, False)
        sink.write(group)

    try:
        for row_base, t in _blocks(i):
            out = convert_rows(t, plan, job["specs"], job["vocabs"], where, row_base)
            pending.append(out)
            pending_rows += out.num_rows
            total += out.num_rows
            while pending_rows >= rpg:
                whole = pa.concat_tables(pending)
                write(whole.slice(0, rpg))
                pending, pending_rows = [whole.slice(rpg)], pending_rows - rpg
        if pending_rows:
            write(pa.concat_tables(pending))
        sink.writer.add_key_value_metadata({SPEC_KEY: job["spec"].to_json()})
        sink.close()
        os.replace(sink.tmp_path, sink.final_path)
    except BaseException:
        if sink is not None:
            sink.abort()
        raise
    return total


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


def _table_specs(plan: Plan, counts: Dict[str, Optional[pa.Table]], default_rows: int):
    """Final TableSpecs (mapping, rows) and the vocabularies, from the schema and counts."""
    specs, vocabs = {}, {}
    for name, tp in plan.tables.items():
        ts = tp.schema
        mapping = ts.mapping
        if mapping is None:
            mapping = "hash" if counts.get(name) is None else "vocab"
        rows = ts.rows or default_rows
        vocab_file = None
        if mapping == "vocab":
            vocab = Vocabulary.build(counts[name], ts.min_count,
                                     None if ts.rows is None else ts.rows - 1)
            vocabs[name] = vocab
            rows = len(vocab) + 1
            safe = re.sub(r"[^\w.\-]", "_", name)
            vocab_file = f"vocab/{safe}.parquet"
        specs[name] = TableSpec(name=name, features=tp.features, num_rows=rows,
                                embedding_dim=ts.dim, pooling=ts.pooling, weighted=tp.weighted,
                                mapping=mapping, min_count=ts.min_count,
                                vocabulary=vocab_file, id_type=tp.id_type)
    return specs, vocabs


def _total_rows(files: List[str], fmt: str) -> Optional[int]:
    if fmt != "parquet":
        return None
    try:
        return sum(pq.read_metadata(f).num_rows for f in files)
    except (OSError, pa.ArrowException):
        return None  # reported, naming the file, when the file is read


def convert(src, out, schema=None, fmt: Optional[str] = None, *, workers: Optional[int] = None,
            rows_per_group: int = DEFAULT_ROWS_PER_GROUP, sort_by: Optional[str] = "auto",
            overwrite: bool = False, progress: bool = True) -> DatasetSpec:
    """Convert SRC (a file, or a folder of files of one format) into the dataset folder `out`.

    Args:
        src: path of a .parquet / .csv / Criteo TSV file, or a folder of them.
        out: the dataset folder to create (must not exist or be empty, unless `overwrite`).
        schema: a schema file path, a parsed `recxla.data.schema.Schema`, or None (infer).
        fmt: "parquet", "csv" or "criteo-tsv"; None: from the file extension.
        workers: processes converting files in parallel (None: min(files, CPUs)).
        rows_per_group: rows per output row group (the unit of sharding and shuffling).
        sort_by: "auto", a sparse feature's name, or None (source order) within row groups.
        overwrite: replace an existing dataset at `out` (only once the new one is complete).
        progress: show a progress bar (tqdm) on stderr.
    Returns the DatasetSpec stored with the data.
    Raises FileNotFoundError, FileExistsError, ValueError / DataFormatError naming the file,
    the column and, where it applies, the row. Nothing is left at `out` on failure.
    """
    out = os.fspath(out)
    if not isinstance(rows_per_group, int) or rows_per_group < 1:
        raise ValueError(f"{OP}: rows_per_group must be an int >= 1, got {rows_per_group!r}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) and not overwrite:
        raise FileExistsError(f"{OP}: {out} exists and is not an empty folder; pass "
                              "overwrite=True (--overwrite) to replace it")
    files, fmt = list_sources(src, fmt)
    if schema is None:
        schema = Schema()
    elif not isinstance(schema, Schema):
        schema = load_schema(schema)
    if fmt == "criteo-tsv":
        from recxla.data.convert_criteo import criteo_schema

        schema = criteo_schema(schema)
    plan = make_plan(schema, source_schema(files[0], fmt), files[0])
    if sort_by not in (None, "auto") and sort_by not in [f.name for f in plan.features]:
        raise ValueError(f"{OP}: sort_by must be None, 'auto' or a sparse feature "
                         f"({[f.name for f in plan.features]}), got {sort_by!r}")
    workers = min(len(files), os.cpu_count() or 1) if workers is None else workers
    total = _total_rows(files, fmt)
    parent = os.path.dirname(os.path.abspath(out))
    tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.tmp-"
                       f"{uuid.uuid4().hex[:8]}")
    _JOB.clear()
    _JOB.update(files=files, fmt=fmt, plan=plan, rows_per_group=rows_per_group,
                sort_by=sort_by, vocab_limit=schema.vocab_limit, tmp=tmp)
    try:
        counted = {n: t.schema.mapping for n, t in plan.tables.items()
                   if t.schema.mapping in (None, "vocab")}
        counts: Dict[str, Optional[pa.Table]] = {}
        if counted:
            _JOB["counted"] = counted
            per_file = _run(_count_file, len(files), workers, total, "counting ids", progress)
            for name in counted:
                parts = [c[name] for c in per_file]
                if any(p is None for p in parts):
                    counts[name] = None
                    continue
                merged = merge_counts(parts)
                over = counted[name] is None and merged.num_rows > schema.vocab_limit
                counts[name] = None if over else merged
        specs, vocabs = _table_specs(plan, counts, schema.default_rows)
        spec = DatasetSpec(
            sparse_features=tuple(f.name for f in plan.features),
            dense_features=tuple(plan.dense), label=plan.label,
            tables=tuple(specs[n] for n in plan.tables if specs[n].features),
            timestamp=plan.timestamp, label_kind=plan.label_kind)
        spec.check(f"{OP}: {src}")
        _JOB.update(specs=specs, vocabs=vocabs, spec=spec)
        os.makedirs(tmp)
        if vocabs:
            os.makedirs(os.path.join(tmp, "vocab"))
            for name, v in vocabs.items():
                v.save(os.path.join(tmp, specs[name].vocabulary))
        _run(_write_file, len(files), workers, total, "converting", progress)
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _JOB.clear()
    return spec


def _install(tmp: str, out: str) -> None:
    """Rename the complete temporary folder to `out`, replacing what was there."""
    old = None
    if os.path.exists(out):
        old = f"{tmp}.old"
        os.rename(out, old)
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def left_out_columns(src, schema=None, fmt: Optional[str] = None) -> List[str]:
    """The source columns a conversion leaves out (no role in the schema, none inferred)."""
    files, fmt = list_sources(src, fmt)
    schema = Schema() if schema is None else schema if isinstance(schema, Schema) else (
        load_schema(schema))
    if fmt == "criteo-tsv":
        return []
    return make_plan(schema, source_schema(files[0], fmt), files[0]).left_out

