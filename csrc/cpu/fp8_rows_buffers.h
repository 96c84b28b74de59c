// Reusable CPU buffers for the outputs of the row codec and the wire buffers of the quantized
// all-to-all: a loop that calls them with the same shapes allocates no new memory after its first
// call, with the default allocator.
//
// Why: glibc gives large freed blocks back to the kernel (a block of 32 MiB or more always, and
// smaller ones when the heap top is trimmed), so an op that returns a fresh tensor of tens of MiB
// pays first-touch page faults on every call, about 3 us per 4 KiB page on these VMs: 25 ms for
// 32 MiB, twenty times the work of the codec itself.
//
// How: the pool keeps a reference to every storage it hands out. A storage whose only reference
// is the pool's (use_count() == 1) is idle: no tensor, view, autograd node or in-flight
// collective holds it, so nothing can read or write it any more, and it is handed out again for
// a request of the same size class (sizes round up to 2^k * {4, 5, 6, 7} / 4 bytes: a loop whose
// sizes vary a little from call to call, as deduplicated rows do, reuses the same storages). A
// storage that anything still references is never reused: an async all-to-all's buffers stay
// out of the pool until its handle lets them go. New buffers of
// 4 MiB or more are mapped 2 MiB-aligned with MADV_HUGEPAGE, so their first touch costs one fault
// per 2 MiB instead of one per 4 KiB (where the kernel has transparent huge pages in "madvise"
// mode, the default of most distributions).
//
// The pool holds at most RECXLA_CPU_BUFFER_POOL_MB MiB (default 1024; 0 turns pooling off);
// idle storages are freed least recently used first when a new one would not fit, and
// release_idle_buffers() frees them all. This is not specific to FP8 rows: any CPU op of recxla
// that returns large tensors in a loop can allocate them here.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace recxla {
namespace cpu {

// Buffers smaller than this come from at::empty: below glibc's initial mmap threshold
// (128 KiB) they live in its heap, whose top it trims only in large steps.
constexpr int64_t kMinPooledBytes = int64_t{128} << 10;

// An uninitialized contiguous CPU tensor of `sizes` and `dtype` (from the pool when it has
// kMinPooledBytes or more).
at::Tensor empty_reusable(at::IntArrayRef sizes, at::ScalarType dtype);

// Frees every pooled storage that nothing else references; returns the bytes freed.
int64_t release_idle_buffers();

// What the pool holds now: {bytes in use, bytes idle, storages in use, storages idle}.
std::vector<int64_t> buffer_pool_stats();

}  // namespace cpu
}  // namespace recxla
