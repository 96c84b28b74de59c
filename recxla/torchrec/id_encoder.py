"""The sending half of the input dist: a batch's ids checked, routed to the ranks that own their
rows, and packed into one block of bytes per owner (id_wire_format.py).

Per step:
1. check the batch (TorchRec's KeyedJaggedTensor checks: unique keys, lengths, weights; then
   features), then, in one op (`recxla.ops.route_ids`, two passes over the ids in C++), check
   every id's range, route it to the owner(s) of its row block (`ShardLayout`: one owner for
   table-wise and row-wise, every column owner for column-wise) as an id local to the owner's
   rows, and order the ids by destination slot (stable: each bag keeps its order) with each
   slot's bag lengths;
2. deduplicate each (destination, local table) segment with `segmented_unique`;
3. per destination choose the smaller encoding (`id_wire_format.choose_encoding`) and write
   the block's sections; ids of row-exchange tables go their own way (row_exchange.py).
"""

from dataclasses import dataclass, field
from itertools import accumulate
from typing import List, Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.sparse.jagged_tensor_validator import validate_keyed_jagged_tensor

from recxla.ops.dedup import segmented_unique
from recxla.ops.id_blocks import PackedBlock, pack_id_blocks
from recxla.ops.route_ids import route_ids
from recxla.torchrec import id_wire_format as wire
from recxla.torchrec.comm_stats import CommStats
from recxla.torchrec.row_exchange import RowBags, RowRouting, encode_rows
from recxla.torchrec.shard_layout import ShardLayout


@dataclass
class SendBlocks:
    """This rank's blocks, one per destination: sizes for the first all-to-all, bytes for the
    second."""

    batch: int
    num_ids: List[int] = field(default_factory=list)
    num_unique: List[int] = field(default_factory=list)
    encoding: List[int] = field(default_factory=list)
    nbytes: List[int] = field(default_factory=list)
    buffer: Optional[torch.Tensor] = None
    num_row_ids: List[int] = field(default_factory=list)
    # The batch's bag lengths, [input slots, B], in the module's (table, feature) order.
    input_lengths: Optional[torch.Tensor] = None
    # This rank's bags of row tables, for pooling the rows the owners send back.
    row_bags: Optional[RowBags] = None


