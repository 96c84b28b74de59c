"""The key hash of sample clustering and the sizes of its sampled counting tables: the contract
that recxla.ops.cluster_steps (torch ops), triton_kernels/cluster.py (Triton) and
csrc/include/recxla/cluster.h (C++ and CUDA) share. A leaf, like recxla.formats: the kernels
import it, and it imports nothing of recxla, so kernels never import the ops that call them.
"""

# Features are scored on a hash sample of their keys of about this many values.
SAMPLE_VALUES = 8192
# Also in csrc/include/recxla/cluster.h.
HASH_SALT = 0x5EED_C1A5_D1CE_F00D
HASH_MULTIPLIER = 0x2545F4914F6CDD1D  # odd: multiplication by it is a bijection mod 2**64
MIX_MULTIPLIER = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as an int64, odd


def sample_bits(num_values: int) -> int:
    """log2 of the key sampling rate R of a feature with N values: R >= N / SAMPLE_VALUES."""
    return (max(num_values - 1, 0) // SAMPLE_VALUES).bit_length()


def table_bits(num_values: int) -> int:
    """log2 of a counting table for N values: the power of two in [N, 2N) (at least 2 slots)."""
    return max(1, (num_values - 1).bit_length())
