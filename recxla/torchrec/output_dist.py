"""The output dist of recxla's sharded EmbeddingBagCollection: pooled embeddings back to the
ranks whose samples they belong to, through `recxla.quantized_all_to_all`, and into the
module's output columns.

Each owner's lookup output is [B_total, D_owner] (its slots' column blocks side by side, its
sources' samples one after another), so the rows for source s are one contiguous block. Seen as
rows of `wire_row_dim` values (a width that divides every shard's width, so no row straddles
two embeddings), that is exactly one `quantized_all_to_all`: FP8 rows with a scale each in
forward, the gradient back in the backward format. The receiver gets, from every owner, its
[B, D_owner] block; `AssembleColumns` copies each column range to the module's output columns
(TorchRec's order), summing the partial sums of row-sharded tables and dividing row-sharded
MEAN bags by their length, in one pass forward and one pass backward.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from recxla.distributed import quantized_all_to_all
from recxla.formats import get_format
from recxla.ops.embedding_bag import MEAN
from recxla.torchrec.comm_stats import CommStats
from recxla.torchrec.shard_layout import OWNER, ShardLayout


@dataclass(frozen=True)
class ColumnCopy:
    """Columns [src, src + width) of owner `owner`'s block go to output columns
    [dst, dst + width); `add` when an earlier copy already wrote them (row-sharded sums)."""

    owner: int
    src: int
    dst: int
    width: int
    add: bool


def column_copies(layout: ShardLayout) -> List[ColumnCopy]:
    """The copies from the received blocks to the output, adjacent ranges merged."""
    targets = layout.output_columns(layout.rank).tolist()
    copies: List[ColumnCopy] = []
    written = set()
    position = 0
    for owner in range(layout.world_size):
        for src in range(layout.output_dim(owner)):
            dst = targets[position]
            position += 1
            add = dst in written
            written.add(dst)
            last = copies[-1] if copies else None
            if (last is not None and last.owner == owner and last.add == add
                    and last.src + last.width == src and last.dst + last.width == dst):
                copies[-1] = ColumnCopy(owner, last.src, last.dst, last.width + 1, add)
            else:
                copies.append(ColumnCopy(owner, src, dst, 1, add))
    return copies


def _owner_blocks(flat: torch.Tensor, batch: int, owner_dims: List[int]) -> List[torch.Tensor]:
    blocks, start = [], 0
    for dim in owner_dims:
        blocks.append(flat[start: start + batch * dim].view(batch, dim))
        start += batch * dim
    return blocks


def assemble_columns(received: torch.Tensor, batch: int, owner_dims: List[int],
                     copies: List[ColumnCopy], out_dim: int, mean_ranges, bag_lengths):
    """received [R, wire_row_dim] (owner blocks of [batch, D_owner], one after another) ->
    [batch, out_dim]: each copy's columns to their output columns (adding row-sharded parts),
    then the mean ranges divided by bag_lengths (float32 [batch, ranges], >= 1)."""
    blocks = _owner_blocks(received.reshape(-1), batch, owner_dims)
    out = received.new_empty((batch, out_dim))
    for c in copies:
        source = blocks[c.owner][:, c.src: c.src + c.width]
        target = out[:, c.dst: c.dst + c.width]
        if c.add:
            target.add_(source)
        else:
            target.copy_(source)
    for k, (lo, hi) in enumerate(mean_ranges):
        out[:, lo:hi].div_(bag_lengths[:, k: k + 1])
    return out


def split_columns(grad_out: torch.Tensor, shape, batch: int, owner_dims: List[int],
                  copies: List[ColumnCopy], mean_ranges, bag_lengths) -> torch.Tensor:
    """The transpose of assemble_columns: [batch, out_dim] -> `shape` (the received layout)."""
    grad_out = grad_out.contiguous()
    if mean_ranges:
        grad_out = grad_out.clone()
        for k, (lo, hi) in enumerate(mean_ranges):
            grad_out[:, lo:hi].div_(bag_lengths[:, k: k + 1])
    grad = grad_out.new_empty(shape)
    blocks = _owner_blocks(grad.view(-1), batch, owner_dims)
    for c in copies:
        blocks[c.owner][:, c.src: c.src + c.width].copy_(grad_out[:, c.dst: c.dst + c.width])
    return grad


class AssembleColumns(torch.autograd.Function):
    """assemble_columns, differentiable w.r.t. `received`."""

    @staticmethod
    def forward(ctx, received, batch, owner_dims, copies, out_dim, mean_ranges, bag_lengths):
        ctx.meta = (received.shape, batch, owner_dims, copies, mean_ranges)
        ctx.save_for_backward(bag_lengths)
        return assemble_columns(received, batch, owner_dims, copies, out_dim, mean_ranges,
                                bag_lengths)

    @staticmethod
    def backward(ctx, grad_out):
        (bag_lengths,) = ctx.saved_tensors
        return (split_columns(grad_out, *ctx.meta, bag_lengths),
                None, None, None, None, None, None)


class OutputDist:
    """Sends each owner's pooled rows back and assembles the receiver's output.

    Args:
        layout: the module's ShardLayout.
        group: the process group.
        fwd, bwd: wire formats of the embeddings and of their gradients.
        stats: counters this dist adds its bytes to.
    """

    def __init__(self, layout: ShardLayout, group, fwd: str, bwd: str, stats: CommStats):
        self.layout, self.group, self.fwd, self.bwd, self.stats = layout, group, fwd, bwd, stats
        self.row_dim = layout.wire_row_dim
        self.owner_dims = [layout.output_dim(d) for d in range(layout.world_size)]
        self.out_dim = sum(layout.embedding_dims)
        self.copies = column_copies(layout)
        self.fwd_row_bytes = get_format(fwd, OWNER, "fwd_comm").row_bytes(self.row_dim)
        self.bwd_row_bytes = get_format(bwd, OWNER, "bwd_comm").row_bytes(self.row_dim)
        # Output columns of row-sharded MEAN tables: pooled as sums at the owners.
        self.mean_ranges: List[Tuple[int, int]] = []
        self.mean_slots: List[int] = []
        offset = 0
        for slot, (t, dim) in enumerate(zip(layout.input_slot_table, layout.embedding_dims)):
            if layout.row_sharded(t) and layout.tables[t].pooling == MEAN:
                self.mean_ranges.append((offset, offset + dim))
                self.mean_slots.append(slot)
            offset += dim

    def start(self, pooled: torch.Tensor, source_batches: List[int], batch: int):
        """pooled: float32 [sum(source_batches), D_me], the owner's rows for each source in
        turn; batch: this rank's samples. -> (in-flight QuantizedAllToAllHandle, rows sent to
        each rank, rows expected from each rank)."""
        me = self.layout.rank
        rows_per_sample = self.owner_dims[me] // self.row_dim
        send = [b * rows_per_sample for b in source_batches]
        recv = [batch * dim // self.row_dim for dim in self.owner_dims]
        for r in range(self.layout.world_size):
            if r != me:
                self.stats.embedding_bytes_sent += send[r] * self.fwd_row_bytes
                self.stats.embedding_bytes_received += recv[r] * self.fwd_row_bytes
        rows = pooled.reshape(-1, self.row_dim)
        handle = quantized_all_to_all(rows, recv, send, group=self.group, fwd=self.fwd,
                                      bwd=self.bwd, async_op=True, validate_splits=False)
        return handle, send, recv

    def assemble(self, received: torch.Tensor, batch: int,
                 bag_lengths: Optional[torch.Tensor]) -> torch.Tensor:
        """received rows (from `start`'s handle) -> [batch, sum of embedding dims], the
        module's output columns; differentiable."""
        if bag_lengths is None:
            bag_lengths = received.new_empty((batch, 0))
        return AssembleColumns.apply(received, batch, self.owner_dims, self.copies,
                                     self.out_dim, self.mean_ranges, bag_lengths)

    def start_gradient(self, grad_out: torch.Tensor, source_batches: List[int], batch: int,
                       bag_lengths: Optional[torch.Tensor]):
        """The backward exchange on its own (no autograd): grad_out float32 [batch, sum of
        embedding dims] -> the in-flight handle whose wait() gives the owner's gradient rows,
        [sum(source_batches) * D_me / wire_row_dim, wire_row_dim], sent in `bwd`."""
        me = self.layout.rank
        rows_per_sample = self.owner_dims[me] // self.row_dim
        to_owners = [batch * dim // self.row_dim for dim in self.owner_dims]
        from_sources = [b * rows_per_sample for b in source_batches]
        if bag_lengths is None:
            bag_lengths = grad_out.new_empty((batch, 0))
        rows = split_columns(grad_out, (sum(to_owners), self.row_dim), batch, self.owner_dims,
                             self.copies, self.mean_ranges, bag_lengths)
        for r in range(self.layout.world_size):
            if r != me:
                self.stats.gradient_bytes_sent += to_owners[r] * self.bwd_row_bytes
                self.stats.gradient_bytes_received += from_sources[r] * self.bwd_row_bytes
        return quantized_all_to_all(rows, from_sources, to_owners, group=self.group,
                                    fwd=self.bwd, bwd=self.bwd, async_op=True,
                                    validate_splits=False)

    def finish(self, handle, send: List[int], recv: List[int], batch: int,
               bag_lengths: Optional[torch.Tensor], on_backward) -> torch.Tensor:
        """Waits for the rows and assembles [batch, sum of embedding dims]; `on_backward` runs
        when the output's gradient arrives, before it is sent back."""
        received = handle.wait()
        if received.requires_grad:
            me = self.layout.rank
            gradient_sent = sum(n for r, n in enumerate(recv) if r != me) * self.bwd_row_bytes
            gradient_received = sum(n for r, n in enumerate(send) if r != me) * \
                self.bwd_row_bytes

            def hook(grad):
                self.stats.gradient_bytes_sent += gradient_sent
                self.stats.gradient_bytes_received += gradient_received
                on_backward()

            received.register_hook(hook)
        return self.assemble(received, batch, bag_lengths)
