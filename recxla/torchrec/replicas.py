"""2D parallelism: shard groups inside a node, replica groups across nodes.

With N nodes of G ranks (ranks node-major, as torchrun numbers them), every node holds a whole
copy of the tables, sharded over its G ranks: the embedding all-to-alls stay on the fast
intra-node links. The copies on one local rank of every node (its replica group) are kept
in step in one of two ways:

- sync="gradients" (exact: equals 1D training up to float rounding): before each update, the
  replicas sum their per-row gradients over the union of the rows they touched (one
  all_gather of the row ids, one all_reduce of the rows, optionally in bf16), then every replica
  applies the same fused update to the same rows;
- sync="weights" (TorchRec's DMPCollection semantics, cheaper): each replica updates from its
  own node's samples, and every `sync_every` steps the replicas average their weights and
  optimizer state (fp32: averaging weights in bf16 would round them).

Dense parameters stay data parallel over all ranks (DDP on the world group).

Gradient division (TorchRec's `set_gradient_division`, on by default): the shard group's
output dist divides the gradients reaching an owner by the shard group's size G
(output_dist.py), as TorchRec's all-to-all inside DMPCollection's shard group does. With
sync="weights" that is all TorchRec computes: each replica steps on its node's gradient / G and
the replicas average weights, so with SGD and sync_every=1 the tables move by the mean over
nodes of (gradient / G), i.e. the sum over every rank divided by the world size N x G. With
sync="gradients" the replicas' sum is divided by N as well, so the update is that same sum over
all N x G ranks / (N x G): what 1D TorchRec on the N x G ranks computes, and what
DMPCollection's weight averaging gives for SGD.
"""

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.types import ShardingEnv

from recxla.distributed.gather import all_gather_flat
from recxla.host_copy import int64_on
from recxla.ops.embedding_bag import NONE, BagLookup, backward_update, pooled_forward, unique_grad
from recxla.torchrec.choices import REPLICA_PRECISIONS as PRECISIONS
from recxla.torchrec.choices import REPLICA_SYNCS as SYNCS
from recxla.torchrec.row_exchange import (RequestedRows, apply_row_gradients,
                                          update_requested_rows)
from recxla.torchrec.shard_layout import OWNER
from recxla.torchrec.types import PooledTables


def group_layout(world_size: int, ranks_per_node: int) -> Tuple[List[List[int]], List[List[int]]]:
    """-> (shard groups: the ranks of each node, replica groups: each local rank's ranks across
    nodes), for ranks numbered node-major."""
    if not isinstance(ranks_per_node, int) or ranks_per_node < 1 or world_size % ranks_per_node:
        raise ValueError(f"{OWNER}: ranks_per_node must be an int >= 1 that divides the world "
                         f"size {world_size}, got {ranks_per_node!r}")
    nodes = world_size // ranks_per_node
    shards = [list(range(n * ranks_per_node, (n + 1) * ranks_per_node)) for n in range(nodes)]
    replicas = [[n * ranks_per_node + local for n in range(nodes)]
                for local in range(ranks_per_node)]
    return shards, replicas


@dataclass
class Topology2D:
    """This rank's place in a 2D layout and its groups (see `make_topology_2d`)."""

    num_nodes: int
    ranks_per_node: int
    node: int
    local_rank: int
    shard_group: dist.ProcessGroup
    replica_group: dist.ProcessGroup

    @property
    def shard_env(self) -> ShardingEnv:
        """The ShardingEnv of this rank's node: plans are made for ranks_per_node ranks."""
        return ShardingEnv(self.ranks_per_node, self.local_rank, self.shard_group)


def make_topology_2d(ranks_per_node: Optional[int] = None) -> Topology2D:
    """Creates the shard and replica groups (every rank must call it, in the same order as its
    other group creations). ranks_per_node: None reads torchrun's LOCAL_WORLD_SIZE."""
    if not dist.is_initialized():
        raise RuntimeError(f"{OWNER}: make_topology_2d needs an initialized process group")
    world, rank = dist.get_world_size(), dist.get_rank()
    if ranks_per_node is None:
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise ValueError(f"{OWNER}: pass ranks_per_node, or launch with torchrun (which sets "
                             "LOCAL_WORLD_SIZE)")
        ranks_per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    shard_lists, replica_lists = group_layout(world, ranks_per_node)
    local = os.environ.get("LOCAL_RANK")
    if local is not None and os.environ.get("LOCAL_WORLD_SIZE") == str(ranks_per_node) \
            and int(local) != rank % ranks_per_node:
        raise ValueError(f"{OWNER}: rank {rank} has LOCAL_RANK {local}, but 2D groups need ranks "
                         f"numbered node by node (rank % {ranks_per_node} == LOCAL_RANK)")
    shard_group, _ = dist.new_subgroups_by_enumeration(shard_lists)
    replica_group, _ = dist.new_subgroups_by_enumeration(replica_lists)
    return Topology2D(world // ranks_per_node, ranks_per_node, rank // ranks_per_node,
                      rank % ranks_per_node, shard_group, replica_group)


