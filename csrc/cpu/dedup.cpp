// Segmented key dedup on CPU: the distinct keys of each segment, ascending, and the inverse index.
//
// Segments are deduplicated one per thread; threads take them largest first from a shared
// counter (longest-processing-time order), so one big table does not end up last on a busy
// thread. Segments of 65536 keys or more run first, one at a time, each split over all threads
// when it is sorted (csrc/cpu/dedup_sort.h). Inside a segment one of three exact methods runs,
// picked from the data:
// - presence array: when the key range max - min is at most a few times the segment length
//   (small tables), one scan over the range yields the sorted uniques, no sort at all;
// - hash table: an open-addressing table numbers the distinct keys in first-seen order (with
//   skewed traffic most keys hit a few hot slots in cache), then only the U distinct keys are
//   sorted (LSD radix on key - min, packed above the number) and numbers become ranks. Sorting
//   U keys instead of N is what makes skewed segments cheap;
// - radix sort of all keys: when the first keys of a segment are mostly distinct, sorting all
//   (key, position) pairs and numbering the runs beats inserting nearly every key into a table;
//   big segments are first split into key-range buckets that sort in cache.
// A last pass adds each segment's global base to its inverse and copies its uniques out.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <limits>
#include <numeric>
#include <tuple>
#include <utility>
#include <vector>

#include "dedup_cpu.h"
#include "dedup_sort.h"
#include "recxla/dedup.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RECXLA_DEDUP_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define RECXLA_DEDUP_MULTIVERSION
#endif

