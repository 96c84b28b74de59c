"""The receiving half of the input dist: the owner's blocks of ids decoded into the input of its
lookup (`LookupInput`).

The sizes' all-to-all gives every block's size (`IdDecoder.block_sizes`); after the ids'
all-to-all, the inverse index re-expands the ids, the bags of all sources are put slot by slot
(micro-batch by micro-batch, then sources in rank order, so bag b of source s in micro-batch k
is owner sample sum over earlier micro-batches + sum(earlier sources' part of k) + b), and one
`unique_keys` pass per local table gives the lookup its unique rows.
"""

from dataclasses import dataclass
from typing import List, Optional

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import torch

from recxla.ops.dedup import segmented_unique
from recxla.torchrec import id_wire_format as wire
from recxla.torchrec.row_exchange import RowInput, RowRouting
from recxla.torchrec.shard_layout import ShardLayout


@dataclass
class LookupInput:
    """What the owner's lookup needs, for its batch of B = sum(batch_sizes) samples, ordered
    micro-batch by micro-batch and, inside one, source rank by source rank: sample b of source
    s's micro-batch k is owner sample sum(micro_batch_sizes[:k] over all sources) +
    sum(micro_batch_sizes[s'][k] for s' < s) + b. With one micro-batch that is source-major.

    unique_values: int64 [U] unique local row ids, local table by local table;
    unique_offsets: int64 [T_local + 1]; inverse: int64 [N] into unique_values;
    offsets: int64 [S * B + 1] bag bounds, slot-major (bag (j, b) = j * B + b);
    per_sample_weights: float32 [N] or None; micro_batch_sizes: [W][M] ints; rows: the row
    groups' requested ids (row_exchange.RowInput) or None.
    """

    unique_values: torch.Tensor
    unique_offsets: torch.Tensor
    inverse: torch.Tensor
    offsets: torch.Tensor
    per_sample_weights: Optional[torch.Tensor]
    micro_batch_sizes: List[List[int]]
    # The owner's row groups (row_exchange.RowInput), None when it has none.
    rows: Optional[RowInput] = None
    # unique_offsets, and the first id of each slot (S + 1), as host ints: read without a
    # device sync.
    unique_bounds: Optional[List[int]] = None
    slot_id_bounds: Optional[List[int]] = None

    def slot_bounds(self, slot: int):
        """The ids [first, last) of slot `slot` (all its bags)."""
        return self.slot_id_bounds[slot], self.slot_id_bounds[slot + 1]

    @property
    def batch_sizes(self) -> List[int]:
        """Samples from each source rank."""
        return [sum(m) for m in self.micro_batch_sizes]

    @property
    def batch_size(self) -> int:
        return sum(self.batch_sizes)

    def micro_batch_rows(self, k: int) -> List[int]:
        """Samples of micro-batch k from each source rank."""
        return [m[k] for m in self.micro_batch_sizes]

    def micro_batch_start(self, k: int) -> int:
        """The owner's first sample of micro-batch k."""
        return sum(sum(m[:k]) for m in self.micro_batch_sizes)

    def to(self, device: torch.device) -> "LookupInput":
        """The same input on `device` (non-blocking copies; pinned first on CPU)."""
        device = torch.device(device)
        if self.offsets.device == device:
            return self

        def move(t):
            if t is None:
                return None
            if device.type == "cuda" and not t.is_pinned():
                t = t.pin_memory()
            return t.to(device, non_blocking=True)

        rows = None if self.rows is None else RowInput([move(i) for i in self.rows.ids],
                                                       self.rows.counts)
        return LookupInput(move(self.unique_values), move(self.unique_offsets),
                           move(self.inverse), move(self.offsets), move(self.per_sample_weights),
                           self.micro_batch_sizes, rows, self.unique_bounds,
                           self.slot_id_bounds)

    def tensors(self) -> List[torch.Tensor]:
        """Every tensor the input holds (the requested rows' ids included)."""
        rows = [] if self.rows is None else list(self.rows.ids)
        return [t for t in (self.unique_values, self.unique_offsets, self.inverse, self.offsets,
                            self.per_sample_weights, *rows) if t is not None]

    def record_stream(self, stream) -> None:  # TorchRec's Multistreamable protocol
        for t in self.tensors():
            if t.is_cuda:
                t.record_stream(stream)



