"""The cost of one training step on N nodes x G ranks, term by term.

Per rank and step, with B examples per rank, P = N x G ranks (see DESIGN.md for the data flow):

  ids a2a     B x id_bytes            input all-to-all (unique ids, positions, lengths)
  lookup      B x lookup_bytes / memory rate
  codec       B x pooled fp32 bytes x 2 (fwd rows, bwd gradients) / codec rate, FP8 only
  output a2a  B x pooled_bytes(fwd)   pooled rows to their sources
  dense       3 x B x dense FLOPs / dense FLOP rate (forward + backward)
  grad a2a    B x pooled_bytes(bwd)   gradients back to the owners
  update      B x unique x dim x 4 x 3 / memory rate (read row, read grad, write row)
  dense AR    dense parameters, all-reduced (ring inside the node, then across nodes)
  2D sync     (2D only) the embedding shards' replicas across nodes: touched rows all-gathered
              every step (exact), or all weights averaged every k steps

An all-to-all over a group: each rank sends (P' - 1)/P' of its bytes to the others, the
share to ranks of its node over the intra-node link, the rest over its share of the node's
network; the two run at once, so the slower sets the time, plus one latency. The busiest rank
sets it: bytes are multiplied by the plan's imbalance (max/mean, from recxla.planner).
1D: one group of all P ranks. 2D (DESIGN.md): the all-to-all stays inside a node (P' = G) and
only the 2D sync crosses nodes.

Overlap (the FWP/DBP schedule of DESIGN.md): the output and gradient all-to-alls of one
micro-batch run while another micro-batch's dense layers do (FWP, M micro-batches); the next
batch's ids all-to-all and lookup run while this one computes (DBP); the dense all-reduce and
the 2D sync run behind the backward and the next micro-batches. Modeled as two streams:
step = max(compute terms, communication terms) + min(dense, output + gradient a2a) / M, the
fill and drain of the micro-batch pipeline. It is the best such a schedule can do (every
transfer finds compute to hide behind); with overlap off every term adds up. Transfers that
overlap each other are assumed to get their full links.
"""

from dataclasses import dataclass, fields
from typing import Dict, Iterable, List

from recxla.formats import (
    DEFAULT_BWD_COMM, DEFAULT_FWD_COMM, accepts_old_comm_keywords, get_format,
)
from recxla.sim.hardware import Hardware
from recxla.sim.workload import Workload

OP = "recxla.sim"
TOPOLOGIES = ("1d", "2d")
SYNCS = ("grads", "weights")


@dataclass(frozen=True)
class StepConfig:
    """How the step runs.

    topology: "1d" (one all-to-all over all ranks) or "2d" (all-to-all inside a node, replicas
        synced across nodes).
    fwd_comm / bwd_comm: wire formats of pooled rows and their gradients (recxla.FORMATS).
    overlap: the FWP/DBP schedule on, or every term in sequence.
    micro_batches: M of FWP (1 = no split inside a batch).
    sync / sync_every: 2D replica sync, "grads" (touched rows all-gathered every step) or
        "weights" (all tables averaged every `sync_every` steps).
    imbalance: max/mean of the all-to-all bytes over ranks (1.0 = perfectly balanced).
    """

    topology: str = "1d"
    fwd_comm: str = DEFAULT_FWD_COMM
    bwd_comm: str = DEFAULT_BWD_COMM
    overlap: bool = True
    micro_batches: int = 4
    sync: str = "grads"
    sync_every: int = 1
    imbalance: float = 1.0

    def __post_init__(self):
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"{OP}.StepConfig: topology must be one of {TOPOLOGIES}, got "
                             f"{self.topology!r}")
        get_format(self.fwd_comm, f"{OP}.StepConfig", "fwd_comm")
        get_format(self.bwd_comm, f"{OP}.StepConfig", "bwd_comm")
        if self.sync not in SYNCS:
            raise ValueError(f"{OP}.StepConfig: sync must be one of {SYNCS}, got {self.sync!r}")
        if self.micro_batches < 1 or self.sync_every < 1:
            raise ValueError(f"{OP}.StepConfig: micro_batches and sync_every must be >= 1")
        if not self.imbalance >= 1.0:
            raise ValueError(f"{OP}.StepConfig: imbalance is max/mean, so >= 1.0, got "
                             f"{self.imbalance}")


