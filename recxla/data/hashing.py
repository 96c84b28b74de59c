"""Counter-based randomness for the synthetic data: pure functions of integer tensors.

The synthetic world (which attributes a user has, which items are in their history, the hidden
weight of every key) is a function of ids, not a stored table: a Criteo-sized world has 10M users
and 7M items, and a table per (user, feature) would not fit a small machine. Hashing ids on the
fly costs a few integer operations per value, vectorizes, gives the same answer in every batch
and every worker, and needs no memory.

All functions take and return torch tensors (any device). int64 arithmetic wraps modulo 2**64
in torch, which is what a 64-bit hash relies on; right shifts of int64 are arithmetic, so the
logical shift the hash needs is spelled out with a mask.
"""

import math

import numpy as np
import torch


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= (1 << 63) else c


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)
# A prime above every table size: (A * rank + b) mod C is then a bijection of [0, C).
SCRAMBLE_MULTIPLIER = 2654435761


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer: int64 -> int64, a bijection with full avalanche.

    Bit-identical to the usual unsigned 64-bit C code (tests check it against Python ints).
    """
    z = x.to(torch.int64) + _GOLDEN
    z = (z ^ _srl(z, 30)) * _MUL1
    z = (z ^ _srl(z, 27)) * _MUL2
    return z ^ _srl(z, 31)


def splitmix64_numpy(x: np.ndarray) -> np.ndarray:
    """`splitmix64` of int64/uint64 numpy ids: uint64 [n], the same bits, computed in place on
    one copy (the data converter hashes millions of ids per block; torch's out-of-place ops
    allocate an array per step)."""
    z = np.array(x, dtype=np.int64).view(np.uint64)
    z += np.uint64(_GOLDEN & ((1 << 64) - 1))
    z ^= z >> np.uint64(30)
    z *= np.uint64(_MUL1 & ((1 << 64) - 1))
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MUL2 & ((1 << 64) - 1))
    z ^= z >> np.uint64(31)
    return z


def mix(x: torch.Tensor, *salts: int) -> torch.Tensor:
    """Hash of `x` under a sequence of integer salts (seed, feature, slot...): int64 tensor."""
    h = splitmix64(x)
    for s in salts:
        h = splitmix64(h ^ _signed(s & ((1 << 64) - 1)))
    return h


def mix_scalar(*values: int) -> int:
    """`mix` for plain ints (a seed for torch.Generator): a non-negative int below 2**63."""
    h = mix(torch.tensor([values[0]], dtype=torch.int64), *values[1:])
    return int(h.item()) & ((1 << 63) - 1)


def uniform(h: torch.Tensor) -> torch.Tensor:
    """Hash bits -> float64 in [0, 1), 53 random bits each."""
    return _srl(h, 11).to(torch.float64) * (2.0**-53)


def centered(h: torch.Tensor) -> torch.Tensor:
    """Hash bits -> float64 uniform in [-sqrt(3), sqrt(3)): mean 0, variance 1."""
    return (uniform(h) * 2.0 - 1.0) * math.sqrt(3.0)


def normal(h1: torch.Tensor, h2: torch.Tensor) -> torch.Tensor:
    """Two hashes -> one standard normal float64 (Box-Muller)."""
    radius = torch.sqrt(-2.0 * torch.log1p(-uniform(h1)))  # 1 - u is in (0, 1]: log is finite
    return radius * torch.cos(2.0 * math.pi * uniform(h2))


def zipf_ranks(u: torch.Tensor, n, exponent: float) -> torch.Tensor:
    """Map uniforms to Zipf-distributed ranks: P(rank = k) ~ (k + 1) ** -exponent, k in [0, n).

    Args:
        u: float64 uniforms in [0, 1), any shape.
        n: number of ranks (>= 1): an int, or an int64 tensor broadcastable with u (one
            population per column, say).
        exponent: Zipf exponent s >= 0; 0 gives the uniform distribution.
    Returns:
        int64 ranks of the broadcast shape. Rank 0 is the most popular.

    Inverse-CDF sampling of the continuous power law x ** -s on [0.5, n + 0.5), rounded to the
    nearest integer: the mass of rank k is the integral over [k + 0.5, k + 1.5), within a few
    percent of the discrete Zipf law (exact in the tail), and one pow per draw, with no table of
    n probabilities (n is 10M for a user id).
    """
    n = torch.as_tensor(n, dtype=torch.int64, device=u.device)
    a, b = 0.5, n.to(torch.float64) + 0.5
    if exponent == 0.0:
        x = a + u * (b - a)
    elif abs(exponent - 1.0) < 1e-9:
        x = a * torch.exp(u * torch.log(b / a))
    else:
        p = 1.0 - exponent
        lo, hi = a**p, torch.pow(b, p)
        x = torch.pow(lo + u * (hi - lo), 1.0 / p)
    # x >= 0.5: adding 0.5 and truncating rounds half up, cheaper than torch.round.
    ranks = (x + 0.5).to(torch.int64) - 1
    return torch.minimum(ranks.clamp_(min=0), n - 1)


def scramble(rank: torch.Tensor, size, salt) -> torch.Tensor:
    """Spread ranks over table rows: (A * rank + b) mod size, int64 in [0, size).

    `size` and `salt` are ints, or int64 tensors broadcastable with `rank` (one per column).
    A bijection of [0, size) for ranks below size (A is a prime larger than any table), so the
    popular ranks land on scattered rows, as hashed ids do, instead of rows 0, 1, 2, ... Ranks
    above `size` (a capped table) wrap around, like the hashing trick.
    """
    size = torch.as_tensor(size, dtype=torch.int64, device=rank.device)
    salt = torch.as_tensor(salt, dtype=torch.int64, device=rank.device)
    offset = torch.remainder(salt & ((1 << 62) - 1), size)
    return torch.remainder(rank * SCRAMBLE_MULTIPLIER + offset, size)
