"""Command line of recxla.data.

    python -m recxla.data write --out PATH --batches N [--sort-by KEY] [--batch-size 8192]
                                [--seed 0] [--max-rows 100000] [--rows-per-file N] [--overwrite]
        Writes N synthetic batches (`SyntheticRankingDataset`, the Criteo Kaggle profile with
        tables capped at R rows) to PATH (a .parquet file, or a folder) with
        `recxla.data.write_parquet`, and prints the size on disk next to the unsorted layout's.
        R defaults to the trainer's default --max-rows, so that `python -m recxla.train --data
        PATH` trains on the output with its default tables (--max-rows 0: the full tables).
        --sort-by: none (default), auto (the key that compresses best on the first row group),
        a feature name (cat_0 ... cat_25) or request_id.

    python -m recxla.data info PATH
        Prints the dataset's metadata (layout, rows, bytes, sort key and trial) as JSON, and
        its DatasetSpec (features, tables, dense features, label, id mapping).

    python -m recxla.data convert SRC --out DIR [--schema FILE] [--format parquet|csv|criteo-tsv]
                                  [--workers N] [--rows-per-group N] [--sort-by auto]
                                  [--transform MODULE:FN ...] [--join KEY=TABLE ...]
                                  [--overwrite] [--no-progress]
        Converts a click log (a file, or a folder of files of one format) into a dataset folder
        that `python -m recxla.train --data DIR` trains with no other flags (recxla.data.convert;
        docs/your-data.md describes the formats, the schema file and the id mapping). Prints
        every column's role and why before converting. --overwrite replaces only a dataset
        that convert wrote, never a folder holding the input. SRC may be an Iceberg table
        (iceberg:CATALOG#NAMESPACE.TABLE); with --transform or --join the rows are joined and
        transformed as the trainer reads a raw table (recxla.data.read_time), then converted.

    python -m recxla.data bucket SRC --key COLUMN --buckets N --out DIR [--rows-per-group R]
                                 [--no-progress]
        Splits a Parquet file, or a folder of them, into N buckets by Iceberg's bucket
        transform of COLUMN (recxla.data.buckets): DIR/COLUMN_bucket=<i>/part-00000.parquet for
        i in 0..N-1, the layout of an Iceberg table partitioned by bucket(COLUMN, N), so that
        feature tables bucketed by the same key and N join bucket for bucket. Prints each
        bucket's rows and the total. DIR must be absent or an empty folder.

Exit status: 0 done; 2 a usage or data error (bad arguments, input or schema; an output it may
not replace), the message naming the file, column, row or limit; 1 writing failed (a full
disk, permissions), the message naming the output; nothing is left at the output on 1 or 2.
"""

import argparse
import json
import sys
import time

from recxla.data.parquet_layout import MAX_GROUP_ROWS
from recxla.data.errors import DataFormatError

# recxla.train's default --max-rows (not imported: recxla.data does not depend on the trainer).
TRAINER_MAX_ROWS = 100_000


def _write(args) -> int:
    from recxla.data import SyntheticRankingDataset, criteo_kaggle_profile, write_parquet
    from recxla.data.parquet_layout import DatasetInfo

    sort_by = None if args.sort_by == "none" else args.sort_by
    profile = criteo_kaggle_profile(max_rows=args.max_rows or None)
    data = SyntheticRankingDataset(profile, batch_size=args.batch_size,
                                   num_batches=args.batches, seed=args.seed)
    start = time.perf_counter()
    write_parquet(data, args.out, sort_by=sort_by, rows_per_file=args.rows_per_file,
                  measure_unsorted=sort_by is not None, overwrite=args.overwrite)
    seconds = time.perf_counter() - start
    info = DatasetInfo(args.out, "python -m recxla.data write").summary()
    print(f"wrote {info['rows']} rows ({args.batches} batches of {args.batch_size}) to "
          f"{args.out}: {info['files']} file(s), {info['row_groups']} row groups, "
          f"{info['bytes']:,} bytes, {seconds:.1f} s (generation included)")
    if sort_by is not None:
        trial = info["sort_trial"]["bytes"]
        ranked = sorted(trial.items(), key=lambda kv: kv[1])[:5]
        print(f"sorted by {info['sort_by']} within row groups; first row group with each key "
              "tried (bytes): " + ", ".join(f"{k} {v:,}" for k, v in ranked))
        unsorted = info["unsorted_bytes"]
        print(f"unsorted layout: {unsorted:,} bytes; sorted is {1 - info['bytes'] / unsorted:.1%}"
              " smaller")
    return 0


