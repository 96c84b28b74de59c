"""An emulated multi-node cluster on one machine, for communication benchmarks.

Every emulated node is a Linux network namespace; ranks of one node talk over its loopback, and
nodes talk through a bridge namespace over veth links shaped with tbf (see netns.py for the
recipe and its limits). Where root, `ip netns` or `tc` is missing, the harness says so on stderr
and runs every rank on plain loopback instead (see launch.py).

- EmulatedCluster / run_job (launch.py): build the cluster, run `module:function` on every rank
  (one process per rank, gloo process group already up), collect each rank's JSON result, and
  always clean up: ranks, namespaces, veths.
- rank_info (rank.py): inside a rank, its rank, node, local rank and the cluster mode.
- benchmark_lock (launch.py): one cluster benchmark at a time on a machine (run_a2a, run_train,
  collective_cpu).
- collective_cpu.py: the CPU one gloo collective costs each rank, by kind, group and size.
- history.py, train_report.py: run_train's sittings, one history file per cluster shape
  (bench/results/training_<N>x<R>.json), and the tables of bench/results/training.md
  generated from them.
"""

from bench.cluster.launch import (
    ClusterBusy, ClusterJobError, ClusterTimeout, EmulatedCluster, benchmark_lock, run_job,
)
from bench.cluster.netns import NetnsUnavailable, Topology, probe
from bench.cluster.rank import RankInfo, rank_info

__all__ = [
    "ClusterBusy",
    "ClusterJobError",
    "ClusterTimeout",
    "EmulatedCluster",
    "NetnsUnavailable",
    "RankInfo",
    "Topology",
    "benchmark_lock",
    "probe",
    "rank_info",
    "run_job",
]
