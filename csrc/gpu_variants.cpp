// The GPU kernel variants of each op family, the winner each GPU architecture runs by default,
// and the process-wide override (declarations and contract: recxla/gpu_variants.h). Compiled in
// every build, so that a CPU-only install reports the same names.
#include "recxla/gpu_variants.h"

#include <torch/library.h>

#include <map>
#include <mutex>
#include <sstream>

namespace recxla {
namespace gpu_variants {

// Each family's variants; the first runs on an architecture with no measured winner. A family's
// CUDA file maps these indices to its kernels (csrc/cuda/<family>.cu; the cluster family's
// composite path is recxla/ops/cluster.py).
const std::map<std::string, std::vector<std::string>>& families() {
  static const std::map<std::string, std::vector<std::string>> table = {
      {"fp8_quantize", {"warp_per_row", "vector_warp_per_row", "vector_rows_per_warp"}},
      {"fp8_dequantize", {"warp_per_row", "vector_warp_per_row", "vector_rows_per_warp"}},
      {"dedup", {"segmented_sort", "packed_radix_sort"}},
      {"cluster", {"passes", "fused"}},
      {"embedding_update", {"warp_per_row", "batched_ids"}},
  };
  return table;
}

namespace {

struct Winner {
  const char* family;
  int capability;  // major * 10 + minor
  const char* variant;
  const char* evidence;  // where the measurement is written down
};

// The measured winners: one line per (family, architecture), added from the campaign's report
// (bench/results/gpu.md, `make gpu-campaign`). An architecture not listed runs each family's
// first variant.
constexpr Winner kWinners[] = {
    // H100 (sm_90), 2026-11-27: 21.6 / 24.4 / 26.1 us at 65536 x 128 fp32 (0.88x / 0.78x /
    // 0.73x a device copy's bandwidth), 20.6 us bf16; fastest on 3 of the 4 timed shapes.
    {"fp8_quantize", 90, "vector_rows_per_warp", "bench/results/gpu.md"},
    // H100: 20.8 / 20.9 / 29.1 us at 65536 x 128 fp32 (0.92x copy), fastest on every shape.
    {"fp8_dequantize", 90, "vector_rows_per_warp", "bench/results/gpu.md"},
    // H100: 170 / 195 us (uniform / Zipf, 262k keys) against 380 / 385 us, 2.9-3.2x torch.unique.
    {"dedup", 90, "packed_radix_sort", "bench/results/gpu.md"},
    // H100: 487 / 530 / 561 us at batch 8192, M = 2 / 4 / 8, against 6.8-8.4 ms.
    {"cluster", 90, "fused", "bench/results/gpu.md"},
};

std::mutex override_mutex;
std::map<std::string, int>& overrides() {
  static std::map<std::string, int> table;
  return table;
}

std::string join(const std::vector<std::string>& items) {
  std::ostringstream out;
  for (size_t i = 0; i < items.size(); ++i) out << (i ? ", " : "") << items[i];
  return out.str();
}

int index_of(const char* op, const std::string& family, const std::string& variant) {
  const auto& all = names(family);
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i] == variant) return static_cast<int>(i);
  }
  TORCH_CHECK_VALUE(
      false, op, ": family '", family, "' has no variant '", variant, "'; it has ", join(all));
  return -1;
}

}  // namespace

const std::vector<std::string>& names(const std::string& family) {
  const auto& table = families();
  const auto it = table.find(family);
  if (it == table.end()) {
    std::vector<std::string> known;
    for (const auto& [name, variants] : table) known.push_back(name);
    TORCH_CHECK_VALUE(
        false, "recxla::gpu_kernel_variants: unknown op family '", family, "'; the families are ",
        join(known));
  }
  return it->second;
}

int chosen(const std::string& family, int capability) {
  names(family);  // an unknown family is an error, never a silent default
  {
    const std::lock_guard<std::mutex> lock(override_mutex);
    const auto it = overrides().find(family);
    if (it != overrides().end()) return it->second;
  }
  for (const Winner& w : kWinners) {
    if (family == w.family && capability == w.capability) {
      return index_of("recxla::gpu_kernel_variant", family, w.variant);
    }
  }
  return 0;
}

void set_override(const std::string& family, const std::string& variant) {
  constexpr const char* op = "recxla::set_gpu_kernel_variant";
  names(family);
  const std::lock_guard<std::mutex> lock(override_mutex);
  if (variant.empty()) {
    overrides().erase(family);
  } else {
    overrides()[family] = index_of(op, family, variant);
  }
}

}  // namespace gpu_variants
}  // namespace recxla

TORCH_LIBRARY_FRAGMENT(recxla, m) {
  // The op families that have GPU kernel variants.
  m.def("gpu_kernel_families() -> str[]", []() {
    std::vector<std::string> out;
    for (const auto& [family, variants] : recxla::gpu_variants::families()) out.push_back(family);
    return out;
  });
  // The variants of an op family, the architectures' fallback first.
  m.def("gpu_kernel_variants(str family) -> str[]", [](c10::string_view family) {
    return recxla::gpu_variants::names(std::string(family));
  });
  // The variant a device of compute capability `capability` (major * 10 + minor) runs.
  m.def("gpu_kernel_variant(str family, int capability) -> str",
        [](c10::string_view family, int64_t capability) {
          const std::string f(family);
          return recxla::gpu_variants::names(f)[recxla::gpu_variants::chosen(
              f, static_cast<int>(capability))];
        });
  // Makes every device run `variant` of `family` in this process; "" restores the default.
  m.def("set_gpu_kernel_variant(str family, str variant) -> ()",
        [](c10::string_view family, c10::string_view variant) {
          recxla::gpu_variants::set_override(std::string(family), std::string(variant));
        });
}