@dataclass
class ReplicaSync:
    """How a sharded module keeps its replicas in step (see the module docstring).

    group: the replica group; sync: "gradients" or "weights"; sync_every: steps between
    averages (weights only); precision: "fp32" or "bf16" for the gradients' all-reduce.
    """

    group: dist.ProcessGroup
    sync: str = "gradients"
    sync_every: int = 1
    precision: str = "fp32"

    def __post_init__(self):
        if self.sync not in SYNCS:
            raise ValueError(f"{OWNER}: replica sync must be one of {SYNCS}, got {self.sync!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"{OWNER}: replica sync precision must be one of {PRECISIONS}, got "
                             f"{self.precision!r}")
        if self.sync == "weights" and self.precision != "fp32":
            raise ValueError(f"{OWNER}: weights are averaged in fp32 (bf16 would round them); "
                             "bf16 applies to sync='gradients'")
        if not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ValueError(f"{OWNER}: sync_every must be an int >= 1, got {self.sync_every!r}")


class ReplicatedLookup(torch.autograd.Function):
    """The owner's lookup with its update kept in step across replicas.

    Inputs: (tables: PooledTables, replicas: ReplicaSync, optim: the module's
    ShardedFusedOptimizer, lookup tensors..., *local weights); forward pools as
    FusedPooledLookup; backward updates the rows per `replicas` (tables need a fused
    optimizer).
    """

    @staticmethod
    def forward(ctx, tables, replicas, optim, unique_values, unique_offsets, inverse, offsets, psw,
                *weights):
        ctx.tables, ctx.replicas, ctx.optim = tables, replicas, optim
        ctx.weights = weights
        ctx.save_for_backward(unique_values, unique_offsets, inverse, offsets, psw)
        return pooled_forward(BagLookup(weights, unique_values, unique_offsets, inverse, offsets,
                                        psw, list(tables.slot_table), list(tables.pooling),
                                        owner_batch(offsets, tables)))

    @staticmethod
    def backward(ctx, grad_output):
        replicas: ReplicaSync = ctx.replicas
        tables = ctx.tables
        weights = [w.detach() for w in ctx.weights]
        unique_values, unique_offsets, inverse, offsets, psw = ctx.saved_tensors
        lookup = BagLookup(weights, unique_values, unique_offsets, inverse, offsets, psw,
                           list(tables.slot_table), list(tables.pooling),
                           owner_batch(offsets, tables))
        grad_output = grad_output.contiguous().float()
        kinds, states, hparams = ctx.optim.step_arguments(0, len(weights))
        states = [s if s is not None else w.new_empty(0) for s, w in zip(states, weights)]
        with torch.no_grad():
            if replicas.sync == "weights":
                backward_update(grad_output, lookup, states, kinds, hparams)
                if ctx.optim.step_count % replicas.sync_every == 0:
                    average_replicas(weights, states, replicas.group)
            else:
                rows = unique_grad(grad_output, lookup)
                uoff = unique_offsets.tolist()
                mine = [unique_values[uoff[t]: uoff[t + 1]] for t in range(len(weights))]
                union, summed = sum_over_replicas(mine, rows, replicas)
                if any(k == NONE for k in kinds):
                    raise ValueError(f"{OWNER}: 2D training with replica sync needs a fused "
                                     "optimizer on every table (fused_params or "
                                     "apply_optimizer_in_backward)")
                apply_row_gradients(weights, states, union, summed, kinds, hparams)
        return (None,) * 8 + (None,) * len(weights)


