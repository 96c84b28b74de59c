"""Balanced sharding against TorchRec's default planner, measured on real synthetic batches.

    .venv/bin/python bench/bench_planner.py [--world-sizes 4,8,64] [--batch 4096] [--json out]

For each world size R, plans the 26 Criteo Kaggle tables (full sizes, 33.8M rows, dim 64) of
`recxla.data.criteo_kaggle_profile` for a CPU Topology of R ranks (8 per host), with no process
group:
- torchrec: `EmbeddingShardingPlanner` as shipped (GreedyPerfPartitioner, its estimators, no
  constraints), with a sharder that offers table-, column-, table-column- and row-wise;
- torchrec+pf: the same given the measured pooling factors as constraints (what TorchRec can
  know about the data);
- recxla: `BalancedShardingPlanner` (splits and placement from a 4-batch sample of one rank,
  default `CostModel`, e4m3 forward / bf16 backward);
- recxla, history row-wise (R >= 64): the same with the history table (cat_11) pinned
  row-wise, the split that evens ids and lookups at that size.
Then every plan is measured with `count_rank_loads` on R fresh batches (batch s is rank s's,
another seed than the sample): per rank the unique ids it receives, the rows it looks up and
the bytes it sends and receives in the three all-to-alls. Reported: max/mean over ranks of
wire bytes (sent + received), owner bytes (the placement-dependent part), lookups and ids, the
largest one-way bytes of each all-to-all (critical bytes: what the step waits for), and
TorchRec's own EmbeddingStats imbalance measures (over its estimated per-rank perf).
"""

import argparse
import json
import logging
import os
import sys
import time
import warnings

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology  # noqa: E402
from torchrec.distributed.planner.types import ParameterConstraints  # noqa: E402
from torchrec.modules.embedding_modules import EmbeddingBagCollection  # noqa: E402

from recxla.data import SyntheticRankingDataset, criteo_kaggle_profile  # noqa: E402
from recxla.data import embedding_bag_configs  # noqa: E402
from recxla.planner import (  # noqa: E402
    BalancedShardingPlanner,
    RowWiseEverywhereSharder,
    TableLoads,
    TableSplit,
    count_rank_loads,
    torchrec_imbalance_stats,
)

DIM = 64
SAMPLE_BATCHES = 4
HISTORY = "t_cat_11"


def measure(name, plan, options, tables, batches, seconds):
    loads = count_rank_loads(plan, tables, batches)
    row = {"plan": name, "plan_s": round(seconds, 2)}
    for metric in ("wire_bytes", "owner_bytes", "lookups", "ids_received"):
        row[f"{metric} max/mean"] = round(loads.max_over_mean(metric), 3)
    row["wire MB max"] = round(float(loads.wire_bytes.max()) / 1e6, 1)
    row["wire MB mean"] = round(float(loads.wire_bytes.double().mean()) / 1e6, 1)
    row["lookups max"] = int(loads.lookups.max())
    row["lookups mean"] = round(float(loads.lookups.double().mean()))
    for c in ("ids", "fwd", "bwd"):
        busiest = loads.collective_bytes(c).double()
        row[f"{c} max/mean"] = round(float(busiest.max() / busiest.mean()), 3)
    row["critical MB"] = round(loads.critical_bytes / 1e6, 1)
    torchrec = torchrec_imbalance_stats(options, len(batches))
    row["torchrec perf max/mean"] = round(torchrec["perf max/mean"], 3)
    row["torchrec total variation"] = round(torchrec["Total Variation"], 3)
    row["torchrec KL divergence"] = round(torchrec["KL Divergence"], 3)
    row["types"] = {}
    for sharding in plan.plan[""].values():
        key = sharding.sharding_type
        row["types"][key] = row["types"].get(key, 0) + 1
    return row


def run(world_size, batch, profile, tables, sample):
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    topology = Topology(world_size=world_size, compute_device="cpu",
                        local_world_size=min(world_size, 8))
    sharder = RowWiseEverywhereSharder()
    plans = []
    start = time.perf_counter()
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=batch, debug=False)
    plans.append(("torchrec", planner.plan(ebc, [sharder]), planner,
                  time.perf_counter() - start))
    pooling = TableLoads.measure(tables, sample, world_size).pooling_factors()
    start = time.perf_counter()
    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=batch, debug=False,
        constraints={n: ParameterConstraints(pooling_factors=[p]) for n, p in pooling.items()})
    plans.append(("torchrec+pf", planner.plan(ebc, [sharder]), planner,
                  time.perf_counter() - start))
    variants = [("recxla", {})]
    if world_size >= 64:
        variants.append(("recxla, history row-wise", {HISTORY: TableSplit("row_wise", world_size)}))
    for name, fixed in variants:
        start = time.perf_counter()
        ours = BalancedShardingPlanner(topology, sample, fixed_splits=fixed)
        plan = ours.plan(ebc, [sharder])
        plans.append((name, plan, ours.torchrec_planner, time.perf_counter() - start))
    batches = [
        SyntheticRankingDataset(profile, batch_size=batch, seed=2, rank=r,
                                world_size=world_size).batch(0)
        for r in range(world_size)
    ]
    rows = []
    for name, plan, planner, seconds in plans:
        row = measure(name, plan, planner.get_selected_options(), tables, batches, seconds)
        row["world_size"] = world_size
        rows.append(row)
    return rows


COLUMNS = [
    "world_size", "plan", "wire_bytes max/mean", "owner_bytes max/mean", "lookups max/mean",
    "ids max/mean", "fwd max/mean", "bwd max/mean", "critical MB", "wire MB max",
    "wire MB mean", "lookups max", "lookups mean", "torchrec perf max/mean",
    "torchrec total variation", "torchrec KL divergence", "plan_s", "types",
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="4,8,64")
    parser.add_argument("--batch", type=int, default=4096, help="samples per rank")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    profile = criteo_kaggle_profile()
    tables = embedding_bag_configs(profile, DIM)
    sample = [SyntheticRankingDataset(profile, batch_size=args.batch, seed=1).batch(i)
              for i in range(SAMPLE_BATCHES)]
    rows = []
    for world_size in (int(x) for x in args.world_sizes.split(",")):
        rows += run(world_size, args.batch, profile, tables, sample)
        print(f"done {world_size} ranks", file=sys.stderr)
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