namespace recxla {
namespace {

using dedup::from_ordered_bits;
using dedup::ordered_bits;
using dedup_cpu::number_runs;
using dedup_cpu::radix_sort;

constexpr uint32_t kEmpty = std::numeric_limits<uint32_t>::max();
// Below this many keys in all, threads cost more than they save.
constexpr int64_t kParallelMinKeys = 16384;
// Unique counts below this sort with std::sort: radix histograms would dominate.
constexpr int64_t kRadixMinKeys = 256;
// From this length a segment's two sort arrays (16 bytes a key) leave L2: it is split in
// buckets (csrc/cpu/dedup_sort.h) and over all threads.
constexpr int64_t kBigSegmentKeys = 65536;
// Distinct keys whose hash table (twice as many 16-byte slots) still fits in L2.
constexpr uint64_t kCachedDistinct = 32768;

template <typename key_t>
struct Slot {
  key_t key;
  uint32_t id;
};

// Per-thread buffers, reused from segment to segment.
template <typename key_t>
struct Scratch {
  std::vector<Slot<key_t>> table;
  std::vector<uint32_t> dense;
  std::vector<uint64_t> packed, packed_tmp;
  std::vector<uint32_t> histogram;
  std::vector<uint32_t> rank;
};

// Fibonacci hashing: the top bits of key * 2^64/phi spread consecutive and strided keys evenly.
inline uint64_t hash_slot(uint64_t bits, int shift) {
  return (bits * UINT64_C(0x9E3779B97F4A7C15)) >> shift;
}

// An entry of the presence array costs a fraction of a hash probe: up to about four entries per
// key the array is the cheaper method.
inline bool use_dense(uint64_t range, int64_t n) {
  return range < static_cast<uint64_t>(4 * n + 1024);
}

// The smallest and largest key (n >= 1): signed compares, which AVX2 / AVX-512 vectorize, and
// a plain function per key type so that each is compiled for those and picked at load time.
#define RECXLA_KEY_RANGE(key_t)                                                          \
  RECXLA_DEDUP_MULTIVERSION std::pair<key_t, key_t> key_range(const key_t* v, int64_t n) { \
    key_t lo = v[0], hi = v[0];                                                            \
    for (int64_t i = 1; i < n; ++i) {                                                      \
      lo = v[i] < lo ? v[i] : lo;                                                          \
      hi = v[i] > hi ? v[i] : hi;                                                          \
    }                                                                                      \
    return {lo, hi};                                                                       \
  }
RECXLA_KEY_RANGE(int32_t)
RECXLA_KEY_RANGE(int64_t)
#undef RECXLA_KEY_RANGE

template <typename key_t>
int64_t dedup_dense(
    const key_t* __restrict__ v, int64_t n, uint64_t lo, uint64_t range, key_t* __restrict__ uniq,
    int64_t* __restrict__ inv, Scratch<key_t>& scratch) {
  std::vector<uint32_t>& rank = scratch.dense;
  rank.assign(range + 1, 0);
  for (int64_t i = 0; i < n; ++i) rank[ordered_bits(v[i]) - lo] = 1;
  uint32_t u = 0;
  for (uint64_t r = 0; r <= range; ++r) {
    if (rank[r]) {
      uniq[u] = from_ordered_bits<key_t>(lo + r);
      rank[r] = u++;
    }
  }
  for (int64_t i = 0; i < n; ++i) inv[i] = rank[ordered_bits(v[i]) - lo];
  return u;
}

// Sorts uniq[0:u) (distinct keys, first-seen order) ascending and renumbers inv[0:n) from
// first-seen numbers to ranks.
template <typename key_t>
void sort_uniques(
    key_t* __restrict__ uniq, int64_t u, uint64_t lo, uint64_t range, int64_t* __restrict__ inv,
    int64_t n, Scratch<key_t>& scratch) {
  std::vector<uint32_t>& rank = scratch.rank;
  rank.resize(u);
  const int id_bits = std::bit_width(static_cast<uint64_t>(u - 1));
  const int key_bits = std::bit_width(range);
  if (id_bits + key_bits <= 64) {
    // (key - min) above the first-seen number: one array to sort, the number rides along.
    std::vector<uint64_t>& packed = scratch.packed;
    packed.resize(u);
    for (int64_t j = 0; j < u; ++j) {
      packed[j] = ((ordered_bits(uniq[j]) - lo) << id_bits) | static_cast<uint64_t>(j);
    }
    const uint64_t* sorted = packed.data();
    if (u < kRadixMinKeys) {
      std::sort(packed.begin(), packed.end());
    } else {
      scratch.packed_tmp.resize(u);
      sorted = radix_sort(
          packed.data(), scratch.packed_tmp.data(), u, id_bits, id_bits + key_bits,
          scratch.histogram);
    }
    const uint64_t id_mask = (uint64_t{1} << id_bits) - 1;
    for (int64_t r = 0; r < u; ++r) {
      rank[sorted[r] & id_mask] = static_cast<uint32_t>(r);
      uniq[r] = from_ordered_bits<key_t>(lo + (sorted[r] >> id_bits));
    }
  } else {
    // Keys spread over nearly all 64 bits (hashed ids): sort the numbers by key instead.
    std::vector<uint64_t>& keys = scratch.packed;
    keys.assign(uniq, uniq + u);
    std::vector<uint32_t>& order = scratch.histogram;
    order.resize(u);
    std::iota(order.begin(), order.end(), 0u);
    std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      return static_cast<key_t>(keys[a]) < static_cast<key_t>(keys[b]);
    });
    for (int64_t r = 0; r < u; ++r) {
      rank[order[r]] = static_cast<uint32_t>(r);
      uniq[r] = static_cast<key_t>(keys[order[r]]);
    }
  }
  for (int64_t i = 0; i < n; ++i) inv[i] = rank[inv[i]];
}

// Sorts all n keys, each packed above its position, and numbers the runs of equal keys. The
// faster method when nearly every key is distinct: hashing would insert almost every key.
template <typename key_t>
int64_t dedup_sorted(
    const key_t* __restrict__ v, int64_t n, uint64_t lo, int pos_bits, int key_bits,
    key_t* __restrict__ uniq, int64_t* __restrict__ inv, Scratch<key_t>& scratch) {
  std::vector<uint64_t>& packed = scratch.packed;
  packed.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    packed[i] = ((ordered_bits(v[i]) - lo) << pos_bits) | static_cast<uint64_t>(i);
  }
  scratch.packed_tmp.resize(n);
  const uint64_t* sorted = radix_sort(
      packed.data(), scratch.packed_tmp.data(), n, pos_bits, pos_bits + key_bits,
      scratch.histogram);
  return number_runs(sorted, n, pos_bits, lo, 0, uniq, inv);
}

template <typename key_t>
class HashTable {
 public:
  explicit HashTable(std::vector<Slot<key_t>>& slots) : slots_(slots) {}

