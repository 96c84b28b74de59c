"""Conversion speed: `recxla.data.convert` against what a user would write instead, per format.

    .venv/bin/python bench/bench_convert.py [--rows 200000] [--rounds 3]
                                            [--trainer-rate EXAMPLES_PER_S]
        The report of bench/results/convert.md. Writes one source per format to a temporary
        folder (the click log of tests/data_convert_cases.py: string users, int64 items above
        2**40, list<string> genres, list<int64> history sharing the items table, floats, a
        label; the same as CSV with "|"-separated history; Criteo TSV with 20% missing fields)
        and prints rows/s (median of --rounds) of:
        - recxla: `convert(..., workers=1)`, sorted ("auto", the default) and unsorted;
        - pandas + per-row Python: pandas reads the file, a Python loop maps every id of every
          row (dict vocabularies built with Counter; Criteo: int(x or "0", 16) % rows and
          math.log1p per value), pyarrow writes zstd Parquet: the obvious first script;
        - pyarrow compute (Parquet and CSV): value_counts + index_in vocabularies on flattened
          list columns, vectorized, one table in memory (no hex parsing kernel for Criteo);
        against the trainer's consumption (--trainer-rate, examples/s of `torchrun
        --nproc-per-node 2 -m recxla.train`, default: bench_data_pipeline's measured 24.5k).

    .venv/bin/python -m pytest bench/bench_convert.py --benchmark-only
        pytest-benchmark timings of recxla's conversion of each format (20k rows).
"""