# StepConfig(fwd_fmt=..., bwd_fmt=...), as documented before the rename, still works.
StepConfig.__init__ = accepts_old_comm_keywords(StepConfig.__init__)


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds of every term of one step (before overlap), the step itself, throughput, and a
    rank's bytes to other nodes and to other ranks at all (all-to-alls, all-reduces, sync)."""

    ids_a2a: float
    lookup: float
    codec: float
    output_a2a: float
    dense: float
    grad_a2a: float
    update: float
    dense_allreduce: float
    sync_2d: float
    fixed: float
    step: float
    examples_per_s: float
    inter_node_bytes: float
    wire_bytes: float

    @property
    def communication(self) -> float:
        return (self.ids_a2a + self.output_a2a + self.grad_a2a + self.dense_allreduce
                + self.sync_2d)

    @property
    def exposed_communication(self) -> float:
        """Step time not spent computing (lookup, codec, dense, update, fixed cost)."""
        busy = self.lookup + self.codec + self.dense + self.update + self.fixed
        return max(0.0, self.step - busy)

    def as_dict(self) -> Dict[str, float]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["communication"] = self.communication
        out["exposed_communication"] = self.exposed_communication
        return out


def _check_scale(nodes: int, batch_per_rank: int) -> None:
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise ValueError(f"{OP}.step: nodes must be an int >= 1, got {nodes!r}")
    if not isinstance(batch_per_rank, int) or batch_per_rank < 1:
        raise ValueError(f"{OP}.step: batch_per_rank must be an int >= 1, got {batch_per_rank!r}")


def all_to_all_seconds(bytes_per_rank: float, group: int, ranks_per_node: int,
                       hw: Hardware) -> float:
    """Time of an all-to-all in which every rank of a `group` of ranks (filling nodes of
    `ranks_per_node`) holds `bytes_per_rank` spread evenly over the group."""
    if group <= 1 or bytes_per_rank <= 0:
        return 0.0
    local = min(group, ranks_per_node)
    intra = bytes_per_rank * (local - 1) / group
    inter = bytes_per_rank * (group - local) / group
    seconds = max(intra / hw.intra_bytes_per_s, inter / hw.inter_bytes_per_s)
    return seconds + (hw.inter_latency_s if inter > 0 else hw.intra_latency_s)


def all_reduce_seconds(nbytes: float, nodes: int, ranks_per_node: int, hw: Hardware) -> float:
    """Hierarchical ring all-reduce of `nbytes` on every rank: reduce-scatter and all-gather
    inside the node (2 (G - 1)/G of the bytes over NVLink), then across nodes on 1/G of them
    (2 (N - 1)/N over the network)."""
    g, n = ranks_per_node, nodes
    seconds = 0.0
    if g > 1:
        seconds += 2 * (g - 1) / g * nbytes / hw.intra_bytes_per_s + hw.intra_latency_s
    if n > 1:
        seconds += 2 * (n - 1) / n * nbytes / g / hw.inter_bytes_per_s + hw.inter_latency_s
    return seconds


