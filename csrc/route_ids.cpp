// Schema of the input dist's id routing (kernel: csrc/cpu/route_ids.cpp; Python API, fake kernel
// and the plain-PyTorch reference: recxla/ops/route_ids.py, recxla/reference/route_ids.py).
// A host op by design: a sharded module routes its ids on the CPU, where the loader delivers
// them, whatever device the tables live on.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(recxla, m) {
  // values int32/int64 [N] and lengths int32/int64 [S * B]: a batch's bags, input slot by input
  // slot; weights float32 [N] or None. slot_rows int64 [S]; slot_first_block int64 [S + 1];
  // block_starts int64 [K] (first row of each row block, within its table); block_first_route
  // int64 [K + 1]; route_send_slot, route_row_group, route_row_offset int64 [R].
  // -> (send_ids int64 [M], send_weights float32 [M] or [0], slot_lengths int32
  //     [num_send_slots * B], slot_counts int64 [num_send_slots], row_group, row_slot,
  //     row_sample, row_ids int64 [P], row_weights float32 [P] or [0], first_bad int64 []).
  m.def(
      "route_ids(Tensor values, Tensor lengths, Tensor? weights, int batch, Tensor slot_rows, "
      "Tensor slot_first_block, Tensor block_starts, Tensor block_first_route, "
      "Tensor route_send_slot, Tensor route_row_group, Tensor route_row_offset, "
      "int num_send_slots) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor, Tensor)");
}