  // Room for `keys` distinct keys at load <= 1/2 (linear probing stays short); rehashes the
  // `u` keys numbered so far (uniq[j] has number j).
  void reserve(uint64_t keys, const key_t* uniq, uint32_t u) {
    const int log_cap = std::max(4, static_cast<int>(std::bit_width(2 * keys - 1)));
    if (!slots_.empty() && (size_t{1} << log_cap) <= slots_.size()) return;
    slots_.assign(size_t{1} << log_cap, Slot<key_t>{key_t{0}, kEmpty});
    mask_ = slots_.size() - 1;
    shift_ = 64 - log_cap;
    for (uint32_t j = 0; j < u; ++j) {
      uint64_t h = hash_slot(static_cast<uint64_t>(uniq[j]), shift_);
      while (slots_[h].id != kEmpty) h = (h + 1) & mask_;
      slots_[h] = Slot<key_t>{uniq[j], j};
    }
  }

  // Numbers v[begin:end) in first-seen order, continuing from u: new keys are appended to uniq
  // and every key's number goes to inv. Returns the new count.
  uint32_t number(
      const key_t* __restrict__ v, int64_t begin, int64_t end, key_t* __restrict__ uniq,
      int64_t* __restrict__ inv, uint32_t u) {
    for (int64_t i = begin; i < end; ++i) {
      const key_t k = v[i];
      uint64_t h = hash_slot(static_cast<uint64_t>(k), shift_);
      for (;;) {
        const Slot<key_t> slot = slots_[h];
        if (slot.id == kEmpty) {
          slots_[h] = Slot<key_t>{k, u};
          uniq[u] = k;
          inv[i] = u++;
          if (2 * static_cast<uint64_t>(u) > slots_.size()) reserve(2 * u, uniq, u);
          break;
        }
        if (slot.key == k) {
          inv[i] = slot.id;
          break;
        }
        h = (h + 1) & mask_;
      }
    }
    return u;
  }

 private:
  std::vector<Slot<key_t>>& slots_;
  uint64_t mask_ = 0;
  int shift_ = 64;
};

// How many distinct keys a segment of n keys holds, judged from its first m keys, numbered in
// inv[0:m) (d distinct ones). Good-Turing: the share of keys seen once in the first m estimates
// how often a later key is new. Right for skewed keys, whose distinct count keeps growing with
// n; an overestimate for keys from a small set, which only makes the table roomier.
inline uint64_t expected_distinct(
    const int64_t* inv, int64_t m, uint32_t d, int64_t n, std::vector<uint32_t>& counts) {
  counts.assign(d, 0);
  for (int64_t i = 0; i < m; ++i) ++counts[inv[i]];
  int64_t seen_once = 0;
  for (uint32_t j = 0; j < d; ++j) seen_once += counts[j] == 1;
  const uint64_t later = static_cast<uint64_t>((n - m) * static_cast<double>(seen_once) / m);
  return std::min<uint64_t>(n, d + later + 1);
}

// Numbers the keys with a hash table, then sorts only the distinct ones. The first eighth of
// the segment (1024 to 16384 keys) is numbered first and decides the rest:
// - three quarters of it distinct: sorting all keys beats inserting nearly every one
//   (dedup_sorted; measured on 2^12 to 2^17 keys);
// - a big segment whose distinct keys would not fit a table in L2: the partitioned sort, which
//   also spreads the segment over the threads;
// - otherwise the table is sized for the distinct keys expected (growing a table as it fills
//   costs as much as the inserts themselves) and numbers the rest.
template <typename key_t>
int64_t dedup_hashed(
    const key_t* __restrict__ v, int64_t n, uint64_t lo, uint64_t range, key_t* __restrict__ uniq,
    int64_t* __restrict__ inv, Scratch<key_t>& scratch, int64_t workers) {
  const int64_t prefix = std::min<int64_t>(n, std::clamp<int64_t>(n / 8, 1024, 16384));
  HashTable<key_t> table(scratch.table);
  scratch.table.clear();
  table.reserve(static_cast<uint64_t>(prefix), uniq, 0);
  uint32_t u = table.number(v, 0, prefix, uniq, inv, 0);
  if (prefix < n) {
    const int pos_bits = std::bit_width(static_cast<uint64_t>(n - 1));
    const int key_bits = std::bit_width(range);
    const bool sortable = pos_bits + key_bits <= 64;
    if (sortable && 4 * static_cast<int64_t>(u) >= 3 * prefix) {
      return n >= kBigSegmentKeys
          ? dedup_cpu::dedup_partitioned(v, n, lo, key_bits, pos_bits, uniq, inv, workers)
          : dedup_sorted(v, n, lo, pos_bits, key_bits, uniq, inv, scratch);
    }
    const uint64_t expected = expected_distinct(inv, prefix, u, n, scratch.rank);
    if (sortable && n >= kBigSegmentKeys && expected > kCachedDistinct) {
      return dedup_cpu::dedup_partitioned(v, n, lo, key_bits, pos_bits, uniq, inv, workers);
    }
    table.reserve(expected, uniq, u);
    u = table.number(v, prefix, n, uniq, inv, u);
  }
  if (u > 1) sort_uniques(uniq, u, lo, range, inv, n, scratch);
  return u;
}

