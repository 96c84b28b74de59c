// The input dist's id blocks on CPU. The sender's pack writes every destination's sections
// into one buffer. The owner's decode runs two passes over the bags: the
// first checks each source's block (sections inside the buffer, lengths, the inverse index) and
// finds each (slot, micro-batch) segment of its ids; the second writes the ids, weights and bag
// bounds in the owner's order. It replaces a dozen torch calls per source block and a segment
// permutation. Semantics: recxla/reference/id_blocks.py, which the tests compare with.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace recxla {
namespace {

constexpr const char* kOp = "recxla::decode_id_blocks";
constexpr int64_t kFixedFields = 11;
enum Encoding : int64_t { kRaw = 0, kDedup16 = 1, kDedup32 = 2 };

using Decoded = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct Block {
  int64_t batch, num_ids, num_unique, encoding, num_row_ids;
  int64_t lengths_at, ids_at, index_at, weights_at, row_counts_at, row_ids_at;
  std::vector<int64_t> micro_start;  // num_micro + 1 sample bounds
  // Per (slot, micro-batch): the first id of the segment in this block's ids, and its size.
  std::vector<int64_t> segment_start, segment_size;
};

// A section of `count` elements of `width` bytes at byte `at` of the `bytes`-byte buffer.
void check_section(int64_t source, const char* name, int64_t at, int64_t count, int64_t width,
                   int64_t bytes) {
  TORCH_CHECK_VALUE(at >= 0 && count >= 0 && at % width == 0, kOp, ": source ", source, "'s ",
                    name, " section at byte ", at, " is not aligned to ", width, " bytes");
  TORCH_CHECK_VALUE(count <= (bytes - at) / width, kOp, ": source ", source, "'s ", name,
                    " section (", count, " x ", width, " bytes at byte ", at,
                    ") ends past the received ", bytes, " bytes");
}

// The block's ids [first, first + size), widened to int64 (through the inverse index when
// the block is deduplicated), into out.
template <typename id_t>
void copy_ids(const uint8_t* data, const Block& b, int64_t first, int64_t size, int64_t* out) {
  const id_t* ids = reinterpret_cast<const id_t*>(data + b.ids_at);
  if (b.encoding == kRaw) {
    for (int64_t i = 0; i < size; ++i) out[i] = static_cast<int64_t>(ids[first + i]);
  } else if (b.encoding == kDedup16) {
    const uint16_t* index = reinterpret_cast<const uint16_t*>(data + b.index_at) + first;
    for (int64_t i = 0; i < size; ++i) out[i] = static_cast<int64_t>(ids[index[i]]);
  } else {
    const int32_t* index = reinterpret_cast<const int32_t*>(data + b.index_at) + first;
    for (int64_t i = 0; i < size; ++i) out[i] = static_cast<int64_t>(ids[index[i]]);
  }
}

template <typename id_t>
Decoded decode(const at::Tensor& received, std::vector<Block>& blocks, int64_t num_slots,
               int64_t num_micro, int64_t row_groups, bool weighted) {
  const uint8_t* data = received.const_data_ptr<uint8_t>();
  const int64_t bytes = received.numel();
  const int64_t world = static_cast<int64_t>(blocks.size());
  int64_t total_ids = 0, total_batch = 0, total_rows = 0;
  for (int64_t s = 0; s < world; ++s) {
    Block& b = blocks[s];
    TORCH_CHECK_VALUE(b.encoding == kRaw || b.encoding == kDedup16 || b.encoding == kDedup32,
                      kOp, ": source ", s, "'s encoding must be 0, 1 or 2, got ", b.encoding);
    check_section(s, "lengths", b.lengths_at, num_slots * b.batch, 4, bytes);
    const int64_t stored_ids = b.encoding == kRaw ? b.num_ids : b.num_unique;
    check_section(s, "ids", b.ids_at, stored_ids, sizeof(id_t), bytes);
    if (b.encoding != kRaw) {
      check_section(s, "inverse index", b.index_at, b.num_ids, b.encoding == kDedup16 ? 2 : 4,
                    bytes);
    }
    if (weighted) check_section(s, "weights", b.weights_at, b.num_ids, 4, bytes);
    check_section(s, "row counts", b.row_counts_at, row_groups * num_micro, 4, bytes);
    check_section(s, "row ids", b.row_ids_at, b.num_row_ids, sizeof(id_t), bytes);
    // Pass 1: the segments of each (slot, micro-batch), every length checked.
    const int32_t* lengths = reinterpret_cast<const int32_t*>(data + b.lengths_at);
    b.segment_start.assign(num_slots * num_micro, 0);
    b.segment_size.assign(num_slots * num_micro, 0);
    int64_t at = 0;
    for (int64_t j = 0; j < num_slots; ++j) {
      for (int64_t k = 0; k < num_micro; ++k) {
        b.segment_start[j * num_micro + k] = at;
        for (int64_t i = b.micro_start[k]; i < b.micro_start[k + 1]; ++i) {
          const int64_t len = lengths[j * b.batch + i];
          TORCH_CHECK_VALUE(len >= 0, kOp, ": source ", s, "'s bag (slot ", j, ", sample ", i,
                            ") has a negative length (", len, ")");
          at += len;
        }
        b.segment_size[j * num_micro + k] = at - b.segment_start[j * num_micro + k];
      }
    }
    TORCH_CHECK_VALUE(at == b.num_ids, kOp, ": source ", s, "'s lengths sum to ", at,
                      ", but its block holds ", b.num_ids, " ids");
    if (b.encoding != kRaw) {
      for (int64_t i = 0; i < b.num_ids; ++i) {
        const int64_t k = b.encoding == kDedup16
            ? static_cast<int64_t>(reinterpret_cast<const uint16_t*>(data + b.index_at)[i])
            : static_cast<int64_t>(reinterpret_cast<const int32_t*>(data + b.index_at)[i]);
        TORCH_CHECK_VALUE(k >= 0 && k < b.num_unique, kOp, ": source ", s, "'s inverse index [",
                          i, "] = ", k, " is outside its ", b.num_unique, " unique ids");
      }
    }
    const int32_t* row_counts = reinterpret_cast<const int32_t*>(data + b.row_counts_at);
    int64_t rows = 0;
    for (int64_t r = 0; r < row_groups * num_micro; ++r) {
      TORCH_CHECK_VALUE(row_counts[r] >= 0, kOp, ": source ", s, "'s row count [", r,
                        "] is negative (", row_counts[r], ")");
      rows += row_counts[r];
    }
    TORCH_CHECK_VALUE(rows == b.num_row_ids, kOp, ": source ", s, "'s row counts sum to ", rows,
                      ", but its block holds ", b.num_row_ids, " row ids");
    total_ids += b.num_ids;
    total_batch += b.batch;
    total_rows += b.num_row_ids;
  }
  auto i64 = at::TensorOptions().dtype(at::kLong);
  at::Tensor values = at::empty({total_ids}, i64);
  at::Tensor weights = at::empty({weighted ? total_ids : 0}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor offsets = at::empty({num_slots * total_batch + 1}, i64);
  at::Tensor row_ids = at::empty({total_rows}, i64);
  at::Tensor row_counts = at::empty({row_groups, num_micro, world}, i64);
  int64_t* out = values.data_ptr<int64_t>();
  float* out_weights = weighted ? weights.data_ptr<float>() : nullptr;
  int64_t* bounds = offsets.data_ptr<int64_t>();
  // Pass 2: ids and bags in (slot, micro-batch, source) order.
  int64_t n = 0, bag = 0;
  bounds[0] = 0;
  for (int64_t j = 0; j < num_slots; ++j) {
    for (int64_t k = 0; k < num_micro; ++k) {
      for (int64_t s = 0; s < world; ++s) {
        const Block& b = blocks[s];
        const int64_t first = b.segment_start[j * num_micro + k];
        const int64_t size = b.segment_size[j * num_micro + k];
        copy_ids<id_t>(data, b, first, size, out + n);
        if (weighted) {
          std::memcpy(out_weights + n, data + b.weights_at + first * 4, size * 4);
        }
        n += size;
        const int32_t* lengths = reinterpret_cast<const int32_t*>(data + b.lengths_at);
        for (int64_t i = b.micro_start[k]; i < b.micro_start[k + 1]; ++i, ++bag) {
          bounds[bag + 1] = bounds[bag] + lengths[j * b.batch + i];
        }
      }
    }
  }
  // Row ids: each source's (group, micro-batch) runs, in (group, micro-batch, source) order.
  int64_t* rows_out = row_ids.data_ptr<int64_t>();
  int64_t* counts = row_counts.data_ptr<int64_t>();
  std::vector<int64_t> run_start(world, 0);
  int64_t r = 0;
  for (int64_t g = 0; g < row_groups; ++g) {
    for (int64_t k = 0; k < num_micro; ++k) {
      for (int64_t s = 0; s < world; ++s) {
        const Block& b = blocks[s];
        const int32_t* sizes = reinterpret_cast<const int32_t*>(data + b.row_counts_at);
        const id_t* ids = reinterpret_cast<const id_t*>(data + b.row_ids_at);
        const int64_t size = sizes[g * num_micro + k];
        for (int64_t i = 0; i < size; ++i) {
          rows_out[r + i] = static_cast<int64_t>(ids[run_start[s] + i]);
        }
        run_start[s] += size;
        r += size;
        counts[(g * num_micro + k) * world + s] = size;
      }
    }
  }
  return {values, weights, offsets, row_ids, row_counts};
}

Decoded decode_id_blocks_cpu(const at::Tensor& received, at::IntArrayRef blocks_arg,
                             int64_t num_slots, int64_t num_micro, int64_t row_groups,
                             int64_t id_bytes, bool weighted) {
  TORCH_CHECK_TYPE(received.scalar_type() == at::kByte, kOp, ": received must be uint8, got ",
                   received.scalar_type());
  TORCH_CHECK_VALUE(received.dim() == 1 && received.is_contiguous(), kOp,
                    ": received must be 1-D and contiguous");
  TORCH_CHECK_VALUE(id_bytes == 4 || id_bytes == 8, kOp, ": id_bytes must be 4 or 8, got ",
                    id_bytes);
  TORCH_CHECK_VALUE(num_slots >= 0 && row_groups >= 0 && num_micro >= 1, kOp,
                    ": num_slots and row_groups must be >= 0 and num_micro >= 1, got ",
                    num_slots, ", ", row_groups, ", ", num_micro);
  const int64_t per_block = kFixedFields + num_micro;
  TORCH_CHECK_VALUE(static_cast<int64_t>(blocks_arg.size()) % per_block == 0, kOp,
                    ": blocks must hold ", per_block, " ints per source, got ",
                    blocks_arg.size());
  const int64_t world = static_cast<int64_t>(blocks_arg.size()) / per_block;
  std::vector<Block> blocks(world);
  for (int64_t s = 0; s < world; ++s) {
    const int64_t* f = blocks_arg.data() + s * per_block;
    Block& b = blocks[s];
    b.batch = f[0];
    b.num_ids = f[1];
    b.num_unique = f[2];
    b.encoding = f[3];
    b.num_row_ids = f[4];
    b.lengths_at = f[5];
    b.ids_at = f[6];
    b.index_at = f[7];
    b.weights_at = f[8];
    b.row_counts_at = f[9];
    b.row_ids_at = f[10];
    TORCH_CHECK_VALUE(b.batch >= 0 && b.num_ids >= 0 && b.num_unique >= 0 &&
                          b.num_row_ids >= 0, kOp, ": source ", s,
                      " has a negative batch, id, unique id or row id count");
    b.micro_start.assign(num_micro + 1, 0);
    for (int64_t k = 0; k < num_micro; ++k) {
      TORCH_CHECK_VALUE(f[kFixedFields + k] >= 0, kOp, ": source ", s, "'s micro-batch ", k,
                        " has a negative size");
      b.micro_start[k + 1] = b.micro_start[k] + f[kFixedFields + k];
    }
    TORCH_CHECK_VALUE(b.micro_start[num_micro] == b.batch, kOp, ": source ", s,
                      "'s micro-batch sizes sum to ", b.micro_start[num_micro],
                      ", not its batch ", b.batch);
  }
  return id_bytes == 4 ? decode<int32_t>(received, blocks, num_slots, num_micro, row_groups,
                                         weighted)
                       : decode<int64_t>(received, blocks, num_slots, num_micro, row_groups,
                                         weighted);
}

constexpr const char* kPackOp = "recxla::pack_id_blocks";
constexpr int64_t kDestFields = 18;

void check_source(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, kPackOp, ": ", name, " must be ", dtype, ", got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.dim() == 1 && t.is_contiguous(), kPackOp, ": ",
                    name, " must be a contiguous 1-D CPU tensor");
}

void check_range(int64_t d, const char* name, int64_t first, int64_t last, int64_t size) {
  TORCH_CHECK_VALUE(0 <= first && first <= last && last <= size, kPackOp, ": destination ", d,
                    "'s ", name, " [", first, ", ", last, ") is outside [0, ", size, ")");
}

// The section of `count` elements of `width` bytes at byte `at`, inside the buffer and aligned.
uint8_t* section(uint8_t* out, int64_t total, int64_t d, const char* name, int64_t at,
                 int64_t count, int64_t width) {
  TORCH_CHECK_VALUE(at >= 0 && at % width == 0 && count <= (total - at) / width, kPackOp,
                    ": destination ", d, "'s ", name, " section (", count, " x ", width,
                    " bytes at byte ", at, ") is misaligned or ends past the ", total,
                    " bytes");
  return out + at;
}

// ids[first, last) as id_t, each checked to fit.
template <typename id_t>
void write_ids(const int64_t* ids, int64_t first, int64_t last, uint8_t* to, int64_t d,
               const char* name) {
  id_t* out = reinterpret_cast<id_t*>(to);
  for (int64_t i = first; i < last; ++i) {
    TORCH_CHECK_VALUE(ids[i] >= std::numeric_limits<id_t>::min() &&
                          ids[i] <= std::numeric_limits<id_t>::max(), kPackOp,
                      ": destination ", d, "'s ", name, " [", i, "] = ", ids[i],
                      " does not fit its ", sizeof(id_t), " wire bytes");
    out[i - first] = static_cast<id_t>(ids[i]);
  }
}

void write_id_section(const int64_t* ids, int64_t first, int64_t last, int64_t id_bytes,
                      uint8_t* to, int64_t d, const char* name) {
  if (id_bytes == 4) {
    write_ids<int32_t>(ids, first, last, to, d, name);
  } else {
    write_ids<int64_t>(ids, first, last, to, d, name);
  }
}

at::Tensor pack_id_blocks_cpu(const at::Tensor& slot_lengths, const at::Tensor& ids,
                              const at::Tensor& unique, const at::Tensor& inverse,
                              const std::optional<at::Tensor>& weights, const at::Tensor& row_ids,
                              at::IntArrayRef row_counts, at::IntArrayRef dests,
                              int64_t total_bytes) {
  check_source(slot_lengths, "slot_lengths", at::kInt);
  check_source(ids, "ids", at::kLong);
  check_source(unique, "unique", at::kLong);
  check_source(inverse, "inverse", at::kLong);
  check_source(row_ids, "row_ids", at::kLong);
  if (weights.has_value()) check_source(*weights, "weights", at::kFloat);
  TORCH_CHECK_VALUE(inverse.numel() == ids.numel(), kPackOp, ": inverse must have one entry per "
                    "id (", ids.numel(), "), got ", inverse.numel());
  TORCH_CHECK_VALUE(!weights.has_value() || weights->numel() == ids.numel(), kPackOp,
                    ": weights must have one entry per id (", ids.numel(), "), got ",
                    weights->numel());
  TORCH_CHECK_VALUE(static_cast<int64_t>(dests.size()) % kDestFields == 0, kPackOp,
                    ": dests must hold ", kDestFields, " ints per destination, got ",
                    dests.size());
  TORCH_CHECK_VALUE(total_bytes >= 0, kPackOp, ": total_bytes must be >= 0, got ", total_bytes);
  at::Tensor buffer = at::zeros({total_bytes}, at::TensorOptions().dtype(at::kByte));
  uint8_t* out = buffer.data_ptr<uint8_t>();
  const int32_t* lengths = slot_lengths.const_data_ptr<int32_t>();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const int64_t* uniq = unique.const_data_ptr<int64_t>();
  const int64_t* inv = inverse.const_data_ptr<int64_t>();
  const int64_t* rows = row_ids.const_data_ptr<int64_t>();
  const int64_t world = static_cast<int64_t>(dests.size()) / kDestFields;
  for (int64_t d = 0; d < world; ++d) {
    const int64_t* f = dests.data() + d * kDestFields;
    const int64_t lengths_first = f[0], lengths_count = f[1], id0 = f[2], id1 = f[3];
    const int64_t u0 = f[4], u1 = f[5], encoding = f[6], id_bytes = f[7];
    const int64_t runs0 = f[8], runs1 = f[9], r0 = f[10], r1 = f[11];
    const int64_t* at = f + 12;
    TORCH_CHECK_VALUE(id_bytes == 4 || id_bytes == 8, kPackOp, ": destination ", d,
                      "'s id bytes must be 4 or 8, got ", id_bytes);
    TORCH_CHECK_VALUE(encoding == kRaw || encoding == kDedup16 || encoding == kDedup32,
                      kPackOp, ": destination ", d, "'s encoding must be 0, 1 or 2, got ",
                      encoding);
    check_range(d, "lengths", lengths_first, lengths_first + lengths_count,
                slot_lengths.numel());
    check_range(d, "ids", id0, id1, ids.numel());
    check_range(d, "unique ids", u0, u1, unique.numel());
    check_range(d, "row runs", runs0, runs1, static_cast<int64_t>(row_counts.size()));
    check_range(d, "row ids", r0, r1, row_ids.numel());
    std::memcpy(section(out, total_bytes, d, "lengths", at[0], lengths_count, 4),
                lengths + lengths_first, lengths_count * 4);
    if (encoding == kRaw) {
      write_id_section(id, id0, id1, id_bytes,
                       section(out, total_bytes, d, "ids", at[1], id1 - id0, id_bytes), d,
                       "id");
    } else {
      write_id_section(uniq, u0, u1, id_bytes,
                       section(out, total_bytes, d, "ids", at[1], u1 - u0, id_bytes), d,
                       "unique id");
      const int64_t width = encoding == kDedup16 ? 2 : 4;
      uint8_t* index = section(out, total_bytes, d, "inverse index", at[2], id1 - id0, width);
      for (int64_t i = id0; i < id1; ++i) {
        const int64_t k = inv[i] - u0;
        TORCH_CHECK_VALUE(k >= 0 && k < u1 - u0 && (width == 4 || k <= 0xFFFF), kPackOp,
                          ": destination ", d, "'s inverse [", i, "] = ", inv[i],
                          " is outside its unique ids [", u0, ", ", u1, ")");
        if (width == 2) {
          reinterpret_cast<uint16_t*>(index)[i - id0] = static_cast<uint16_t>(k);
        } else {
          reinterpret_cast<int32_t*>(index)[i - id0] = static_cast<int32_t>(k);
        }
      }
    }
    if (weights.has_value()) {
      std::memcpy(section(out, total_bytes, d, "weights", at[3], id1 - id0, 4),
                  weights->const_data_ptr<float>() + id0, (id1 - id0) * 4);
    }
    int32_t* counts = reinterpret_cast<int32_t*>(
        section(out, total_bytes, d, "row counts", at[4], runs1 - runs0, 4));
    for (int64_t r = runs0; r < runs1; ++r) counts[r - runs0] = static_cast<int32_t>(row_counts[r]);
    write_id_section(rows, r0, r1, id_bytes,
                     section(out, total_bytes, d, "row ids", at[5], r1 - r0, id_bytes), d,
                     "row id");
  }
  return buffer;
}

}  // namespace

TORCH_LIBRARY_IMPL(recxla, CPU, m) {
  m.impl("pack_id_blocks", &pack_id_blocks_cpu);
  m.impl("decode_id_blocks", &decode_id_blocks_cpu);
}

}  // namespace recxla
