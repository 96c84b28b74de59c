"""The receiving half of the input dist: the owner's blocks of ids decoded into the input of its
lookup (`LookupInput`).

The sizes' all-to-all gives every block's size (`IdDecoder.block_sizes`); after the ids'
all-to-all, one op (recxla.ops.decode_id_blocks, a host op) re-expands the ids through their
inverse index and puts the bags of all sources slot by slot (micro-batch by micro-batch, then
sources in rank order, so bag b of source s in micro-batch k is owner sample sum over earlier
micro-batches + sum(earlier sources' part of k) + b), and one `unique_keys` pass per local
table gives the lookup its unique rows.
"""

from dataclasses import dataclass
from itertools import accumulate
from typing import List, Optional

import torch

from recxla.host_copy import to_device
from recxla.ops.dedup import segmented_unique
from recxla.ops.id_blocks import decode_id_blocks
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
            return to_device(t, device)

        rows = None if self.rows is None else RowInput(move(self.rows.values),
                                                       self.rows.counts)
        return LookupInput(move(self.unique_values), move(self.unique_offsets),
                           move(self.inverse), move(self.offsets), move(self.per_sample_weights),
                           self.micro_batch_sizes, rows, self.unique_bounds,
                           self.slot_id_bounds)

    def tensors(self) -> List[torch.Tensor]:
        """Every tensor the input holds (the requested rows' ids included)."""
        rows = [] if self.rows is None else [self.rows.values]
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
        after another) and the sources' sizes rows: recxla.ops.decode_id_blocks puts the
        sources' ids, weights, bags and row ids in the owner's order (where each section
        starts comes from the wire format), then one unique pass per local table."""
        num_slots = self.num_slots
        micro = [wire.micro_batch_sizes(row) for row in meta]
        num_micro = len(micro[0])
        total_batch = sum(row[1] for row in meta)
        my_groups = self.row_groups
        blocks, start = [], 0
        for row, sizes_of_micro in zip(meta, micro):
            _, batch, n, u, encoding, num_row_ids = wire.BlockMeta.of(row)
            sizes = wire.section_bytes(num_slots, batch, n, u, encoding, self.id_bytes,
                                       self.is_weighted, my_groups * num_micro, num_row_ids)
            bounds = list(accumulate(sizes, initial=start))
            start = bounds[-1]
            blocks += [batch, n, u, encoding, num_row_ids, *bounds[:-1], *sizes_of_micro]
        decoded = decode_id_blocks(received, blocks, num_slots, num_micro, my_groups,
                                   self.id_bytes, self.is_weighted)
        offsets = decoded.offsets
        table_bounds = offsets.index_select(
            0, torch.tensor(self.table_first_slot) * total_batch)
        unique_values, unique_offsets, inverse = segmented_unique(decoded.values, table_bounds)
        rows = None
        if my_groups:
            counts = decoded.row_counts.tolist()  # [group][micro-batch][source]
            rows = RowInput(decoded.row_ids, counts)
        slot_id_bounds = offsets[::total_batch].tolist() if total_batch else \
            [0] * (num_slots + 1)
        return LookupInput(unique_values, unique_offsets, inverse, offsets,
                           decoded.weights if self.is_weighted else None, micro, rows,
                           unique_offsets.tolist(), slot_id_bounds)
