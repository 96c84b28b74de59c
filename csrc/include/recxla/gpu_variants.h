// GPU kernel variants: several kernels compute one op family's result bit for bit alike, and
// which is fastest depends on the GPU. The variants of each family and the one each GPU
// architecture runs by default (the winner measured on that architecture by the GPU campaign,
// `make gpu-campaign`, bench/results/gpu.md) are kept in one place, csrc/gpu_variants.cpp.
// A process may override the choice per family (the campaign does, to check and time each one):
// torch.ops.recxla.set_gpu_kernel_variant, recxla.ops.gpu_variants.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace recxla {
namespace gpu_variants {

// Every family and its variants.
const std::map<std::string, std::vector<std::string>>& families();

// The variants of `family`, the architectures' fallback first. Unknown family: a ValueError
// that names the known ones.
const std::vector<std::string>& names(const std::string& family);

// The index into names(family) that a device of compute capability `capability` (major * 10 +
// minor, e.g. 90 for sm_90) runs: the process's override, else the measured winner for that
// capability, else 0.
int chosen(const std::string& family, int capability);

// Overrides the choice of `family` in this process ("" restores the default). Unknown family
// or variant: a ValueError naming the known ones.
void set_override(const std::string& family, const std::string& variant);

}  // namespace gpu_variants
}  // namespace recxla
