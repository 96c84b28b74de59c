"""The data pipeline on the synthetic ranking log: bytes on disk sorted vs unsorted, reader and
loader examples/s against a naive row-wise reader, CompactBatch size and encode/decode time.

Two entry points:

    .venv/bin/python bench/bench_data_pipeline.py [--batches 16] [--rounds 5]
                                                  [--trainer-rate EXAMPLES_PER_S]
        The report of bench/results/data_pipeline.md. Writes `--batches` batches of 8192
        samples of the default profile (`criteo_kaggle_profile()`, full Criteo table sizes) to
        a temporary folder, unsorted and with sort_by="auto", then prints:
        - bytes on disk: pyarrow's defaults (pq.write_table, zstd), recxla unsorted, recxla
          sorted, and the first-row-group trial that chose the sort key;
        - examples/s in steady state (after the first batch, so process and Ray start-up are
          reported apart; two epochs, so every shuffle window's read is counted) of: a naive
          reader (row-wise Python over `to_pylist()`, the way a Parquet-to-KJT reader is first
          written), ParquetDataset in its default order (rows shuffled within windows of
          row groups) without and with prefetch, with rows as stored (`shuffle_rows=0`, the
          order before shuffle windows) and in file order (`shuffle=False`), the local loader
          with 1 and 2 workers, the Ray loader with 2 tasks; medians of
          `--rounds` interleaved rounds, against the trainer's consumption (--trainer-rate:
          examples/s of `python -m recxla.train` on 2 ranks with its defaults, measured apart,
          since a trainer and these readers on the same 2 cores would measure each other);
        - distinct users (values of the sort key) per batch of the sorted file, read with rows
          as stored and in the default shuffle windows, against batches drawn at random from
          the whole file;
        - CompactBatch bytes and encode/decode times (raw, zstd 1, zstd 3) against pickle of
          the same Batch and a memcpy of the raw bytes.

    .venv/bin/python -m pytest bench/bench_data_pipeline.py --benchmark-only
        pytest-benchmark timings of the reader (one row group per call) and of CompactBatch.
"""

import argparse
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from recxla.data import (  # noqa: E402
    Batch,
    CompactBatch,
    ParquetDataset,
    SyntheticRankingDataset,
    make_loader,
    write_parquet,
)
from recxla.data.parquet_layout import Layout  # noqa: E402
from recxla.data.parquet_writer import batch_to_table  # noqa: E402

WRITE_BATCH = 8192
# examples/s of `torchrun --nproc-per-node 2 -m recxla.train` with its defaults (synthetic logs,
# batch 1024 a rank) on this project's 2-core machine: bench/results/data_pipeline.md.
TRAINER_EXAMPLES_PER_S = 24_500


