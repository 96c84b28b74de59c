// Schema of the sender's half of the row exchange (kernel: csrc/cpu/row_ids.cpp; Python API,
// fake kernel and the vectorized torch path: recxla/ops/row_ids.py; the plain-Python
// reference: recxla/reference/row_ids.py). A host op by design, as route_ids: ids are routed
// and encoded on the CPU whatever device holds the tables.
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(recxla, m) {
  // group, slot, sample, ids int64 [P]: per routed id (input order) its global row group, input
  // slot, sample (micro-batch order) and row local to the owner; weights float32 [P] or None.
  // slot_position: per input slot its feature's position among its table's features;
  // group_features: per row group its table's feature count; micro: the micro-batch sizes
  // (sum: batch).
  // -> (order int64 [P]: the input index of each id in (group, micro-batch, position, sample)
  //     order, stable; unique int64 [U]: each (group, micro-batch) run's distinct ids,
  //     ascending, runs in order; counts int64 [groups, micro]: distinct ids per run;
  //     bounds int64 [groups * micro + 1]: the runs' bounds in that order; inverse int64 [P]:
  //     each ordered id's index into its run's distinct ids; plan int64: per micro-batch k its
  //     message bags (unique values [U_k], unique offsets [groups + 1], inverse [P_k], bag
  //     offsets [features * B_k + 1]); message_weights float32 [P] (the plan's inverse order)
  //     or [0]).
  m.def(
      "encode_row_ids(Tensor group, Tensor slot, Tensor sample, Tensor ids, Tensor? weights, "
      "int[] slot_position, int[] group_features, int[] micro) -> (Tensor, Tensor, Tensor, "
      "Tensor, Tensor, Tensor, Tensor)");
}

// Schema of the receiver's plan for expanded rows (the sequence module), made by the sender
// with the encoding (kernel: csrc/cpu/expand_rows.cpp; Python API, fake kernel and the torch
// path: recxla/ops/row_ids.py; reference: recxla/reference/row_ids.py). A host op, as
// encode_row_ids.
TORCH_LIBRARY_FRAGMENT(recxla, m) {
  // order, inverse, counts, bounds: encode_row_ids' results; slot, sample int64 [P]: as given to
  // encode_row_ids (input order: slot by slot, id by id, each id's routes_per_slot[slot] routes
  // one after another); input_lengths int32/int64 [slots, batch]: the batch's bag lengths
  // (samples in micro-batch order); micro: the micro-batch sizes; group_chunks, group_first_chunk:
  // per row group the wire rows of one of its rows and the first chunk of the output row it
  // fills; chunks_per_row: wire rows per output row.
  // -> int64: per micro-batch k, the lookup that expands its message's wire rows [W_k] to its
  //    output's chunks [C_k] (one bag of one wire row per chunk): unique values [W_k]
  //    (0 .. W_k - 1), unique offsets [2] (0, W_k), index [C_k] (each chunk's wire row), bag
  //    offsets [C_k + 1] (0 .. C_k). Output chunks: input slot by slot, sample by sample, in bag
  //    order, chunks_per_row per id.
  m.def(
      "expand_row_plan(Tensor order, Tensor inverse, Tensor counts, Tensor bounds, Tensor slot, "
      "Tensor sample, Tensor input_lengths, int[] routes_per_slot, int[] micro, "
      "int[] group_chunks, int[] group_first_chunk, int chunks_per_row) -> Tensor");
}
