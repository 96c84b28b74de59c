"""The input dist of recxla's sharded EmbeddingBagCollection: each rank's ids to the ranks that
own their rows, deduplicated per (destination rank, table), in two all-to-alls.

Sender, per step (every op vectorized over all ids):
1. check the batch (TorchRec's KeyedJaggedTensor checks: unique keys, lengths, weights; then
   features, id ranges), then route every id to the owner(s) of its row
   block (`ShardLayout`: one owner for table-wise and row-wise, every column owner for
   column-wise), as an id local to the owner's rows;
2. order ids by destination slot (stable: each bag keeps its order), count each slot's bag
   lengths, and deduplicate each (destination, local table) segment with `unique_keys`;
3. per destination choose the smaller encoding: raw ids, or unique ids plus an inverse index of
   2 bytes (at most 65536 uniques) or 4; ids travel as int32 when the owner's rows fit;
4. a first all-to-all of 5 int64 per rank pair (status, batch size, ids, uniques, encoding),
   then one all-to-all of bytes: per destination its bag lengths, ids, inverse index and
   per-sample weights, each section 8-byte aligned.

Owner: the first all-to-all gives every block's size; after the second, the inverse index
re-expands the ids, the bags of all sources are put slot by slot (sources in rank order, so
bag b of source s is sample offset_s + b of the owner's batch), and one `unique_keys` pass per
local table gives the lookup its unique rows.

Bad input on one rank (an id out of range, a missing feature, ...) travels as a status in the
first all-to-all, so every rank raises before any id moves: the rank with the bad batch raises
its own error, the others say which rank failed. No rank is left waiting in a collective.
"""

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.sparse.jagged_tensor_validator import validate_keyed_jagged_tensor

from recxla.ops.dedup import segmented_unique
from recxla.torchrec.comm_stats import CommStats
from recxla.torchrec.row_exchange import RowBags, RowInput, RowRouting, encode_rows
from recxla.torchrec.shard_layout import OWNER, ShardLayout
from recxla.torchrec.variable_batch import expand_variable_batch

# Encodings of one (source, destination) block of ids.
RAW, DEDUP16, DEDUP32 = 0, 1, 2
_META = 6  # status, batch size, ids, unique ids, encoding, row ids; then micro-batch sizes
_OK, _BAD_INPUT = 0, 1
_ALIGN = 8
_INT32_ROWS = 2**31


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _section_bytes(num_slots: int, batch: int, num_ids: int, num_unique: int, encoding: int,
                   id_bytes: int, weighted: bool, row_runs: int, row_ids: int) -> List[int]:
    """Byte sizes of the aligned sections of one block: lengths, ids (raw or unique), inverse
    index, per-sample weights (the pooled tables), then the row groups' unique counts (int32,
    one per (row group, micro-batch)) and unique ids. The one place both sides agree on the
    block layout."""
    if encoding == RAW:
        ids, inverse = num_ids * id_bytes, 0
    else:
        ids = num_unique * id_bytes
        inverse = num_ids * (2 if encoding == DEDUP16 else 4)
    weights = num_ids * 4 if weighted else 0
    return [_aligned(num_slots * batch * 4), _aligned(ids), _aligned(inverse), _aligned(weights),
            _aligned(row_runs * 4), _aligned(row_ids * id_bytes)]


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

    def record_stream(self, stream) -> None:  # TorchRec's Multistreamable protocol
        for t in (self.unique_values, self.unique_offsets, self.inverse, self.offsets,
                  self.per_sample_weights):
            if t is not None and t.is_cuda:
                t.record_stream(stream)


class InputDistError(ValueError):
    """A rank's batch failed its checks; raised on every rank before any id moved."""


