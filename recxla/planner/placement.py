"""Placing shards on ranks so that every rank carries about the same load.

A shard is a vector of D loads (say bytes in each all-to-all and rows looked up); a rank's
load is the sum of its shards'. The goal is the smallest

    max over ranks r and resources d of  load[r, d] / mean over ranks of load[:, d]

so every resource comes out even where the shards allow it (1.0: each rank carries exactly the
mean of each). Two phases:
1. largest first (LPT): shards in decreasing total normalized load, each to the rank whose
   score after taking it is lowest, among the ranks with room for its storage;
2. local search: on the rank with the highest score, move one of its shards to another rank
   or swap it for a smaller one there, whenever that lowers the larger score of the two
   ranks; when nothing helps that rank (a shard heavier than the mean alone), try the next
   rank; stop when no move or swap helps any rank.
Pinned shards (row-wise blocks: TorchRec puts block i on rank i) are not moved.
The planner calls this for every candidate split, so it works on small numpy arrays.
"""

from typing import Optional, Sequence

import numpy as np
import torch


def place_shards(
    loads,
    world_size: int,
    fixed_ranks: Optional[Sequence[int]] = None,
    storage: Optional[Sequence[float]] = None,
    capacity: Optional[Sequence[float]] = None,
    max_rounds: Optional[int] = None,
    groups: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """Ranks for N shards.

    Args:
        loads: N x D floats (tensor, array or nested sequence), each shard's load per resource
            (any units: each resource is compared with its own mean).
        world_size: R >= 1.
        fixed_ranks: N ints; >= 0 pins the shard to that rank, -1 lets it be placed.
        storage: N floats, bytes each shard needs; capacity: R floats, bytes per rank.
            A shard only goes where it fits.
        max_rounds: moves of the local search (default 4 N).
        groups: N ints; shards of one group (>= 0: the column blocks of one table) go to
            different ranks where there are enough (two blocks of a table on one rank would
            receive the same ids twice and look the same rows up twice); -1: no group.
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
    n = load.shape[0]
    fixed = np.full(n, -1, np.int64) if fixed_ranks is None else np.array(fixed_ranks, np.int64)
    if fixed.shape != (n,) or (n and fixed.max() >= world_size):
        raise ValueError(f"{op}: fixed_ranks must be N ints below world_size={world_size}")
    need = np.zeros(n) if storage is None else np.array(storage, np.float64)
    room = np.full(world_size, np.inf) if capacity is None else np.array(capacity, np.float64)
    if need.shape != (n,) or room.shape != (world_size,):
        raise ValueError(f"{op}: storage must have N entries and capacity world_size entries")
    # Normalize each resource by its mean per rank (a resource nobody uses stays at 0).
    mean = load.sum(0) / world_size
    load = load / np.where(mean > 0, mean, 1.0)

    group = np.full(n, -1, np.int64) if groups is None else np.array(groups, np.int64)
    if group.shape != (n,):
        raise ValueError(f"{op}: groups must have N entries")
    members = np.zeros((world_size, int(group.max(initial=-1)) + 2), np.int64)  # last: none
    state = _State(fixed.copy(), load, need, np.zeros((world_size, load.shape[1])), room.copy(),
                   group, members)
    pinned = fixed >= 0
    for i in np.flatnonzero(pinned):
        state.shift(i, None, fixed[i])

    free = np.flatnonzero(~pinned)
    for i in free[np.argsort(-load[free].sum(1), kind="stable")]:
        score = (state.total + load[i]).max(1)
        score[state.room < need[i]] = np.inf
        crowded = state.crowded(i)
        if not np.isinf(score[~crowded]).all():
            score[crowded] = np.inf
        r = int(np.argmin(score))
        if not np.isfinite(score[r]):
            raise ValueError(
                f"{op}: shard {i} needs {need[i]:.0f} bytes, more than any rank has left "
                f"(at most {state.room.max():.0f})"
            )
        state.shift(i, None, r)

    for _ in range(4 * n if max_rounds is None else max_rounds):
        score = state.total.max(1)
        for top in np.argsort(-score, kind="stable"):
            if state.improve(int(top), pinned, float(score[top])):
                break
        else:
            break
    return torch.from_numpy(state.ranks)


class _State:
    """Ranks of the shards, the running per-rank totals and free storage, and how many shards
    of each group every rank holds (the last column counts shards of no group)."""

    def __init__(self, ranks, load, need, total, room, group, members):
        self.ranks, self.load, self.need, self.total, self.room = ranks, load, need, total, room
        self.group, self.members = group, members

    def crowded(self, i, without=None) -> np.ndarray:
        """bool [R]: ranks that already hold another shard of i's group (not `without`)."""
        if self.group[i] < 0:
            return np.zeros(self.members.shape[0], bool)
        count = self.members[:, self.group[i]].copy()
        count[self.ranks[i]] -= int(self.ranks[i] >= 0 and self.placed[i])
        if without is not None and self.group[without] == self.group[i]:
            count[self.ranks[without]] -= 1
        return count > 0

    @property
    def placed(self):
        return self.ranks >= 0

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

    def improve(self, top, pinned, worst) -> bool:
        """Apply the best move or swap of a shard of rank `top`; False when none lowers the
        worse score of the two ranks involved."""
        load, need, total, room, ranks = self.load, self.need, self.total, self.room, self.ranks
        movable = ~pinned
        mine = np.flatnonzero((ranks == top) & movable)
        others = np.flatnonzero((ranks != top) & movable)
        q_of = ranks[others]
        best_score, best = worst * (1.0 - 1e-9), None
        for i in mine:
            # Move i to any other rank.
            after = np.maximum((total + load[i]).max(1), (total[top] - load[i]).max())
            after[(room < need[i]) | self.crowded(i)] = np.inf
            after[top] = np.inf
            q = int(np.argmin(after))
            if after[q] < best_score:
                best_score, best = float(after[q]), (i, None, q)
            if not others.size:
                continue
            # Swap i with a shard j of another rank.
            delta = load[i] - load[others]
            pair = np.maximum((total[top] - delta).max(1), (total[q_of] + delta).max(1))
            fits = (room[q_of] + need[others] >= need[i]) & (room[top] + need[i] >= need[others])
            pair[~fits] = np.inf
            # No swap may put two shards of a group on one rank.
            crowded_i = self.crowded(i)
            same = self.group[others] == self.group[i]
            pair[crowded_i[q_of] & ~(same & (self.members[q_of, self.group[i]] == 1))] = np.inf
            gj = self.group[others]
            top_has = np.where(gj >= 0, self.members[top, np.maximum(gj, 0)], 0)
            top_has = top_has - (gj == self.group[i]) * (self.group[i] >= 0)
            pair[(gj >= 0) & (top_has > 0)] = np.inf
            j = int(np.argmin(pair))
            if pair[j] < best_score:
                best_score, best = float(pair[j]), (i, int(others[j]), int(q_of[j]))
        if best is None:
            return False
        i, j, q = best
        self.shift(i, top, q)
        if j is not None:
            self.shift(j, q, top)
        return True