def step(workload: Workload, hw: Hardware, nodes: int, batch_per_rank: int,
         config: StepConfig = StepConfig()) -> StepBreakdown:
    """Model one training step of `workload` on `nodes` nodes of `hw` (see module docstring).

    Args:
        workload: per-example figures.
        hw: the node type (ranks per node, rates).
        nodes: N >= 1.
        batch_per_rank: B, examples per rank per step.
        config: topology, formats, overlap, imbalance.
    Returns:
        StepBreakdown, all times in seconds; examples_per_s = N x G x B / step.
    """
    _check_scale(nodes, batch_per_rank)
    b, g = batch_per_rank, hw.gpus_per_node
    ranks = nodes * g
    group = g if config.topology == "2d" else ranks
    skew = config.imbalance
    ids_bytes = b * workload.id_bytes * skew
    fwd_bytes = b * workload.pooled_bytes(config.fwd_comm) * skew
    bwd_bytes = b * workload.pooled_bytes(config.bwd_comm) * skew
    ids_a2a = all_to_all_seconds(ids_bytes, group, g, hw)
    output_a2a = all_to_all_seconds(fwd_bytes, group, g, hw)
    grad_a2a = all_to_all_seconds(bwd_bytes, group, g, hw)
    fp32 = b * workload.pooled_bytes("fp32")
    coded = [f for f in (config.fwd_comm, config.bwd_comm) if f != "fp32"]
    codec = len(coded) * fp32 / hw.codec_bytes_per_s if group > 1 else 0.0
    lookup = b * workload.lookup_bytes * skew / hw.memory_bytes_per_s
    mean_dim = sum(workload.dims) / len(workload.dims)
    update = b * workload.unique_per_example * mean_dim * 4 * 3 * skew / hw.memory_bytes_per_s
    dense = 3 * b * workload.dense_flops_per_example / hw.dense_flops
    dense_ar = all_reduce_seconds(workload.dense_param_bytes, nodes, g, hw)
    sync_2d, sync_bytes = 0.0, 0.0
    if config.topology == "2d" and nodes > 1:
        if config.sync == "grads":
            # Every replica's touched rows of this rank's shard, gathered from the N - 1 others.
            rows = b * workload.unique_per_example
            sync_bytes = (nodes - 1) * rows * (workload.pooled_bytes(config.bwd_comm)
                                               / len(workload.dims) + 8)
        else:
            sync_bytes = 2 * (nodes - 1) / nodes * workload.table_bytes / g / config.sync_every
        sync_2d = sync_bytes / hw.inter_bytes_per_s + hw.inter_latency_s
    inter_share = (group - min(group, g)) / group
    dense_inter = 2 * (nodes - 1) / nodes * workload.dense_param_bytes / g if nodes > 1 else 0.0
    inter_bytes = (ids_bytes + fwd_bytes + bwd_bytes) * inter_share + sync_bytes + dense_inter
    dense_intra = 2 * (g - 1) / g * workload.dense_param_bytes if g > 1 else 0.0
    wire_bytes = ((ids_bytes + fwd_bytes + bwd_bytes) * (group - 1) / group + sync_bytes
                  + dense_inter + dense_intra)

    if config.overlap:
        # Two streams, compute and communication, each as busy as its terms add up to; the
        # step is the busier one plus the pipeline's fill and drain (the first micro-batch's
        # output all-to-all and the last one's gradients cannot hide behind dense work).
        compute = lookup + codec + dense + update + hw.fixed_step_s
        comm = ids_a2a + output_a2a + grad_a2a + dense_ar + sync_2d
        m = config.micro_batches
        total = max(compute, comm) + min(dense / m, (output_a2a + grad_a2a) / m)
    else:
        total = (ids_a2a + lookup + codec + output_a2a + dense + grad_a2a + update + dense_ar
                 + sync_2d + hw.fixed_step_s)
    return StepBreakdown(ids_a2a, lookup, codec, output_a2a, dense, grad_a2a, update, dense_ar,
                         sync_2d, hw.fixed_step_s, total, ranks * b / total, inter_bytes,
                         wire_bytes)


@dataclass(frozen=True)
class ScalingPoint:
    nodes: int
    breakdown: StepBreakdown
    speedup: float  # examples/s over 1 node's
    efficiency: float  # speedup / nodes


def scaling(workload: Workload, hw: Hardware, node_counts: Iterable[int], batch_per_rank: int,
            config: StepConfig = StepConfig(), baseline: StepConfig = None) -> List[ScalingPoint]:
    """Weak scaling (fixed batch per rank): examples/s at each node count, and speedup and
    efficiency over one node run with `baseline` (default: the same config)."""
    one = step(workload, hw, 1, batch_per_rank, baseline or config).examples_per_s
    out = []
    for n in node_counts:
        b = step(workload, hw, n, batch_per_rank, config)
        out.append(ScalingPoint(n, b, b.examples_per_s / one, b.examples_per_s / one / n))
    return out
