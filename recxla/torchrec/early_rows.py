"""Early rows: the next batch's row-exchange rows that this batch's update leaves as they are,
sent before the update.

An owner of row-exchange tables (row_exchange.py) sends each rank the unique rows its bags
read. This batch's update changes exactly the rows this batch read (every rank's requests of
the batch, at this owner); every other row the next batch reads already holds the value it
will have after the update. So, once the next batch's ids are decoded, the owner splits each
rank's requests of the next batch:

    early  rows this batch did not read: final now, sent while this batch's dense forward and
           backward run (a link otherwise idle then);
    late   rows this batch read: sent after the update, with the pooled rows, as every row was
           before.

Each row travels once, early or late, with the same bytes it had in one message (rows are
quantized one by one, a scale per wire row): the receiver puts both parts back into the one
message's layout, and the step is bit for bit the step without early rows. The receiver learns
which of its rows come late from a mask the owner sends first (one byte per requested row;
the rows themselves are cols / wire_row_dim wire rows of wire_row_dim values each).

What pays on the trainer's Zipf data (bench/results/training.md, "Early rows"): the hot rows
are read by every batch, so they come late; the tail comes early (48% of the row tables'
values). Pooled tables get no early send: a bag is a sum over its rows, and on that data 94%
and 100% of the two pooled tables' next bags hold a row the update changes, so a correction of
the changed bags would cost as many bytes after the update as it saved before it
(recxla.planner.early_send measures both shares on a user's data).
"""

from itertools import accumulate
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from recxla.distributed import traffic
from recxla.torchrec.output_dist import Message, OutputDist
from recxla.torchrec.row_exchange import RowBags, RowInput

def split_requests(rows: RowInput, late: torch.Tensor) -> Tuple[RowInput, RowInput]:
    """rows: the owner's requests; late: bool [sum_g R_g], rows.ids concatenated, the requests
    that come late. -> (the early requests, the late ones), each a RowInput in rows' order."""
    sizes = [c for counts in rows.counts for per_micro in counts for c in per_micro]
    ends = torch.tensor(list(accumulate(sizes, initial=0)), dtype=torch.int64,
                        device=late.device)
    running = torch.zeros(late.numel() + 1, dtype=torch.int64, device=late.device)
    torch.cumsum(late, 0, out=running[1:])
    late_per = running.index_select(0, ends).diff().tolist()
    early_per = [s - n for s, n in zip(sizes, late_per)]
    flat = torch.cat(rows.ids) if rows.ids else late.new_empty(0, dtype=torch.int64)
    early_ids, late_ids = flat[~late], flat[late]
    early_counts, late_counts, early_totals, late_totals = [], [], [], []
    run = 0
    for counts in rows.counts:
        width = len(counts[0]) if counts else 0
        n = len(counts) * width
        early_counts.append([early_per[run + k * width: run + (k + 1) * width]
                             for k in range(len(counts))])
        late_counts.append([late_per[run + k * width: run + (k + 1) * width]
                            for k in range(len(counts))])
        early_totals.append(sum(early_per[run: run + n]))
        late_totals.append(sum(late_per[run: run + n]))
        run += n
    return (RowInput(list(early_ids.split(early_totals)), early_counts),
            RowInput(list(late_ids.split(late_totals)), late_counts))


def _runs_index(starts: Sequence[int], lengths: Sequence[int], device) -> torch.Tensor:
    """The positions of the runs [start, start + length) one after another."""
    lengths_t = torch.tensor(list(lengths), dtype=torch.int64, device=device)
    total = int(sum(lengths))
    before = torch.tensor(list(accumulate(lengths, initial=0))[:-1], dtype=torch.int64,
                          device=device)
    shift = torch.tensor(list(starts), dtype=torch.int64, device=device) - before
    return torch.arange(total, device=device) + torch.repeat_interleave(shift, lengths_t,
                                                                        output_size=total)