def _info(args) -> int:
    import dataclasses

    from recxla.data.parquet_layout import DatasetInfo, is_recxla_layout
    from recxla.data.schema import read_dataset_spec
    from recxla.data.table_source import is_table_ref

    raw = args.schema is not None or args.transform or args.join
    if raw or is_table_ref(args.path) or not is_recxla_layout(args.path):
        # A raw table (a bucketed folder, other Parquet files, an Iceberg table): what the
        # trainer would make of it, read as it is (recxla.data.read_time).
        from recxla.data.read_time import ReadTimeTable

        table = ReadTimeTable(args.path, args.schema, args.transform, args.join)
        summary = {"raw_table": args.path, "rows": table.info.num_rows,
                   "row_groups": len(table.info.unit_of), "roles": table.plan.roles,
                   "spec": dataclasses.asdict(table.spec)}
    else:
        summary = DatasetInfo(args.path, "python -m recxla.data info").summary()
        summary["spec"] = dataclasses.asdict(read_dataset_spec(args.path))
    print(json.dumps(summary, indent=2))
    return 0


def _convert(args) -> int:
    from recxla.data.convert import convert

    def print_roles(lines):
        for line in lines:
            print(line, flush=True)

    sort_by = None if args.sort_by == "none" else args.sort_by
    start = time.perf_counter()
    spec = convert(args.src, args.out, args.schema, args.format, workers=args.workers,
                   rows_per_group=args.rows_per_group, sort_by=sort_by,
                   overwrite=args.overwrite, progress=not args.no_progress,
                   transforms=args.transform, joins=args.join, on_roles=print_roles)
    seconds = time.perf_counter() - start
    from recxla.data.parquet_layout import DatasetInfo

    info = DatasetInfo(args.out, "python -m recxla.data convert").summary()
    groups = DatasetInfo(args.out, "python -m recxla.data convert").row_groups
    print(f"converted {info['rows']:,} rows in {seconds:.1f} s ({info['rows'] / seconds:,.0f} "
          f"rows/s) to {args.out}: {info['files']} file(s), {info['bytes']:,} bytes, "
          f"{len(groups)} row groups of up to {max(r for _, _, r in groups):,} rows"
          f"{'' if args.rows_per_group else ' (from the row count; --rows-per-group sets it)'}")
    print(f"dense features ({len(spec.dense_features)}): {list(spec.dense_features)}; label "
          f"{spec.label!r} ({spec.label_kind}); timestamp {spec.timestamp!r}")
    for t in spec.tables:
        print(f"table {t.name}: {t.num_rows:,} rows, {t.mapping}"
              f"{f' (min count {t.min_count})' if t.mapping == 'vocab' else ''}, {t.pooling}"
              f"{'' if t.embedding_dim is None else f', dim {t.embedding_dim}'}"
              f"{', weighted' if t.weighted else ''}: {list(t.features)}")
    return 0


