"""Early rows: the next batch's embedding rows that this batch's update leaves as they are, sent
before the update.

What an owner sends a rank in one exchange (output_dist.py) is rows: per sample its pooled
bags, one per slot (the slot's columns), then its row groups' unique rows. This batch's update
changes exactly the rows of the tables this batch read (every rank's requests of the batch, at
this owner), so once the next batch's ids are decoded and its pooled tables looked up (before
the update, as DBP's early lookup does: early_lookup.py), the owner splits the next batch's
message, cell by cell:

    early  a row-exchange row this batch did not read, or a pooled bag none of whose rows this
           batch read: its value is final now, and it leaves while this batch's dense forward
           and backward run (a link otherwise idle then);
    late   the others: sent after the update, as every cell was before (a late bag's value is
           the early lookup corrected for the rows the update changed).

Each cell travels once, early or late, in the bytes it has in one message (the wire quantizes
each wire row on its own, with its own scale): the receiver puts both parts back into the one
message's layout. Every early cell and every late row is bit for bit what the message without
early rows would carry; a late bag equals it to float rounding (the early lookup's
correction). The receiver learns which cells come late from masks the owner sends first (a
byte per pooled bag and per requested row).

What pays depends on the data (`recxla.planner.early_send` measures it per table;
bench/results/training.md, "Early rows"): on the trainer's Zipf data the hot rows are read by
every batch, so they come late and the tail comes early (48% of the row tables' values), while
94% and 100% of the two pooled tables' next bags hold a row the update changes; with uniform
keys most bags are early. The bytes are the same either way (plus the masks): only when they
travel changes. Rows are split at no cost but the bookkeeping; early bags need the early
lookup and its correction of the late bags, so an owner sends bags early only in a batch where
at least POOLED_EARLY_MIN of its pooled values can leave (a choice per owner and batch, which
the masks carry: the receivers need no other agreement), and the trainer's metrics count the
cells that left early.
"""

from itertools import accumulate
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from recxla.distributed import traffic
from recxla.torchrec.input_dist import LookupInput
from recxla.torchrec.output_dist import Message, OutputDist
from recxla.torchrec.row_exchange import RowBags, RowInput
from recxla.torchrec.types import PooledTables

# An owner sends pooled bags early only when at least this share of its pooled values can
# leave before the update: the early lookup's correction of the late bags costs CPU on the
# step's path (on the trainer's Zipf data, where 94-100% of the bags are late, it cost 0.82x
# the examples/s at 200 Mbit/s), while rows are split for free.
POOLED_EARLY_MIN = 0.5


def split_requests(rows: RowInput, late: torch.Tensor) -> Tuple[RowInput, RowInput]:
    """rows: the owner's requests; late: bool [sum_g R_g], one per rows.values, the requests
    that come late. -> (the early requests, the late ones), each a RowInput in rows' order."""
    sizes = [c for counts in rows.counts for per_micro in counts for c in per_micro]
    ends = torch.tensor(list(accumulate(sizes, initial=0)), dtype=torch.int64,
                        device=late.device)
    running = torch.zeros(late.numel() + 1, dtype=torch.int64, device=late.device)
    torch.cumsum(late, 0, out=running[1:])
    late_per = running.index_select(0, ends).diff().tolist()
    early_per = [s - n for s, n in zip(sizes, late_per)]
    early_ids, late_ids = rows.values[~late], rows.values[late]
    early_counts, late_counts = [], []
    run = 0
    for counts in rows.counts:
        width = len(counts[0]) if counts else 0
        n = len(counts) * width
        early_counts.append([early_per[run + k * width: run + (k + 1) * width]
                             for k in range(len(counts))])
        late_counts.append([late_per[run + k * width: run + (k + 1) * width]
                            for k in range(len(counts))])
        run += n
    return RowInput(early_ids, early_counts), RowInput(late_ids, late_counts)


