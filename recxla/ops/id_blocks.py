"""The input dist's id blocks: the sender's pack (`recxla::pack_id_blocks`) and the owner's
decode (`recxla::decode_id_blocks`).

Each source rank sends an owner one block of bytes per step: its bags' lengths for the owner's
slots, the ids (raw, or unique ids plus an inverse index), the per-sample weights, and the row
groups' counts and ids (recxla.torchrec.id_wire_format, which also says where each section
starts). The pack writes every destination's block into one buffer in one pass (a check of
each range and of each id against its wire width first), where torch ops took a slice, a cast,
a byte view and a pad per section. The decode turns the sources' blocks into the owner's order
in two passes over the bags:
ids in segments (slot, micro-batch, source), the bags' bounds slot-major with their columns in
(micro-batch, source, sample) order, the row ids in segments (group, micro-batch, source). It
checks every block first (sections inside the buffer, lengths that sum to the block's ids, an
inverse index inside the unique ids, row counts that sum to the row ids) and raises a
ValueError naming the source and the limit. Done with torch ops it was a dozen calls per block
and a segment permutation.

Host ops by design, like recxla.ops.route_ids: ids travel and are encoded and decoded on the
CPU whatever device holds the tables, so they have C++ CPU kernels (csrc/cpu/id_blocks.cpp) and
no GPU kernel. Their oracles: recxla/reference/id_blocks.py.
"""

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from recxla import _extension

PACK_OP = "recxla.pack_id_blocks"
DECODE_OP = "recxla.decode_id_blocks"
# The ints of one source in `blocks`, before its micro-batch sizes.
BLOCK_FIELDS = 11


class PackedBlock(NamedTuple):
    """Where one destination's block comes from and goes (pack_id_blocks' `dests`)."""

    lengths_first: int   # its bag lengths: slot_lengths[lengths_first, + lengths_count)
    lengths_count: int
    id0: int             # its ids: ids[id0, id1)
    id1: int
    u0: int              # its unique ids: unique[u0, u1) (deduplicated encodings)
    u1: int
    encoding: int        # id_wire_format's RAW, DEDUP16, DEDUP32
    id_bytes: int        # 4 or 8
    runs0: int           # its row runs: row_counts[runs0, runs1)
    runs1: int
    r0: int              # its row ids: row_ids[r0, r1)
    r1: int
    sections: Tuple[int, int, int, int, int, int]  # byte offsets: lengths, ids, inverse
    #                                                 index, weights, row counts, row ids


class DecodedBlocks(NamedTuple):
    """The sources' blocks in the owner's order (see the module docstring)."""

    values: torch.Tensor      # int64 [N]: ids, segments (slot, micro-batch, source)
    weights: torch.Tensor     # float32 [N], or [0] without weights
    offsets: torch.Tensor     # int64 [slots * B + 1]: bag bounds, slot-major
    row_ids: torch.Tensor     # int64 [R]: row ids, segments (group, micro-batch, source)
    row_counts: torch.Tensor  # int64 [groups, micro-batches, sources]


@_extension.register_fake("recxla::pack_id_blocks")
def _pack_fake(slot_lengths, ids, unique, inverse, weights, row_ids, row_counts, dests,
               total_bytes):
    return ids.new_empty(total_bytes, dtype=torch.uint8)


def pack_id_blocks(slot_lengths: torch.Tensor, ids: torch.Tensor, unique: torch.Tensor,
                   inverse: torch.Tensor, weights: Optional[torch.Tensor],
                   row_ids: torch.Tensor, row_counts: Sequence[int],
                   blocks: List[PackedBlock], total_bytes: int) -> torch.Tensor:
    """Every destination's block in one uint8 buffer of total_bytes (padding zero).

    slot_lengths int32 [slots * B]; ids int64 [N], send slot by send slot; unique, inverse
    int64: the unique values of each (destination, local table) segment and each id's index
    into them (recxla.ops.segmented_unique); weights float32 [N] or None; row_ids int64 [R]
    and row_counts (ints) of the row groups; blocks: a PackedBlock per destination. All on
    the CPU."""
    for name, t in (("slot_lengths", slot_lengths), ("ids", ids)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise ValueError(f"{PACK_OP}: {name} must be a CPU tensor (ids are packed on the "
                             "host)")
    _extension.backend_for(ids, PACK_OP)  # the error of a build without the extension
    dests = [v for b in blocks for v in (*b[:-1], *b.sections)]
    return torch.ops.recxla.pack_id_blocks(slot_lengths, ids, unique, inverse, weights, row_ids,
                                           list(row_counts), dests, total_bytes)


@_extension.register_fake("recxla::decode_id_blocks")
def _decode_fake(received, blocks, num_slots, num_micro, row_groups, id_bytes, weighted):
    per = BLOCK_FIELDS + num_micro
    fields = [blocks[i:i + per] for i in range(0, len(blocks), per)]
    ids = sum(f[1] for f in fields)
    batch = sum(f[0] for f in fields)
    rows = sum(f[4] for f in fields)
    long = dict(dtype=torch.int64)
    return (received.new_empty(ids, **long),
            received.new_empty(ids if weighted else 0, dtype=torch.float32),
            received.new_empty(num_slots * batch + 1, **long), received.new_empty(rows, **long),
            received.new_empty((row_groups, num_micro, len(fields)), **long))


def decode_id_blocks(received: torch.Tensor, blocks: Sequence[int], num_slots: int,
                     num_micro: int, row_groups: int, id_bytes: int,
                     weighted: bool) -> DecodedBlocks:
    """Decodes the sources' blocks in `received` (uint8, CPU).

    Args:
        blocks: per source BLOCK_FIELDS + num_micro ints: its batch, ids, unique ids, encoding
            (id_wire_format's RAW, DEDUP16, DEDUP32), row-exchange ids; the byte offsets in
            `received` of its sections (lengths int32 [num_slots, batch], ids, inverse index,
            weights float32, row counts int32 [row_groups, num_micro], row ids); then its
            micro-batch sizes.
        num_slots: the owner's slots; num_micro: micro-batches; row_groups: the owner's row
            groups; id_bytes: 4 (int32 ids on the wire) or 8; weighted: blocks carry weights.
    """
    if not isinstance(received, torch.Tensor):
        raise TypeError(f"{DECODE_OP}: received must be a torch.Tensor")
    if received.device.type != "cpu":
        raise ValueError(f"{DECODE_OP}: received must be on the CPU (ids are decoded on the host), "
                         f"got {received.device}")
    _extension.backend_for(received, DECODE_OP)  # the error of a build without the extension
    return DecodedBlocks(*torch.ops.recxla.decode_id_blocks(
        received, list(blocks), num_slots, num_micro, row_groups, id_bytes, weighted))
