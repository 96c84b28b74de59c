"""Source files for the conversion tests and benchmarks, and the plain-Python reference of the
id mapping (the documented formulas, one id at a time, no numpy)."""

import math
import random
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq

M64 = (1 << 64) - 1


def fnv1a64(s: str) -> int:
    h = 0xCBF29CE484222325
    for b in s.encode():
        h = ((h ^ b) * 0x100000001B3) & M64
    return h


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def key(raw, id_type: str) -> int:
    """The unsigned 64-bit key of a raw id in a table of `id_type`."""
    if id_type == "string":
        return fnv1a64(str(raw))
    return raw & M64


def hash_row(raw, rows: int, id_type: str) -> int:
    return (splitmix64(key(raw, id_type)) & ((1 << 63) - 1)) % rows


def vocabulary(ids, min_count: int, max_ids=None) -> dict:
    """raw id -> row: most frequent first, ties by smaller id, rows from 1 (0: OOV)."""
    counts = Counter(ids)
    kept = sorted((kv for kv in counts.items() if kv[1] >= min_count), key=lambda kv: (-kv[1],
                                                                                      kv[0]))
    return {raw: i + 1 for i, (raw, _) in enumerate(kept[:max_ids])}


def log1p_dense(x) -> float:
    return math.log1p(max(float(x or 0), 0.0))


def click_log(n: int, rng: random.Random) -> dict:
    """A MovieLens-style click log as Python lists: string user ids, int64 item ids above
    2**40, list<string> genres with list<float> weights, a list<int64> history of items, a
    float, a nullable float, a 0/1 label and a unique timestamp."""
    base = 1 << 41
    items = [base + rng.randrange(300) for _ in range(n)]
    genres = [[f"g{rng.randrange(12)}" for _ in range(rng.randrange(4))] for _ in range(n)]
    return {
        "user": [f"user-{rng.randrange(80)}" for _ in range(n)],
        "item": items,
        "genres": genres,
        "genre_w": [[rng.random() for _ in g] for g in genres],
        "history": [[base + rng.randrange(400) for _ in range(rng.randrange(6))]
                    for _ in range(n)],
        "age": [rng.uniform(10, 70) for _ in range(n)],
        "price": [None if rng.random() < 0.1 else rng.uniform(-1, 500) for _ in range(n)],
        "clicked": [rng.randrange(2) for _ in range(n)],
        "ts": rng.sample(range(1 << 40), n),
    }


def write_click_log_parquet(path, log: dict, row_group_size=None) -> None:
    types = {"user": pa.string(), "item": pa.int64(), "genres": pa.list_(pa.string()),
             "genre_w": pa.list_(pa.float32()), "history": pa.list_(pa.int64()),
             "age": pa.float64(), "price": pa.float64(), "clicked": pa.int64(),
             "ts": pa.int64()}
    table = pa.table({k: pa.array(v, types[k]) for k, v in log.items()})
    pq.write_table(table, path, row_group_size=row_group_size)


def criteo_lines(n: int, rng: random.Random, missing: float = 0.2) -> list:
    """Criteo TSV lines: label, 13 integers (some negative), 26 hex ids; `missing` empty."""
    lines = []
    for _ in range(n):
        ints = ["" if rng.random() < missing else str(rng.randint(-3, 5000)) for _ in range(13)]
        cats = ["" if rng.random() < missing else f"{rng.getrandbits(32):08x}"
                for _ in range(26)]
        lines.append("\t".join([str(rng.randrange(2))] + ints + cats))
    return lines
