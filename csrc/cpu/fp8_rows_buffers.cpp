// The pool of reusable CPU buffers (see fp8_rows_buffers.h for why and how).
#include "fp8_rows_buffers.h"

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace recxla {
namespace cpu {
namespace {

constexpr int64_t kHugePage = int64_t{2} << 20;
// Mapped with huge pages from this size on; below it, rounding up to 2 MiB would waste too much.
constexpr int64_t kHugePageMinBytes = int64_t{4} << 20;
constexpr int64_t kDefaultPoolMiB = 1024;

int64_t pool_capacity_bytes() {
  static const int64_t capacity = [] {
    const char* env = std::getenv("RECXLA_CPU_BUFFER_POOL_MB");
    if (env == nullptr || *env == '\0') return kDefaultPoolMiB << 20;
    char* end = nullptr;
    const long long mib = std::strtoll(env, &end, 10);
    TORCH_CHECK_VALUE(
        end != env && *end == '\0' && mib >= 0,
        "recxla: RECXLA_CPU_BUFFER_POOL_MB must be an integer >= 0 (MiB; 0 turns the buffer pool "
        "off), got '", env, "'");
    return static_cast<int64_t>(mib) << 20;
  }();
  return capacity;
}

#if defined(__linux__) && defined(MADV_HUGEPAGE)
struct Mapping {
  void* base;
  size_t length;
};

void unmap(void* ctx) {
  auto* m = static_cast<Mapping*>(ctx);
  munmap(m->base, m->length);
  delete m;
}

// nbytes of fresh zero pages, 2 MiB-aligned and marked for transparent huge pages; an empty
// DataPtr when the mapping fails (the caller then falls back to the CPU allocator).
at::DataPtr map_huge(int64_t nbytes) {
  const size_t length = static_cast<size_t>((nbytes + kHugePage - 1) / kHugePage * kHugePage);
  const size_t padded = length + static_cast<size_t>(kHugePage);
  void* raw = mmap(nullptr, padded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return at::DataPtr(nullptr, at::Device(at::kCPU));
  // Keep the 2 MiB-aligned part; give back the head and tail around it.
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + kHugePage - 1) & ~static_cast<uintptr_t>(kHugePage - 1);
  if (aligned > start) munmap(raw, aligned - start);
  const uintptr_t end = start + padded, used_end = aligned + length;
  if (end > used_end) munmap(reinterpret_cast<void*>(used_end), end - used_end);
  void* data = reinterpret_cast<void*>(aligned);
  madvise(data, length, MADV_HUGEPAGE);  // a hint: without THP the pages are 4 KiB, still valid
  return at::DataPtr(data, new Mapping{data, length}, &unmap, at::Device(at::kCPU));
}
#else
at::DataPtr map_huge(int64_t) { return at::DataPtr(nullptr, at::Device(at::kCPU)); }
#endif

// A fresh storage of nbytes: huge-page backed when large; resizable through the CPU allocator
// like any storage (a resize copies into memory of the CPU allocator and unmaps this one).
c10::Storage new_storage(int64_t nbytes) {
  if (nbytes >= kHugePageMinBytes) {
    at::DataPtr data = map_huge(nbytes);
    if (data.get() != nullptr) {
      return c10::Storage(
          c10::Storage::use_byte_size_t(), static_cast<size_t>(nbytes), std::move(data),
          c10::GetCPUAllocator(), /*resizable=*/true);
    }
  }
  return c10::Storage(
      c10::Storage::use_byte_size_t(), static_cast<size_t>(nbytes), c10::GetCPUAllocator(),
      /*resizable=*/true);
}

// The bytes pooled for a request of nbytes: the next size class, 2^k * {4, 5, 6, 7} / 4 rounded
// up to whole pages. Requests of a training loop vary in size from step to step (deduplicated
// rows, per-rank counts); with exact sizes every new size would map a new buffer and the pool
// would fill with idle storages of sizes never asked for again. Classes cost at most 25% of
// unused tail, and sizes that differ by a few rows share a storage.
int64_t size_class(int64_t nbytes) {
  constexpr int64_t kPage = 4096;
  int64_t power = 1;
  while (power * 2 <= nbytes) power *= 2;
  int64_t bytes = power;
  for (int64_t quarter = 1; bytes < nbytes && quarter <= 4; ++quarter) {
    bytes = power + quarter * (power / 4);
  }
  return (bytes + kPage - 1) / kPage * kPage;
}

struct Entry {
  c10::Storage storage;
  int64_t nbytes;
  uint64_t last_use;
  bool idle() const { return storage.use_count() == 1; }
};

struct Pool {
  std::mutex mutex;
  std::vector<Entry> entries;
  int64_t total_bytes = 0;
  uint64_t clock = 0;

  // An idle storage of nbytes, a size class (the most recently used one: its pages are the
  // likeliest to be in cache), or an empty one.
  c10::Storage take(int64_t nbytes) {
    Entry* best = nullptr;
    for (Entry& e : entries) {
      if (e.nbytes == nbytes && e.storage.nbytes() == static_cast<size_t>(nbytes) && e.idle() &&
          (best == nullptr || e.last_use > best->last_use)) {
        best = &e;
      }
    }
    if (best == nullptr) return c10::Storage();
    best->last_use = ++clock;
    return best->storage;
  }

  // Frees idle storages, least recently used first, until `needed` more bytes fit (or all idle
  // ones when needed < 0). Returns the bytes freed.
  int64_t evict(int64_t needed) {
    std::vector<size_t> idle;
    for (size_t i = 0; i < entries.size(); ++i) {
      if (entries[i].idle()) idle.push_back(i);
    }
    std::sort(idle.begin(), idle.end(), [&](size_t a, size_t b) {
      return entries[a].last_use < entries[b].last_use;
    });
    std::vector<bool> drop(entries.size(), false);
    int64_t freed = 0;
    for (size_t i : idle) {
      if (needed >= 0 && total_bytes - freed + needed <= pool_capacity_bytes()) break;
      drop[i] = true;
      freed += entries[i].nbytes;
    }
    size_t kept = 0;
    for (size_t i = 0; i < entries.size(); ++i) {
      if (drop[i]) continue;
      if (kept != i) entries[kept] = std::move(entries[i]);
      ++kept;
    }
    entries.resize(kept);
    total_bytes -= freed;
    return freed;
  }
};

Pool& pool() {
  // Never destroyed: tensors may outlive static destructors at interpreter exit.
  static Pool* p = new Pool();
  return *p;
}

}  // namespace

at::Tensor empty_reusable(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  int64_t numel = 1;
  for (const int64_t s : sizes) {
    TORCH_CHECK_VALUE(s >= 0, "recxla::empty_reusable: sizes must be >= 0, got ", sizes);
    numel *= s;
  }
  const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t capacity = pool_capacity_bytes();
  if (nbytes < kMinPooledBytes || nbytes > capacity) return at::empty(sizes, options);

  const int64_t pooled_bytes = size_class(nbytes);
  if (pooled_bytes > capacity) return at::empty(sizes, options);
  Pool& p = pool();
  c10::Storage storage;
  {
    std::lock_guard<std::mutex> lock(p.mutex);
    storage = p.take(pooled_bytes);
    if (!storage) {
      storage = new_storage(pooled_bytes);
      p.evict(pooled_bytes);
      // When every pooled storage is in use and this one does not fit, it is not pooled: it is
      // freed like any tensor's memory once unused.
      if (p.total_bytes + pooled_bytes <= capacity) {
        p.entries.push_back(Entry{storage, pooled_bytes, ++p.clock});
        p.total_bytes += pooled_bytes;
      }
    }
  }
  at::Tensor out = at::empty({0}, options);
  out.set_(storage, /*storage_offset=*/0, sizes, c10::contiguous_strides(sizes));
  return out;
}

int64_t release_idle_buffers() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  return p.evict(-1);
}

std::vector<int64_t> buffer_pool_stats() {
  Pool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  std::vector<int64_t> stats(4, 0);
  for (const Entry& e : p.entries) {
    const bool idle = e.idle();
    stats[idle ? 1 : 0] += e.nbytes;
    stats[idle ? 3 : 2] += 1;
  }
  return stats;
}

namespace {

at::Tensor empty_reusable_op(at::IntArrayRef size, at::ScalarType dtype) {
  return empty_reusable(size, dtype);
}

}  // namespace

// No tensor argument to dispatch on: one kernel for every backend key (it allocates on CPU).
TORCH_LIBRARY_IMPL(recxla, CompositeExplicitAutograd, m) {
  m.impl("empty_reusable", &empty_reusable_op);
  m.impl("release_idle_buffers", &release_idle_buffers);
  m.impl("buffer_pool_stats", &buffer_pool_stats);
}

}  // namespace cpu
}  // namespace recxla