def naive_batches(path: str, batch_size: int):
    """The baseline reader: Arrow record batches -> Python rows -> lists -> tensors."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    f = pq.ParquetFile(path)
    names = [n for n in f.schema_arrow.names if n.startswith("sparse:")]
    dense_names = [n for n in f.schema_arrow.names if n.startswith("dense:")]
    for record_batch in f.iter_batches(batch_size=batch_size):
        rows = record_batch.to_pylist()
        lengths, values = [], []
        for name in names:
            for row in rows:
                lengths.append(len(row[name]))
                values.extend(row[name])
        kjt = KeyedJaggedTensor(keys=[n[7:] for n in names], values=torch.tensor(values),
                                lengths=torch.tensor(lengths, dtype=torch.int32),
                                stride=len(rows))
        dense = torch.tensor([[row[n] for n in dense_names] for row in rows])
        labels = torch.tensor([row["label"] for row in rows])
        yield Batch(kjt, dense, labels, torch.tensor([row["request_id"] for row in rows]))


def write_data(folder: str, num_batches: int) -> dict:
    data = SyntheticRankingDataset(batch_size=WRITE_BATCH, num_batches=num_batches, seed=0)
    t0 = time.perf_counter()
    batches = list(data)
    generate = time.perf_counter() - t0
    paths = {"unsorted": os.path.join(folder, "unsorted.parquet"),
             "sorted": os.path.join(folder, "sorted.parquet")}
    t0 = time.perf_counter()
    write_parquet(batches, paths["unsorted"])
    write_unsorted = time.perf_counter() - t0
    t0 = time.perf_counter()
    write_parquet(batches, paths["sorted"], sort_by="auto", measure_unsorted=True)
    write_sorted = time.perf_counter() - t0
    layout = Layout.of_batch(batches[0], "bench")
    plain = os.path.join(folder, "pyarrow_defaults.parquet")
    pq.write_table(pa.concat_tables([batch_to_table(b, layout) for b in batches]), plain,
                   row_group_size=WRITE_BATCH, compression="zstd")
    return {"paths": paths, "plain": plain, "batches": batches, "generate": generate,
            "write_unsorted": write_unsorted, "write_sorted": write_sorted}


def sizes_table(d: dict, lines: list) -> None:
    meta = ParquetDataset(d["paths"]["sorted"], WRITE_BATCH).metadata
    unsorted = ParquetDataset(d["paths"]["unsorted"], WRITE_BATCH).metadata["bytes"]
    plain = os.path.getsize(d["plain"])
    rows = meta["rows"]
    raw = sum(len(CompactBatch.encode(b, compress=False)) for b in d["batches"])
    lines += [
        "| layout | bytes | bytes/sample | vs recxla unsorted |", "|---|---|---|---|",
        f"| raw tensors (CompactBatch, no compression) | {raw:,} | {raw / rows:.1f} | "
        f"{raw / unsorted:.2f}x |",
        f"| pyarrow defaults (pq.write_table, zstd, dictionary everywhere), unsorted | {plain:,} "
        f"| {plain / rows:.1f} | {plain / unsorted:.2f}x |",
        f"| recxla unsorted (encodings measured per column) | {unsorted:,} | "
        f"{unsorted / rows:.1f} | 1.00x |",
        f"| recxla sorted by {meta['sort_by']} (sort_by='auto') | {meta['bytes']:,} | "
        f"{meta['bytes'] / rows:.1f} | {meta['bytes'] / unsorted:.2f}x "
        f"({1 - meta['bytes'] / unsorted:.1%} smaller; {1 - meta['bytes'] / plain:.1%} smaller "
        "than pyarrow defaults) |",
        "",
        f"Unsorted layout measured by the sorted write itself (measure_unsorted): "
        f"{meta['unsorted_bytes']:,} bytes. Write times ({len(d['batches'])} batches): unsorted "
        f"{d['write_unsorted']:.1f} s, sorted with the 'auto' trial {d['write_sorted']:.1f} s; "
        f"generating the batches took {d['generate']:.1f} s.",
        "",
        "The 'auto' trial (first row group, 8192 rows, bytes with each sort key, best 8 and "
        "unsorted):", "",
        "| sort key | bytes | vs unsorted |", "|---|---|---|",
    ]
    trial = meta["sort_trial"]["bytes"]
    for key, size in sorted(trial.items(), key=lambda kv: kv[1])[:8] + [("none", trial["none"])]:
        lines.append(f"| {key} | {size:,} | {size / trial['none']:.2f}x |")
    lines.append("")


def steady_rate(make_iter, batches: int) -> tuple:
    """(examples/s over `batches` batches after the first, seconds to the first batch)."""
    t0 = time.perf_counter()
    it = make_iter()
    first = next(it)
    start = time.perf_counter()
    n = 0
    for _ in range(batches):
        n += next(it).batch_size
    rate = n / (time.perf_counter() - start)
    close = getattr(it, "close", None)
    if close is not None:
        close()
    return rate, start - t0, first.batch_size


def reader_table(d: dict, batch_size: int, rounds: int, lines: list, ray_dir: str,
                 trainer_rate: float) -> None:
    path = d["paths"]["sorted"]
    epoch = ParquetDataset(path, batch_size).num_batches(0)
    n = 2 * epoch  # two epochs of steady state (endless loaders)
    providers = {
        "naive row-wise Python reader": (lambda: naive_batches(path, batch_size),
                                         max(2, 16384 // batch_size)),
        "ParquetDataset, prefetch=0": (lambda: iter(ParquetDataset(
            path, batch_size, num_epochs=None, prefetch=0)), n),
        "ParquetDataset, prefetch=2 (thread)": (lambda: iter(ParquetDataset(
            path, batch_size, num_epochs=None)), n),
        "ParquetDataset, rows as stored (shuffle_rows=0), prefetch=0": (
            lambda: iter(ParquetDataset(path, batch_size, num_epochs=None, prefetch=0,
                                        shuffle_rows=0)), n),
        "ParquetDataset, file order (shuffle=False), prefetch=0": (
            lambda: iter(ParquetDataset(path, batch_size, num_epochs=None, prefetch=0,
                                        shuffle=False)), n),
        "ParquetDataset, unsorted file": (lambda: iter(ParquetDataset(
            d["paths"]["unsorted"], batch_size, num_epochs=None)), n),
        "local loader, 1 worker": (lambda: iter(make_loader(path, batch_size, num_workers=1)), n),
        "local loader, 2 workers": (lambda: iter(make_loader(path, batch_size, num_workers=2)), n),
    }
    ray_loader = None
    try:
        import ray  # noqa: F401

        ray_loader = make_loader(path, batch_size, loader="ray", num_workers=2, run_dir=ray_dir)
        providers["Ray loader, 2 tasks (zstd batches)"] = (lambda: iter(ray_loader), n)
    except ImportError:
        lines.append("(Ray is not installed: no Ray row.)")
    rates = {name: [] for name in providers}
    starts = {name: [] for name in providers}
    for _ in range(rounds):
        for name, (make, count) in providers.items():
            rate, startup, _ = steady_rate(make, count)
            rates[name].append(rate)
            starts[name].append(startup)
    if ray_loader is not None:
        ray_loader.close()
    naive = statistics.median(rates["naive row-wise Python reader"])
    lines += [
        f"Batch size {batch_size} ({epoch} batches an epoch):", "",
        f"| provider | examples/s (median) | min-max | vs naive | vs trainer's "
        f"{trainer_rate / 1e3:.1f}k/s | first batch after (median) |", "|---|---|---|---|---|---|",
    ]
    for name in providers:
        r = statistics.median(rates[name])
        lines.append(f"| {name} | {r:,.0f} | {min(rates[name]):,.0f}-{max(rates[name]):,.0f} | "
                     f"{r / naive:.1f}x | {r / trainer_rate:.1f}x | "
                     f"{statistics.median(starts[name]):.2f} s |")
    lines.append("")


def users_table(d: dict, batch_size: int, lines: list) -> None:
    """Distinct values of the sort key (the user, for the synthetic log) per batch."""
    path = d["paths"]["sorted"]
    key = ParquetDataset(path, batch_size).metadata["sort_by"]
    if key is None or key == "request_id":
        lines.append(f"(sorted by {key}: no users-per-batch table)\n")
        return

    def first_ids(batch):  # a sample's user: the first id of its bag (-1: empty bag)
        jt = batch.sparse[key]
        ids = np.full(batch.batch_size, -1, dtype=np.int64)
        lengths = jt.lengths().numpy()
        starts = np.cumsum(lengths) - lengths
        ids[lengths > 0] = jt.values().numpy()[starts[lengths > 0]]
        return ids

    def per_batch(ds):
        return statistics.mean(np.unique(first_ids(b)).size for b in ds)

    every = np.concatenate([first_ids(b) for b in ParquetDataset(path, 8192, shuffle=False)])
    rng = np.random.default_rng(0)
    sample = statistics.mean(np.unique(rng.choice(every, batch_size, replace=False)).size
                             for _ in range(200))
    rows = {
        "rows as stored (shuffle_rows=0; before shuffle windows)":
            per_batch(ParquetDataset(path, batch_size, shuffle_rows=0)),
        "default: rows shuffled within windows": per_batch(ParquetDataset(path, batch_size)),
        f"{batch_size} rows drawn at random from the whole file": sample,
    }
    lines += [f"Distinct {key} ids per batch of {batch_size} (the file sorted by {key}):", "",
              "| order | distinct per batch (mean) | vs random |", "|---|---|---|"]
    lines += [f"| {name} | {v:,.1f} | {v / sample:.2f}x |" for name, v in rows.items()]
    lines.append("")


def compact_table(batch: Batch, rounds: int, lines: list) -> None:
    raw = CompactBatch.encode(batch, compress=False)
    src = np.frombuffer(raw, dtype=np.uint8)
    dst = np.empty_like(src)
    providers = {
        "memcpy of the raw bytes": (lambda: np.copyto(dst, src), None, len(raw)),
        "pickle (protocol 5)": (lambda: pickle.dumps(batch, protocol=5), pickle.loads, None),
        "CompactBatch raw": (lambda: CompactBatch.encode(batch, compress=False),
                             CompactBatch.decode, None),
        "CompactBatch zstd 1": (lambda: CompactBatch.encode(batch, level=1),
                                CompactBatch.decode, None),
        "CompactBatch zstd 3 (default)": (lambda: CompactBatch.encode(batch),
                                          CompactBatch.decode, None),
    }
    enc = {k: [] for k in providers}
    dec = {k: [] for k in providers}
    size = {}
    for _ in range(rounds):
        for name, (encode, decode, nbytes) in providers.items():
            t0 = time.perf_counter()
            data = encode()
            enc[name].append(time.perf_counter() - t0)
            size[name] = nbytes if nbytes is not None else len(data)
            if decode is not None:
                t0 = time.perf_counter()
                decode(data)
                dec[name].append(time.perf_counter() - t0)
    lines += [
        f"One batch of {batch.batch_size} samples ({batch.sparse.values().numel():,} ids):", "",
        "| provider | bytes | vs raw | encode ms (median) | decode ms (median) |",
        "|---|---|---|---|---|",
    ]
    for name in providers:
        d = f"{statistics.median(dec[name]) * 1e3:.1f}" if dec[name] else "-"
        lines.append(f"| {name} | {size[name]:,} | {size[name] / len(raw):.3f} | "
                     f"{statistics.median(enc[name]) * 1e3:.1f} | {d} |")
    lines.append("")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=16, help="batches of 8192 to write")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--trainer-rate", type=float, default=TRAINER_EXAMPLES_PER_S,
                        help="examples/s the trainer consumes (2 ranks, its defaults; default "
                        f"{TRAINER_EXAMPLES_PER_S:,})")
    args = parser.parse_args(argv)
    lines = [
        f"machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, pyarrow "
        f"{pa.__version__}, torch threads {torch.get_num_threads()}, load average at start "
        f"{os.getloadavg()[0]:.1f}", "",
    ]
    with tempfile.TemporaryDirectory(prefix="recxla-bench-data-") as folder:
        d = write_data(folder, args.batches)
        lines.append("## Bytes on disk\n")
        sizes_table(d, lines)
        lines.append("## Examples/s\n")
        for b in (1024, 8192):
            reader_table(d, b, args.rounds, lines, os.path.join(folder, "run"),
                         args.trainer_rate)
        lines.append("## Users per batch\n")
        users_table(d, 1024, lines)
        lines.append("## CompactBatch\n")
        compact_table(d["batches"][0], 3 * args.rounds, lines)
    lines.append(f"load average at the end: {os.getloadavg()[0]:.1f}")
    print("\n".join(lines))


# ---- pytest-benchmark entry points -----------------------------------------------------------


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    batches = list(SyntheticRankingDataset(batch_size=WRITE_BATCH, num_batches=2, seed=0))
    path = str(tmp_path_factory.mktemp("data") / "sorted.parquet")
    write_parquet(batches, path, sort_by="cat_2")
    return path, batches[0]


@pytest.mark.parametrize("order", ["file", "window"])
def test_reader_one_row_group(benchmark, written, order):
    # "window": the row group shuffled on its own (a window of one group).
    path, _ = written
    ds = ParquetDataset(path, WRITE_BATCH, shuffle=order == "window", prefetch=0,
                        shuffle_rows=WRITE_BATCH)
    benchmark(lambda: list(ds.read_chunk(0, 0, 0, WRITE_BATCH)))
    benchmark.extra_info["examples_per_call"] = WRITE_BATCH


@pytest.mark.parametrize("compress", [False, True])
def test_compact_encode(benchmark, written, compress):
    _, batch = written
    data = benchmark(CompactBatch.encode, batch, compress)
    benchmark.extra_info["bytes"] = len(data)


@pytest.mark.parametrize("compress", [False, True])
def test_compact_decode(benchmark, written, compress):
    _, batch = written
    data = CompactBatch.encode(batch, compress)
    benchmark(CompactBatch.decode, data)
    benchmark.extra_info["bytes"] = len(data)


if __name__ == "__main__":
    main()
