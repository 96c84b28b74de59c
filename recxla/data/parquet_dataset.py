"""`ParquetDataset`: the iterable of batches a trainer consumes, sharded by rank, in a seeded
order, resumable from a checkpointed position, read ahead by a background thread.

The loaders of `recxla.data.loaders` move the same reading into worker processes or Ray tasks:
the dataset decides what every batch is (`plan`, `chunks`, `read_chunk`), a loader only decides
where it is read, so every loader yields the same batches in the same order.
"""

from typing import Dict, Iterator, Optional, Sequence, Tuple

from recxla.data.batch_iterator import POSITION_FORMAT, BatchIterator, check_position
from recxla.data.parquet_layout import DatasetInfo
from recxla.data.parquet_reader import OP, EpochPlan, _check_int, _GroupReader, read_batches


class ParquetDataset:
    """Batches from a Parquet dataset written by `recxla.data.write_parquet`.

    Args:
        path: one .parquet file or a folder of them (read in name order).
        batch_size: samples per batch, B (need not match the written batches).
        rank, world_size: this rank reads row groups rank, rank + world_size, ... of each
            epoch's order; every rank yields the same number of batches per epoch.
        seed: the order of row groups in epoch e is a permutation drawn from (seed, e).
        shuffle: False reads row groups in file order (each rank its share).
        num_epochs: epochs to iterate, counted from epoch 0 (None: endless).
        position: a dict from an iterator's `state_dict()`: iteration continues right after
            the last batch that iterator returned (same seed, batch size, world size, shuffle
            and files, else ValueError).
        prefetch: batches an iterator reads ahead in a background thread (0: none).
        row_groups: read only these row groups (indices into the dataset's row groups in file
            order, e.g. a training or held-out split); None: all of them.
    Iterating yields `recxla.data.Batch` (KJT with the written ids, lengths, weights; dense
    [B, num_dense]; labels [B]; request_ids [B] or None), in an order fixed by the arguments.
    Each `iter()` starts at `position` (or the beginning); the iterator's `state_dict()` gives
    the position to resume from. Rows within a row group keep their stored order.

    Raises FileNotFoundError for a missing path and DataFormatError (a ValueError) naming the
    file for an unreadable, truncated or inconsistent one, at construction (footers) or on the
    batch that reads a corrupt row group; a batch is returned only once it is complete.
    """

    def __init__(
        self,
        path: str,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        *,
        shuffle: bool = True,
        num_epochs: Optional[int] = 1,
        position: Optional[Dict] = None,
        prefetch: int = 2,
        row_groups: Optional[Sequence[int]] = None,
    ):
        self.batch_size = _check_int(batch_size, "batch_size", 1)
        self.world_size = _check_int(world_size, "world_size", 1)
        self.rank = _check_int(rank, "rank", 0)
        if rank >= world_size:
            raise ValueError(f"{OP}: rank must be < world_size={world_size}, got {rank}")
        self.seed = _check_int(seed, "seed", 0)
        if not isinstance(shuffle, bool):
            raise TypeError(f"{OP}: shuffle must be a bool, got {type(shuffle).__name__}")
        self.shuffle = shuffle
        self.num_epochs = None if num_epochs is None else _check_int(num_epochs, "num_epochs", 1)
        self.prefetch = _check_int(prefetch, "prefetch", 0)
        self.info = DatasetInfo(path, OP)
        if row_groups is not None:
            self.info = _only_row_groups(self.info, row_groups)
        self.layout = self.info.layout
        self._reader = _GroupReader(self.info)
        self._plan: Optional[EpochPlan] = None
        self.identity = {
            "seed": seed, "batch_size": batch_size, "world_size": world_size,
            "shuffle": shuffle, "dataset": self.info.fingerprint,
        }  # fmt: skip
        if row_groups is not None:  # a position is a position in the same split
            self.identity["row_groups"] = self.info.split_fingerprint
        self.plan(0)  # a dataset too small for one batch per rank fails here
        self.start = (0, 0) if position is None else self._normalize(
            check_position(position, self.identity, OP))

    def _normalize(self, start: Tuple[int, int]) -> Tuple[int, int]:
        epoch, batch = start
        n = self.plan(epoch).num_batches
        if batch > n:
            raise ValueError(f"{OP}: position batch {batch} is past the {n} batches of epoch "
                             f"{epoch}")
        return (epoch + 1, 0) if batch == n else (epoch, batch)

    @property
    def metadata(self) -> Dict:
        """Layout (feature names, dense width, dtypes), rows, files, bytes, sort key: JSON-able."""
        return self.info.summary()

    def check_tables(self, tables: Sequence, num_dense: Optional[int] = None) -> None:
        """DataFormatError unless the files fit the model: every table's features present,
        their ids in [0, num_embeddings), and `num_dense` dense features (None: unchecked)."""
        self.info.check_tables(tables, num_dense)

    def plan(self, epoch: int) -> EpochPlan:
        """This rank's row groups and batch count in `epoch` (the last plan is cached)."""
        if self._plan is None or self._plan.epoch != epoch:
            self._plan = self._make_plan(epoch)
        return self._plan

    def _make_plan(self, epoch: int) -> EpochPlan:
        plan = EpochPlan(self.info, self.batch_size, self.rank, self.world_size, self.seed,
                         self.shuffle, epoch)
        if plan.num_batches == 0:
            raise ValueError(
                f"{OP}: {self.info.path}: epoch {epoch}: {self.info.num_rows} rows in "
                f"{len(self.info.row_groups)} row groups fill no batch of {self.batch_size} on "
                f"each of {self.world_size} ranks")
        return plan

    def num_batches(self, epoch: int = 0) -> int:
        """Batches every rank yields in `epoch`."""
        return self.plan(epoch).num_batches

    def position_after(self, batches: int) -> Dict:
        """The position (as an iterator's `state_dict()`) after `batches` batches counted from
        the start of epoch 0: what a trainer that consumed that many batches resumes from.
        Every rank yields as many batches per epoch, so it is the same on every rank."""
        remaining, epoch = _check_int(batches, "batches", 0), 0
        while remaining >= self.num_batches(epoch):
            remaining -= self.num_batches(epoch)
            epoch += 1
        return {"format": POSITION_FORMAT, **self.identity, "epoch": epoch, "batch": remaining}

    def _epochs(self) -> Iterator[int]:
        epoch = self.start[0]
        while self.num_epochs is None or epoch < self.num_epochs:
            yield epoch
            epoch += 1

    def chunks(self) -> Iterator[Tuple[int, int, int]]:
        """(epoch, first, stop) runs of batches from the start position to the last epoch; each
        run's batches begin in the same row group (see EpochPlan.chunks)."""
        for epoch in self._epochs():
            first = self.start[1] if epoch == self.start[0] else 0
            for a, b in self.plan(epoch).chunks(first):
                yield epoch, a, b

    def read_chunk(self, epoch: int, first: int, stop: int, use_threads: bool = True):
        """(k, Batch) for batches first <= k < stop of `epoch`."""
        return read_batches(self._reader, self.plan(epoch), self.layout, first, stop,
                            use_threads)

    def _batches(self) -> Iterator[Tuple[int, int, object]]:
        # An iterator of its own: files and plans are not shared with other iterators'
        # threads (a ParquetFile is not safe to read from two threads at once).
        reader = _GroupReader(self.info)
        for epoch in self._epochs():
            plan = self._make_plan(epoch)
            first = self.start[1] if epoch == self.start[0] else 0
            for k, batch in read_batches(reader, plan, self.layout, first, plan.num_batches):
                yield epoch, k, batch

    def __iter__(self) -> BatchIterator:
        return BatchIterator(self._batches(), self.start, self.identity, self.prefetch)

    def close(self) -> None:
        """Nothing to release (iterators close themselves); here so that every loader that
        `make_loader` returns can be closed alike."""

    def __getstate__(self):
        # Worker processes and Ray actors get the footers' content, not open files.
        state = dict(self.__dict__)
        state["_reader"], state["_plan"] = None, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reader = _GroupReader(self.info)


def _only_row_groups(info: DatasetInfo, indices: Sequence[int]) -> DatasetInfo:
    """A copy of `info` that holds only the row groups `indices` (file order kept)."""
    import copy
    import hashlib

    n = len(info.row_groups)
    keep = sorted(set(int(i) for i in indices))
    if not keep or keep[0] < 0 or keep[-1] >= n:
        raise ValueError(f"{OP}: row_groups must be a non-empty set of indices in [0, {n}), got "
                         f"{list(indices)[:8]}")
    out = copy.copy(info)
    out.row_groups = [info.row_groups[i] for i in keep]
    out.num_rows = sum(r for _, _, r in out.row_groups)
    out.split_fingerprint = hashlib.sha1(repr(keep).encode()).hexdigest()[:16]
    return out