def update_replicated_rows(replicas: ReplicaSync, optim, requested: RequestedRows,
                           states: Sequence[torch.Tensor], grad: torch.Tensor,
                           kinds: Sequence[int], hparams: Sequence[float]) -> None:
    """row_exchange.update_requested_rows for a module with 2D replicas (its RowLookup's
    update, with `replicas` and `optim`, the module's ShardedFusedOptimizer, bound), kept in
    step per `replicas`: "gradients" sums each requested row's gradient on this rank, then over
    the replicas (the union of the rows they touched, as the pooled tables' sum_over_replicas),
    so every replica applies the same update to the same rows; "weights" updates from this
    node's gradients and averages the row tables and their state every sync_every steps. The
    other arguments as update_requested_rows's."""
    weights = requested.lookup.weights
    if replicas.sync == "weights":
        update_requested_rows(requested, states, grad, kinds, hparams)
        if optim.step_count % replicas.sync_every == 0:
            average_replicas(weights, states, replicas.group)
        return
    sums = unique_grad(grad, requested.lookup)
    union, summed = sum_over_replicas(requested.unique_rows(), sums, replicas)
    apply_row_gradients(weights, states, union, summed, kinds, hparams)


def owner_batch(offsets: torch.Tensor, tables: PooledTables) -> int:
    """The owner's batch size from its bag offsets ([slots * B + 1])."""
    slots = len(tables.slot_table)
    return (offsets.numel() - 1) // slots if slots else 0


def sum_over_replicas(rows: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                      replicas: ReplicaSync) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Per local table: (the union of the replicas' rows, ascending; the sum of their gradients
    at those rows, divided by the group's size under TorchRec's gradient division).
    rows: int64 [U_t] ascending; grads: float32 [U_t, D_t]."""
    group = replicas.group
    size = dist.get_world_size(group)
    device = grads[0].device if grads else torch.device("cpu")
    counts = int64_on((r.numel() for r in rows), device)
    # gloo gathers into flat outputs only.
    all_counts = torch.empty(size * counts.numel(), dtype=torch.int64, device=device)
    all_gather_flat(all_counts, counts, group=group)
    all_counts = all_counts.view(size, -1).cpu()
    longest = int(all_counts.sum(1).max()) if size else 0
    mine = torch.full((longest,), -1, dtype=torch.int64, device=device)
    flat = torch.cat([r.to(torch.int64) for r in rows]) if rows else mine[:0]
    mine[: flat.numel()] = flat
    gathered = torch.empty(size * longest, dtype=torch.int64, device=device)
    all_gather_flat(gathered, mine, group=group)
    gathered = gathered.view(size, longest)
    unions, positions = [], []
    starts = torch.cumsum(all_counts, 1) - all_counts
    for t, own in enumerate(rows):
        pieces = [gathered[r, starts[r, t]: starts[r, t] + all_counts[r, t]] for r in range(size)]
        union = torch.unique(torch.cat(pieces)) if pieces else own[:0]
        unions.append(union)
        positions.append(torch.searchsorted(union, own.to(torch.int64)))
    wire = torch.float32 if replicas.precision == "fp32" else torch.bfloat16
    widths = [g.shape[1] for g in grads]
    buffer = torch.zeros(sum(u.numel() * w for u, w in zip(unions, widths)), dtype=wire,
                         device=grads[0].device if grads else None)
    views, start = [], 0
    for union, width, position, grad in zip(unions, widths, positions, grads):
        view = buffer[start: start + union.numel() * width].view(union.numel(), width)
        view[position] = grad.to(wire)
        views.append(view)
        start += union.numel() * width
    dist.all_reduce(buffer, group=group)
    if get_gradient_division() and size > 1:
        # The replicas' mean (see the module docstring), divided in fp32 as TorchRec divides.
        return unions, [v.float() / size for v in views]
    return unions, [v.float() for v in views]


def average_replicas(weights: Sequence[torch.Tensor], states: Sequence[torch.Tensor],
                     group: dist.ProcessGroup) -> None:
    """Averages every local weight and optimizer state over the replica group, in place."""
    size = dist.get_world_size(group)
    tensors = [t for t in list(weights) + list(states) if t.numel()]
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    flat.div_(size)
    start = 0
    for t in tensors:
        t.copy_(flat[start: start + t.numel()].view_as(t))
        start += t.numel()


class WorldDataParallelWrapper:
    """DistributedModelParallel's data_parallel_wrapper for 2D: the dense part is data parallel
    over every rank (DDP on `group`, default the world), while DMP's env is one node's shard
    group. Pass `data_parallel_wrapper=WorldDataParallelWrapper()` to DistributedModelParallel.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, **ddp_options):
        from torchrec.distributed.model_parallel import DefaultDataParallelWrapper

        self._group = group
        self._default = DefaultDataParallelWrapper(**ddp_options)

    def wrap(self, dmp, env: ShardingEnv, device: torch.device) -> None:
        group = self._group if self._group is not None else dist.group.WORLD
        self._default.wrap(dmp, ShardingEnv.from_process_group(group), device)