// Dedups one segment: distinct keys ascending into uniq, inv[i] = rank of v[i] among them.
template <typename key_t>
int64_t dedup_segment(
    const key_t* v, int64_t n, key_t* uniq, int64_t* inv, Scratch<key_t>& scratch,
    int64_t workers) {
  if (n == 0) return 0;
  const auto [min_key, max_key] = key_range(v, n);
  const uint64_t lo = ordered_bits(min_key);
  const uint64_t range = ordered_bits(max_key) - lo;
  if (use_dense(range, n)) return dedup_dense(v, n, lo, range, uniq, inv, scratch);
  return dedup_hashed(v, n, lo, range, uniq, inv, scratch, workers);
}

// Per-thread buffers live as long as the thread (at::parallel_for's pool keeps its threads):
// a training loop dedups a batch of the same shape every step, and fresh buffers would cost
// first-touch page faults every time.
template <typename key_t>
Scratch<key_t>& thread_scratch() {
  static thread_local Scratch<key_t> scratch;
  return scratch;
}

// Dedups every segment: segment s's uniques go, ascending, to stage[off[s]:off[s] + counts[s]]
// (there are never more of them than keys), and inv[i] = rank of v[i] within its segment.
// Returns counts [S].
template <typename key_t>
std::vector<int64_t> dedup_segments(
    const key_t* v, const int64_t* off, int64_t segments, int64_t n, key_t* stage,
    int64_t* inv) {
  std::vector<int64_t> counts(segments, 0);
  std::vector<int64_t> order;
  order.reserve(segments);
  for (int64_t s = 0; s < segments; ++s) {
    if (off[s + 1] > off[s]) order.push_back(s);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return off[a + 1] - off[a] > off[b + 1] - off[b];
  });
  const int64_t threads = n < kParallelMinKeys ? 1 : at::get_num_threads();
  // Big segments first, one at a time, each split over all threads (the pool below would give
  // one of them a single thread); the rest share the threads segment by segment.
  size_t first_small = 0;
  for (; first_small < order.size(); ++first_small) {
    const int64_t s = order[first_small], len = off[s + 1] - off[s];
    if (len < kBigSegmentKeys) break;
    counts[s] = dedup_segment(
        v + off[s], len, stage + off[s], inv + off[s], thread_scratch<key_t>(), threads);
  }
  const int64_t workers =
      std::min<int64_t>(threads, static_cast<int64_t>(order.size() - first_small));
  std::atomic<size_t> next{first_small};
  at::parallel_for(0, std::max<int64_t>(workers, 1), 1, [&](int64_t, int64_t) {
    Scratch<key_t>& scratch = thread_scratch<key_t>();
    for (size_t t = next.fetch_add(1); t < order.size(); t = next.fetch_add(1)) {
      const int64_t s = order[t];
      counts[s] = dedup_segment(
          v + off[s], off[s + 1] - off[s], stage + off[s], inv + off[s], scratch, 1);
    }
  });
  return counts;
}

// Segment bounds of the uniques (uo [S + 1]) from the counts, and each segment's global base
// added to its inverse entries.
void number_globally(
    const int64_t* off, int64_t segments, int64_t n, const std::vector<int64_t>& counts,
    int64_t* uo, int64_t* inv) {
  uo[0] = 0;
  for (int64_t s = 0; s < segments; ++s) uo[s + 1] = uo[s] + counts[s];
  const int64_t grain = n < kParallelMinKeys ? segments : 1;
  at::parallel_for(0, segments, grain, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t base = uo[s];
      int64_t* seg_inv = inv + off[s];
      const int64_t len = off[s + 1] - off[s];
      for (int64_t i = 0; i < len; ++i) seg_inv[i] += base;
    }
  });
}

