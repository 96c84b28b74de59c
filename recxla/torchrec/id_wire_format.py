"""The wire format of the input dist's ids: the one place that says what the ids cost to move.

The input dist (input_dist.py, id_encoder.py, id_decoder.py) writes and reads it; the planner's
load count (recxla.planner.loads) and cost model (recxla.planner.cost) and the simulator
(recxla.sim) count bytes with it, so a change of format changes all of them at once.

Per step, between a source rank and each owner, two all-to-alls:

1. sizes: one int64 row per rank pair, `META_FIELDS` fields (status, batch size, ids, unique
   ids, encoding, row-exchange ids) then the M micro-batch sizes (`meta_row_bytes`);
2. one block of bytes per (source, owner), its sections each 8-byte aligned
   (`section_bytes`): the bag lengths of the owner's slots (int32, one per sample and slot),
   the ids (raw, or unique ids plus an inverse index: `choose_encoding`), the inverse index,
   the per-sample weights (float32), then the row groups' unique counts (int32) and unique ids.

Ids travel as int32 where every local table of the owner has fewer than 2^31 rows
(`owner_id_bytes`), else int64; the inverse index as int16 (at most 65,536 unique ids) or int32.
"""

from typing import Iterable, List, NamedTuple, Sequence

import torch

# Encodings of one (source, owner) block of ids.
RAW, DEDUP16, DEDUP32 = 0, 1, 2
# The sizes row: these fields, then the micro-batch sizes.
META_FIELDS = 6
STATUS_OK, STATUS_BAD_INPUT = 0, 1
# Every section of a block starts at a multiple of this many bytes.
ALIGN = 8
# Ids below this travel as int32.
INT32_ROWS = 2**31
# Bag lengths travel as int32.
LENGTH_BYTES = 4
# At most this many unique ids take a 2-byte inverse index.
MAX_DEDUP16 = 65536


class BlockMeta(NamedTuple):
    """One row of the sizes' all-to-all: what the block from one source holds."""

    status: int
    batch: int
    num_ids: int
    num_unique: int
    encoding: int
    num_row_ids: int

    @classmethod
    def of(cls, row: Sequence[int]) -> "BlockMeta":
        return cls(*row[:META_FIELDS])


def micro_batch_sizes(row: Sequence[int]) -> List[int]:
    """The micro-batch sizes a sizes row carries after its META_FIELDS."""
    return list(row[META_FIELDS:])


def meta_row_bytes(num_micro_batches: int = 1) -> int:
    """Bytes of one rank pair's sizes row."""
    return (META_FIELDS + num_micro_batches) * 8


def aligned(n: int) -> int:
    """n bytes rounded up to the section alignment."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def owner_id_bytes(local_table_rows: Iterable[int]) -> int:
    """Bytes per id sent to an owner whose local tables have these row counts: 4 or 8."""
    return 4 if all(rows < INT32_ROWS for rows in local_table_rows) else 8


def id_dtype(id_bytes: int) -> torch.dtype:
    """The dtype of ids of `id_bytes` bytes on the wire."""
    return torch.int32 if id_bytes == 4 else torch.int64


def index_bytes(num_unique) -> int:
    """Bytes per entry of the inverse index into num_unique unique ids: 2 or 4."""
    return 2 if num_unique <= MAX_DEDUP16 else 4


def index_dtype(encoding: int) -> torch.dtype:
    """The dtype of a deduplicated block's inverse index."""
    return torch.int16 if encoding == DEDUP16 else torch.int32


def choose_encoding(num_ids: int, num_unique: int, id_bytes: int, dedup: bool = True) -> int:
    """The block's encoding: unique ids plus an inverse index where that is smaller than the
    raw ids (and `dedup` allows it), else RAW."""
    if dedup:
        index = index_bytes(num_unique)
        if num_unique * id_bytes + num_ids * index < num_ids * id_bytes:
            return DEDUP16 if index == 2 else DEDUP32
    return RAW


def encoded_ids_bytes(num_ids, num_unique, id_bytes: int, index: int = 0):
    """Bytes of a block's ids and inverse index under the encoding `choose_encoding` picks,
    unaligned (counts may be expected values, floats). index: bytes per inverse-index entry
    (0: from num_unique, as the input dist picks it)."""
    index = index or index_bytes(num_unique)
    return min(num_ids * id_bytes, num_unique * id_bytes + num_ids * index)


def section_bytes(num_slots: int, batch: int, num_ids: int, num_unique: int, encoding: int,
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
    return [aligned(num_slots * batch * LENGTH_BYTES), aligned(ids), aligned(inverse),
            aligned(weights), aligned(row_runs * 4), aligned(row_ids * id_bytes)]


def block_bytes(num_slots: int, meta: BlockMeta, id_bytes: int, weighted: bool,
                row_runs: int) -> int:
    """Bytes of the block a sizes row announces."""
    return sum(section_bytes(num_slots, meta.batch, meta.num_ids, meta.num_unique,
                             meta.encoding, id_bytes, weighted, row_runs, meta.num_row_ids))