def late_bags(next_input: LookupInput, current_input: LookupInput,
              tables: PooledTables) -> torch.Tensor:
    """bool [B, S]: bag (sample b, slot j) of next_input holds a row of slot j's table that
    current_input read (the owner's pooled lookups, samples in LookupInput order)."""
    batch, slots = next_input.batch_size, len(tables.slot_table)
    device = next_input.offsets.device
    if not slots or not batch:
        return torch.zeros((batch, slots), dtype=torch.bool, device=device)
    read = _rows_read(current_input.unique_values, current_input.unique_bounds,
                      [w.shape[0] for w in tables.weights], device)
    base = torch.tensor(list(accumulate((w.shape[0] for w in tables.weights), initial=0))[:-1],
                        dtype=torch.int64, device=device)
    lengths = next_input.offsets.diff()
    total = int(next_input.inverse.numel())
    bag = torch.repeat_interleave(torch.arange(slots * batch, device=device), lengths,
                                  output_size=total)
    table = torch.tensor(list(tables.slot_table), dtype=torch.int64,
                         device=device).index_select(0, bag // batch)
    ids = next_input.unique_values.index_select(0, next_input.inverse)
    hits = read.index_select(0, ids + base.index_select(0, table)).to(torch.int32)
    per_bag = torch.zeros(slots * batch, dtype=torch.int32, device=device).index_add_(0, bag,
                                                                                     hits)
    return (per_bag > 0).view(slots, batch).t()


def _rows_read(values: torch.Tensor, bounds: Sequence[int], table_rows: Sequence[int],
               device: torch.device) -> torch.Tensor:
    """One flag per row of the tables (concatenated): read by `values` (unique ids, table by
    table, cut by `bounds`). Linear, where an isin would sort."""
    base = list(accumulate(table_rows, initial=0))
    sizes = [bounds[t + 1] - bounds[t] for t in range(len(table_rows))]
    read = torch.zeros(base[-1], dtype=torch.bool, device=device)
    if sum(sizes):
        shift = torch.repeat_interleave(
            torch.tensor(base[:-1], dtype=torch.int64, device=device),
            torch.tensor(sizes, dtype=torch.int64, device=device), output_size=sum(sizes))
        read[values[bounds[0]: bounds[len(table_rows)]].to(torch.int64) + shift] = True
    return read


def _late_requests(next_rows: RowInput, current_rows: RowInput, table_rows: Sequence[int],
                   device: torch.device) -> torch.Tensor:
    """bool per request of next_rows (its values): the current batch requested that row of
    that group too."""
    if not next_rows.counts:
        return torch.zeros(0, dtype=torch.bool, device=device)
    read = _rows_read(current_rows.values, list(accumulate(current_rows.sizes, initial=0)),
                      table_rows, device)
    base = torch.tensor(list(accumulate(table_rows, initial=0))[:-1], dtype=torch.int64,
                        device=device)
    sizes = next_rows.sizes
    shift = torch.repeat_interleave(base, torch.tensor(sizes, dtype=torch.int64, device=device),
                                    output_size=sum(sizes))
    return read.index_select(0, next_rows.values + shift)


class EarlyRows:
    """One module's early rows of the next batch (see the module docstring): made by the sharded
    module's `start_early_rows` step, on every rank of the group at once (it runs collectives),
    before the current batch's update. Two steps, so that the masks' small exchange travels
    while something else is awaited: the constructor starts it; `send()` waits for it and
    starts the early cells' exchanges (one per micro-batch). After the update, `start_late`
    sends the rest of each exchange and `merge` lays the two parts out as the one message.
    Every step is a few vectorized ops over all slots and row groups at once: they run on the
    training step's path.

    Args:
        output: the module's OutputDist; group: the process group of the masks (CPU tensors:
            the input dist's group); device: the module's.
        tables: the owner's pooled tables; early_lookup: `lookup(next_input)` -> the next
            batch's early lookup (early_lookup.py), called when its pooled bags go early
            (POOLED_EARLY_MIN); `early` is then that EarlyLookup, else None.
        row_weights: the owner's row-exchange shards (its local row groups, in order).
        next_input: the owner's LookupInput of the next batch (on the module's device);
            current_input: the current batch's.
        row_bags: this rank's bags of row-exchange tables of the next batch (None without
            row-exchange tables).
    """

    def __init__(self, output: OutputDist, group, device: torch.device, tables: PooledTables,
                 early_lookup, row_weights: Sequence[torch.Tensor],
                 next_input: LookupInput, current_input: LookupInput,
                 row_bags: Optional[RowBags]):
        layout = output.layout
        self.output, self.device = output, device
        world, me, row_dim = layout.world_size, layout.rank, output.row_dim
        self.sizes = next_input.micro_batch_sizes  # [W][M] samples per source and micro-batch
        self.num_micro = len(self.sizes[me])
        no_rows = RowInput(torch.zeros(0, dtype=torch.int64, device=device), [])
        next_rows = next_input.rows if next_input.rows is not None else no_rows
        current_rows = current_input.rows if current_input.rows is not None else no_rows
        # Owner: the late pooled bags, as flags per wire row of the pooled block, and the late
        # requests of the row groups.
        bags = late_bags(next_input, current_input, tables)
        rows = _late_requests(next_rows, current_rows, [w.shape[0] for w in row_weights],
                              device)
        cols = torch.tensor(layout.slot_cols(me), dtype=torch.float32, device=device)
        early_values = float(((~bags).to(torch.float32) * cols).sum()) if bags.numel() else 0.0
        total_values = float(cols.sum()) * bags.shape[0]
        self.early = None
        if total_values and early_values >= POOLED_EARLY_MIN * total_values:
            self.early = early_lookup(next_input)
            self._early_pooled = self.early.output.detach()
        else:  # every bag late: looked up after the update, as without early rows
            bags = torch.ones_like(bags)
            self._early_pooled = torch.empty((next_input.batch_size, 0), device=device)
        self._late_wire = _wire_flags(bags, layout.slot_cols(me), row_dim)
        self.early_input, self.late_input = split_requests(next_rows, rows)
        positions = rows.nonzero().flatten()
        group_starts = list(accumulate(next_rows.sizes, initial=0))
        late_sizes = self.late_input.sizes
        self.late_index = list((positions - torch.repeat_interleave(
            torch.tensor(group_starts[:-1], dtype=torch.int64, device=device),
            torch.tensor(late_sizes, dtype=torch.int64, device=device),
            output_size=positions.numel())).split(late_sizes))
        self._early_rows = [w.detach().index_select(0, ids)
                            for w, ids in zip(row_weights, self.early_input.ids)]
        # Where each row group's rows lie in the row block that start_late is given.
        self._row_layout = next_rows.block_layout(output.local_group_cols)
        # The masks to the ranks that asked: per source, micro-batch by micro-batch, its bags
        # (sample by sample, slot by slot) then its rows group by group.
        groups = len(next_rows.counts)
        run_sizes = [c for counts in next_rows.counts for per_micro in counts for c in per_micro]
        run_starts = list(accumulate(run_sizes, initial=0))
        bag_flat = bags.reshape(-1)
        slots = bags.shape[1]
        pieces, send_sizes = [], []
        for s in range(world):
            size = 0
            for k in range(self.num_micro):
                first = self._sample_start(k, s)
                pieces.append(bag_flat[first * slots: (first + self.sizes[s][k]) * slots])
                size += self.sizes[s][k] * slots
                for g in range(groups):
                    run = (g * self.num_micro + k) * world + s
                    pieces.append(rows[run_starts[run]: run_starts[run + 1]])
                    size += run_sizes[run]
            send_sizes.append(size)
        # What this rank receives from owner o, micro-batch by micro-batch: its bags of o's
        # slots, then its rows of o's groups.
        counts = row_bags.counts if row_bags is not None else \
            torch.zeros((output.group_base[-1], self.num_micro), dtype=torch.int64)
        self._counts = counts
        self._owner_slots = [len(layout.slot_cols(o)) for o in range(world)]
        self._recv_runs = []  # (owner, k, None for its bags or a global group, size)
        for o in range(world):
            for k in range(self.num_micro):
                self._recv_runs.append((o, k, None, self.sizes[me][k] * self._owner_slots[o]))
                for g in range(output.group_base[o], output.group_base[o + 1]):
                    self._recv_runs.append((o, k, g, int(counts[g, k])))
        recv_sizes = [sum(n for owner, _, _, n in self._recv_runs if owner == o)
                      for o in range(world)]
        flat = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.bool, device=device)
        self._masks_in_flight = _MasksInFlight(flat, send_sizes, recv_sizes, group)
        early_cells = int((~bags).sum()) + self.early_input.values.numel()
        output.stats.rows_sent_early += early_cells
        output.stats.rows_sent_late += bags.numel() + rows.numel() - early_cells
        self._early: List[Optional[tuple]] = []
        self._late_flags: List[Optional[torch.Tensor]] = [None] * self.num_micro
        self._mask: Optional[torch.Tensor] = None

    def _sample_start(self, k: int, source: int) -> int:
        """The owner's first sample of (micro-batch k, source)."""
        return sum(sum(m[:k]) for m in self.sizes) + sum(m[k] for m in self.sizes[:source])

    # ------------------------------------------------------------------ owner: what leaves

    def _message(self, k: int, pooled: torch.Tensor, rows: Sequence[torch.Tensor],
                 requests: RowInput, late: bool) -> Tuple[torch.Tensor, List[int]]:
        """The owner's part of exchange k: per source its pooled cells (the late or the early
        ones; pooled: this owner's pooled rows of every sample) and its rows of each group ->
        (flat float32 values, values per source)."""
        row_dim, world = self.output.row_dim, self.output.layout.world_size
        pieces, sizes = [], []
        for s in range(world):
            first, n = self._sample_start(k, s), self.sizes[s][k]
            size = 0
            if self._late_wire.shape[1] and (late or pooled.shape[1]):
                flags = self._late_wire[first: first + n].reshape(-1)
                cells = pooled[first: first + n].reshape(-1, row_dim)
                cells = cells[flags] if late else cells[~flags]
                pieces.append(cells.reshape(-1))
                size += cells.numel()
            for g, values in enumerate(rows):
                start, count = requests.start(g, k, s), requests.rows(g, k, s)
                pieces.append(values[start: start + count].reshape(-1))
                size += values[start: start + count].numel()
            sizes.append(size)
        flat = torch.cat(pieces) if pieces else pooled.new_empty(0)
        return flat, sizes

    def send(self) -> None:
        """Waits for the masks and starts the early cells' exchanges (once)."""
        if self._masks_in_flight is None:
            return
        mask, self._masks_in_flight = self._masks_in_flight.wait(), None
        self._mask = mask.to(self.device)
        for k in range(self.num_micro):
            flat, send = self._message(k, self._early_pooled, self._early_rows,
                                       self.early_input, late=False)
            flags = self._flags(k)
            recv = [int(n) * self.output.row_dim for n in self._per_owner(~flags, k)]
            self._early.append((self.output.start_values(flat, send, recv), recv))
        self._early_pooled, self._early_rows = None, None

    def start_late(self, k: int, pooled: torch.Tensor, row_block: Optional[torch.Tensor]):
        """After the update: starts exchange k's late cells (pooled: the owner's pooled rows of
        every sample, as the update's tables give them; row_block: lookup_rows' row block,
        detached, or None without row groups) -> its handle (wait() gives the late wire
        rows)."""
        self.send()
        late_rows = [] if row_block is None else \
            [self._row_layout.group_rows(row_block, g).index_select(0, index)
             for g, index in enumerate(self.late_index)]
        flat, send = self._message(k, pooled, late_rows, self.late_input, late=True)
        recv = [int(n) * self.output.row_dim for n in self._per_owner(self._flags(k), k)]
        return self.output.start_values(flat, send, recv)

    # ------------------------------------------------------------------ receiver

    def _flags(self, k: int) -> torch.Tensor:
        """bool per wire row of this rank's exchange k: the cell comes late."""
        if self._late_flags[k] is not None:
            return self._late_flags[k]
        layout, output, row_dim = self.output.layout, self.output, self.output.row_dim
        starts = list(accumulate((n for _, _, _, n in self._recv_runs), initial=0))
        flags, widths = [], []
        for i, (o, kk, g, n) in enumerate(self._recv_runs):
            if kk != k or not n:
                continue
            flags.append(self._mask[starts[i]: starts[i + 1]])
            if g is None:  # bags: sample by sample, o's slots in turn
                batch = n // self._owner_slots[o]
                cols = torch.tensor([c // row_dim for c in layout.slot_cols(o)],
                                    dtype=torch.int64, device=self.device)
                widths.append(cols.repeat(batch))
            else:
                widths.append(torch.full((n,), output.group_cols[g] // row_dim,
                                         dtype=torch.int64, device=self.device))
        if not flags:
            self._late_flags[k] = torch.zeros(0, dtype=torch.bool, device=self.device)
        else:
            width = torch.cat(widths)
            self._late_flags[k] = torch.repeat_interleave(
                torch.cat(flags), width, output_size=int(width.sum()))
        return self._late_flags[k]

    def _per_owner(self, flags: torch.Tensor, k: int) -> List[int]:
        """Wire rows set in `flags` (exchange k's, owner by owner) per owner."""
        row_dim, layout, output = self.output.row_dim, self.output.layout, self.output
        me = layout.rank
        bounds = []
        for o in range(layout.world_size):
            rows = self.sizes[me][k] * output.owner_dims[o] // row_dim + sum(
                int(self._counts[g, k]) * output.group_cols[g] // row_dim
                for g in range(output.group_base[o], output.group_base[o + 1]))
            bounds.append(rows)
        return [int(part.sum()) for part in flags.split(bounds)]

    def merge(self, late_received: torch.Tensor, message: Message) -> torch.Tensor:
        """Waits for the early cells of `message`'s exchange and lays them out with the late
        exchange's rows (late_received) as one message: -> [message.total / wire_row_dim,
        wire_row_dim], what the exchange without early rows would have received."""
        self.send()
        k = message.micro_batch
        (handle, _), self._early[k] = self._early[k], None
        early = handle.wait()
        flags = self._flags(k)
        full = late_received.new_empty((message.total // self.output.row_dim,
                                        self.output.row_dim))
        full.index_copy_(0, flags.nonzero().flatten(), late_received.view(-1,
                                                                          self.output.row_dim))
        full.index_copy_(0, (~flags).nonzero().flatten(), early.view(-1, self.output.row_dim))
        return full

    def wait(self) -> None:
        """Waits for every exchange not used yet (dropped early rows leave no collective in
        flight)."""
        if self._masks_in_flight is not None:
            self._masks_in_flight.wait()
            self._masks_in_flight = None
            return
        for entry in self._early:
            if entry is not None:
                entry[0].wait()
        self._early = [None] * self.num_micro