class IdRouter:
    """The sending and receiving halves of the input dist for one sharded module.

    Args:
        layout: the module's ShardLayout (its rank is this process's rank in `group`).
        group: the process group of the all-to-alls.
        device: where the module's tensors live.
        is_weighted: batches carry per-sample weights.
        dedup: allow the deduplicated encodings (False: always raw ids).
        stats: counters this router adds its bytes to.
    """

    def __init__(self, layout: ShardLayout, group: Optional[dist.ProcessGroup],
                 device: torch.device, is_weighted: bool, dedup: bool, stats: CommStats):
        self.layout = layout
        self.group = group
        self.device = device
        self.is_weighted = is_weighted
        self.dedup = dedup
        self.stats = stats
        # Features every batch must hold: the layout's, and those of tables looked up
        # elsewhere (data-parallel ones) that the sharded module adds.
        self.required_features: List[str] = layout.feature_names
        world, me = layout.world_size, layout.rank
        self.num_slots = [len(s) for s in layout.slots]
        self.slot_base = [sum(self.num_slots[:d]) for d in range(world + 1)]
        self.id_bytes = [
            4 if all(lt.rows < _INT32_ROWS for lt in layout.local_tables[d]) else 8
            for d in range(world)
        ]
        # Sender: per input slot its table's rows; per row block (over all input slots, in
        # order) its routes, flattened.
        tables = layout.tables
        self.slot_rows = torch.tensor(
            [tables[t].num_embeddings for t in layout.input_slot_table], dtype=torch.int64,
            device=device)
        blocks = [(i, k) for i, starts in enumerate(layout.block_starts)
                  for k in range(len(starts))]
        self.multi_block = len(blocks) > len(layout.block_starts)
        if self.multi_block:
            # Shift each slot's ids into a band of its own so one searchsorted over every
            # slot's block starts finds every id's block.
            band, bounds, first_block = 0, [], []
            self._band = []
            for i, starts in enumerate(layout.block_starts):
                first_block.append(len(bounds))
                self._band.append(band)
                bounds.extend(band + s for s in starts)
                band += tables[layout.input_slot_table[i]].num_embeddings + 1
            self.band = torch.tensor(self._band, dtype=torch.int64, device=device)
            self.block_bounds = torch.tensor(bounds, dtype=torch.int64, device=device)
        routes = [layout.block_routes[i][k] for i, k in blocks]
        self.single_route = all(len(r) == 1 for r in routes)
        counts = [len(r) for r in routes]
        self.route_counts = torch.tensor(counts, dtype=torch.int64, device=device)
        self.route_offsets = torch.tensor([sum(counts[:g]) for g in range(len(counts))],
                                          dtype=torch.int64, device=device)
        flat = [route for r in routes for route in r]
        self.rows = RowRouting(layout, device)
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
        # Owner: the first slot of each of my local tables.
        self.my_table_first_slot = []
        previous = None
        for j, (lt, _) in enumerate(layout.slots[me]):
            if lt != previous:
                self.my_table_first_slot.append(j)
                previous = lt
        self.my_table_first_slot.append(len(layout.slots[me]))

    # ---------------------------------------------------------------- sender

    def start(self, features: KeyedJaggedTensor,
              micro_batch_sizes: Optional[Sequence[int]] = None) -> "_MetaAwaitable":
        """Check and route `features` and start the first all-to-all. Never raises for bad
        input: the error is raised on every rank by the returned awaitable's wait().

        micro_batch_sizes: M ints summing to the batch size: the batch's samples are M
            micro-batches one after another, and the owner orders its batch micro-batch by
            micro-batch (see LookupInput). None: one micro-batch. Every rank must pass the
            same M.
        """
        try:
            if isinstance(features, KeyedJaggedTensor) and features.variable_stride_per_key():
                if micro_batch_sizes is not None:
                    raise ValueError(f"{OWNER}: a batch with variable batch per feature cannot "
                                     "be split into micro-batches; expand it first "
                                     "(recxla.torchrec.variable_batch.expand_variable_batch)")
                features = expand_variable_batch(features)
            batch = features.stride() if isinstance(features, KeyedJaggedTensor) else 0
            micro = [batch] if micro_batch_sizes is None else [int(m) for m in micro_batch_sizes]
            if any(m < 0 for m in micro) or sum(micro) != batch:
                raise ValueError(f"{OWNER}: micro_batch_sizes {micro} must be >= 0 and sum to "
                                 f"the batch size {batch}")
            blocks = self._encode(features, micro)
            error = None
        except (ValueError, TypeError, IndexError) as e:
            blocks, error = None, e
            micro = [0] * (1 if micro_batch_sizes is None else len(micro_batch_sizes))
        world = self.layout.world_size
        meta = torch.zeros((world, _META + len(micro)), dtype=torch.int64)
        if blocks is None:
            meta[:, 0] = _BAD_INPUT
        else:
            meta[:, 0] = _OK
            meta[:, 1] = blocks.batch
            meta[:, 2] = torch.tensor(blocks.num_ids)
            meta[:, 3] = torch.tensor(blocks.num_unique)
            meta[:, 4] = torch.tensor(blocks.encoding)
            meta[:, 5] = torch.tensor(blocks.num_row_ids)
            meta[:, _META:] = torch.tensor(micro)
        # The sizes cross the links too: one row to and from each other rank.
        self.stats.id_bytes_sent += (world - 1) * meta.shape[1] * 8
        self.stats.id_bytes_received += (world - 1) * meta.shape[1] * 8
        meta = meta.to(self.device)
        received = torch.empty_like(meta)
        work = dist.all_to_all_single(received, meta, group=self.group, async_op=True)
        awaitable = _MetaAwaitable(self, work, received, blocks, error, meta)
        awaitable.features = features  # as routed (a variable batch expanded)
        return awaitable

    def _encode(self, features: KeyedJaggedTensor, micro: List[int]) -> "_SendBlocks":
        layout = self.layout
        values, lengths, weights, batch = self._slot_major(features)
        num_slots_in = len(layout.input_slot_table)
        n = values.numel()
        slot_of_id = torch.repeat_interleave(
            torch.arange(num_slots_in, device=values.device),
            lengths.view(num_slots_in, batch).sum(1), output_size=n)
        ids = values.to(torch.int64)
        bad = (ids < 0) | (ids >= self.slot_rows[slot_of_id])
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            slot = int(slot_of_id[i])
            table = layout.tables[layout.input_slot_table[slot]]
            raise IndexError(
                f"{OWNER}: feature '{layout.input_slot_feature[slot]}' has id {int(ids[i])} "
                f"outside [0, {table.num_embeddings}) (table '{table.name}' has "
                f"{table.num_embeddings} rows)")
        bag = torch.repeat_interleave(torch.arange(num_slots_in * batch, device=ids.device),
                                      lengths, output_size=n)
        sample = bag - slot_of_id * batch
        if self.multi_block:
            block = torch.searchsorted(self.block_bounds, ids + self.band[slot_of_id],
                                       right=True) - 1
        else:
            block = slot_of_id
        if self.single_route:
            route = block
        else:
            per_id = self.route_counts[block]
            source = torch.repeat_interleave(torch.arange(n, device=ids.device), per_id)
            first = torch.cumsum(per_id, 0) - per_id
            position = torch.arange(source.numel(), device=ids.device) - \
                torch.repeat_interleave(first, per_id)
            route = self.route_offsets[block[source]] + position
            ids, sample, slot_of_id = ids[source], sample[source], slot_of_id[source]
            if weights is not None:
                weights = weights[source]
        local_ids = ids - self.route_row_offset[route]
        rows = None
        if self.rows.active:
            row_group = self.route_row_group[route]
            to_rows = row_group >= 0
            take = torch.nonzero(to_rows).squeeze(1)
            rows = encode_rows(self.rows, row_group[take], slot_of_id[take], sample[take],
                               local_ids[take], None if weights is None else weights[take],
                               micro, batch)
            keep = torch.nonzero(~to_rows).squeeze(1)
            route, local_ids, sample = route[keep], local_ids[keep], sample[keep]
            if weights is not None:
                weights = weights[keep]
        send_slot = self.route_send_slot[route]
        order = torch.sort(send_slot, stable=True).indices
        local_ids = local_ids[order]
        if weights is not None:
            weights = weights[order]
        total_slots = self.slot_base[-1]
        slot_lengths = torch.bincount(send_slot * batch + sample, minlength=total_slots * batch)
        slot_counts = torch.bincount(send_slot, minlength=total_slots)
        slot_ends = torch.cumsum(slot_counts, 0)
        slot_starts = slot_ends - slot_counts
        group_bounds = torch.cat([slot_starts, slot_ends[-1:]])[self.group_first_slot] \
            if total_slots else torch.zeros(1, dtype=torch.int64, device=ids.device)
        blocks = self._pack(local_ids, slot_lengths.to(torch.int32), group_bounds, weights,
                            batch, features.values().element_size(),
                            features.lengths().element_size(), rows, len(micro))
        blocks.input_lengths = lengths.view(num_slots_in, batch)
        return blocks

    def _slot_major(self, features: KeyedJaggedTensor):
        """The batch's ids in input-slot order (the module's (table, feature) order; a feature
        read by several tables appears once per table). -> values [N], lengths int32/int64
        [S_in * B], weights float32 [N] or None, B."""
        layout = self.layout
        if not isinstance(features, KeyedJaggedTensor):
            raise TypeError(f"{OWNER}: features must be a KeyedJaggedTensor, got "
                            f"{type(features).__name__}")
        try:
            # TorchRec's own checks of a sharded module's input (unique keys, lengths and
            # offsets that agree with the values, one weight per id), on every batch: recxla
            # reads the keys of each batch anew, where TorchRec checks its first batch only.
            validate_keyed_jagged_tensor(features)
        except ValueError as e:
            raise ValueError(f"{OWNER}: invalid KeyedJaggedTensor: {e}") from None
        keys = features.keys()
        position = {k: i for i, k in enumerate(keys)}
        missing = [f for f in self.required_features if f not in position]
        if missing:
            raise ValueError(f"{OWNER}: feature '{missing[0]}' is missing from the input "
                             f"(keys: {keys}; the module reads {self.required_features})")
        values, lengths = features.values(), features.lengths()
        if values.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{OWNER}: ids must be int32 or int64, got {values.dtype}")
        batch = features.stride()
        if lengths.numel() != len(keys) * batch:
            raise ValueError(f"{OWNER}: lengths has {lengths.numel()} entries, but {len(keys)} "
                             f"features x batch size {batch} need {len(keys) * batch}")
        if lengths.numel() and int(lengths.min()) < 0:
            i = int(torch.nonzero(lengths < 0)[0])
            raise ValueError(f"{OWNER}: feature '{keys[i // batch]}' has a negative length "
                             f"({int(lengths[i])}) at sample {i % batch}")
        if int(lengths.sum()) != values.numel():
            raise ValueError(f"{OWNER}: lengths sum to {int(lengths.sum())} but the input holds "
                             f"{values.numel()} ids")
        weights = features.weights_or_none()
        if self.is_weighted and weights is None:
            raise ValueError(f"{OWNER}: the module is weighted but the input has no weights")
        order = [position[f] for f in layout.input_slot_feature]
        if order != list(range(len(keys))):
            features = features.permute(order)
            values, lengths = features.values(), features.lengths()
            weights = features.weights_or_none()
        weights = weights.to(torch.float32) if self.is_weighted else None
        return values, lengths, weights, batch

    def _pack(self, local_ids, slot_lengths, group_bounds, weights, batch, value_bytes,
              length_bytes, rows, num_micro: int) -> "_SendBlocks":
        world, me = self.layout.world_size, self.layout.rank
        unique, unique_offsets, inverse = segmented_unique(local_ids, group_bounds)
        group_bounds_list = group_bounds.tolist()
        unique_list = unique_offsets.tolist()
        pieces: List[torch.Tensor] = []
        blocks = _SendBlocks(batch)
        row_run_bounds = [0]
        if rows is not None:
            blocks.row_bags, row_ids, row_counts = rows
            for count in row_counts:
                row_run_bounds.append(row_run_bounds[-1] + count)
        for d in range(world):
            g0, g1 = self.dest_groups[d]
            id0, id1 = group_bounds_list[g0], group_bounds_list[g1]
            u0, u1 = unique_list[g0], unique_list[g1]
            n, u = id1 - id0, u1 - u0
            id_dtype = torch.int32 if self.id_bytes[d] == 4 else torch.int64
            encoding = RAW
            if self.dedup:
                inverse_bytes = 2 if u <= 65536 else 4
                if u * self.id_bytes[d] + n * inverse_bytes < n * self.id_bytes[d]:
                    encoding = DEDUP16 if inverse_bytes == 2 else DEDUP32
            runs = (self.rows.group_base[d] * num_micro, self.rows.group_base[d + 1] * num_micro)
            r0, r1 = row_run_bounds[runs[0]] if rows else 0, row_run_bounds[runs[1]] if rows else 0
            sizes = _section_bytes(self.num_slots[d], batch, n, u, encoding, self.id_bytes[d],
                                   weights is not None, runs[1] - runs[0], r1 - r0)
            lengths_d = slot_lengths[self.slot_base[d] * batch: self.slot_base[d + 1] * batch]
            sections = [lengths_d]
            if encoding == RAW:
                sections += [local_ids[id0:id1].to(id_dtype), None]
            else:
                index = inverse[id0:id1] - u0
                sections += [unique[u0:u1].to(id_dtype),
                             index.to(torch.int16 if encoding == DEDUP16 else torch.int32)]
            sections.append(weights[id0:id1] if weights is not None else None)
            if rows is not None:
                sections.append(torch.tensor(row_counts[runs[0]:runs[1]], dtype=torch.int32,
                                             device=self.device))
                sections.append(row_ids[r0:r1].to(id_dtype))
            blocks.num_row_ids.append(r1 - r0)
            for section, size in zip(sections, sizes):
                if section is None:
                    continue
                raw = section.contiguous().view(torch.uint8)
                pieces.append(raw)
                if size > raw.numel():
                    pieces.append(raw.new_zeros(size - raw.numel()))
            blocks.num_ids.append(n)
            blocks.num_unique.append(u)
            blocks.encoding.append(encoding)
            blocks.nbytes.append(sum(sizes))
            if d != me:
                self.stats.id_bytes_sent += sum(sizes)
                # The ids of row tables cost TorchRec its usual bags too.
                row_bags = 0 if rows is None else blocks.row_bags.ids_to(d, self.rows)
                self.stats.id_bytes_without_dedup += (
                    lengths_d.numel() * length_bytes + (n + row_bags) * value_bytes
                    + ((n + row_bags) * 4 if weights is not None else 0))
        blocks.buffer = torch.cat(pieces) if pieces else \
            torch.empty(0, dtype=torch.uint8, device=self.device)
        return blocks

    # ---------------------------------------------------------------- owner

    def _decode(self, received: torch.Tensor, meta: List[List[int]]) -> LookupInput:
        me = self.layout.rank
        num_slots = self.num_slots[me]
        id_dtype = torch.int32 if self.id_bytes[me] == 4 else torch.int64
        micro = [row[_META:] for row in meta]
        num_micro = len(micro[0])
        world = len(meta)
        total_batch = sum(row[1] for row in meta)
        lengths, ids, weights, counts = [], [], [], []
        start = 0
        my_groups = self.rows.groups_per_rank[me]
        row_sizes, row_ids = [], []
        for s, row in enumerate(meta):
            _, batch, n, u, encoding, num_row_ids = row[:_META]
            sizes = _section_bytes(num_slots, batch, n, u, encoding, self.id_bytes[me],
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
            at_edges = cumulative[:, edges]
            counts.append((at_edges[:, 1:] - at_edges[:, :-1]).flatten())
            if encoding == RAW:
                ids.append(received[bounds[1]: bounds[1] + n * self.id_bytes[me]].view(id_dtype))
            else:
                unique = received[bounds[1]: bounds[1] + u * self.id_bytes[me]].view(id_dtype)
                if encoding == DEDUP16:
                    index = received[bounds[2]: bounds[2] + n * 2].view(torch.int16)
                    index = index.to(torch.int64) & 0xFFFF
                else:
                    index = received[bounds[2]: bounds[2] + n * 4].view(torch.int32)
                ids.append(unique[index.to(torch.int64)])
            if self.is_weighted:
                weights.append(received[bounds[3]: bounds[3] + n * 4].view(torch.float32))
            if my_groups:
                row_sizes.append(received[bounds[4]: bounds[4] + my_groups * num_micro * 4]
                                 .view(torch.int32).to(torch.int64))
                row_ids.append(received[bounds[5]: bounds[5] + num_row_ids * self.id_bytes[me]]
                               .view(id_dtype).to(torch.int64))
        values = torch.cat([i.to(torch.int64) for i in ids]) if ids else \
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
            all_lengths = all_lengths[:, torch.cat(columns).to(self.device)]
        if values.numel() and (world > 1 or num_micro > 1) and num_slots > 0:
            # ids in segments (source, slot, micro-batch) -> (slot, micro-batch, source)
            sizes = torch.stack(counts).view(world, num_slots, num_micro)
            gather = _segment_gather(sizes, (1, 2, 0), values.numel())
            values = values[gather]
            if psw is not None:
                psw = psw[gather]
        offsets = torch.zeros(num_slots * total_batch + 1, dtype=torch.int64,
                              device=self.device)
        torch.cumsum(all_lengths.flatten(), 0, out=offsets[1:])
        table_bounds = offsets[torch.tensor(self.my_table_first_slot, device=self.device)
                               * total_batch]
        unique_values, unique_offsets, inverse = segmented_unique(values, table_bounds)
        rows = None
        if my_groups:
            # (source, group, micro-batch) runs -> (group, micro-batch, source)
            sizes = torch.stack(row_sizes).view(world, my_groups, num_micro)
            all_ids = torch.cat(row_ids)
            ordered = all_ids[_segment_gather(sizes, (1, 2, 0), all_ids.numel())]
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


def _segment_gather(sizes: torch.Tensor, dims: Sequence[int], total: int) -> torch.Tensor:
    """Gather index that reorders segments: they lie in the row-major order of `sizes` (an
    int64 tensor of segment lengths, one dim per level) and go to the order of
    sizes.permute(dims). total: the sum of sizes."""
    flat = sizes.flatten()
    start = (torch.cumsum(flat, 0) - flat).view(sizes.shape)
    target_sizes = sizes.permute(*dims).flatten()
    target_start = torch.cumsum(target_sizes, 0) - target_sizes
    shift = torch.repeat_interleave(start.permute(*dims).flatten() - target_start, target_sizes,
                                    output_size=total)
    return torch.arange(total, device=sizes.device) + shift


@dataclass
class _SendBlocks:
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


class _MetaAwaitable(Awaitable["_DataAwaitable"]):
    def __init__(self, router: IdRouter, work, received: torch.Tensor,
                 blocks: Optional[_SendBlocks], error: Optional[Exception], sent: torch.Tensor):
        super().__init__()
        self._router, self._work, self._received = router, work, received
        self._blocks, self._error, self._sent = blocks, error, sent

    @property
    def input_lengths(self) -> Optional[torch.Tensor]:
        """This rank's bag lengths [input slots, B] (None when its batch failed its checks)."""
        return self._blocks.input_lengths if self._blocks is not None else None

    @property
    def row_bags(self) -> Optional[RowBags]:
        """This rank's bags of row tables (None without row tables or on bad input)."""
        return self._blocks.row_bags if self._blocks is not None else None

    def _wait_impl(self) -> "_DataAwaitable":
        router = self._router
        self._work.wait()
        meta = self._received.cpu().tolist()
        if self._error is not None:
            raise self._error
        failed = [r for r, row in enumerate(meta) if row[0] != _OK]
        if failed:
            raise InputDistError(
                f"{OWNER}: the batch of rank(s) {failed} failed its checks (that rank raised "
                "the reason); no ids were exchanged")
        me = router.layout.rank
        num_slots = router.num_slots[me]
        num_micro = len(meta[0]) - _META
        row_runs = router.rows.groups_per_rank[me] * num_micro
        recv_sizes = [
            sum(_section_bytes(num_slots, b, n, u, e, router.id_bytes[me], router.is_weighted,
                               row_runs, r))
            for _, b, n, u, e, r in (row[:_META] for row in meta)
        ]
        for r, size in enumerate(recv_sizes):
            if r != me:
                router.stats.id_bytes_received += size
        received = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=router.device)
        work = dist.all_to_all_single(received, self._blocks.buffer, recv_sizes,
                                      self._blocks.nbytes, group=router.group, async_op=True)
        return _DataAwaitable(router, work, received, meta, self._blocks)


class _DataAwaitable(Awaitable[LookupInput]):
    def __init__(self, router: IdRouter, work, received: torch.Tensor, meta, blocks):
        super().__init__()
        self._router, self._work, self._received, self._meta = router, work, received, meta
        self._blocks = blocks  # the send buffer must live until the exchange is done

    def _wait_impl(self) -> LookupInput:
        self._work.wait()
        self._blocks = None
        return self._router._decode(self._received, self._meta)
