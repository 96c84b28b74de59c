// Sort-based dedup on CPU (included by csrc/cpu/dedup.cpp): LSD radix sort of packed words,
// numbering runs of equal keys, and the partitioned sort that splits one big segment over all
// threads.
//
// Every method sorts 64-bit words that hold (key - min) above a small number (a key's position,
// or its first-seen number), so one array is sorted and the number rides along. The key bits
// start at `pos_bits`; the caller checks that key_bits + pos_bits <= 64.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "recxla/dedup.h"

namespace recxla {
namespace dedup_cpu {

// Sorts a[0:n) on bits [lo_bit, hi_bit) (bits above hi_bit are zero); LSD with equal digits of
// at most 11 bits; a digit every key shares is skipped. Returns the buffer holding the result.
inline uint64_t* radix_sort(
    uint64_t* a, uint64_t* tmp, int64_t n, int lo_bit, int hi_bit, std::vector<uint32_t>& hist) {
  const int bits = hi_bit - lo_bit;
  if (bits <= 0 || n < 2) return a;
  const int passes = (bits + 10) / 11;
  const int digit = (bits + passes - 1) / passes;
  const int64_t buckets = int64_t{1} << digit;
  const uint64_t mask = static_cast<uint64_t>(buckets - 1);
  hist.assign(static_cast<size_t>(passes * buckets), 0);
  for (int64_t i = 0; i < n; ++i) {
    for (int p = 0; p < passes; ++p) ++hist[p * buckets + ((a[i] >> (lo_bit + p * digit)) & mask)];
  }
  for (int p = 0; p < passes; ++p) {
    uint32_t* h = hist.data() + p * buckets;
    const int shift = lo_bit + p * digit;
    if (h[(a[0] >> shift) & mask] == static_cast<uint32_t>(n)) continue;
    uint32_t sum = 0;
    for (int64_t b = 0; b < buckets; ++b) sum += std::exchange(h[b], sum);
    for (int64_t i = 0; i < n; ++i) tmp[h[(a[i] >> shift) & mask]++] = a[i];
    std::swap(a, tmp);
  }
  return a;
}

// Distinct keys among sorted[0:n) (sorted on the key bits above pos_bits, n >= 1).
inline int64_t count_runs(const uint64_t* sorted, int64_t n, int pos_bits) {
  int64_t runs = 1;
  for (int64_t i = 1; i < n; ++i) runs += (sorted[i] >> pos_bits) != (sorted[i - 1] >> pos_bits);
  return runs;
}

// Numbers the runs of equal keys in sorted[0:n) from `first` on: each run's key goes to
// uniq[number] and every word's position p gets inv[p] = number. Returns first + runs.
template <typename key_t>
int64_t number_runs(
    const uint64_t* __restrict__ sorted, int64_t n, int pos_bits, uint64_t lo, int64_t first,
    key_t* __restrict__ uniq, int64_t* __restrict__ inv) {
  const uint64_t pos_mask = (uint64_t{1} << pos_bits) - 1;
  // No key equals the sentinel: callers sort segments of over 1024 keys, so pos_bits >= 11 and
  // key - min < 2^(64 - pos_bits).
  uint64_t prev = std::numeric_limits<uint64_t>::max();
  int64_t u = first - 1;
  for (int64_t r = 0; r < n; ++r) {
    const uint64_t k = sorted[r] >> pos_bits;
    u += k != prev;  // branch-free: uniq[u] is rewritten with the same key within a run
    prev = k;
    uniq[u] = dedup::from_ordered_bits<key_t>(lo + k);
    inv[sorted[r] & pos_mask] = u;
  }
  return u + 1;
}

// Keys per bucket of the partitioned sort: a bucket's two word arrays stay in L1/L2.
constexpr int64_t kBucketKeys = 4096;

// The partitioned sort's buffers, kept by the calling thread from call to call (a training loop
// dedups a batch of the same size every step; fresh arrays would cost first-touch page faults).
struct PartitionScratch {
  std::vector<uint64_t> packed, split;
  std::vector<int64_t> cursor, bucket_start, runs;
  std::vector<uint8_t> sorted_in_packed;
};

inline PartitionScratch& partition_scratch() {
  static thread_local PartitionScratch scratch;
  return scratch;
}

// Room for n elements (contents undefined); grows with headroom, so batches whose size varies a
// little from step to step do not reallocate every time.
template <typename T>
T* reserve_for(std::vector<T>& buffer, int64_t n) {
  if (buffer.size() < static_cast<size_t>(n)) buffer.resize(n + n / 8);
  return buffer.data();
}

// Dedups one big segment on `workers` threads: one parallel counting pass splits the packed
// words into 2^b buckets by their top key bits (bucket order is key order), then threads take
// buckets, radix sort each on the remaining key bits in cache, count its runs, and after a
// prefix sum over the buckets' counts number them into place. A whole-segment LSD sort would
// stream every pass through memory; here only the split does.
template <typename key_t>
int64_t dedup_partitioned(
    const key_t* __restrict__ v, int64_t n, uint64_t lo, int key_bits, int pos_bits,
    key_t* __restrict__ uniq, int64_t* __restrict__ inv, int64_t workers) {
  const int wanted = static_cast<int>(std::bit_width(static_cast<uint64_t>(n / kBucketKeys)));
  const int bucket_bits = std::clamp(wanted, 1, std::min(key_bits, 16));
  const int64_t buckets = int64_t{1} << bucket_bits;
  const int low_bits = key_bits - bucket_bits;
  const int digit_shift = pos_bits + low_bits;
  PartitionScratch& scratch = partition_scratch();
  uint64_t* packed = reserve_for(scratch.packed, n);
  uint64_t* split = reserve_for(scratch.split, n);
  const int64_t chunks = std::max<int64_t>(1, workers);
  auto chunk_begin = [&](int64_t c) { return n * c / chunks; };

  // Per-chunk bucket counts become per-chunk write cursors: a stable, race-free split.
  std::vector<int64_t>& cursor = scratch.cursor;
  cursor.assign(chunks * buckets, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* count = cursor.data() + c * buckets;
      const int64_t begin = chunk_begin(c), end = chunk_begin(c + 1);
      for (int64_t i = begin; i < end; ++i) {
        packed[i] = ((dedup::ordered_bits(v[i]) - lo) << pos_bits) | static_cast<uint64_t>(i);
        ++count[packed[i] >> digit_shift];
      }
    }
  });
  std::vector<int64_t>& bucket_start = scratch.bucket_start;
  bucket_start.resize(buckets + 1);
  int64_t total = 0;
  for (int64_t b = 0; b < buckets; ++b) {
    bucket_start[b] = total;
    for (int64_t c = 0; c < chunks; ++c) total += std::exchange(cursor[c * buckets + b], total);
  }
  bucket_start[buckets] = total;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* at = cursor.data() + c * buckets;
      const int64_t begin = chunk_begin(c), end = chunk_begin(c + 1);
      for (int64_t i = begin; i < end; ++i) {
        split[at[packed[i] >> digit_shift]++] = packed[i];
      }
    }
  });

  // Buckets differ in size (skewed keys crowd some), so threads take them one at a time.
  std::vector<int64_t>& runs = scratch.runs;
  runs.assign(buckets + 1, 0);
  std::vector<uint8_t>& sorted_in_packed = scratch.sorted_in_packed;
  sorted_in_packed.assign(buckets, 0);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, chunks, 1, [&](int64_t, int64_t) {
    std::vector<uint32_t> hist;
    for (int64_t b = next.fetch_add(1); b < buckets; b = next.fetch_add(1)) {
      const int64_t s = bucket_start[b], len = bucket_start[b + 1] - s;
      if (len == 0) continue;
      const uint64_t* sorted =
          radix_sort(split + s, packed + s, len, pos_bits, digit_shift, hist);
      sorted_in_packed[b] = sorted != split + s;
      runs[b + 1] = count_runs(sorted, len, pos_bits);
    }
  });
  for (int64_t b = 0; b < buckets; ++b) runs[b + 1] += runs[b];
  next = 0;
  at::parallel_for(0, chunks, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(1); b < buckets; b = next.fetch_add(1)) {
      const int64_t s = bucket_start[b], len = bucket_start[b + 1] - s;
      const uint64_t* sorted = (sorted_in_packed[b] ? packed : split) + s;
      number_runs(sorted, len, pos_bits, lo, runs[b], uniq, inv);
    }
  });
  return runs[buckets];
}

}  // namespace dedup_cpu
}  // namespace recxla