def _bucket(args) -> int:
    from recxla.data.buckets import bucket_folder_name, write_buckets

    start = time.perf_counter()
    result = write_buckets(args.src, args.key, args.buckets, args.out,
                           rows_per_group=args.rows_per_group, progress=not args.no_progress)
    seconds = time.perf_counter() - start
    for i, rows in enumerate(result["rows_per_bucket"]):
        print(f"{bucket_folder_name(args.key, i)}: {rows:,} rows")
    print(f"wrote {result['rows']:,} rows in {result['buckets']} buckets (bucket({args.key}, "
          f"{result['buckets']}), Iceberg's bucket transform) to {args.out} in {seconds:.1f} s")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m recxla.data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write synthetic batches to Parquet")
    w.add_argument("--out", required=True, help="a .parquet file or a folder")
    w.add_argument("--batches", type=int, required=True, help="batches to write")
    w.add_argument("--sort-by", default="none",
                   help="none, auto, a feature name or request_id (default none)")
    w.add_argument("--batch-size", type=int, default=8192, help="rows per batch and row group")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--max-rows", type=int, default=TRAINER_MAX_ROWS,
                   help="cap every table at this many rows, to match the trainer's tables "
                   f"(default {TRAINER_MAX_ROWS:,}, the trainer's default; 0: the full tables)")
    w.add_argument("--rows-per-file", type=int, default=None, help="folders: rows per file")
    w.add_argument("--overwrite", action="store_true",
                   help="replace the .parquet files recxla wrote there (never anything else)")
    i = sub.add_parser("info", help="print a dataset's metadata, or what a raw table's "
                       "columns become (their roles, the tables)")
    i.add_argument("path")
    i.add_argument("--schema", default=None, help="a raw table: the schema file (TOML)")
    i.add_argument("--transform", action="append", default=[],
                   help="a raw table: a transform, module:function or file.py:function")
    i.add_argument("--join", action="append", default=[],
                   help="a raw table: KEY=TABLE, a feature table joined on KEY")
    c = sub.add_parser("convert", help="convert Parquet, CSV or Criteo TSV into a dataset")
    c.add_argument("src", help="a file, or a folder of files of one format, or an Iceberg "
                   "table (iceberg:CATALOG#NAMESPACE.TABLE)")
    c.add_argument("--out", required=True, help="the dataset folder to create")
    c.add_argument("--schema", default=None, help="a schema file (TOML); default: infer")
    c.add_argument("--format", default=None, choices=("parquet", "csv", "criteo-tsv"),
                   help="default: from the file extension (.parquet, .csv, .tsv)")
    c.add_argument("--workers", type=int, default=None,
                   help="processes converting files in parallel (default: min(files, CPUs))")
    c.add_argument("--rows-per-group", type=int, default=None,
                   help="rows per row group, the unit of sharding and shuffling (default: from "
                   "the row count, 64 groups of 1,024 to 65,536 rows, at least 16 groups)")
    c.add_argument("--sort-by", default="auto",
                   help="auto (default), none, or a sparse feature's name")
    c.add_argument("--transform", action="append", default=[], metavar="MODULE:FN",
                   help="a Python function over Arrow record batches applied to the rows after "
                   "the joins (module:function or file.py:function); repeat for several")
    c.add_argument("--join", action="append", default=[], metavar="KEY=TABLE",
                   help="join a feature table on a key column (a Parquet file or folder, "
                   "bucketed like SRC, or iceberg:...); repeat for several")
    c.add_argument("--overwrite", action="store_true", help="replace an existing dataset")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    b = sub.add_parser("bucket", help="split Parquet into buckets by Iceberg's bucket(key, N)")
    b.add_argument("src", help="a Parquet file, or a folder of them (same columns)")
    b.add_argument("--key", required=True, help="the column to bucket by (integers or strings)")
    b.add_argument("--buckets", type=int, required=True, help="N, in [1, 2**31 - 1]")
    b.add_argument("--out", required=True, help="the folder to create (absent or empty)")
    b.add_argument("--rows-per-group", type=int, default=None,
                   help="rows read per block and per output row group (default: as a "
                   f"conversion's, about 1/64 of the rows, at most {MAX_GROUP_ROWS:,})")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.command == "write" and args.batches < 1:
        parser.error("--batches must be >= 1")
    if args.command == "write" and args.max_rows < 0:
        parser.error("--max-rows must be >= 0 (0: the full tables)")
    if args.command == "convert" and args.workers is not None and args.workers < 1:
        parser.error("--workers must be >= 1")
    if args.command in ("convert", "bucket") and args.rows_per_group is not None and \
            args.rows_per_group < 1:
        parser.error("--rows-per-group must be >= 1")
    try:
        return {"write": _write, "info": _info, "convert": _convert,
                "bucket": _bucket}[args.command](args)
    except (FileNotFoundError, FileExistsError, DataFormatError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # writing failed (recxla.data.convert_output.OutputError)
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