def _wire_flags(bags: torch.Tensor, slot_cols: Sequence[int], row_dim: int) -> torch.Tensor:
    """bool [B, D_owner / row_dim]: per sample, each slot's flag over its wire rows."""
    if not bags.shape[1]:
        return bags.new_zeros((bags.shape[0], 0))
    widths = torch.tensor([c // row_dim for c in slot_cols], dtype=torch.int64,
                          device=bags.device)
    return torch.repeat_interleave(bags, widths, dim=1, output_size=int(widths.sum()))


class _MasksInFlight:
    """The late masks on their way to the ranks that asked (one byte per cell, through the
    CPU: they are small, and gloo carries uint8); wait() -> this rank's masks, bool, every
    owner's in turn."""

    def __init__(self, send: torch.Tensor, send_sizes: List[int], recv_sizes: List[int], group):
        data = send.to("cpu", torch.uint8)
        if len(send_sizes) == 1:
            self._out, self._work = data, None
            return
        self._out = torch.empty(sum(recv_sizes), dtype=torch.uint8)
        with traffic.carrying("ids"):  # metadata of the rows, as the ids are
            self._work = dist.all_to_all_single(
                self._out, data, output_split_sizes=recv_sizes, input_split_sizes=send_sizes,
                group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._out.bool()