class IdDecoder:
    """The owner's view of the blocks it receives, for one sharded module.

    Args:
        layout: the module's ShardLayout (its rank is the owner).
        rows: the layout's RowRouting (the row groups of every rank).
        device: where the ids arrive.
        is_weighted: blocks carry per-sample weights.
    """

    def __init__(self, layout: ShardLayout, rows: RowRouting, device: torch.device,
                 is_weighted: bool):
        me = layout.rank
        self.device = device
        self.is_weighted = is_weighted
        self.num_slots = len(layout.slots[me])
        self.id_bytes = wire.owner_id_bytes(lt.rows for lt in layout.local_tables[me])
        self.row_groups = rows.groups_per_rank[me]
        # The first slot of each of my local tables, then the number of slots.
        self.table_first_slot = []
        previous = None
        for j, (lt, _) in enumerate(layout.slots[me]):
            if lt != previous:
                self.table_first_slot.append(j)
                previous = lt
        self.table_first_slot.append(len(layout.slots[me]))

    def block_sizes(self, meta: List[List[int]]) -> List[int]:
        """Bytes of the block each source announced in its sizes row (meta: one row each)."""
        row_runs = self.row_groups * len(wire.micro_batch_sizes(meta[0]))
        return [wire.block_bytes(self.num_slots, wire.BlockMeta.of(row), self.id_bytes,
                                 self.is_weighted, row_runs) for row in meta]

    def decode(self, received: torch.Tensor, meta: List[List[int]]) -> LookupInput:
        """The owner's LookupInput from the received bytes (uint8, the sources' blocks one
        after another) and the sources' sizes rows."""
        num_slots = self.num_slots
        id_bytes = self.id_bytes
        id_dtype = wire.id_dtype(id_bytes)
        micro = [wire.micro_batch_sizes(row) for row in meta]
        num_micro = len(micro[0])
        world = len(meta)
        total_batch = sum(row[1] for row in meta)
        lengths, ids, weights, counts = [], [], [], []
        start = 0
        my_groups = self.row_groups
        row_sizes, row_ids = [], []
        for s, row in enumerate(meta):
            _, batch, n, u, encoding, num_row_ids = wire.BlockMeta.of(row)
            sizes = wire.section_bytes(num_slots, batch, n, u, encoding, id_bytes,
                                       self.is_weighted, my_groups * num_micro, num_row_ids)
            bounds = [start]
            for size in sizes:
                bounds.append(bounds[-1] + size)
            start = bounds[-1]
            block_lengths = received[bounds[0]: bounds[0] + num_slots * batch * 4] \
                .view(torch.int32).view(num_slots, batch)
            lengths.append(block_lengths)
            # ids of each (slot, micro-batch) of this source
            edges = torch.tensor([0] + list(_cumsum(micro[s])), device=self.device)
            cumulative = torch.nn.functional.pad(
                torch.cumsum(block_lengths, 1, dtype=torch.int64), (1, 0))
            at_edges = cumulative.index_select(1, edges)
            counts.append((at_edges[:, 1:] - at_edges[:, :-1]).flatten())
            if encoding == wire.RAW:
                ids.append(received[bounds[1]: bounds[1] + n * id_bytes].view(id_dtype))
            else:
                unique = received[bounds[1]: bounds[1] + u * id_bytes].view(id_dtype)
                if encoding == wire.DEDUP16:
                    index = received[bounds[2]: bounds[2] + n * 2].view(torch.int16)
                    index = index.to(torch.int32) & 0xFFFF  # unsigned on the wire
                else:
                    index = received[bounds[2]: bounds[2] + n * 4].view(torch.int32)
                ids.append(unique.index_select(0, index))
            if self.is_weighted:
                weights.append(received[bounds[3]: bounds[3] + n * 4].view(torch.float32))
            if my_groups:
                row_sizes.append(received[bounds[4]: bounds[4] + my_groups * num_micro * 4]
                                 .view(torch.int32).to(torch.int64))
                row_ids.append(received[bounds[5]: bounds[5] + num_row_ids * id_bytes]
                               .view(id_dtype).to(torch.int64))
        # One cat at the wire's width, then one widening pass.
        values = torch.cat(ids).to(torch.int64) if ids else \
            torch.zeros(0, dtype=torch.int64, device=self.device)
        psw = torch.cat(weights) if self.is_weighted else None
        all_lengths = torch.cat(lengths, dim=1) if lengths else \
            torch.zeros((num_slots, 0), dtype=torch.int32, device=self.device)
        if num_micro > 1 and world > 1:
            # Columns (source, sample) -> (micro-batch, source, sample).
            source_start = list(_cumsum([0] + [row[1] for row in meta]))[:-1]
            columns = [torch.arange(source_start[s] + sum(micro[s][:k]),
                                    source_start[s] + sum(micro[s][:k + 1]))
                       for k in range(num_micro) for s in range(world)]
            all_lengths = all_lengths.index_select(1, torch.cat(columns).to(self.device))
        if values.numel() and (world > 1 or num_micro > 1) and num_slots > 0:
            # ids in segments (source, slot, micro-batch) -> (slot, micro-batch, source)
            sizes = torch.stack(counts).view(world, num_slots, num_micro)
            values, psw = _permute_segments(sizes, values, psw)
        offsets = torch.zeros(num_slots * total_batch + 1, dtype=torch.int64,
                              device=self.device)
        torch.cumsum(all_lengths.flatten(), 0, out=offsets[1:])
        table_bounds = offsets.index_select(
            0, torch.tensor(self.table_first_slot, device=self.device) * total_batch)
        unique_values, unique_offsets, inverse = segmented_unique(values, table_bounds)
        rows = None
        if my_groups:
            # (source, group, micro-batch) runs -> (group, micro-batch, source)
            sizes = torch.stack(row_sizes).view(world, my_groups, num_micro)
            ordered, _ = _permute_segments(sizes, torch.cat(row_ids))
            counts = sizes.permute(1, 2, 0).tolist()
            per_group = [sum(sum(c) for c in group) for group in counts]
            rows = RowInput(list(torch.split(ordered, per_group)), counts)
        slot_id_bounds = offsets[::total_batch].tolist() if total_batch else \
            [0] * (num_slots + 1)
        return LookupInput(unique_values, unique_offsets, inverse, offsets, psw, micro, rows,
                           unique_offsets.tolist(), slot_id_bounds)


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total


