"""Placing shards on ranks so that the step's collectives, each waiting for its busiest rank,
take as little time as possible.

A shard is a vector of D loads (bytes in each all-to-all, lookup seconds, rows looked up); a
rank's load is the sum of its shards'. A step waits, in each resource, for the busiest rank,
so the cost of a placement is

    J  = sum over resources d of weight[d] x max over ranks of load[r, d]
    J2 = sum over resources d of max over ranks of load[r, d] / mean over ranks of load[:, d]

J first (weights turn loads into seconds), J2 to break ties: it evens out what J does not
price (rows looked up, ranks tied at a maximum). Two phases:
1. largest first (LPT): shards in decreasing normalized load, each to the rank where it raises
   (J, J2) least, among the ranks with room for its storage;
2. local search: move a shard of a rank that is the busiest in some resource to another rank,
   or swap it with a shard there, whenever that lowers (J, J2); stop when nothing does.
Pinned shards (row-wise blocks: TorchRec puts block i on rank i) are not moved. Shards of one
group (the column blocks of one table) go to different ranks where there are enough.
The planner calls this for every candidate split, so it works on small numpy arrays.
"""

from typing import Optional, Sequence

import numpy as np
import torch

_EPS = 1e-12


def place_shards(
    loads,
    world_size: int,
    fixed_ranks: Optional[Sequence[int]] = None,
    storage: Optional[Sequence[float]] = None,
    capacity: Optional[Sequence[float]] = None,
    max_rounds: Optional[int] = None,
    groups: Optional[Sequence[int]] = None,
    weights: Optional[Sequence[float]] = None,
) -> torch.Tensor:
    """Ranks for N shards.

    Args:
        loads: N x D floats (tensor, array or nested sequence), each shard's load per resource.
        world_size: R >= 1.
        fixed_ranks: N ints; >= 0 pins the shard to that rank, -1 lets it be placed.
        storage: N floats, bytes each shard needs; capacity: R floats, bytes per rank.
            A shard only goes where it fits.
        max_rounds: moves of the local search (default 4 N).
        groups: N ints; shards of one group (>= 0: the column blocks of one table) go to
            different ranks where there are enough (two blocks of a table on one rank would
            receive the same ids twice and look the same rows up twice); -1: no group.
        weights: D floats, the price of one unit of each resource (seconds per byte, say);
            default 1 / mean, every resource as important as its mean.
    Returns:
        int64 [N]: the rank of every shard.
    Raises:
        ValueError: bad shapes, or a shard that fits on no rank.
    """
    op = "recxla.planner.place_shards"
    load = np.array(loads.numpy() if isinstance(loads, torch.Tensor) else loads, dtype=np.float64)
    if load.ndim == 1:
        load = load[:, None]
    if load.ndim != 2:
        raise ValueError(f"{op}: loads must be N x D, got shape {load.shape}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"{op}: world_size must be an int >= 1, got {world_size!r}")
    n, dims = load.shape
    fixed = np.full(n, -1, np.int64) if fixed_ranks is None else np.array(fixed_ranks, np.int64)
    if fixed.shape != (n,) or (n and fixed.max() >= world_size):
        raise ValueError(f"{op}: fixed_ranks must be N ints below world_size={world_size}")
    need = np.zeros(n) if storage is None else np.array(storage, np.float64)
    room = np.full(world_size, np.inf) if capacity is None else np.array(capacity, np.float64)
    if need.shape != (n,) or room.shape != (world_size,):
        raise ValueError(f"{op}: storage must have N entries and capacity world_size entries")
    group = np.full(n, -1, np.int64) if groups is None else np.array(groups, np.int64)
    if group.shape != (n,):
        raise ValueError(f"{op}: groups must have N entries")
    mean = load.sum(0) / world_size
    inverse_mean = np.where(mean > 0, 1.0 / np.where(mean > 0, mean, 1.0), 0.0)
    price = inverse_mean if weights is None else np.array(weights, np.float64)
    if price.shape != (dims,) or (price < 0).any():
        raise ValueError(f"{op}: weights must be D floats >= 0")

    state = _State(load, need, room, group, world_size, price, inverse_mean)
    pinned = fixed >= 0
    for i in np.flatnonzero(pinned):
        state.shift(i, None, int(fixed[i]))
    free = np.flatnonzero(~pinned)
    for i in free[np.argsort(-(load[free] * inverse_mean).sum(1), kind="stable")]:
        state.place(i)
    for _ in range(4 * n if max_rounds is None else max_rounds):
        if not state.improve(pinned):
            break
    return torch.from_numpy(state.ranks)


class _State:
    """Ranks of the shards, running per-rank totals and free storage, and per rank the count
    of shards of each group (the last column counts shards of no group)."""

    def __init__(self, load, need, room, group, world_size, price, inverse_mean):
        self.load, self.need, self.room, self.group = load, need, room, group
        self.ranks = np.full(load.shape[0], -1, np.int64)
        self.total = np.zeros((world_size, load.shape[1]))
        self.members = np.zeros((world_size, int(group.max(initial=-1)) + 2), np.int64)
        self.price, self.norm = price, inverse_mean

    def shift(self, i, src, dst):
        g = self.group[i]
        if src is not None:
            self.total[src] -= self.load[i]
            self.room[src] += self.need[i]
            self.members[src, g] -= 1
        self.ranks[i] = dst
        self.total[dst] += self.load[i]
        self.room[dst] -= self.need[i]
        self.members[dst, g] += 1

    def _cost(self, peaks):
        """(J, J2) of per-resource maxima [..., D]."""
        return (peaks * self.price).sum(-1), (peaks * self.norm).sum(-1)

    def _others_peak(self, exclude):
        """Per resource, the max over ranks outside `exclude` ([K, E] rank indices): [K, D]."""
        order = np.argsort(-self.total, axis=0)[:3]  # top-3 ranks per resource, [3, D]
        values = np.take_along_axis(self.total, order, 0)
        peak = np.zeros((exclude.shape[0], self.total.shape[1]))
        done = np.zeros_like(peak, dtype=bool)
        for k in range(min(3, self.total.shape[0])):
            hit = (order[k][None, None, :] == exclude[:, :, None]).any(1)
            take = ~done & ~hit
            peak[take] = np.broadcast_to(values[k], peak.shape)[take]
            done |= take
        return peak  # zeros where every rank is excluded

    def crowded(self, i):
        """bool [R]: ranks that hold another shard of i's group."""
        if self.group[i] < 0:
            return np.zeros(self.total.shape[0], bool)
        count = self.members[:, self.group[i]].copy()
        if self.ranks[i] >= 0:
            count[self.ranks[i]] -= 1
        return count > 0

    def place(self, i):
        peak = self.total.max(0)
        j, j2 = self._cost(np.maximum(peak, self.total + self.load[i]))
        bad = self.room < self.need[i]
        if bad.all():
            raise ValueError(
                f"recxla.planner.place_shards: shard {i} needs {self.need[i]:.0f} bytes, more "
                f"than any rank has left (at most {self.room.max():.0f})")
        crowded = self.crowded(i) & ~bad
        if (~bad & ~crowded).any():
            bad |= crowded
        j[bad] = np.inf
        best = np.flatnonzero(j <= j[~bad].min() * (1 + _EPS) + _EPS)
        self.shift(i, None, int(best[np.argmin(j2[best])]))

    def improve(self, pinned) -> bool:
        """Apply the best move or swap of a shard on a busiest rank; False when none helps."""
        total, load, ranks = self.total, self.load, self.ranks
        now = self._cost(total.max(0))
        busiest = np.unique(total.argmax(0))
        movable = ~pinned
        others = np.flatnonzero(movable)
        best, best_key = None, (now[0] * (1 - 1e-9), now[1])
        for a in busiest:
            for i in np.flatnonzero((ranks == a) & movable):
                # Move i to every rank b.
                b = np.arange(total.shape[0])
                rest = self._others_peak(np.stack([np.full_like(b, a), b], 1))
                after = np.maximum(rest, np.maximum(total[a] - load[i], total + load[i]))
                j, j2 = self._cost(after)
                bad = (self.room < self.need[i]) | self.crowded(i)
                bad[a] = True
                j[bad] = np.inf
                best, best_key = self._pick(j, j2, best, best_key, lambda k: (i, None, int(k)))
                # Swap i with a shard s of another rank.
                cand = others[ranks[others] != a]
                if not cand.size:
                    continue
                q = ranks[cand]
                delta = load[i] - load[cand]
                rest = self._others_peak(np.stack([np.full_like(q, a), q], 1))
                after = np.maximum(rest, np.maximum(total[a] - delta, total[q] + delta))
                j, j2 = self._cost(after)
                fits = ((self.room[q] + self.need[cand] >= self.need[i])
                        & (self.room[a] + self.need[i] >= self.need[cand]))
                j[~fits | self._swap_crowds(i, cand, a, q)] = np.inf
                best, best_key = self._pick(j, j2, best, best_key,
                                            lambda k: (i, int(cand[k]), int(q[k])))
        if best is None:
            return False
        i, s, q = best
        a = int(ranks[i])
        self.shift(i, a, q)
        if s is not None:
            self.shift(s, q, a)
        return True

    @staticmethod
    def _pick(j, j2, best, best_key, describe):
        k = int(np.lexsort((j2, j))[0])
        key = (float(j[k]), float(j2[k]))
        better = key[0] < best_key[0] * (1 - 1e-9) or (
            key[0] <= best_key[0] * (1 + 1e-9) and key[1] < best_key[1] * (1 - 1e-9))
        if np.isfinite(key[0]) and better:
            return describe(k), key
        return best, best_key

    def _swap_crowds(self, i, cand, a, q):
        """bool [K]: swapping i (on a) with cand[k] (on q[k]) would put two shards of a group
        on one rank."""
        gi, gs = self.group[i], self.group[cand]
        same = gs == gi
        i_clash = np.zeros(cand.shape, bool)
        if gi >= 0:
            i_clash = (self.members[q, gi] - same) > 0
        s_clash = np.where(gs >= 0, self.members[a, np.maximum(gs, 0)] - (same & (gi >= 0)), 0) > 0
        return i_clash | s_clash
