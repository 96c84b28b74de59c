"""The owner's decode of the input dist's id blocks (`recxla::decode_id_blocks`).

Each source rank sends an owner one block of bytes per step: its bags' lengths for the owner's
slots, the ids (raw, or unique ids plus an inverse index), the per-sample weights, and the row
groups' counts and ids (recxla.torchrec.id_wire_format, which also says where each section
starts). The op turns the sources' blocks into the owner's order in two passes over the bags:
ids in segments (slot, micro-batch, source), the bags' bounds slot-major with their columns in
(micro-batch, source, sample) order, the row ids in segments (group, micro-batch, source). It
checks every block first (sections inside the buffer, lengths that sum to the block's ids, an
inverse index inside the unique ids, row counts that sum to the row ids) and raises a
ValueError naming the source and the limit. Done with torch ops it was a dozen calls per block
and a segment permutation.

A host op by design, like recxla.ops.route_ids: ids travel and are decoded on the CPU
whatever device holds the tables, so it has a C++ CPU kernel (csrc/cpu/id_blocks.cpp) and no
GPU kernel. Its oracle: recxla/reference/id_blocks.py.
"""

from typing import NamedTuple, Sequence

import torch

from recxla import _extension

OP = "recxla.decode_id_blocks"
# The ints of one source in `blocks`, before its micro-batch sizes.
BLOCK_FIELDS = 11


class DecodedBlocks(NamedTuple):
    """The sources' blocks in the owner's order (see the module docstring)."""

    values: torch.Tensor      # int64 [N]: ids, segments (slot, micro-batch, source)
    weights: torch.Tensor     # float32 [N], or [0] without weights
    offsets: torch.Tensor     # int64 [slots * B + 1]: bag bounds, slot-major
    row_ids: torch.Tensor     # int64 [R]: row ids, segments (group, micro-batch, source)
    row_counts: torch.Tensor  # int64 [groups, micro-batches, sources]


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
        raise TypeError(f"{OP}: received must be a torch.Tensor")
    if received.device.type != "cpu":
        raise ValueError(f"{OP}: received must be on the CPU (ids are decoded on the host), "
                         f"got {received.device}")
    _extension.backend_for(received, OP)  # the error of a build without the extension
    return DecodedBlocks(*torch.ops.recxla.decode_id_blocks(
        received, list(blocks), num_slots, num_micro, row_groups, id_bytes, weighted))