def _permute_segments(sizes: torch.Tensor, values: torch.Tensor,
                      weights: Optional[torch.Tensor] = None):
    """values (and weights alike) lie in segments of the lengths `sizes` (int64 [world, groups,
    micro-batches], row-major): -> the same segments in (group, micro-batch, world) order.

    On CPU, FBGEMM's permute_2D_sparse_data copies each segment whole: about 6x faster than a
    gather index over every value. A GPU may have FBGEMM's CPU-only build (docs/gpu.md), so
    other devices take the gather (`segment_gather`, a few torch ops)."""
    if values.device.type != "cpu":
        gather = segment_gather(sizes, values.numel())
        return (values.index_select(0, gather),
                None if weights is None else weights.index_select(0, gather))
    world, groups, micro = sizes.shape
    order = torch.arange(world * groups * micro, dtype=torch.int32)
    order = order.view(world, groups, micro).permute(1, 2, 0).flatten()
    _, values, weights = torch.ops.fbgemm.permute_2D_sparse_data(
        order, sizes.reshape(-1, 1), values, weights, values.numel())
    return values, weights


def segment_gather(sizes: torch.Tensor, total: int) -> torch.Tensor:
    """The gather index of _permute_segments: segments in the row-major order of `sizes`
    (int64 [world, groups, micro-batches]) to (group, micro-batch, world). total: the sum of
    sizes."""
    flat = sizes.flatten()
    start = (torch.cumsum(flat, 0) - flat).view(sizes.shape)
    target_sizes = sizes.permute(1, 2, 0).flatten()
    target_start = torch.cumsum(target_sizes, 0) - target_sizes
    shift = torch.repeat_interleave(start.permute(1, 2, 0).flatten() - target_start,
                                    target_sizes, output_size=total)
    return torch.arange(total, device=sizes.device) + shift
