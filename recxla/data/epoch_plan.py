"""`EpochPlan`: which rows one rank reads in one epoch, in which order, cut into which batches.

Order. The row groups of all files, in file order or in a seeded random order that changes
every epoch, are dealt round-robin to the ranks (rank r takes groups r, r + W, ...). A rank's
groups, in that order, are cut into shuffle windows: consecutive groups, whole, holding at most
`shuffle_rows` rows (at least one group each). The rows of a window are read in a seeded random
order drawn from (seed, epoch, rank, window), and the windows one after another form the rank's
stream of rows, cut into batches of B. Without a shuffle (`shuffle=False`, or `shuffle_rows=0`)
each row group is a window of its own and its rows keep their stored order.

Why windows: `convert --sort-by auto` sorts every row group by an id (the user, mostly) because
that compresses best, so consecutive rows share a user; read in stored order, a batch of 1024
held 20 users where a random sample holds 620, and held-out AUC after 300 steps on 2 ranks was
0.0027 and 0.0062 lower (seeds 0, 1) than with the unsorted layout; read in windows, 0.0001 and
0.0000 (the synthetic Criteo-like log converted both ways). The sort stays on disk, with its
compression; the window undoes it at read time, and holds a bounded number of rows, so memory
is bounded whatever the dataset's size.

Tables read at train time with bucket joins (recxla.data.read_time) keep the row groups of one
bucket together in the epoch's order (buckets in a random order, row groups within each in a
random order): the rank's reader then loads each bucket of a feature table once per run of its
groups instead of once per group. Each bucket holds a hash-drawn share of the keys, and the
windows still shuffle rows across the groups they hold.

Every rank yields the same number of batches (the smallest any rank can fill), so no rank waits
in a collective for a batch that never comes. The rest of a rank's rows (with row groups of one
size: less than a group plus a batch) is left out of that epoch, the last rows of its stream;
which rows those are changes with the epoch's order. Within an epoch no row is read twice, and
every row is read once when every rank's share fills whole batches.
"""

from typing import List, Optional, Tuple

import numpy as np
import torch

from recxla.data import hashing

_TAG_EPOCH_ORDER = 0x0E90C4
_TAG_WINDOW_ORDER = 0x5A1D0E

# The default window: 131,072 rows, two of `convert`'s 65,536-row groups, sixteen of `write`'s
# 8,192-row ones. On the synthetic log (requests of 4-28 rows of one user, in source order) a
# batch of 1024 then holds 0.97x the distinct users of a random sample of the whole log; 0.81x
# with 32,768 rows, 0.46x with one 8,192-row group. The shuffle (one Arrow take a window) costs
# the reader about half its rate (bench/bench_data_pipeline.py). Decoded, that log takes about
# 870 bytes a row: a window holds about 110 MB, twice that while it is being shuffled.
SHUFFLE_ROWS = 131_072


class EpochPlan:
    """The rows one rank reads in one epoch, and how they cut into batches.

    Attributes:
        groups: indices into DatasetInfo.row_groups, in this rank's reading order.
        windows: those groups cut into shuffle windows (lists of row group indices).
        starts: int64 [len(windows) + 1], the first row of each window in the rank's stream,
            and the stream's length at the end.
        shuffled: whether rows are read in a random order within each window.
        num_batches: batches of batch_size every rank yields this epoch.
    """

    def __init__(self, info, batch_size: int, rank: int, world_size: int, seed: int,
                 shuffle: bool, epoch: int, shuffle_rows: int = SHUFFLE_ROWS):
        n = len(info.row_groups)
        if shuffle:
            g = torch.Generator().manual_seed(hashing.mix_scalar(seed, epoch, _TAG_EPOCH_ORDER))
            order = torch.randperm(n, generator=g).tolist()
            buckets = getattr(info, "bucket_of_group", None)
            if buckets is not None:
                order = _bucket_major(order, [buckets(i) for i in range(n)], g)
        else:
            order = list(range(n))
        rows = [[info.row_groups[i][2] for i in order[r::world_size]] for r in range(world_size)]
        self.epoch, self.batch_size = epoch, batch_size
        self.rank, self.seed = rank, seed
        self.groups: List[int] = order[rank::world_size]
        self.shuffled = bool(shuffle and shuffle_rows > 0)
        self.windows = _windows(self.groups, rows[rank], shuffle_rows if self.shuffled else 0)
        sizes = [sum(info.row_groups[i][2] for i in w) for w in self.windows]
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self.num_batches = min(sum(r) for r in rows) // batch_size

    def window_at(self, row: int) -> int:
        """Index (in self.windows) of the window holding row `row` of the rank's stream."""
        return int(np.searchsorted(self.starts, row, side="right")) - 1

    def runs(self, first: int = 0) -> List[Tuple[int, int, int]]:
        """(window, lo, hi): the stream rows [lo, hi) of each window that batches
        first <= k < num_batches hold, in stream order. A reader of one run reads one window,
        once; a batch that straddles two windows is cut into a piece from each (`pieces`)."""
        lo, end = first * self.batch_size, self.num_batches * self.batch_size
        out: List[Tuple[int, int, int]] = []
        if lo >= end:
            return out
        for j in range(self.window_at(lo), len(self.windows)):
            a, b = max(int(self.starts[j]), lo), min(int(self.starts[j + 1]), end)
            if a >= end:
                break
            if a < b:
                out.append((j, a, b))
        return out

    def order(self, window: int) -> Optional[np.ndarray]:
        """The reading order of a window's rows: int64 [rows of the window], a permutation of
        its row positions (groups concatenated in order); None when rows keep their order."""
        if not self.shuffled:
            return None
        n = int(self.starts[window + 1] - self.starts[window])
        g = torch.Generator().manual_seed(
            hashing.mix_scalar(self.seed, self.epoch, self.rank, window, _TAG_WINDOW_ORDER))
        return torch.randperm(n, generator=g).numpy()

    def pieces(self, lo: int, hi: int) -> List[Tuple[int, int, int]]:
        """(batch k, lo, hi): stream rows [lo, hi) cut at batch boundaries; a piece is the
        whole batch k when hi - lo == batch_size."""
        b = self.batch_size
        out = []
        while lo < hi:
            k = lo // b
            stop = min((k + 1) * b, hi)
            out.append((k, lo, stop))
            lo = stop
        return out


def _windows(groups: List[int], rows: List[int], limit: int) -> List[List[int]]:
    """`groups` (with `rows` rows each) cut into runs of whole groups of at most `limit` rows,
    at least one group each; limit 0: one group per window."""
    out: List[List[int]] = []
    held = 0
    for g, r in zip(groups, rows):
        if out and held + r <= limit:
            out[-1].append(g)
            held += r
        else:
            out.append([g])
            held = r
    return out


def _bucket_major(order: List[int], buckets: List[tuple], g: torch.Generator) -> List[int]:
    """`order` regrouped so that the groups of one bucket come one after another: buckets in a
    random order drawn from `g`, groups within a bucket in their order in `order`."""
    distinct = sorted(set(buckets))
    if len(distinct) < 2:
        return order
    rank = dict(zip(distinct, torch.randperm(len(distinct), generator=g).tolist()))
    return sorted(order, key=lambda i: rank[buckets[i]])
