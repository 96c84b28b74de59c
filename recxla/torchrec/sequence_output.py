"""The sequence module's receiver: unique rows expanded to the positions of their ids.

recxla's sharded EmbeddingCollection (sharded_embedding.py) exchanges every table as rows
(row_exchange.py): a rank sends each owner the unique ids of its batch per (row group,
micro-batch), and the owner sends each unique row once. The receiver then gives every id of its
batch the row it names, in the order of TorchRec's jagged output (per feature, sample by sample,
in bag order), where TorchRec's sequence all-to-all carries one row per id.

One pass does it for every sharding type. The message is rows of `wire_row_dim` values (it
divides every shard's width): a table-wise or row-wise row is one wire row, a column-wise row
one wire row per column shard. Each output row [dim] is dim / wire_row_dim wire rows, each
from one row group's unique row. The sender, which is this rank, made with the encoding the index
of the wire row that fills every output chunk of every micro-batch (`recxla::expand_row_plan`,
one host op: `RowBags.expand_plan`), so the receiver only slices it, and:

    forward   output chunks = the message's wire rows gathered by that index
    backward  the message's gradient = the output chunks' gradients summed per wire row

Both are recxla's embedding-bag ops with one wire row per bag (`pooled_forward`, whose bags of
one id are a gather, and `unique_grad`, which sums each unique row's gradients in a fixed order),
so they run on the same C++, CUDA and Triton kernels as the pooled lookup, and the backward is
deterministic on every device. A row's gradient then crosses the wire once, summed over its
positions, and the owner updates it once (row_exchange.RowLookup).
"""

from dataclasses import dataclass
from typing import Dict

import torch
from torchrec.sparse.jagged_tensor import JaggedTensor

from recxla.host_copy import to_device
from recxla.ops.embedding_bag import SUM, BagLookup, pooled_forward, unique_grad
from recxla.torchrec.keyed_output import split_by_key
from recxla.torchrec.shard_layout import ShardLayout


@dataclass(frozen=True)
class ExpandPlan:
    """One exchange's expansion as a lookup of the message's wire rows [R, wire_row_dim], one
    bag per output chunk: unique_values int64 [R] (0 .. R-1), unique_offsets int64 [2],
    index int64 [chunks] (each chunk's wire row), offsets int64 [chunks + 1]."""

    unique_values: torch.Tensor
    unique_offsets: torch.Tensor
    index: torch.Tensor
    offsets: torch.Tensor

    @property
    def chunks(self) -> int:
        return self.index.numel()


class ExpandedAssembly:
    """The output dist's receiver for the sequence module (see the module docstring), with the
    interface of output_dist.PooledAssembly.

    Args:
        layout: the module's ShardLayout (every table a row table, all of one dim).
    """

    pass_through = False  # the expansion always gathers

    def __init__(self, layout: ShardLayout):
        self.layout = layout
        self.row_dim = layout.wire_row_dim
        dims = {t.embedding_dim for t in layout.tables}
        self.out_dim = dims.pop() if len(dims) == 1 else 0
        self.embedding_names = list(layout.embedding_names)

    def receive_lengths(self, input_lengths: torch.Tensor,
                        device: torch.device) -> torch.Tensor:
        """Every bag's length, one row per sample: input_lengths int [input slots, B] ->
        int64 [B, input slots] on the host (the jagged output's lengths; their sums size the
        output there, so they stay where no device has to be read; pinned for a GPU)."""
        lengths = input_lengths.t().to(torch.int64).contiguous()
        if device.type == "cuda":
            lengths = lengths.pin_memory()
        return lengths

    def assemble(self, flat: torch.Tensor, message, lengths: torch.Tensor) -> torch.Tensor:
        """The received message (flat float32) -> float32 [ids of the exchange, dim]."""
        plan = self.plan(message)
        if plan.chunks == 0:
            return flat.new_zeros((0, self.out_dim))
        rows = flat.view(-1, self.row_dim)
        out = pooled_forward(BagLookup([rows], plan.unique_values, plan.unique_offsets,
                                       plan.index, plan.offsets, None, [0], [SUM], plan.chunks))
        return out.view(-1, self.out_dim)

    def split(self, grad_out: torch.Tensor, received: torch.Tensor, message,
              lengths: torch.Tensor) -> torch.Tensor:
        """The transpose of assemble: grad_out float32 [ids, dim] -> a gradient shaped like
        `received`, each wire row's the sum over the chunks it filled."""
        plan = self.plan(message)
        if plan.chunks == 0:
            return grad_out.new_zeros(received.shape)
        rows = received.reshape(-1, self.row_dim)
        lookup = BagLookup([rows], plan.unique_values, plan.unique_offsets, plan.index,
                           plan.offsets, None, [0], [SUM], plan.chunks)
        grad = unique_grad(grad_out.contiguous().view(-1, self.row_dim), lookup)[0]
        return grad.view(received.shape)

    def form(self, values: torch.Tensor, lengths: torch.Tensor) -> Dict[str, JaggedTensor]:
        """values float32 [ids, dim] (assemble's) and the exchange's lengths int64 [B, input
        slots] (host) -> per embedding name (TorchRec's: a feature, or feature@table where
        several tables read it) its JaggedTensor: values [ids of the feature, dim], lengths
        [B], on the values' device."""
        if not self.embedding_names:
            return {}
        counts = lengths.sum(0).tolist()
        on_device = to_device(lengths, values.device)
        return {name: JaggedTensor(values=part, lengths=on_device[:, s])
                for s, (name, part) in enumerate(zip(self.embedding_names,
                                                      split_by_key(values, counts, 0)))}

    def plan(self, message) -> ExpandPlan:
        """The ExpandPlan of exchange `message` (once per message: forward and backward)."""
        bags = message.bags
        if bags is None:  # no model-parallel table anywhere: nothing to expand
            empty = torch.zeros(0, dtype=torch.int64)
            return ExpandPlan(empty, torch.zeros(2, dtype=torch.int64), empty,
                              torch.zeros(1, dtype=torch.int64))
        return bags.cached(("expand", message.micro_batch),
                           lambda: self._make_plan(message))

    def _make_plan(self, message) -> ExpandPlan:
        bags, k = message.bags, message.micro_batch
        section, plan = bags.expand_sections[k], bags.expand_plan
        wire_rows = section.unique_values.stop - section.unique_values.start
        if wire_rows * self.row_dim != message.total:
            raise RuntimeError(f"{self.layout.owner}: the expansion of micro-batch {k} reads "
                               f"{wire_rows} wire rows of {self.row_dim} values, but its "
                               f"message holds {message.total} values")
        return ExpandPlan(unique_values=plan[section.unique_values],
                          unique_offsets=plan[section.unique_offsets],
                          index=plan[section.index], offsets=plan[section.offsets])