// Dedups all segments into stage [N] (segment s's uniques end up at stage[uo[s]:uo[s + 1]]),
// inv [N] and uo [S + 1]. Returns U.
template <typename key_t>
int64_t dedup_all(
    const at::Tensor& values, const int64_t* off, int64_t segments, key_t* stage, int64_t* inv,
    int64_t* uo) {
  const int64_t n = values.numel();
  const std::vector<int64_t> counts =
      dedup_segments(values.const_data_ptr<key_t>(), off, segments, n, stage, inv);
  number_globally(off, segments, n, counts, uo, inv);
  // Segment s moves left from off[s] to uo[s] <= off[s]. In segment order a move never
  // overwrites a segment not yet moved, so they run one after another (U keys in all: little
  // next to the dedup itself).
  for (int64_t s = 0; s < segments; ++s) {
    if (uo[s] != off[s]) std::memmove(stage + uo[s], stage + off[s], counts[s] * sizeof(key_t));
  }
  return uo[segments];
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> segmented_unique_cpu(
    const at::Tensor& values_in, const at::Tensor& offsets_in) {
  constexpr const char* op = "recxla::segmented_unique";
  dedup::check_dedup_args(op, values_in, offsets_in);
  const at::Tensor offsets = offsets_in.contiguous();
  const int64_t count = offsets.numel();
  const int64_t n = values_in.numel();
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  dedup::check_dedup_offsets(op, off, count, n);
  const at::Tensor values = values_in.contiguous();
  at::Tensor inverse = at::empty({n}, values.options().dtype(at::kLong));
  at::Tensor unique_offsets = at::zeros({count}, offsets.options());
  if (n == 0) return {at::empty({0}, values.options()), unique_offsets, inverse};
  // Uniques are staged where their segment's keys sit, then copied out at their final size
  // (a result of N keys would hold memory for nothing once U is known).
  at::Tensor staging = at::empty({n}, values.options());
  at::Tensor unique_values;
  AT_DISPATCH_INDEX_TYPES(values.scalar_type(), "segmented_unique_cpu", [&] {
    const int64_t u = dedup_all<index_t>(values, off, count - 1, staging.data_ptr<index_t>(),
                                         inverse.data_ptr<int64_t>(),
                                         unique_offsets.data_ptr<int64_t>());
    unique_values = staging.narrow(0, 0, u).clone();
  });
  return {unique_values, unique_offsets, inverse};
}

// The same into caller-owned tensors, resized as torch's out= arguments are (a storage that is
// large enough is kept): a loop that passes the same buffers every step allocates nothing.
// unique_values is staged in place, so it is first resized to N, then to U. Returns U.
int64_t segmented_unique_out_cpu(
    const at::Tensor& values_in, const at::Tensor& offsets_in, at::Tensor& unique_values,
    at::Tensor& unique_offsets, at::Tensor& inverse) {
  constexpr const char* op = "recxla::segmented_unique_out";
  dedup::check_dedup_args(op, values_in, offsets_in);
  dedup::check_dedup_out(op, values_in, unique_values, unique_offsets, inverse);
  const at::Tensor offsets = offsets_in.contiguous();
  const int64_t count = offsets.numel();
  const int64_t n = values_in.numel();
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  dedup::check_dedup_offsets(op, off, count, n);
  const at::Tensor values = values_in.contiguous();
  inverse.resize_({n});
  unique_offsets.resize_({count});
  unique_values.resize_({n});
  if (n == 0) {
    unique_offsets.zero_();
    return 0;
  }
  int64_t u = 0;
  AT_DISPATCH_INDEX_TYPES(values.scalar_type(), "segmented_unique_out_cpu", [&] {
    index_t* stage = unique_values.data_ptr<index_t>();
    u = dedup_all<index_t>(values, off, count - 1, stage, inverse.data_ptr<int64_t>(),
                           unique_offsets.data_ptr<int64_t>());
  });
  unique_values.resize_({u});
  return u;
}

}  // namespace

std::vector<int64_t> dedup_cpu::dedup_int64_segments(const int64_t* keys, const int64_t* off,
                                                     int64_t segments, int64_t n,
                                                     int64_t* stage, int64_t* inv) {
  return dedup_segments<int64_t>(keys, off, segments, n, stage, inv);
}

TORCH_LIBRARY_IMPL(recxla, CPU, m) {
  m.impl("segmented_unique", &segmented_unique_cpu);
  m.impl("segmented_unique_out", &segmented_unique_out_cpu);
}

}  // namespace recxla
