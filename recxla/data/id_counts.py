"""Counting the raw ids of vocab tables, and the tables and DatasetSpec that follow from the
counts: what a conversion (recxla.data.convert) and a table read at train time
(recxla.data.read_time) both do with the blocks of rows they read.

A table is counted when its mapping is "vocab", or when the schema gives none (the default is
a vocabulary when the table has at most `vocab_limit` distinct ids over all the rows, else
hashing into `default_rows` rows). Counting stops for a table of the second kind once it
passes the limit, so memory is bounded by the limit (distinct ids), not by the rows.

The same counts tell an inferred integer column that looks like a measure (`flag_measures`).
"""

import json
from typing import Dict, Iterable, List, Optional

import pyarrow as pa

from recxla.data.convert_plan import Plan
from recxla.data.convert_rows import id_bags
from recxla.data.id_mapping import Vocabulary, count_ids, keys_of, merge_counts, vocab_files
from recxla.data.schema import DatasetSpec, TableSpec

_COMPACT_ROWS = 1 << 20  # merge a table's partial counts once they hold this many entries
# An inferred integer column with more distinct values than this and than half the rows reads
# as a measure (fastai's cont_cat_split takes integers above a cardinality bound as continuous).
MEASURE_MIN_DISTINCT = 1000


class IdCounter:
    """The (key, id, count) of every counted table's ids over the blocks given to `add`."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.counted = {n: t.schema.mapping for n, t in plan.tables.items()
                        if t.schema.mapping in (None, "vocab")}
        self._parts: Dict[str, Optional[List[pa.Table]]] = {n: [] for n in self.counted}

    def add(self, t: pa.Table) -> None:
        """Count the ids of a block of source rows (a table holding plan.columns)."""
        plan, limit = self.plan, self.plan.vocab_limit
        for f in plan.features:
            if self._parts.get(f.table) is None:
                continue
            tp = plan.tables[f.table]
            _, ids, _ = id_bags(t.column(f.column).combine_chunks(), f.is_list, f.separator)
            # uint64 ids above 2**63 keep their bits (their key) as int64.
            raw = ids.cast(pa.large_string()) if tp.id_type == "string" else ids.cast(
                pa.int64(), safe=False)
            self._parts[f.table].append(count_ids(keys_of(ids, tp.id_type), raw))
        for name, p in self._parts.items():
            # A table with no mapping given is counted only up to the limit.
            bound = _COMPACT_ROWS if self.counted[name] == "vocab" else min(_COMPACT_ROWS,
                                                                             2 * limit)
            if p is not None and sum(x.num_rows for x in p) > bound:
                merged = merge_counts(p)
                over = self.counted[name] is None and merged.num_rows > limit
                self._parts[name] = None if over else [merged]

    def result(self) -> Dict[str, Optional[pa.Table]]:
        """table -> its counts so far, or None for a table that passed its vocab_limit."""
        return {name: None if p is None else merge_counts(p) if p else None
                for name, p in self._parts.items()}


def merge_results(plan: Plan, results: Iterable[Dict[str, Optional[pa.Table]]]
                  ) -> Dict[str, Optional[pa.Table]]:
    """The counts of several IdCounters (one per file or worker) as one: None for a table that
    passed its limit in any of them or over all of them."""
    results = list(results)
    counted = {n: t.schema.mapping for n, t in plan.tables.items()
               if t.schema.mapping in (None, "vocab")}
    counts: Dict[str, Optional[pa.Table]] = {}
    for name in counted:
        parts = [r[name] for r in results]
        if any(p is None for p in parts):
            counts[name] = None
            continue
        merged = merge_counts(parts)
        over = counted[name] is None and merged.num_rows > plan.vocab_limit
        counts[name] = None if over else merged
    return counts


def table_specs(plan: Plan, counts: Dict[str, Optional[pa.Table]]):
    """Final TableSpecs (mapping, rows) and the vocabularies, from the schema and counts:
    ({table: TableSpec}, {table: Vocabulary})."""
    specs, vocabs = {}, {}
    files = vocab_files(plan.tables)
    for name, tp in plan.tables.items():
        ts = tp.schema
        mapping = ts.mapping
        if mapping is None:
            mapping = "hash" if counts.get(name) is None else "vocab"
        rows = ts.rows or plan.default_rows
        vocab_file = None
        if mapping == "vocab":
            vocab = Vocabulary.build(counts[name], ts.min_count,
                                     None if ts.rows is None else ts.rows - 1)
            vocabs[name] = vocab
            rows = len(vocab) + 1
            vocab_file = files[name]
        specs[name] = TableSpec(name=name, features=tp.features, num_rows=rows,
                                embedding_dim=ts.dim, pooling=ts.pooling, weighted=tp.weighted,
                                mapping=mapping, min_count=ts.min_count,
                                vocabulary=vocab_file, id_type=tp.id_type)
    return specs, vocabs


def dataset_spec(plan: Plan, specs: Dict[str, TableSpec], where: str) -> DatasetSpec:
    """The DatasetSpec of rows converted by `plan` with the tables `specs`; checked."""
    spec = DatasetSpec(
        sparse_features=tuple(f.name for f in plan.features),
        dense_features=tuple(plan.dense), label=plan.label,
        tables=tuple(specs[n] for n in plan.tables if specs[n].features),
        timestamp=plan.timestamp, label_kind=plan.label_kind,
        histories=tuple((f.name, f.history_of) for f in plan.features if f.history_of))
    spec.check(where)
    return spec


def flag_measures(plan: Plan, counts: Dict[str, Optional[pa.Table]], rows: int) -> List[str]:
    """Warn, on its line of `plan.roles`, of every integer column inferred as ids (one id a
    row) whose distinct values are more than half the `rows` counted and more than
    MEASURE_MIN_DISTINCT (Adult's `fnlwgt`, a census weight): more like a measure than an
    id. The column keeps its role: ids are often that many in a click log (a sample of
    Criteo's or Avazu's, an item id with a long tail), and a wrong dense column would train
    on the ids' magnitudes, where a wrong id only costs a table. A table counted past its
    vocab_limit has more distinct values than the limit, which decides when the limit is above
    half the rows. Returns the columns flagged."""
    flagged = []
    columns = list(plan.source_types)
    for f in plan.features:
        t = plan.source_types[f.column]
        if f.name not in plan.inferred or f.is_list or not pa.types.is_integer(t) \
                or f.table not in counts:
            continue
        got = counts[f.table]
        distinct = plan.vocab_limit + 1 if got is None else got.num_rows
        if distinct <= max(MEASURE_MIN_DISTINCT, rows / 2):
            continue
        if got is None:
            seen = f"more than {plan.vocab_limit:,} distinct values"
        else:
            seen = f"{distinct:,} distinct values"
        dense = json.dumps([*plan.dense, f.column])
        i = columns.index(f.column)
        plan.roles[i] += (f"; warning: an integer with {seen} in {rows:,} rows, more like a "
                          f"measure than an id: to train it as a number, name it in the "
                          f"schema's dense (dense = {dense}); to keep it an id, declare "
                          f"[sparse.{f.column}]")
        flagged.append(f.column)
    return flagged
