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
are read by every batch, so they come late; the tail comes early. Pooled tables get no early
send: a bag is a sum over its rows, and on that data 35-100% of the next batch's bags (median
85%) hold a row the update changes, so a correction of the changed bags would cost as many
bytes after the update as it saved before it.
"""

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from recxla.torchrec.output_dist import Message, OutputDist
from recxla.torchrec.row_exchange import RowBags, RowInput


def split_requests(rows: RowInput, late: Sequence[torch.Tensor]) -> Tuple[RowInput, RowInput]:
    """rows: the owner's requests; late: per local row group a bool [R_g] mask of the requests
    that come late. -> (the early requests, the late ones), each a RowInput in rows' order."""
    early_ids, late_ids, early_counts, late_counts = [], [], [], []
    for ids, mask, counts in zip(rows.ids, late, rows.counts):
        sizes = [c for per_micro in counts for c in per_micro]
        ends = torch.tensor(list(_cumulative(sizes)), dtype=torch.int64, device=mask.device)
        running = torch.zeros(mask.numel() + 1, dtype=torch.int64, device=mask.device)
        torch.cumsum(mask, 0, out=running[1:])
        late_per = running.index_select(0, ends).diff().tolist()
        early_per = [s - n for s, n in zip(sizes, late_per)]
        width = len(counts[0]) if counts else 0
        late_counts.append(_reshape(late_per, width))
        early_counts.append(_reshape(early_per, width))
        late_ids.append(ids[mask])
        early_ids.append(ids[~mask])
    return RowInput(early_ids, early_counts), RowInput(late_ids, late_counts)


def _cumulative(sizes: Sequence[int]):
    total = 0
    yield 0
    for s in sizes:
        total += s
        yield total


def _reshape(flat: List[int], width: int) -> List[List[int]]:
    return [flat[i: i + width] for i in range(0, len(flat), width)] if width else []


class EarlyRows:
    """One module's early rows of the next batch (see the module docstring): made by the sharded
    module's `start_early_rows` step, on every rank of the group at once (it runs collectives),
    before the current batch's update. Two steps, so that the masks' small exchange travels
    while something else is awaited: the constructor starts it; `send()` waits for it and
    starts the early rows' exchanges (one per micro-batch).

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
        layout = output.layout
        self.output, self.device = output, device
        self.num_micro = len(row_bags.micro)
        world = layout.world_size
        # Owner: which requests come late (this batch read them) and the early/late split.
        late = [torch.isin(n, c) if hold_changed else torch.zeros_like(n, dtype=torch.bool)
                for n, c in zip(next_rows.ids, current_rows.ids)]
        self.early_input, self.late_input = split_requests(next_rows, late)
        self.late_index = [mask.nonzero().flatten() for mask in late]
        # The masks to the ranks that asked (per source: micro-batch by micro-batch, group by
        # group, in the order of its requests), and the senders' masks of this rank's rows.
        send = [[] for _ in range(world)]
        for g, (mask, counts) in enumerate(zip(late, next_rows.counts)):
            start = 0
            for k in range(self.num_micro):
                for s in range(world):
                    n = counts[k][s]
                    send[s].append((k, g, mask[start: start + n]))
                    start += n
        send_flat = [torch.cat([m for _, _, m in sorted(pieces, key=lambda p: (p[0], p[1]))])
                     if pieces else torch.empty(0, dtype=torch.bool, device=device)
                     for pieces in send]
        counts = row_bags.counts  # [G, M] this rank's unique rows per global group
        recv_sizes = [int(counts[output.group_base[o]: output.group_base[o + 1]].sum())
                      for o in range(world)]
        self._counts = counts
        self._masks_in_flight = _MasksInFlight(send_flat, recv_sizes, group, device)
        output.stats.rows_sent_early += sum(ids.numel() for ids in self.early_input.ids)
        output.stats.rows_sent_late += sum(ids.numel() for ids in self.late_input.ids)
        self._weights = weights
        self._early: List = []

    def send(self) -> None:
        """Waits for the masks and starts the early rows' exchanges (once)."""
        if self._masks_in_flight is None:
            return
        output, counts, world = self.output, self._counts, self.output.layout.world_size
        received, self._masks_in_flight = self._masks_in_flight.wait(), None
        # Per (global group, micro-batch): this rank's late mask of its rows from that group.
        self.masks: List[List[torch.Tensor]] = [[None] * self.num_micro
                                               for _ in range(counts.shape[0])]
        for o in range(world):
            start = 0
            for k in range(self.num_micro):
                for g in range(output.group_base[o], output.group_base[o + 1]):
                    n = int(counts[g, k])
                    self.masks[g][k] = received[o][start: start + n]
                    start += n
        late_counts = torch.tensor([[int(self.masks[g][k].sum()) for k in range(self.num_micro)]
                                    for g in range(counts.shape[0])],
                                   dtype=torch.int64).reshape(counts.shape)
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
        handle, early_message = self._early[k]
        early = handle.wait().reshape(-1)
        late = late_received.reshape(-1)
        late_message = self.late_message(message)
        full = late.new_empty(message.total)
        for (o_full, dim), (o_late, _) in zip(message.pooled, late_message.pooled):
            n = message.batch * dim
            full[o_full: o_full + n] = late[o_late: o_late + n]
        for (o_full, g, count, cols), (o_late, _, n_late, _), (o_early, _, n_early, _) in zip(
                message.rows, late_message.rows, early_message.rows):
            rows = full[o_full: o_full + count * cols].view(count, cols)
            mask = self.masks[g][k]
            rows[mask] = late[o_late: o_late + n_late * cols].view(n_late, cols)
            rows[~mask] = early[o_early: o_early + n_early * cols].view(n_early, cols)
        self._early[k] = None
        return full.view(-1, self.output.row_dim)

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


class _MasksInFlight:
    """The late masks on their way to the ranks that asked (one byte per row, through the
    CPU: they are small, and gloo carries uint8); wait() -> per owner, this rank's masks from
    it (bool, on `device`)."""

    def __init__(self, send: List[torch.Tensor], recv_sizes: List[int], group,
                 device: torch.device):
        self._sizes, self._device = recv_sizes, device
        if len(send) == 1:
            self._out, self._work = send[0].to("cpu", torch.uint8), None
            return
        self._out = torch.empty(sum(recv_sizes), dtype=torch.uint8)
        data = torch.cat([m.to("cpu", torch.uint8) for m in send])
        self._work = dist.all_to_all_single(
            self._out, data, output_split_sizes=recv_sizes,
            input_split_sizes=[m.numel() for m in send], group=group, async_op=True)

    def wait(self) -> List[torch.Tensor]:
        if self._work is not None:
            self._work.wait()
        pieces, start = [], 0
        for n in self._sizes:
            pieces.append(self._out[start: start + n].to(self._device, torch.bool))
            start += n
        return pieces
