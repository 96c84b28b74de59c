"""The CPU one collective costs each rank on gloo, by kind, group and size.

    .venv/bin/python -m bench.cluster.collective_cpu                  # 2 nodes x 2 ranks, 1 Gbit/s
    .venv/bin/python -m bench.cluster.collective_cpu --mode loopback  # the 4 ranks on loopback

On gloo a collective is handed to the process group's worker thread, which drives the TCP pairs
with the transport's event loop thread: every call wakes threads of every rank, whatever the
bytes. Where the trainer's ranks share a machine's cores (the emulated cluster: 4 ranks on 2
cores) that fixed cost is a large part of what a step's communication costs in CPU, so the
count of collectives a step issues matters as much as their bytes. This measures it: each rank
times `--iters` calls of each kind (after a barrier and warm-up), reading its process's CPU
(user + system, every thread: rusage) before and after, for

- the kinds the trainer issues: `all_to_all_single` (the input dist, the embeddings and their
  gradients), `all_reduce` (DDP's buckets, PowerSGD's sums), `all_gather_into_tensor`, and
  recxla's `all_reduce_by_node` (a reduce-scatter as an all-to-all inside the node, an
  all-reduce across the nodes, an all-gather inside the node);
- over every rank and, for the first three, over the two ranks of a node (the groups by-node
  sums use);
- at `--sizes` (KB a rank sends or holds; float32).

It prints a markdown table: per call, the CPU of a rank (mean over ranks) and the slowest
rank's wall time (median over the calls). Every rank runs the same calls in the same order, so
no rank waits on another's schedule. Nothing else should run on the machine meanwhile.
"""

import argparse
import resource
import statistics
import sys
import time
from typing import Dict, List, Optional

from bench.cluster.launch import ClusterBusy, EmulatedCluster, benchmark_lock

KINDS = ("all_to_all_single", "all_reduce", "all_gather_into_tensor", "all_reduce_by_node")


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rank_main(sizes_kb: List[int], iters: int, warmup: int) -> List[Dict]:
    """Every rank: the CPU and wall time of each (kind, group, size) -> one record each, in
    the same order on every rank."""
    import torch
    import torch.distributed as dist

    from recxla.distributed.all_reduce_by_node import all_reduce_by_node
    from recxla.torchrec import make_topology_2d

    from bench.cluster.rank import rank_info

    info = rank_info()
    world = dist.get_world_size()
    topology = make_topology_2d(info.local_world_size) if info.nodes > 1 else None
    groups = [("every rank", None, world)]
    if topology is not None and info.local_world_size > 1:
        groups.append(("a node's ranks", topology.shard_group, info.local_world_size))

    def call(kind: str, group, x, out):
        if kind == "all_to_all_single":
            dist.all_to_all_single(out, x, group=group)
        elif kind == "all_reduce":
            dist.all_reduce(x, group=group)
        elif kind == "all_gather_into_tensor":
            dist.all_gather_into_tensor(out, x, group=group)
        else:
            all_reduce_by_node(x, topology.shard_group, topology.replica_group).wait()

    records = []
    for size_kb in sizes_kb:
        values = max(1, size_kb * 1024 // 4)
        for group_name, group, members in groups:
            for kind in KINDS:
                if kind == "all_reduce_by_node" and (group is not None or topology is None):
                    continue  # one layout: the node groups over every rank
                x = torch.randn(values - values % members or members)
                out = torch.empty(x.numel() * (members if kind == "all_gather_into_tensor"
                                               else 1))
                for _ in range(warmup):
                    call(kind, group, x, out)
                walls = []
                dist.barrier()
                cpu0 = _cpu_s()
                for _ in range(iters):
                    start = time.perf_counter()
                    call(kind, group, x, out)
                    walls.append(time.perf_counter() - start)
                cpu = (_cpu_s() - cpu0) / iters
                dist.barrier()
                records.append({"kind": kind, "group": group_name, "ranks": members,
                                "kb": size_kb, "cpu_ms": cpu * 1e3,
                                "wall_ms": statistics.median(walls) * 1e3})
    return records


def table(per_rank: List[List[Dict]]) -> str:
    """The ranks' records -> markdown: CPU per call (mean over ranks), wall (slowest rank)."""
    lines = ["| collective | group | KB | CPU a rank, ms a call | wall, ms a call (slowest rank) |",
             "|---|---|---:|---:|---:|"]
    for i, first in enumerate(per_rank[0]):
        cpu = statistics.mean(r[i]["cpu_ms"] for r in per_rank)
        wall = max(r[i]["wall_ms"] for r in per_rank)
        lines.append(f"| `{first['kind']}` | {first['group']} ({first['ranks']}) | "
                     f"{first['kb']} | {cpu:.3f} | {wall:.3f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--rate", default="1gbit", help="tbf rate of the links ('none': unshaped)")
    parser.add_argument("--mode", default="auto", choices=("auto", "netns", "loopback"))
    parser.add_argument("--sizes", default="16,512", help="KB a rank sends, comma-separated")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if not sizes or min(sizes) < 1 or args.iters < 1 or args.warmup < 0:
        parser.error("--sizes must be KB >= 1, --iters >= 1, --warmup >= 0")
    rate = None if args.rate == "none" else args.rate
    try:
        with benchmark_lock("bench.cluster.collective_cpu"), \
                EmulatedCluster(args.nodes, args.ranks_per_node, rate=rate,
                                mode=args.mode) as cluster:
            per_rank = cluster.run("bench.cluster.collective_cpu:rank_main",
                                   {"sizes_kb": sizes, "iters": args.iters,
                                    "warmup": args.warmup})
            mode = cluster.mode
    except ClusterBusy as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{args.nodes} node(s) x {args.ranks_per_node} rank(s), {mode}"
          f"{'' if mode == 'loopback' or rate is None else ', ' + rate}; {args.iters} calls "
          f"each after {args.warmup}")
    print(table(per_rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