import argparse
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for p in (_ROOT, os.path.join(_ROOT, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

from data_convert_cases import click_log, criteo_lines, write_click_log_parquet  # noqa: E402

from recxla.data import convert  # noqa: E402
from recxla.data.schema import parse_schema  # noqa: E402

TRAINER_EXAMPLES_PER_S = 24_500  # bench/results/data_pipeline.md
CLICK_SCHEMA = {"label": "clicked", "timestamp": "ts", "dense": ["age", "price"],
                "dense_log1p": ["price"],
                "sparse": {"item": {"table": "items"}, "history": {"table": "items"},
                           "genres": {"weights": "genre_w"}},
                "tables": {"items": {"mapping": "vocab"}}}
CSV_SCHEMA = {"label": "clicked", "dense": ["age", "price"], "dense_log1p": ["price"],
              "sparse": {"item": {"table": "items"},
                         "history": {"table": "items", "separator": "|"}},
              "tables": {"items": {"mapping": "vocab"}}}
CRITEO_ROWS = 100_000


def make_sources(folder: str, rows: int) -> dict:
    rng = random.Random(0)
    log = click_log(rows, rng)
    write_click_log_parquet(os.path.join(folder, "log.parquet"), log)
    csv = pa.table({"user": log["user"], "item": log["item"],
                    "history": ["|".join(map(str, h)) for h in log["history"]],
                    "age": log["age"], "price": log["price"], "clicked": log["clicked"]})
    pcsv.write_csv(csv, os.path.join(folder, "log.csv"))
    with open(os.path.join(folder, "day_0.tsv"), "w") as f:
        f.write("\n".join(criteo_lines(rows, rng)) + "\n")
    return {"parquet": os.path.join(folder, "log.parquet"),
            "csv": os.path.join(folder, "log.csv"),
            "criteo-tsv": os.path.join(folder, "day_0.tsv")}


def recxla_convert(src: str, fmt: str, out: str, sort_by="auto") -> None:
    schema = {"parquet": CLICK_SCHEMA, "csv": CSV_SCHEMA, "criteo-tsv": {}}[fmt]
    convert(src, out, parse_schema(schema, "bench"), fmt, workers=1, sort_by=sort_by,
            overwrite=True, progress=False)


def _vocab(values) -> dict:
    return {v: i + 1 for i, (v, _) in enumerate(Counter(values).most_common())}


def pandas_per_row(src: str, fmt: str, out: str) -> None:
    """The first script: pandas reads, Python maps row by row, pyarrow writes."""
    import pandas as pd

    if fmt == "criteo-tsv":
        names = ["label"] + [f"int_{j}" for j in range(13)] + [f"cat_{i}" for i in range(26)]
        df = pd.read_csv(src, sep="\t", header=None, names=names, dtype=str,
                         keep_default_na=False)
        cols = {n: [] for n in names}
        for row in df.itertuples(index=False):
            cols["label"].append(float(row[0] or 0))
            for j in range(13):
                cols[f"int_{j}"].append(math.log1p(max(int(row[1 + j] or "0"), 0)))
            for i in range(26):
                cols[f"cat_{i}"].append([int(row[14 + i] or "0", 16) % CRITEO_ROWS])
    else:
        df = pd.read_parquet(src) if fmt == "parquet" else pd.read_csv(src)
        if fmt == "csv":
            df["history"] = [[] if not isinstance(h, str) else h.split("|")
                             for h in df["history"]]
            df["item"] = df["item"].astype(str)
        users = _vocab(df["user"])
        items = _vocab(list(df["item"]) + [h for hs in df["history"] for h in hs])
        genres = _vocab([g for gs in df["genres"] for g in gs]) if "genres" in df else None
        cols = {k: [] for k in ("user", "item", "history", "genres", "age", "price", "label")}
        for row in df.to_dict("records"):
            cols["user"].append([users[row["user"]]])
            cols["item"].append([items[row["item"]]])
            cols["history"].append([items[h] for h in row["history"]])
            if genres is not None:
                cols["genres"].append([genres[g] for g in row["genres"]])
            cols["age"].append(float(row["age"]))
            price = row["price"]
            cols["price"].append(math.log1p(max(price, 0.0)) if price == price else 0.0)
            cols["label"].append(float(row["clicked"]))
        cols = {k: v for k, v in cols.items() if v}
    pq.write_table(pa.table(cols), out, compression="zstd")


def _vocab_rows(values: pa.Array, vocab: pa.Array) -> pa.Array:
    return pc.add(pc.fill_null(pc.index_in(values, value_set=vocab), -1), 1)


def pyarrow_compute(src: str, fmt: str, out: str) -> None:
    """Vectorized with pyarrow.compute: vocabularies from value_counts, rows from index_in."""
    t = pq.read_table(src) if fmt == "parquet" else pcsv.read_csv(src)
    history = t.column("history").combine_chunks()
    item = t.column("item").combine_chunks()
    if fmt == "csv":
        history = pc.split_pattern(history, "|")
        item = item.cast(pa.string())
    flat_hist = history.flatten()
    items = pc.value_counts(pa.concat_arrays([item, flat_hist.cast(item.type)]))
    order = pc.array_sort_indices(items.field("counts"), order="descending")
    items = items.field("values").take(order)
    users = pc.value_counts(t.column("user").combine_chunks()).field("values")
    cols = {
        "user": _vocab_rows(t.column("user"), users),
        "item": _vocab_rows(item, items),
        "history": pa.ListArray.from_arrays(history.offsets,
                                            _vocab_rows(flat_hist.cast(item.type), items)),
        "age": t.column("age"),
        "price": pc.ln(pc.add(pc.max_element_wise(pc.fill_null(t.column("price"), 0.0), 0.0),
                              1.0)),
        "label": pc.cast(t.column("clicked"), pa.float32()),
    }
    pq.write_table(pa.table(cols), out, compression="zstd")


def _median_rate(fn, rows: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return rows / statistics.median(times)


def report(rows: int, rounds: int, trainer_rate: float) -> None:
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; rows {rows:,}; medians of "
          f"{rounds} rounds; trainer {trainer_rate:,.0f} examples/s")
    folder = tempfile.mkdtemp(prefix="bench_convert_")
    try:
        sources = make_sources(folder, rows)
        out = os.path.join(folder, "out")
        print("| format | provider | rows/s | vs pandas per-row | vs trainer |")
        print("|---|---|---|---|---|")
        for fmt, src in sources.items():
            runs = {
                "recxla convert (sorted, default)": lambda: recxla_convert(src, fmt, out),
                "recxla convert (unsorted)": lambda: recxla_convert(src, fmt, out, None),
                "pandas + per-row Python": lambda: pandas_per_row(src, fmt, out + ".parquet"),
            }
            if fmt != "criteo-tsv":
                runs["pyarrow compute"] = lambda: pyarrow_compute(src, fmt, out + ".parquet")
            rates = {name: _median_rate(fn, rows, rounds) for name, fn in runs.items()}
            base = rates["pandas + per-row Python"]
            for name, rate in rates.items():
                print(f"| {fmt} | {name} | {rate:,.0f} | {rate / base:.2f}x | "
                      f"{rate / trainer_rate:.1f}x |")
            print(f"load after {fmt}: {os.getloadavg()[0]:.1f}", file=sys.stderr)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return make_sources(str(tmp_path_factory.mktemp("convert_sources")), 20_000)


@pytest.mark.parametrize("fmt", ["parquet", "csv", "criteo-tsv"])
def test_convert(benchmark, sources, fmt, tmp_path):
    benchmark.extra_info["rows"] = 20_000
    benchmark(recxla_convert, sources[fmt], fmt, str(tmp_path / "out"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trainer-rate", type=float, default=TRAINER_EXAMPLES_PER_S)
    args = parser.parse_args(argv)
    report(args.rows, args.rounds, args.trainer_rate)


if __name__ == "__main__":
    main()
