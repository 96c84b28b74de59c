"""A sum over every rank that crosses the nodes once per slice: all_reduce_by_node.

A ring all-reduce over W = N nodes x L ranks sends 2 (W-1)/W of the tensor from each rank to
the next; the ring crosses each node's boundary once, so one link per node carries
2 (NL-1)/(NL) of it (2 x 2 ranks: 1.5x the tensor). Summing inside the node first, then
sending only 1/L of the tensor per rank across the nodes (each local rank with its peers of
the same local rank on the other nodes), then gathering inside the node again, brings that to
2 (N-1)/N (2 x 2: 1.0x, a third less) over the same links. It pays where a node's ranks share
its network link and talk to each other over a faster one (shared memory, NVLink, loopback),
as with the emulated cluster's nodes or CPU nodes on Ethernet; with one NIC per GPU, NCCL
already spreads a ring over every NIC.

The three collectives are issued by the calling thread in program order (no callbacks), so
every rank issues them on each group in the same order whatever the timing: the reduce-scatter
inside the node when the call starts (synchronous: the node's links are the fast ones), the
all-reduce across nodes asynchronously, the all-gather inside the node at wait() (one for
several sums with `wait_together`: the pipeline's DDP buckets end with one). On gloo, where
each collective costs every rank a fixed CPU whatever its bytes (bench.cluster.collective_cpu),
all three are all-to-alls, the cheapest of its collectives, with the ring's bytes: the
reduce-scatter one of the slices and this rank's sum of its slice (`_reduce_scatter_in_node`:
gloo's own reduce-scatter costs the CPU of an all-reduce of the whole tensor), the sum across
two nodes one of the parts and an add (`_start_sum_across`; more nodes: gloo's all-reduce),
the all-gather one of this rank's part to every rank of the node (`_gather_in_node`).
"""

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from recxla.distributed.gather import all_gather_flat
from recxla.distributed.traffic import carrying

OP = "recxla.distributed.all_reduce_by_node"


class AllReduceByNodeHandle:
    """The sum across the nodes in flight; wait() finishes it and returns the summed tensor."""

    def __init__(self, tensor: torch.Tensor, padded: torch.Tensor, part: torch.Tensor,
                 work: Optional[Any], node_group: dist.ProcessGroup):
        # work: the sum across the nodes in flight (_start_sum_across), None with one node.
        self._tensor, self._padded, self._part = tensor, padded, part
        self._work, self._node_group = work, node_group
        self._result: Optional[torch.Tensor] = None

    def wait(self) -> torch.Tensor:
        """Waits for the sum across the nodes, gathers the node's slices (blocking, inside the
        node) and writes the sum into the tensor given to all_reduce_by_node (idempotent)."""
        if self._result is None:
            wait_together([self])
        return self._result

    def _finish(self) -> None:
        """The sum is in padded: into the tensor given to all_reduce_by_node."""
        flat = self._tensor.view(-1)
        if self._padded is not flat:
            flat.copy_(self._padded[:flat.numel()])
        self._result = self._tensor


def wait_together(handles: Sequence[AllReduceByNodeHandle]) -> None:
    """Completes `handles` (sums started in this order, the unfinished ones) with one all-gather
    inside the node for all of those on the same node group and of one dtype, not one each:
    on gloo every collective costs its fixed CPU, whatever its bytes (bench.cluster.
    collective_cpu). The gather only copies, so the sums are the bits each wait() would give.
    Every rank must pass the same handles in the same order, as with wait()."""
    for h in handles:
        if not isinstance(h, AllReduceByNodeHandle):
            raise TypeError(f"{OP}: wait_together takes the handles all_reduce_by_node returns, "
                            f"got {type(h).__name__}")
    pending = [h for h in handles if h._result is None]
    while pending:
        first = pending[0]
        batch = [h for h in pending if h._node_group is first._node_group and
                 h._part.dtype == first._part.dtype]
        pending = [h for h in pending if h not in batch]
        for h in batch:
            if h._work is not None:
                h._work.wait()
        ranks_per_node = dist.get_world_size(first._node_group)
        if len(batch) == 1:
            _gather_in_node(first._padded, first._part, first._node_group, ranks_per_node)
        else:
            parts = torch.cat([h._part for h in batch])
            gathered = parts.new_empty(ranks_per_node * parts.numel())
            _gather_in_node(gathered, parts, first._node_group, ranks_per_node)
            # Rank by rank, each rank's parts one after another: each sum's slices are a
            # column range of that [ranks, parts] view.
            by_rank, at = gathered.view(ranks_per_node, -1), 0
            for h in batch:
                n = h._part.numel()
                h._padded.view(ranks_per_node, n).copy_(by_rank[:, at:at + n])
                at += n
        for h in batch:
            h._finish()


