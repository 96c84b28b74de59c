"""The output dist of recxla's sharded EmbeddingBagCollection: embeddings back to the ranks
whose samples they belong to, through `recxla.quantized_all_to_all`, and into the module's
output columns.

One exchange (a batch, or one micro-batch of the pipeline) is one `quantized_all_to_all`. What
an owner sends a rank is, one after another:
- its pooled block [B, D_owner] for that rank's samples: the column blocks of its pooled slots
  (the owner's lookup output for that rank is one contiguous block of rows);
- for each of its row groups, the unique rows that rank asked for [U, cols] (row_exchange.py).
Every width is a multiple of `wire_row_dim` (it divides every shard's width), so the message is
rows of wire_row_dim values with no row straddling two embeddings: FP8 rows with a scale each in
forward, the gradient back in the backward format.

The receiver copies each pooled column range to the module's output columns (TorchRec's
order), pools its own bags of every row group from the rows it got (one multi-table lookup for
all the groups of a message, a table per group, which writes each feature straight into its
output columns; its gradient likewise reads them in place), adds the partial sums of
row-sharded tables and divides row-sharded MEAN bags by their length (`AssembleOutput`: one
pass forward, one pass backward, which reduces the row groups' gradients per unique row).
Every column range of a pass moves in one op, `recxla::copy_runs` (recxla/ops/copy_runs.py),
as does the owner's message (`owner_message_runs`: packed forward, unpacked when the gradient
comes back); in a group of one rank the received rows are the output as they are, and neither
pass copies.

Gradient division: TorchRec's pooled all-to-alls divide the gradients that reach the owners by
the size of the sharding group (`torchrec.distributed.comm_ops`: `grad.div_(world_size(pg))`
after decoding, unless `set_gradient_division(False)`), so that W ranks' summed gradients of
their mean losses equal one rank's gradient of the mean over the global batch. Every gradient
this dist brings back to an owner goes through `divide_gradient` (both the module's autograd
path and the pipeline's `start_gradient`), which reads TorchRec's setting when the gradient
arrives, as TorchRec does. It covers every sharding type alike: TorchRec's table-/column-wise
all-to-all and its row-wise reduce-scatter (backward: all-gather) both divide by the group's
size, and so does its table-row-wise (intra-node reduce-scatter, then cross-node all-to-all:
local size x nodes = the group's size). Row exchange moves the same gradient summed per unique
row before it travels; a sum of divided terms is the divided sum, so it is divided the same way.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.sparse.jagged_tensor import KeyedTensor

from recxla.distributed import quantized_all_to_all
from recxla.formats import get_format
from recxla.host_copy import to_device
from recxla.ops.copy_runs import PackRuns, Run, copy_runs, pack, row_span, rows_in_place
from recxla.ops.embedding_bag import MEAN, SUM, BagLookup, pooled_forward, unique_grad
from recxla.torchrec.comm_stats import CommStats
from recxla.torchrec.keyed_output import KeyedOutput
from recxla.torchrec.row_exchange import RowBags, RowInput
from recxla.torchrec.shard_layout import OWNER, ShardLayout


@dataclass(frozen=True)
class ColumnCopy:
    """Columns [src, src + width) of source block `block` go to output columns
    [dst, dst + width); `add` when an earlier copy already wrote them (row-sharded sums).
    Blocks: the owners' pooled blocks (0 .. W-1), then the receiver's own pooling of every
    global row group (W: the groups side by side in group order, each [B, features * cols])."""

    block: int
    src: int
    dst: int
    width: int
    add: bool


def column_copies(layout: ShardLayout) -> List[ColumnCopy]:
    """The copies from the received (and locally pooled) blocks to the output, adjacent
    ranges merged."""
    targets = layout.output_columns(layout.rank).tolist()
    columns: List[Tuple[int, int, int]] = []  # (block, src, dst)
    position = 0
    for owner in range(layout.world_size):
        for src in range(layout.output_dim(owner)):
            columns.append((owner, src, targets[position]))
            position += 1
    group_column = 0
    for owner in range(layout.world_size):
        for local in layout.row_groups(owner):
            s = local.shard
            for j, feature in enumerate(layout.tables[s.table].feature_names):
                base = layout.output_offset(s.table, feature) + s.col_offset
                columns.extend((layout.world_size, group_column + c, base + c)
                               for c in range(s.cols))
                group_column += s.cols
    copies: List[ColumnCopy] = []
    written = set()
    for block, src, dst in columns:
        add = dst in written
        written.add(dst)
        last = copies[-1] if copies else None
        if (last is not None and last.block == block and last.add == add
                and last.src + last.width == src and last.dst + last.width == dst):
            copies[-1] = ColumnCopy(block, last.src, last.dst, last.width + 1, add)
        else:
            copies.append(ColumnCopy(block, src, dst, 1, add))
    return copies


@dataclass
class Message:
    """The layout of one received message, in values: per owner its pooled block (offset,
    [batch, dim]) and its row groups' rows (offset, global group, rows, cols); and the bags
    this rank pools from them."""

    batch: int
    pooled: List[Tuple[int, int]]
    rows: List[Tuple[int, int, int, int]]
    total: int
    bags: Optional[RowBags] = None
    micro_batch: int = 0


class AssembleOutput(torch.autograd.Function):
    """received [R, wire_row_dim] -> the module's output values [batch, out_dim] by an
    assembly (PooledAssembly, or sequence_output.ExpandedAssembly); differentiable w.r.t.
    received."""

    @staticmethod
    def forward(ctx, received, assembly, message, lengths):
        ctx.assembly, ctx.message = assembly, message
        ctx.save_for_backward(received, lengths)
        return assembly.assemble(received.reshape(-1), message, lengths)

    @staticmethod
    def backward(ctx, grad_out):
        received, lengths = ctx.saved_tensors
        return (ctx.assembly.split(grad_out, received, ctx.message, lengths), None, None, None)


class _DivideGradient(torch.autograd.Function):
    """Identity forward; backward divides the gradient that arrived at the owner as TorchRec's
    pooled all-to-all does (OutputDist.divide_gradient)."""

    @staticmethod
    def forward(ctx, x, dist):
        ctx.dist = dist
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.dist.divide_gradient(grad), None


class _LocalExchange:
    """The exchange of a group of one rank: the rows never leave the process, so they are handed
    back as they are (quantized_all_to_all would copy them exactly and make no collective)."""

    def __init__(self, rows: torch.Tensor):
        self._rows = rows

    def is_completed(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        return self._rows


class _DividedGradientHandle:
    """A gradient exchange in flight whose wait() gives the owner's message divided as
    TorchRec's all-to-all's backward divides it."""

    def __init__(self, handle, dist: "OutputDist"):
        self._handle, self._dist, self._result = handle, dist, None

    def is_completed(self) -> bool:
        return self._result is not None or self._handle.is_completed()

    def wait(self) -> torch.Tensor:
        if self._result is None:
            self._result = self._dist.divide_gradient(self._handle.wait())
        return self._result


class PooledAssembly:
    """The pooled module's receiver: the received pooled blocks' columns to the output columns
    (TorchRec's order), the receiver's pooling of its row groups' bags, the partial sums of
    row-sharded tables added and their MEAN bags divided (see the module docstring); and the
    output as a KeyedTensor of the module's embedding names.

    Args:
        layout: the module's ShardLayout.
    """

    def __init__(self, layout: ShardLayout):
        self.layout = layout
        self.embedding_names = list(layout.embedding_names)
        self.embedding_dims = list(layout.embedding_dims)
        self.owner_dims = [layout.output_dim(d) for d in range(layout.world_size)]
        self.out_dim = sum(layout.embedding_dims)
        # Both passes move every range in one op (copy_runs over _column_runs).
        self.copies = column_copies(layout)
        groups = [g for r in range(layout.world_size) for g in layout.row_groups(r)]
        self.group_cols = [g.cols for g in groups]
        self.group_features = [len(layout.tables[g.table].feature_names) for g in groups]
        self.group_pooling = [SUM if layout.row_sharded(g.table) else
                              layout.tables[g.table].pooling for g in groups]
        # Output columns of row-sharded MEAN tables: their parts are summed, then divided.
        self.mean_ranges: List[Tuple[int, int]] = []
        self.mean_slots: List[int] = []
        offset = 0
        for slot, (t, dim) in enumerate(zip(layout.input_slot_table, layout.embedding_dims)):
            if layout.row_sharded(t) and layout.tables[t].pooling == MEAN:
                self.mean_ranges.append((offset, offset + dim))
                self.mean_slots.append(slot)
            offset += dim
        # The receiver's pooling of every row group: one block, the groups side by side.
        self.row_block_width = sum(f * c for f, c in zip(self.group_features, self.group_cols))
        # What the runs need: each output column written by one copy (the adds come after it,
        # and the copies run side by side on a GPU), and each received column read by one
        # range (the transposed runs then write each gradient value once).
        widths = self.owner_dims + ([self.row_block_width] if groups else [])
        by_block = {}
        for c in sorted(self.copies, key=lambda c: (c.block, c.src)):
            by_block.setdefault(c.block, []).append(c)
        for block, copies in by_block.items():
            _check_tiling(copies, "src", widths[block])
        _check_tiling(sorted((c for c in self.copies if not c.add), key=lambda c: c.dst), "dst",
                      self.out_dim)
        # Each row group's bags are pooled straight into their output columns, and their
        # gradient read from there, unless a row group's column is a later part of a
        # row-sharded sum: then the row block goes through the runs.
        self.row_feature_columns = _row_feature_columns(
            [c for c in self.copies if c.block == layout.world_size], self.group_features,
            self.group_cols) if groups else None
        # Rank 0 owns every output column, in the output's order, and nothing is pooled or
        # divided here (a group of one rank): the received rows are the output as they are, so
        # neither pass copies.
        self.pass_through = (self.copies == [ColumnCopy(0, 0, 0, self.out_dim, False)]
                             and not self.mean_ranges and not groups)

    def receive_lengths(self, input_lengths: torch.Tensor,
                        device: torch.device) -> Optional[torch.Tensor]:
        """What the assembly needs of this rank's bag lengths (input_lengths int [input slots,
        B]): the lengths of its row-sharded MEAN bags, whose sums arrive in parts and are
        divided here, float32 [B, those features] clamped to >= 1 on `device`; None without
        such bags."""
        if not self.mean_slots:
            return None
        return to_device(input_lengths[self.mean_slots].t().to(torch.float32).clamp(min=1.0)
                         .contiguous(), device)

    def form(self, values: torch.Tensor, lengths: Optional[torch.Tensor]) -> KeyedTensor:
        """values float32 [B, sum of dims] as the KeyedTensor of the module's model-parallel
        features (keys and dims in TorchRec's order; a KeyedOutput, whose to_dict() hands the
        pieces' gradient back without a copy where it can)."""
        return KeyedOutput(keys=self.embedding_names, length_per_key=self.embedding_dims,
                           values=values)

    def assemble(self, flat: torch.Tensor, message: Message,
                 bag_lengths: torch.Tensor) -> torch.Tensor:
        """The received message (flat) -> the output values [batch, out_dim]: one op moves
        every column range (copy_runs), and one pools the row groups' bags, straight into
        their columns (row_feature_columns) or into a block the runs then move."""
        out = flat.new_empty((message.batch, self.out_dim))
        placed = bool(message.rows) and self.row_feature_columns is not None
        sources = [flat]
        if message.rows:
            lookup = self._row_lookup(flat, message)
            if placed:
                pooled_forward(lookup, out, self.row_feature_columns)
            else:
                sources.append(pooled_forward(lookup))
        copy_runs(sources, [out], pack(self._column_runs(message, row_block=not placed)))
        for k, (lo, hi) in enumerate(self.mean_ranges):
            out[:, lo:hi].div_(bag_lengths[:, k: k + 1])
        return out

    def split(self, grad_out: torch.Tensor, received: torch.Tensor, message: Message,
              bag_lengths: torch.Tensor) -> torch.Tensor:
        """The transpose of assemble: -> a gradient shaped like `received`."""
        if self.pass_through:
            return grad_out.contiguous().view(received.shape)
        batch = message.batch
        if self.mean_ranges:
            grad_out = grad_out.clone(memory_format=torch.contiguous_format)
            for k, (lo, hi) in enumerate(self.mean_ranges):
                grad_out[:, lo:hi].div_(bag_lengths[:, k: k + 1])
        else:  # copied only where its columns are apart or its rows overlap (broadcast)
            grad_out = rows_in_place(grad_out)
        # Read where it lies: the model hands over a column range of its wider gradient.
        rows, row_stride = row_span(grad_out)
        grad = grad_out.new_empty(received.shape)
        flat = grad.view(-1)
        placed = bool(message.rows) and self.row_feature_columns is not None
        # Every received column is read by one range (_check_tiling), so the transposed runs
        # write each gradient value once: the pooled blocks' into the message, the row groups'
        # pooled columns into their own block (unless the lookup reads them in place).
        targets = [flat]
        if message.rows and not placed:
            targets.append(grad_out.new_empty((batch, self.row_block_width)))
        copy_runs([rows], targets, pack(r.transposed() for r in self._column_runs(
            message, row_block=not placed, out_stride=row_stride)))
        if message.rows:
            lookup = self._row_lookup(received.reshape(-1), message)
            row_grads = unique_grad(grad_out, lookup, self.row_feature_columns) if placed else \
                unique_grad(targets[1], lookup)
            copy_runs([g.contiguous() for g in row_grads], [flat],
                      pack(Run(g, 0, 0, 0, offset, 0, 1, count * cols)
                           for g, (offset, _, count, cols) in enumerate(message.rows)))
        return grad

    def _row_lookup(self, flat: torch.Tensor, message: Message) -> BagLookup:
        """The receiver's bags of every row group of `message`, over the rows in the received
        message (flat), as one multi-table lookup (a table per group)."""
        bags = message.bags.message_bags(message.micro_batch)
        return BagLookup(self._row_tables(flat, message), bags.unique_values,
                         bags.unique_offsets, bags.inverse, bags.offsets, bags.weights,
                         bags.feature_table, self.group_pooling, message.batch)

    def _row_tables(self, flat: torch.Tensor, message: Message) -> List[torch.Tensor]:
        """Each row group's rows in the received message (flat), as the receiver's lookup
        takes its tables: made once per exchange. The backward asks again with the gradient's
        template, of the same shapes, and gets the forward's views: unique_grad reads only
        its tables' shapes."""
        return message.bags.cached(("row tables", message.micro_batch),
                                   lambda: _group_rows(flat, message))

    def _column_runs(self, message: Message, row_block: bool = True,
                     out_stride: Optional[int] = None) -> List[Run]:
        """The copies of `message` as runs from the received message (source 0; owner block
        b at message.pooled[b], [batch, owner_dims[b]]) and, with row_block, the receiver's
        pooling of its row groups (source 1, [batch, row_block_width]) into the output (target
        0, [batch, out_dim], rows out_stride apart: out_dim by default); with row-sharded sums,
        the later parts of a column add to the first."""
        batch, runs = message.batch, []
        out_stride = self.out_dim if out_stride is None else out_stride
        for c in self.copies:
            if c.block < len(message.pooled):
                offset, width = message.pooled[c.block]
                runs.append(Run(0, offset + c.src, width, 0, c.dst, out_stride, batch, c.width,
                                int(c.add)))
            elif row_block:
                runs.append(Run(1, c.src, self.row_block_width, 0, c.dst, out_stride, batch,
                                c.width, int(c.add)))
        return runs


class OutputDist:
    """Sends each owner's embeddings back and assembles the receiver's output.

    Args:
        layout: the module's ShardLayout.
        group: the process group.
        fwd_comm, bwd_comm: wire formats of the embeddings and of their gradients.
        stats: counters this dist adds its bytes to.
        assembly: the receiver's side: PooledAssembly (default) or
            sequence_output.ExpandedAssembly.
    """

    def __init__(self, layout: ShardLayout, group, fwd_comm: str, bwd_comm: str,
                 stats: CommStats, assembly=None):
        self.layout, self.group, self.stats = layout, group, stats
        self.fwd_comm, self.bwd_comm = fwd_comm, bwd_comm
        self.assembly = assembly if assembly is not None else PooledAssembly(layout)
        self.row_dim = layout.wire_row_dim
        self.owner_dims = [layout.output_dim(d) for d in range(layout.world_size)]
        self.fwd_row_bytes = get_format(fwd_comm, layout.owner, "fwd_comm").row_bytes(self.row_dim)
        self.bwd_row_bytes = get_format(bwd_comm, layout.owner, "bwd_comm").row_bytes(self.row_dim)
        world = layout.world_size
        self.group_cols = [g.cols for r in range(world) for g in layout.row_groups(r)]
        self.group_base = [0]
        for r in range(world):
            self.group_base.append(self.group_base[-1] + len(layout.row_groups(r)))
        # This owner's row groups' widths: the one source of the row block's layout
        # (RowInput.block_layout), for the lookup, the exchanges' runs and the early rows.
        me = layout.rank
        self.local_group_cols = self.group_cols[self.group_base[me]: self.group_base[me + 1]]

    # -------------------------------------------------------------- gradient division

    @property
    def gradient_divisor(self) -> int:
        """What the owners' gradients are divided by now: the group's size while TorchRec's
        gradient division is on (its default), else 1."""
        return self.layout.world_size if get_gradient_division() else 1

    def divide_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """grad (received at the owner, any shape) divided by `gradient_divisor` (a division,
        not a multiplication by its inverse, to round as TorchRec does)."""
        divisor = self.gradient_divisor
        return grad / divisor if divisor != 1 else grad

    # -------------------------------------------------------------- message layouts

    def receive_layout(self, batch: int, bags: Optional[RowBags], k: int = 0) -> Message:
        """What this rank receives in exchange k (its `batch` samples of that micro-batch)."""
        pooled, rows, offset = [], [], 0
        # One read of the host counts, not a tensor index and an int() per row group.
        counts = bags.counts[:, k].tolist() if bags is not None else None
        for owner in range(self.layout.world_size):
            pooled.append((offset, self.owner_dims[owner]))
            offset += batch * self.owner_dims[owner]
            for g in range(self.group_base[owner], self.group_base[owner + 1]):
                count = counts[g] if counts is not None else 0
                rows.append((offset, g, count, self.group_cols[g]))
                offset += count * self.group_cols[g]
        return Message(batch, pooled, rows, offset, bags, k)

    def send_sizes(self, source_batches: Sequence[int], rows: Optional[RowInput],
                   k: int = 0) -> List[int]:
        """Values this owner sends each rank in exchange k."""
        me = self.layout.rank
        groups = range(self.group_base[me + 1] - self.group_base[me])
        return [b * self.owner_dims[me] + sum(rows.rows(g, k, s) * self.group_cols[
            self.group_base[me] + g] for g in groups) if rows is not None else
            b * self.owner_dims[me] for s, b in enumerate(source_batches)]

    def _count(self, sent: Sequence[int], received: Sequence[int], forward: bool) -> None:
        me = self.layout.rank
        row_bytes = self.fwd_row_bytes if forward else self.bwd_row_bytes
        out = sum(n for r, n in enumerate(sent) if r != me) // self.row_dim * row_bytes
        into = sum(n for r, n in enumerate(received) if r != me) // self.row_dim * row_bytes
        if forward:
            self.stats.embedding_bytes_sent += out
            self.stats.embedding_bytes_received += into
        else:
            self.stats.gradient_bytes_sent += out
            self.stats.gradient_bytes_received += into

    # -------------------------------------------------------------- forward exchange

    def start(self, pooled: torch.Tensor, source_batches: List[int], message: Message,
              row_block: Optional[torch.Tensor] = None, rows: Optional[RowInput] = None):
        """Starts exchange `message.micro_batch`. pooled: float32 [sum(source_batches),
        D_me], the owner's pooled rows for each source in turn; row_block: the owner's
        requested rows (row_exchange.RequestedRows, laid out as
        rows.block_layout(local_group_cols)), or None without row groups. -> (in-flight
        handle, values sent to each rank, values expected from each rank)."""
        k = message.micro_batch
        send = self.send_sizes(source_batches, rows, k)
        recv = _owner_totals(message)
        sources = [pooled.contiguous()] if row_block is None else \
            [pooled.contiguous(), row_block.contiguous()]
        runs = self.owner_message_runs(source_batches, rows, k, 0, row_block is not None)
        flat = PackRuns.apply(runs, sum(send), *sources)
        if flat.requires_grad:
            flat = _DivideGradient.apply(flat, self)
        return self.start_values(flat, send, recv), send, recv

    def owner_message_runs(self, source_batches: Sequence[int], rows: Optional[RowInput],
                           k: int, first_sample: int, with_rows: bool) -> List[Run]:
        """The layout of this owner's message of exchange k (forward rows, or the gradient
        coming back) as runs into target 0, the flat message: for each source rank in turn its
        samples' pooled rows (source 0, [samples, D_owner], from sample `first_sample` on),
        then, with_rows, the rows it asked of each of the owner's row groups (source 1, the row
        block, laid out as rows.block_layout(local_group_cols))."""
        dim = self.owner_dims[self.layout.rank]
        block = rows.block_layout(self.local_group_cols) if with_rows else None
        runs = []
        for group, first, count, at in self._owner_message_parts(source_batches, rows, k,
                                                                 first_sample, with_rows):
            if group is None:
                runs.append(Run(0, first * dim, 0, 0, at, 0, 1, count * dim))
                continue
            cols = self.local_group_cols[group]
            for offset, n in block.pieces(group, first, count):
                runs.append(Run(1, offset, block.width, 0, at, cols, n, cols))
                at += n * cols
        return runs

    def _owner_message_parts(self, source_batches: Sequence[int], rows: Optional[RowInput],
                             k: int, first_sample: int, with_rows: bool):
        """The parts of owner_message_runs's message, in order: for each source rank its pooled
        rows (None, first sample, samples, element offset in the message), then, with_rows, its
        rows of each local row group g (g, first row in rows.ids order, rows, element
        offset)."""
        dim = self.owner_dims[self.layout.rank]
        at, sample = 0, first_sample
        for s, samples in enumerate(source_batches):
            yield None, sample, samples, at
            at += samples * dim
            sample += samples
            if not with_rows:
                continue
            for g, cols in enumerate(self.local_group_cols):
                count = rows.rows(g, k, s)
                yield g, rows.start(g, k, s), count, at
                at += count * cols

    def owner_gradient_offsets(self, source_batches: Sequence[int], rows: Optional[RowInput],
                               feature_columns: Sequence[int]
                               ) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """Where the owner's lookups find each bag's gradient row in the gradient message of a
        batch sent as one exchange (owner_message_runs's layout, k = 0), for the fused update
        to read it there (embedding_bag_backward_update's grad_offsets) instead of from
        buffers it is first unpacked into. feature_columns: the pooled lookup's F features'
        first columns in its [B, D_owner] output. -> (pooled: int64 [F * B], bag f * B + b at
        sample b's row plus feature f's column; rows: None without row groups, else int64
        [slots * slot rows], a bag per row of the row block (RequestedRows), the requested
        row's gradient where it lies; a padding row's entry 0, never read)."""
        dim = self.owner_dims[self.layout.rank]
        batch = sum(source_batches)
        with_rows = rows is not None
        sample_at = np.empty(batch, dtype=np.int64)
        segments = []  # (first bag, rows, element offset, cols) of each row group part
        block = rows.block_layout(self.local_group_cols) if with_rows else None
        for group, first, count, at in self._owner_message_parts(source_batches, rows, 0, 0,
                                                                 with_rows):
            if group is None:
                sample_at[first: first + count] = at + dim * np.arange(count)
            elif count:
                segments.append((block.first_slot[group] * block.rows + first, count, at,
                                 self.local_group_cols[group]))
        pooled = (np.asarray(feature_columns, dtype=np.int64)[:, None] + sample_at).reshape(-1)
        if block is None:
            return pooled, None
        row_offsets = np.zeros(block.first_slot[-1] * block.rows, dtype=np.int64)
        if segments:
            first_bag, count, at, cols = (np.array(c, dtype=np.int64) for c in zip(*segments))
            part = np.repeat(np.arange(len(segments)), count)
            within = np.arange(part.size) - np.repeat(np.cumsum(count) - count, count)
            row_offsets[first_bag[part] + within] = at[part] + within * cols[part]
        return pooled, row_offsets

    def start_values(self, flat: torch.Tensor, send: List[int], recv: List[int]):
        """Starts a forward exchange of values laid out by the caller (`start`, and
        early_rows.py for part of a message): flat float32, `send` values to each rank, `recv`
        from each, every one a multiple of wire_row_dim -> its handle (wait() gives
        [sum(recv) / wire_row_dim, wire_row_dim]; its backward sends the gradient back)."""
        self._count(send, recv, forward=True)
        return self._exchange(flat, recv, send, self.fwd_comm)

    def assemble(self, received: torch.Tensor, message: Message,
                 bag_lengths: Optional[torch.Tensor]) -> torch.Tensor:
        """received rows -> the output values [batch, assembly.out_dim]; differentiable.
        bag_lengths: this exchange's rows of the assembly's receive_lengths (or None)."""
        assembly = self.assembly
        if assembly.pass_through and not received.requires_grad:
            return received.view(message.batch, assembly.out_dim)  # the pipeline's path: no copy
        if bag_lengths is None:
            bag_lengths = received.new_empty((message.batch, 0))
        return AssembleOutput.apply(received, assembly, message, bag_lengths)

    def finish(self, handle, sent: List[int], message: Message,
               bag_lengths: Optional[torch.Tensor], on_backward) -> torch.Tensor:
        """Waits for the rows and assembles the output (autograd path); `on_backward` runs
        when the output's gradient arrives, before it is sent back. sent: the values this
        rank sent each rank in the forward exchange (`start`)."""
        received = handle.wait()
        if received.requires_grad:
            back = _owner_totals(message)

            def hook(grad):
                # The gradients retrace the forward's paths backwards.
                self._count(back, sent, forward=False)
                on_backward()

            received.register_hook(hook)
        return self.assemble(received, message, bag_lengths)

    # -------------------------------------------------------------- backward exchange

    def start_gradient(self, grad_out: torch.Tensor, source_batches: List[int],
                       message: Message, bag_lengths: Optional[torch.Tensor],
                       rows: Optional[RowInput]):
        """The backward exchange on its own (no autograd): grad_out float32 [batch, sum of
        embedding dims] -> (in-flight handle whose wait() gives the owner's gradient message,
        divided as the autograd path divides it, the sizes it will hold per source)."""
        if bag_lengths is None:
            bag_lengths = grad_out.new_empty((message.batch, 0))
        template = grad_out.new_empty((message.total,))
        grad = self.assembly.split(grad_out, template, message, bag_lengths)
        to_owners = _owner_totals(message)
        from_sources = self.send_sizes(source_batches, rows, message.micro_batch)
        self._count(to_owners, from_sources, forward=False)
        handle = self._exchange(grad, from_sources, to_owners, self.bwd_comm)
        return _DividedGradientHandle(handle, self), from_sources

    def _exchange(self, flat: torch.Tensor, recv: List[int], send: List[int], wire: str):
        """Starts the all-to-all of `flat` (values: `send` to each rank, `recv` from each) in
        `wire` format (the gradient, if any, goes back in self.bwd_comm) -> its in-flight handle."""
        rows = flat.view(-1, self.row_dim)
        if self.layout.world_size == 1:
            return _LocalExchange(rows)
        return quantized_all_to_all(rows, [n // self.row_dim for n in recv],
                                    [n // self.row_dim for n in send], group=self.group,
                                    fwd=wire, bwd=self.bwd_comm, async_op=True,
                                    validate_splits=False)


def _check_tiling(copies: List[ColumnCopy], side: str, width: int) -> None:
    """The column ranges' `side` ("src" or "dst"), in order, cover [0, width) without a gap or
    an overlap: what PooledAssembly's runs rely on."""
    position = 0
    for c in copies:
        if getattr(c, side) != position:
            break
        position += c.width
    if position != width or sum(c.width for c in copies) != width:
        raise RuntimeError(f"{OWNER}: the output columns' {side} ranges do not tile "
                           f"[0, {width}): {copies}")


def _row_feature_columns(row_copies: List[ColumnCopy], group_features: Sequence[int],
                         group_cols: Sequence[int]) -> Optional[List[int]]:
    """The output column where each feature of the receiver's row lookup (group by group,
    each group's features in turn, `cols` wide: the row block's layout) starts, from the row
    block's copies; None when a copy adds to a column (a later part of a row-sharded sum,
    which the runs add in order) or splits a feature."""
    if any(c.add for c in row_copies):
        return None
    columns, at = [], 0
    for features, cols in zip(group_features, group_cols):
        for _ in range(features):
            if cols == 0:
                columns.append(0)
                continue
            copy = next(c for c in row_copies if c.src <= at < c.src + c.width)
            if at + cols > copy.src + copy.width:
                return None
            columns.append(copy.dst + at - copy.src)
            at += cols
    return columns


def _group_rows(flat: torch.Tensor, message: Message) -> List[torch.Tensor]:
    """Each row group's rows in a message laid out as `message` ([U_g, cols] views of flat):
    the groups that lie back to back with one width (an owner's) as one view split in one
    call, not a view each."""
    runs: List[Tuple[int, int, List[int]]] = []  # (offset, cols, each group's rows)
    for offset, _, count, cols in message.rows:
        if runs and runs[-1][1] == cols and \
                runs[-1][0] + sum(runs[-1][2]) * cols == offset:
            runs[-1][2].append(count)
        else:
            runs.append((offset, cols, [count]))
    views: List[torch.Tensor] = []
    for offset, cols, counts in runs:
        run = flat.as_strided((sum(counts), cols), (cols, 1), flat.storage_offset() + offset)
        views.extend(run.split_with_sizes(counts) if len(counts) > 1 else (run,))
    return views


def _owner_totals(message: Message) -> List[int]:
    """Values received from each owner (its pooled block and its row groups' rows)."""
    starts = [offset for offset, _ in message.pooled] + [message.total]
    return [starts[i + 1] - starts[i] for i in range(len(message.pooled))]
