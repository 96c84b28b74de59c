"""Reference decode of the input dist's id blocks (see recxla.ops.id_blocks for the contract):
each source's sections read with torch views, then the segments gathered one at a time in the
owner's order with Python loops. The oracle of tests/test_id_blocks.py for the C++ kernel
(csrc/cpu/id_blocks.cpp): written for clarity, not speed."""

from typing import List, Sequence

import torch

from recxla.ops.id_blocks import BLOCK_FIELDS, DecodedBlocks


def decode_id_blocks_ref(received: torch.Tensor, blocks: Sequence[int], num_slots: int,
                         num_micro: int, row_groups: int, id_bytes: int,
                         weighted: bool) -> DecodedBlocks:
    """Same arguments and result as `recxla.ops.id_blocks.decode_id_blocks` (valid blocks)."""
    per = BLOCK_FIELDS + num_micro
    id_dtype = torch.int32 if id_bytes == 4 else torch.int64
    sources = []
    for s in range(len(blocks) // per):
        f = list(blocks[s * per:(s + 1) * per])
        batch, n, u, encoding, num_rows, lengths_at, ids_at, index_at, weights_at, \
            counts_at, rows_at = f[:BLOCK_FIELDS]
        micro = f[BLOCK_FIELDS:]
        lengths = received[lengths_at: lengths_at + num_slots * batch * 4].view(torch.int32) \
            .to(torch.int64).view(num_slots, batch)
        if encoding == 0:
            ids = received[ids_at: ids_at + n * id_bytes].view(id_dtype).to(torch.int64)
        else:
            unique = received[ids_at: ids_at + u * id_bytes].view(id_dtype).to(torch.int64)
            width = 2 if encoding == 1 else 4
            index = received[index_at: index_at + n * width] \
                .view(torch.int16 if width == 2 else torch.int32).to(torch.int64)
            if width == 2:
                index = index & 0xFFFF  # unsigned on the wire
            ids = unique[index]
        weights = received[weights_at: weights_at + n * 4].view(torch.float32) if weighted \
            else None
        counts = received[counts_at: counts_at + row_groups * num_micro * 4] \
            .view(torch.int32).to(torch.int64).view(row_groups, num_micro)
        rows = received[rows_at: rows_at + num_rows * id_bytes].view(id_dtype).to(torch.int64)
        starts = [0]
        for m in micro:
            starts.append(starts[-1] + m)
        sources.append((lengths, ids, weights, counts, rows, starts))
    values: List[torch.Tensor] = []
    weights_out: List[torch.Tensor] = []
    bag_lengths: List[torch.Tensor] = []
    for j in range(num_slots):
        for k in range(num_micro):
            for lengths, ids, weights, _, _, starts in sources:
                before = int(lengths[:j].sum()) + int(lengths[j, :starts[k]].sum())
                size = int(lengths[j, starts[k]:starts[k + 1]].sum())
                values.append(ids[before: before + size])
                if weighted:
                    weights_out.append(weights[before: before + size])
                bag_lengths.append(lengths[j, starts[k]:starts[k + 1]])
    lengths_all = torch.cat(bag_lengths) if bag_lengths else torch.zeros(0, dtype=torch.int64)
    offsets = torch.zeros(lengths_all.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths_all, 0)
    row_ids, row_counts = [], torch.zeros((row_groups, num_micro, len(sources)),
                                          dtype=torch.int64)
    taken = [0] * len(sources)
    for g in range(row_groups):
        for k in range(num_micro):
            for s, (_, _, _, counts, rows, _) in enumerate(sources):
                size = int(counts[g, k])
                row_ids.append(rows[taken[s]: taken[s] + size])
                taken[s] += size
                row_counts[g, k, s] = size
    long = dict(dtype=torch.int64)
    return DecodedBlocks(
        torch.cat(values) if values else torch.zeros(0, **long),
        torch.cat(weights_out) if weights_out else torch.zeros(0, dtype=torch.float32),
        offsets, torch.cat(row_ids) if row_ids else torch.zeros(0, **long), row_counts)


def encode_id_blocks_ref(sources: Sequence[dict], num_slots: int, num_micro: int,
                         row_groups: int, id_bytes: int, weighted: bool):
    """The bytes and `blocks` ints of the sources' blocks, each section 8-byte aligned (the
    wire format's layout), for tests and benchmarks. Each source: {"lengths": int [num_slots,
    batch], "ids": int64 [N], "micro": [num_micro sizes], "weights": float32 [N] (weighted),
    "row_counts": int [row_groups, num_micro], "row_ids": int64 [R], "encoding": 0, 1 or 2}.
    A deduplicating encoding sends the ids' unique values (sorted) and an inverse index."""
    id_dtype = torch.int32 if id_bytes == 4 else torch.int64
    pieces: List[torch.Tensor] = []
    blocks: List[int] = []
    at = 0

    def add(section: torch.Tensor) -> int:
        nonlocal at
        start = at
        raw = section.contiguous().view(-1).view(torch.uint8)
        pieces.append(raw)
        pad = -raw.numel() % 8
        pieces.append(torch.zeros(pad, dtype=torch.uint8))
        at += raw.numel() + pad
        return start

    for src in sources:
        lengths = torch.as_tensor(src["lengths"]).to(torch.int32)
        batch = sum(src["micro"])
        ids, encoding = src["ids"], src.get("encoding", 0)
        lengths_at = add(lengths)
        if encoding == 0:
            unique, index = ids, None
        else:
            unique, index = torch.unique(ids, return_inverse=True)
            index = index.to(torch.int16 if encoding == 1 else torch.int32)
        ids_at = add(unique.to(id_dtype))
        index_at = add(index) if index is not None else at
        weights_at = add(src["weights"].to(torch.float32)) if weighted else at
        counts = torch.as_tensor(src.get("row_counts", torch.zeros(row_groups, num_micro)))
        counts_at = add(counts.to(torch.int32).reshape(row_groups, num_micro))
        row_ids = src.get("row_ids", torch.zeros(0, dtype=torch.int64))
        rows_at = add(row_ids.to(id_dtype))
        blocks += [batch, ids.numel(), unique.numel(), encoding, row_ids.numel(),
                   lengths_at, ids_at, index_at, weights_at, counts_at, rows_at,
                   *src["micro"]]
    received = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8)
    return received, blocks


