// Schema of the owner's decode of the input dist's id blocks (kernel: csrc/cpu/id_blocks.cpp;
// Python API and fake kernel: recxla/ops/id_blocks.py; the plain-PyTorch reference:
// recxla/reference/id_blocks.py). A host op by design, as route_ids: the ids travel and are
// decoded on the CPU whatever device holds the tables. The block layout (where each section
// starts) comes from recxla.torchrec.id_wire_format, the format's one home.
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
  m.def(
      "decode_id_blocks(Tensor received, int[] blocks, int num_slots, int num_micro, "
      "int row_groups, int id_bytes, bool weighted) -> (Tensor, Tensor, Tensor, Tensor, "
      "Tensor)");
}
