// Schemas of the input dist's id blocks: the sender's pack and the owner's decode (kernels:
// csrc/cpu/id_blocks.cpp; Python API and fake kernels: recxla/ops/id_blocks.py; the plain-
// PyTorch references: recxla/reference/id_blocks.py). Host ops by design, as route_ids: the ids
// travel and are encoded and decoded on the CPU whatever device holds the tables. The block
// layout (where each section starts) comes from recxla.torchrec.id_wire_format, the format's
// one home.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(recxla, m) {
  // received: uint8, the sources' blocks. blocks: per source 11 + num_micro ints: batch, ids,
  // unique ids, encoding (0 raw, 1 dedup16, 2 dedup32), row-exchange ids, the byte offsets in
  // `received` of its lengths (int32 [slots, batch]), ids, inverse index, weights (float32),
  // row counts (int32 [groups, micro]) and row ids, then its micro-batch sizes.
  // -> (values int64 [N], weights float32 [N] or [0], offsets int64 [slots * B + 1],
  //     row_ids int64 [R], row_counts int64 [groups, micro, sources]): ids in segments (slot,
  //     micro-batch, source), bags slot-major with columns (micro-batch, source, sample), row
  //     ids in segments (group, micro-batch, source).
  // slot_lengths int32 [slots * B]; ids int64 [N] (send slot by send slot); unique, inverse
  // int64: the ids' unique values per (destination, local table) segment and each id's index
  // into them; weights float32 [N] or None; row_ids int64 [R]; row_counts: the row groups'
  // unique counts per (group, micro-batch), all destinations'. dests: per destination 18 ints:
  // its lengths (first, count), ids [id0, id1), unique ids [u0, u1), encoding, id bytes (4 or
  // 8), row runs [first, last), row ids [r0, r1), then the byte offsets of its six sections.
  // -> uint8 [total_bytes]: every block, padding zero.
  m.def(
      "pack_id_blocks(Tensor slot_lengths, Tensor ids, Tensor unique, Tensor inverse, "
      "Tensor? weights, Tensor row_ids, int[] row_counts, int[] dests, int total_bytes) -> "
      "Tensor");
  m.def(
      "decode_id_blocks(Tensor received, int[] blocks, int num_slots, int num_micro, "
      "int row_groups, int id_bytes, bool weighted) -> (Tensor, Tensor, Tensor, Tensor, "
      "Tensor)");
}