def pack_id_blocks_ref(slot_lengths: torch.Tensor, ids: torch.Tensor, unique: torch.Tensor,
                       inverse: torch.Tensor, weights, row_ids: torch.Tensor,
                       row_counts: Sequence[int], blocks, total_bytes: int) -> torch.Tensor:
    """Same arguments and result as `recxla.ops.id_blocks.pack_id_blocks` (valid inputs):
    each section cast to its wire dtype, viewed as bytes and put at its offset."""
    out = torch.zeros(total_bytes, dtype=torch.uint8)

    def put(at: int, values: torch.Tensor) -> None:
        raw = values.contiguous().view(-1).view(torch.uint8)
        out[at: at + raw.numel()] = raw

    for b in blocks:
        id_dtype = torch.int32 if b.id_bytes == 4 else torch.int64
        lengths_at, ids_at, index_at, weights_at, counts_at, rows_at = b.sections
        put(lengths_at, slot_lengths[b.lengths_first: b.lengths_first + b.lengths_count])
        if b.encoding == 0:
            put(ids_at, ids[b.id0: b.id1].to(id_dtype))
        else:
            put(ids_at, unique[b.u0: b.u1].to(id_dtype))
            index = inverse[b.id0: b.id1] - b.u0
            # A 16-bit index travels unsigned: its low two bytes.
            put(index_at, index.to(torch.int32) if b.encoding == 2 else
                index.to(torch.int32).view(torch.uint8).view(-1, 4)[:, :2].contiguous())
        if weights is not None:
            put(weights_at, weights[b.id0: b.id1].to(torch.float32))
        put(counts_at, torch.tensor(list(row_counts[b.runs0: b.runs1]), dtype=torch.int32))
        put(rows_at, row_ids[b.r0: b.r1].to(id_dtype))
    return out