def all_reduce_by_node(tensor: torch.Tensor, node_group: dist.ProcessGroup,
                       cross_group: dist.ProcessGroup) -> AllReduceByNodeHandle:
    """Starts summing `tensor` in place over every rank of the node groups together.

    Args:
        tensor: a contiguous floating-point tensor, the same shape and dtype on every rank.
        node_group: the ranks of this rank's node (`recxla.torchrec.make_topology_2d`'s
            shard_group), L of them.
        cross_group: this rank and the ranks of the same local rank on the other nodes (its
            replica_group), N of them.
    Returns:
        A handle; its wait() completes the sum (every rank must call it, in the order of the
        all_reduce_by_node calls, before its next call on the same groups).

    The sum is a float sum in a different order from a ring's: the same up to rounding, and the
    same bits on every rank (each slice is summed once, then copied).
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        raise TypeError(f"{OP}: tensor must be a floating-point torch.Tensor, got "
                        f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
    if not tensor.is_contiguous():
        raise ValueError(f"{OP}: tensor must be contiguous (it is summed in place)")
    for name, group in (("node_group", node_group), ("cross_group", cross_group)):
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"{OP}: {name} must be a torch.distributed.ProcessGroup, got "
                            f"{type(group).__name__}")
    ranks_per_node = dist.get_world_size(node_group)
    flat = tensor.view(-1)
    slice_len = -(-flat.numel() // ranks_per_node)
    padding = slice_len * ranks_per_node - flat.numel()
    # Every rank's slice has the same length: the last one is padded with zeros.
    padded = flat if padding == 0 else torch.cat([flat, flat.new_zeros(padding)])
    part = padded.new_empty(slice_len)
    _reduce_scatter_in_node(part, padded, node_group, ranks_per_node)
    return AllReduceByNodeHandle(tensor, padded, part, _start_sum_across(part, cross_group),
                                 node_group)


class _PairSum:
    """The sum of `part` over a cross group of two gloo ranks in flight: each rank's part went
    to the other by one all-to-all; wait() adds the two, in rank order, into part."""

    def __init__(self, part: torch.Tensor, cross_group: dist.ProcessGroup):
        self._part = part
        self._both = part.new_empty(2 * part.numel())
        with carrying("dense"):
            self._work = dist.all_to_all_single(self._both, part.repeat(2), group=cross_group,
                                                async_op=True)

    def wait(self) -> None:
        self._work.wait()
        n = self._part.numel()
        torch.add(self._both[:n], self._both[n:], out=self._part)


def _start_sum_across(part: torch.Tensor, cross_group: dist.ProcessGroup):
    """Starts summing `part` in place over `cross_group` -> what to wait() for, or None (a
    group of one rank).

    On gloo with two nodes the sum is one all-to-all of the parts and an add: the same bytes
    across the nodes as gloo's all-reduce of two ranks (each rank's part once), a third of its
    CPU (bench.cluster.collective_cpu: gloo wakes every rank's threads for each collective,
    and its all-reduce of two ranks is two steps), and the same bits (a sum of two terms does
    not depend on their order). Otherwise the collective itself."""
    nodes = dist.get_world_size(cross_group)
    if nodes == 1:
        return None
    if nodes == 2 and dist.get_backend(cross_group) == "gloo":
        return _PairSum(part, cross_group)
    return dist.all_reduce(part, group=cross_group, async_op=True)


def _gather_in_node(output: torch.Tensor, local: torch.Tensor, node_group: dist.ProcessGroup,
                    ranks_per_node: int) -> None:
    """output [ranks_per_node * local.numel()] <- every node rank's `local`, rank by rank.

    On gloo an all-to-all of `local` to every rank of the node: the ring all-gather's bytes,
    half its CPU or less (bench.cluster.collective_cpu); a copy either way. Other backends run
    the all-gather."""
    if ranks_per_node == 1:
        output.copy_(local)
    elif dist.get_backend(node_group) == "gloo":
        with carrying("dense"):
            dist.all_to_all_single(output, local.repeat(ranks_per_node), group=node_group)
    else:
        all_gather_flat(output, local, group=node_group)


def _reduce_scatter_in_node(part: torch.Tensor, padded: torch.Tensor,
                            node_group: dist.ProcessGroup, ranks_per_node: int) -> None:
    """part <- the sum over the node's ranks of their slice `rank in the node` of padded.

    gloo reduces the whole tensor for a reduce-scatter: the CPU of an all-reduce of it (2.2 ms
    for 1M bfloat16 values on 2 ranks of one machine), which a step pays once per bucket. An
    all-to-all of the slices and this rank's sum of the ones it gets cost half of that (1.1 ms),
    and the sum is the same on every rank (each slice is summed by one rank, in rank order).
    Other backends (NCCL) run the collective itself."""
    if dist.get_backend(node_group) != "gloo":
        dist.reduce_scatter_single(part, padded, group=node_group)
        return
    if ranks_per_node == 1:
        part.copy_(padded)
        return
    slices = torch.empty_like(padded).view(ranks_per_node, -1)
    with carrying("dense"):  # the data-parallel gradients, for whoever meters the traffic
        dist.all_to_all_single(slices.view(-1), padded, group=node_group)
    # Added in rank order, rounded after each add as gloo's sum rounds (torch.sum over the
    # ranks' dimension would accumulate in float32, but costs 7x the adds in bfloat16).
    torch.add(slices[0], slices[1], out=part)
    for k in range(2, ranks_per_node):
        part.add_(slices[k])