class IdEncoder:
    """The routing tables of one sharded module (static, from its layout) and the sender's
    work on each batch.

    Args:
        layout: the module's ShardLayout.
        device: where the ids are routed (CPU for a GPU module: they come from the loader).
        is_weighted: batches carry per-sample weights.
        dedup: allow the deduplicated encodings (False: always raw ids).
        stats: counters this encoder adds the bytes it sends to.
        expand_rows: the receiver expands unique rows to their ids' positions (the sequence
            module; row_exchange.RowRouting).
        max_bag_length: the longest bag (sequence) a batch may hold; None: no limit.
    """

    def __init__(self, layout: ShardLayout, device: torch.device, is_weighted: bool,
                 dedup: bool, stats: CommStats, expand_rows: bool = False,
                 max_bag_length: Optional[int] = None):
        self.layout = layout
        self.device = device
        self.is_weighted = is_weighted
        self.dedup = dedup
        self.stats = stats
        self.max_bag_length = max_bag_length
        # Features every batch must hold: the layout's, and those of tables looked up
        # elsewhere (data-parallel ones) that the sharded module adds.
        self.required_features: List[str] = layout.feature_names
        world = layout.world_size
        self.num_slots = [len(s) for s in layout.slots]
        self.slot_base = [sum(self.num_slots[:d]) for d in range(world + 1)]
        self.id_bytes = [wire.owner_id_bytes(lt.rows for lt in layout.local_tables[d])
                         for d in range(world)]
        # Sender: per input slot its table's rows.
        tables = layout.tables
        self.slot_rows = torch.tensor(
            [tables[t].num_embeddings for t in layout.input_slot_table], dtype=torch.int64,
            device=device)
        # Row blocks, input slot by input slot, and their routes (column-wise: one per owner of
        # a column range), flattened for recxla.ops.route_ids.
        blocks = [(i, k) for i, starts in enumerate(layout.block_starts)
                  for k in range(len(starts))]
        first_block = [0]
        for starts in layout.block_starts:
            first_block.append(first_block[-1] + len(starts))
        self.slot_first_block = torch.tensor(first_block, dtype=torch.int64, device=device)
        self.block_starts = torch.tensor([s for starts in layout.block_starts for s in starts],
                                         dtype=torch.int64, device=device)
        routes = [layout.block_routes[i][k] for i, k in blocks]
        first_route = [0]
        for r in routes:
            first_route.append(first_route[-1] + len(r))
        self.block_first_route = torch.tensor(first_route, dtype=torch.int64, device=device)
        flat = [route for r in routes for route in r]
        self.rows = RowRouting(layout, expand_rows)
        # A route goes to a send slot (pooled tables) or to a global row group, never both.
        self.route_send_slot = torch.tensor(
            [self.slot_base[r.dest] + r.dest_slot if r.row_group < 0 else -1 for r in flat],
            dtype=torch.int64, device=device)
        self.route_row_group = torch.tensor(
            [self.rows.group_base[r.dest] + r.row_group if r.row_group >= 0 else -1
             for r in flat], dtype=torch.int64, device=device)
        self.route_row_offset = torch.tensor([r.row_offset for r in flat], dtype=torch.int64,
                                             device=device)
        # Send slots are (destination, local table, feature); the (destination, local table)
        # runs are the dedup segments.
        first_slots, self.dest_groups = [], []
        for d in range(world):
            previous = None
            groups_before = len(first_slots)
            for j, (lt, _) in enumerate(layout.slots[d]):
                if lt != previous:
                    first_slots.append(self.slot_base[d] + j)
                    previous = lt
            self.dest_groups.append((groups_before, len(first_slots)))
        first_slots.append(self.slot_base[world])
        self.group_first_slot = torch.tensor(first_slots, dtype=torch.int64, device=device)

    def encode(self, features: KeyedJaggedTensor, micro: List[int]) -> SendBlocks:
        """Checks `features` (ValueError/TypeError/IndexError naming the problem) and packs
        its ids into one block per destination; micro: the micro-batch sizes (sum: B)."""
        layout = self.layout
        values, lengths, weights, batch = self._slot_major(features)
        num_slots_in = len(layout.input_slot_table)
        routed = route_ids(values, lengths, weights, batch, self.slot_rows,
                           self.slot_first_block, self.block_starts, self.block_first_route,
                           self.route_send_slot, self.route_row_group, self.route_row_offset,
                           self.slot_base[-1])
        if routed.first_bad >= 0:
            i = routed.first_bad
            slot = int(torch.searchsorted(lengths.view(num_slots_in, batch).sum(1).cumsum(0),
                                          torch.tensor(i, device=lengths.device), right=True))
            table = layout.tables[layout.input_slot_table[slot]]
            raise IndexError(
                f"{self.layout.owner}: feature '{layout.input_slot_feature[slot]}' has id "
                f"{int(values[i])} outside [0, {table.num_embeddings}) (table '{table.name}' has "
                f"{table.num_embeddings} rows)")
        rows = None
        if self.rows.active:
            rows = encode_rows(self.rows, routed.row_group, routed.row_slot, routed.row_sample,
                               routed.row_ids, routed.row_weights, micro,
                               lengths.view(num_slots_in, batch))
        total_slots = self.slot_base[-1]
        slot_counts = routed.slot_counts
        slot_ends = torch.cumsum(slot_counts, 0)
        slot_starts = slot_ends - slot_counts
        group_bounds = torch.cat([slot_starts, slot_ends[-1:]]).index_select(
            0, self.group_first_slot) \
            if total_slots else torch.zeros(1, dtype=torch.int64, device=values.device)
        blocks = self._pack(routed.send_ids, routed.slot_lengths, group_bounds,
                            routed.send_weights, batch, features.values().element_size(),
                            features.lengths().element_size(), rows, len(micro))
        blocks.input_lengths = lengths.view(num_slots_in, batch)
        return blocks

    def _slot_major(self, features: KeyedJaggedTensor):
        """The batch's ids in input-slot order (the module's (table, feature) order; a feature
        read by several tables appears once per table). -> values [N], lengths int32/int64
        [S_in * B], weights float32 [N] or None, B."""
        layout = self.layout
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"{self.layout.owner}: features must be a KeyedJaggedTensor, got "
                            f"{type(features).__name__}")
        try:
            # TorchRec's own checks of a sharded module's input (unique keys, lengths and
            # offsets that agree with the values, one weight per id), on every batch: recxla
            # reads the keys of each batch anew, where TorchRec checks its first batch only.
            validate_keyed_jagged_tensor(features)
        except ValueError as e:
            raise ValueError(f"{self.layout.owner}: invalid KeyedJaggedTensor: {e}") from None
        keys = features.keys()
        position = {k: i for i, k in enumerate(keys)}
        missing = [f for f in self.required_features if f not in position]
        if missing:
            raise ValueError(f"{self.layout.owner}: feature '{missing[0]}' is missing from the "
                             f"input (keys: {keys}; the module reads {self.required_features})")
        values, lengths = features.values(), features.lengths()
        if values.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{self.layout.owner}: ids must be int32 or int64, got "
                            f"{values.dtype}")
        batch = features.stride()
        if lengths.numel() != len(keys) * batch:
            raise ValueError(f"{self.layout.owner}: lengths has {lengths.numel()} entries, but "
                             f"{len(keys)} features x batch size {batch} need "
                             f"{len(keys) * batch}")
        if lengths.numel() and int(lengths.min()) < 0:
            i = int(torch.nonzero(lengths < 0)[0])
            raise ValueError(f"{self.layout.owner}: feature '{keys[i // batch]}' has a negative "
                             f"length ({int(lengths[i])}) at sample {i % batch}")
        if self.max_bag_length is not None and lengths.numel() and \
                int(lengths.max()) > self.max_bag_length:
            i = int(torch.nonzero(lengths > self.max_bag_length)[0])
            raise ValueError(f"{self.layout.owner}: feature '{keys[i // batch]}' has a sequence of "
                             f"{int(lengths[i])} ids at sample {i % batch}, longer than "
                             f"max_sequence_length={self.max_bag_length}")
        weights = features.weights_or_none()
        if self.is_weighted and weights is None:
            raise ValueError(f"{self.layout.owner}: the module is weighted but the input has no "
                             "weights")
        order = [position[f] for f in layout.input_slot_feature]
        if order != list(range(len(keys))):
            features = features.permute(order)
            values, lengths = features.values(), features.lengths()
            weights = features.weights_or_none()
        weights = weights.to(torch.float32) if self.is_weighted else None
        return values, lengths, weights, batch

    def _pack(self, local_ids, slot_lengths, group_bounds, weights, batch, value_bytes,
              length_bytes, rows, num_micro: int) -> SendBlocks:
        """One block per destination, laid out by the wire format, written into one buffer
        by recxla.ops.pack_id_blocks."""
        world, me = self.layout.world_size, self.layout.rank
        unique, unique_offsets, inverse = segmented_unique(local_ids, group_bounds)
        group_bounds_list = group_bounds.tolist()
        unique_list = unique_offsets.tolist()
        blocks = SendBlocks(batch)
        row_run_bounds, row_ids, row_counts = [0], None, []
        if rows is not None:
            blocks.row_bags, row_ids, row_counts = rows
            for count in row_counts:
                row_run_bounds.append(row_run_bounds[-1] + count)
        packed, start = [], 0
        for d in range(world):
            g0, g1 = self.dest_groups[d]
            id0, id1 = group_bounds_list[g0], group_bounds_list[g1]
            u0, u1 = unique_list[g0], unique_list[g1]
            n, u = id1 - id0, u1 - u0
            encoding = wire.choose_encoding(n, u, self.id_bytes[d], self.dedup)
            runs = (self.rows.group_base[d] * num_micro, self.rows.group_base[d + 1] * num_micro)
            r0, r1 = row_run_bounds[runs[0]] if rows else 0, row_run_bounds[runs[1]] if rows else 0
            sizes = wire.section_bytes(self.num_slots[d], batch, n, u, encoding,
                                       self.id_bytes[d], weights is not None, runs[1] - runs[0],
                                       r1 - r0)
            lengths_first = self.slot_base[d] * batch
            lengths_count = (self.slot_base[d + 1] - self.slot_base[d]) * batch
            packed.append(PackedBlock(lengths_first, lengths_count, id0, id1, u0, u1, encoding,
                                      self.id_bytes[d], *runs, r0, r1,
                                      tuple(accumulate(sizes[:-1], initial=start))))
            start += sum(sizes)
            blocks.num_row_ids.append(r1 - r0)
            blocks.num_ids.append(n)
            blocks.num_unique.append(u)
            blocks.encoding.append(encoding)
            blocks.nbytes.append(sum(sizes))
            if d != me:
                self.stats.id_bytes_sent += sum(sizes)
                # The ids of row tables cost TorchRec its usual bags too.
                row_bags = 0 if rows is None else blocks.row_bags.ids_to(d, self.rows)
                self.stats.id_bytes_without_dedup += (
                    lengths_count * length_bytes + (n + row_bags) * value_bytes
                    + ((n + row_bags) * 4 if weights is not None else 0))
        if row_ids is None:
            row_ids = local_ids.new_empty(0)
        blocks.buffer = pack_id_blocks(slot_lengths, local_ids, unique, inverse, weights,
                                       row_ids, row_counts, packed, start)
        return blocks
