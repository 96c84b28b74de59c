"""`ParquetDataset`: the iterable of batches a trainer consumes, sharded by rank, in a seeded
order (row groups shuffled, rows shuffled within windows of row groups), resumable from a
checkpointed position, read ahead by a background thread.

The loaders of `recxla.data.loaders` move the same reading into worker processes or Ray tasks:
the dataset decides what every batch is (`plan`, `chunks`, `read_chunk`), a loader only decides
where it is read (a chunk is one shuffle window, read once, whichever process reads it), so
every loader yields the same batches in the same order.
"""

from typing import Dict, Iterator, Optional, Sequence, Tuple

from recxla.data.batch_iterator import POSITION_FORMAT, BatchIterator, check_position
from recxla.data.epoch_plan import SHUFFLE_ROWS, EpochPlan
from recxla.data.parquet_layout import DatasetInfo
from recxla.data.parquet_reader import OP, _check_int, _GroupReader, read_run, whole_batches


class ParquetDataset:
    """Batches from a Parquet dataset written by `recxla.data.write_parquet`.

    Args:
        path: one .parquet file or a folder of them (read in name order), or a
            recxla.data.read_time.ReadTimeTable (a raw table, read with its joins and
            transforms).
        batch_size: samples per batch, B (need not match the written batches).
        rank, world_size: this rank reads row groups rank, rank + world_size, ... of each
            epoch's order; every rank yields the same number of batches per epoch.
        seed: the order of row groups in epoch e is a permutation drawn from (seed, e), the
            order of rows within a shuffle window one drawn from (seed, e, rank, window).
        shuffle: False reads in file order: row groups in file order (each rank its share),
            rows in their stored order.
        shuffle_rows: rows shuffled together (with `shuffle`): this rank's row groups, in the
            epoch's order, are cut into windows of whole groups holding at most this many rows
            (at least one group), and each window's rows are read in a random order. Memory:
            one window's decoded rows, twice while it is shuffled. 0: rows keep their stored
            order within each row group (only the order of row groups is shuffled). Default
            `recxla.data.epoch_plan.SHUFFLE_ROWS` (131,072).
        num_epochs: epochs to iterate, counted from epoch 0 (None: endless).
        position: a dict from an iterator's `state_dict()`: iteration continues right after
            the last batch that iterator returned (same seed, batch size, world size, shuffle,
            shuffle_rows and files, else ValueError).
        prefetch: batches an iterator reads ahead in a background thread (0: none).
        row_groups: read only these row groups (indices into the dataset's row groups in file
            order, e.g. a training or held-out split); None: all of them.
    Iterating yields `recxla.data.Batch` (KJT with the written ids, lengths, weights; dense
    [B, num_dense]; labels [B]; request_ids [B] or None), in an order fixed by the arguments.
    Each `iter()` starts at `position` (or the beginning); the iterator's `state_dict()` gives
    the position to resume from. Within an epoch no row is read twice; what is left out of an
    epoch (with row groups of one size, fewer than a row group plus a batch per rank) is said
    in recxla.data.epoch_plan.

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
        shuffle_rows: int = SHUFFLE_ROWS,
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
        self.shuffle_rows = _check_int(shuffle_rows, "shuffle_rows", 0)
        self.num_epochs = None if num_epochs is None else _check_int(num_epochs, "num_epochs", 1)
        self.prefetch = _check_int(prefetch, "prefetch", 0)
        # A table read at train time (recxla.data.read_time.ReadTimeTable) brings its own
        # reader: joins, transforms and id mapping happen as its row groups are read.
        self._table = path if hasattr(path, "reader") else None
        self.info = self._table.info if self._table is not None else DatasetInfo(path, OP)
        if row_groups is not None:
            self.info = _only_row_groups(self.info, row_groups)
        self.layout = self.info.layout
        self._reader = self._new_reader()
        self._plan: Optional[EpochPlan] = None
        self.identity = {
            "seed": seed, "batch_size": batch_size, "world_size": world_size,
            "shuffle": shuffle, "shuffle_rows": shuffle_rows if shuffle else 0,
            "dataset": self.info.fingerprint,
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
                         self.shuffle, epoch, self.shuffle_rows)
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

    def chunks(self) -> Iterator[Tuple[int, int, int, int]]:
        """(epoch, window, lo, hi) from the start position to the last epoch: the rows
        [lo, hi) of the rank's stream that shuffle window `window` holds (EpochPlan.runs).
        Reading the chunks in order and joining their pieces (`whole_batches`) gives the
        dataset's batches; each chunk reads its window's row groups once."""
        for epoch in self._epochs():
            first = self.start[1] if epoch == self.start[0] else 0
            for window, lo, hi in self.plan(epoch).runs(first):
                yield epoch, window, lo, hi

    def read_chunk(self, epoch: int, window: int, lo: int, hi: int, use_threads: bool = True):
        """(k, Batch) pieces of a chunk: batch k's samples among stream rows [lo, hi), in
        order (a whole batch, or the part of one that straddles two windows)."""
        return read_run(self._reader, self.plan(epoch), self.layout, window, lo, hi,
                        use_threads)

    def _pieces(self) -> Iterator[Tuple[int, int, object]]:
        # An iterator of its own: files and plans are not shared with other iterators'
        # threads (a ParquetFile is not safe to read from two threads at once).
        reader = self._new_reader()
        for epoch in self._epochs():
            plan = self._make_plan(epoch)
            first = self.start[1] if epoch == self.start[0] else 0
            for window, lo, hi in plan.runs(first):
                for k, piece in read_run(reader, plan, self.layout, window, lo, hi):
                    yield epoch, k, piece

    def _batches(self) -> Iterator[Tuple[int, int, object]]:
        return whole_batches(self._pieces(), self.batch_size)

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
        self._reader = self._new_reader()

    def _new_reader(self):
        if self._table is not None:
            reader = self._table.reader()
            reader.info = self.info  # a split's row groups index the split's info
            return reader
        return _GroupReader(self.info)


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