class EarlyRows:
    """One module's early rows of the next batch (see the module docstring): made by the sharded
    module's `start_early_rows` step, on every rank of the group at once (it runs collectives),
    before the current batch's update. Two steps, so that the masks' small exchange travels
    while something else is awaited: the constructor starts it; `send()` waits for it and
    starts the early rows' exchanges (one per micro-batch). Every step is a few vectorized ops
    over all row groups at once: the steps run on the training step's path.

    Args:
        output: the module's OutputDist; group: its process group; device: the module's.
        weights: the owner's row-exchange shards (its local row groups, in order).
        next_rows: the owner's requests of the next batch (its LookupInput's RowInput, on the
            module's device); current_rows: the current batch's.
        row_bags: this rank's bags of row-exchange tables of the next batch (its counts: what
            it asked each owner for).
        hold_changed: False sends every row early, those the update changes too (a planted
            stale read, for tests).
    """

    def __init__(self, output: OutputDist, group, device: torch.device,
                 weights: Sequence[torch.Tensor], next_rows: RowInput, current_rows: RowInput,
                 row_bags: RowBags, hold_changed: bool = True):
        self.output, self.device = output, device
        self.num_micro = len(row_bags.micro)
        world = output.layout.world_size
        # Owner: which requests come late (this batch read them), all groups in one isin.
        late = _late_requests(next_rows.ids, current_rows.ids, [w.shape[0] for w in weights],
                              device) if hold_changed else \
            torch.zeros(sum(i.numel() for i in next_rows.ids), dtype=torch.bool, device=device)
        self.early_input, self.late_input = split_requests(next_rows, late)
        group_starts = list(accumulate((i.numel() for i in next_rows.ids), initial=0))
        late_positions = late.nonzero().flatten()
        self.late_index = list((late_positions - torch.repeat_interleave(
            torch.tensor(group_starts[:-1], dtype=torch.int64, device=device),
            torch.tensor([sum(map(sum, c)) for c in self.late_input.counts],
                         dtype=torch.int64, device=device),
            output_size=late_positions.numel())).split(
                [i.numel() for i in self.late_input.ids]))
        # The masks to the ranks that asked: per source, micro-batch by micro-batch, group by
        # group (the runs of `late` are group by group, micro-batch by micro-batch, source by
        # source).
        groups = len(next_rows.ids)
        run_sizes = [c for counts in next_rows.counts for per_micro in counts for c in per_micro]
        run_starts = list(accumulate(run_sizes, initial=0))
        order = [(g * self.num_micro + k) * world + s for s in range(world)
                 for k in range(self.num_micro) for g in range(groups)]
        send_sizes = [sum(run_sizes[(g * self.num_micro + k) * world + s]
                          for k in range(self.num_micro) for g in range(groups))
                      for s in range(world)]
        index = _runs_index([run_starts[i] for i in order], [run_sizes[i] for i in order],
                            device)
        counts = row_bags.counts  # [G, M] this rank's unique rows per global group
        # Received from owner o: micro-batch by micro-batch, o's groups in turn.
        self._recv_runs = [int(counts[g, k]) for o in range(world) for k in range(self.num_micro)
                           for g in range(output.group_base[o], output.group_base[o + 1])]
        recv_sizes = [int(counts[output.group_base[o]: output.group_base[o + 1]].sum())
                      for o in range(world)]
        self._counts = counts
        self._masks_in_flight = _MasksInFlight(late.index_select(0, index), send_sizes,
                                               recv_sizes, group)
        output.stats.rows_sent_early += self.early_input_rows
        output.stats.rows_sent_late += late.numel() - self.early_input_rows
        self._weights = weights
        self._early: List[Optional[tuple]] = []
        self._mask: Optional[torch.Tensor] = None

    @property
    def early_input_rows(self) -> int:
        return sum(i.numel() for i in self.early_input.ids)

    def send(self) -> None:
        """Waits for the masks and starts the early rows' exchanges (once)."""
        if self._masks_in_flight is None:
            return
        output, counts, world = self.output, self._counts, self.output.layout.world_size
        mask, self._masks_in_flight = self._masks_in_flight.wait(), None
        self._mask = mask.to(self.device)
        # Late rows per received run -> late_counts [G, M].
        ends = torch.tensor(list(accumulate(self._recv_runs, initial=0)), dtype=torch.int64)
        running = torch.zeros(mask.numel() + 1, dtype=torch.int64)
        torch.cumsum(mask, 0, out=running[1:])
        late_per_run = iter(running.index_select(0, ends).diff().tolist())
        late_counts = torch.zeros_like(counts)
        for o in range(world):
            for k in range(self.num_micro):
                for g in range(output.group_base[o], output.group_base[o + 1]):
                    late_counts[g, k] = next(late_per_run)
        self.late_counts = late_counts
        self.early_counts = counts - late_counts
        early_values = [w.detach().index_select(0, ids)
                        for w, ids in zip(self._weights, self.early_input.ids)]
        sources = [0] * world
        empty = torch.empty((0, 0), device=self.device)
        for k in range(self.num_micro):
            message = output.receive_layout(0, None, k, counts=self.early_counts)
            handle, _, _ = output.start(empty, sources, message, early_values, self.early_input)
            self._early.append((handle, message))

    def late_message(self, message: Message) -> Message:
        """What this rank receives after the update in `message`'s exchange: the pooled rows
        and the late rows."""
        self.send()
        return self.output.receive_layout(message.batch, None, message.micro_batch,
                                          counts=self.late_counts)

    def late_rows(self, row_outputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The owner's late rows out of its whole gather (lookup_rows' rows, detached)."""
        return [rows.index_select(0, index) for rows, index in zip(row_outputs, self.late_index)]

    def merge(self, late_received: torch.Tensor, message: Message) -> torch.Tensor:
        """Waits for the early rows of `message`'s exchange and lays them out with the late
        exchange's rows (late_received) as one message: -> [message.total / wire_row_dim,
        wire_row_dim], what the exchange without early rows would have received."""
        self.send()
        k = message.micro_batch
        handle, _ = self._early[k]
        early = handle.wait()
        self._early[k] = None
        late_flags = self._late_wire_rows(message)
        full = late_received.new_empty((message.total // self.output.row_dim,
                                        self.output.row_dim))
        full.index_copy_(0, late_flags.nonzero().flatten(), late_received)
        full.index_copy_(0, (~late_flags).nonzero().flatten(), early)
        return full

    def _late_wire_rows(self, message: Message) -> torch.Tensor:
        """bool per wire row of `message`: it comes in the late exchange (the pooled blocks and
        the late rows) or the early one."""
        output, world, k = self.output, self.output.layout.world_size, message.micro_batch
        row_dim, device = output.row_dim, self.device
        # Per element (an owner's pooled block, or one row) its flag and its wire rows.
        flags, pooled_rows, groups = [], [], []
        runs = list(accumulate(self._recv_runs, initial=0))
        run = 0
        for o in range(world):
            mine = range(output.group_base[o], output.group_base[o + 1])
            first = run + k * len(mine)
            flags.append(torch.ones(1, dtype=torch.bool, device=device))
            flags.append(self._mask[runs[first]: runs[first + len(mine)]])
            pooled_rows.append(message.batch * output.owner_dims[o] // row_dim)
            groups.append(mine)
            run += self.num_micro * len(mine)
        # Elements: owner by owner, its pooled block then its groups' rows.
        sizes, widths = [], []
        for o, mine in enumerate(groups):
            sizes.append(1)
            widths.append(pooled_rows[o])
            for g in mine:
                sizes.append(int(self._counts[g, k]))
                widths.append(output.group_cols[g] // row_dim)
        repeat = torch.repeat_interleave(
            torch.tensor(widths, dtype=torch.int64, device=device),
            torch.tensor(sizes, dtype=torch.int64, device=device), output_size=sum(sizes))
        return torch.repeat_interleave(torch.cat(flags), repeat,
                                       output_size=message.total // row_dim)

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


def _late_requests(next_ids: Sequence[torch.Tensor], current_ids: Sequence[torch.Tensor],
                   table_rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """bool per request of next_ids (concatenated): the current batch requested that row of
    that group too. One flag per row of the owner's row groups, set from the current requests
    and read at the next ones: linear, where an isin would sort."""
    if not next_ids:
        return torch.zeros(0, dtype=torch.bool, device=device)
    base = torch.tensor(list(accumulate(table_rows, initial=0))[:-1], dtype=torch.int64,
                        device=device)

    def keyed(ids):
        sizes = torch.tensor([i.numel() for i in ids], dtype=torch.int64, device=device)
        return torch.cat(ids).to(torch.int64) + torch.repeat_interleave(
            base, sizes, output_size=sum(i.numel() for i in ids))

    read = torch.zeros(sum(table_rows), dtype=torch.bool, device=device)
    read[keyed(current_ids)] = True
    return read.index_select(0, keyed(next_ids))


class _MasksInFlight:
    """The late masks on their way to the ranks that asked (one byte per row, through the
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
