"""`make_loader`, the trainer's one entry point to a Parquet dataset, and the local
multi-process loader behind it (the Ray loader is in `recxla.data.ray_loader`).

Every loader yields what `ParquetDataset` with the same arguments yields, batch for batch: the
dataset cuts each epoch into chunks, one per shuffle window (`ParquetDataset.chunks`), workers
read chunks and send each batch, or piece of a batch that straddles two windows, back as one
`CompactBatch` buffer, and the consumer decodes the chunks in their order and joins the pieces
(`whole_batches`). Positions are the dataset's, so a position saved from any loader resumes in
any other.
"""

from typing import Dict, Optional, Sequence, Tuple

import torch

from recxla.data.batch_iterator import BatchIterator
from recxla.data.compact_batch import CompactBatch
from recxla.data.epoch_plan import SHUFFLE_ROWS
from recxla.data.loader_chunks import check_workers, encode_chunk, in_worker_processes
from recxla.data.parquet_dataset import ParquetDataset
from recxla.data.parquet_reader import whole_batches
from recxla.data.ray_loader import RayLoader

LOADERS = ("local", "ray")


class _ChunkReader(torch.utils.data.Dataset):
    """Map-style dataset whose items are chunks: (epoch, window, lo, hi) -> (epoch, pieces)."""

    def __init__(self, dataset: ParquetDataset, compress: bool):
        self.dataset, self.compress = dataset, compress

    def __getitem__(self, chunk):
        return chunk[0], encode_chunk(self.dataset, *chunk, compress=self.compress)

    def describe(self, chunk) -> str:
        """What reading `chunk` is, for an error in a worker."""
        epoch, window, lo, hi = chunk
        return (f"reading {self.dataset.info.path} (epoch {epoch}, shuffle window {window}, "
                f"rows {lo}..{hi} of this rank's share)")


class _Chunks:
    """The sampler: every chunk of the dataset from its start position, in order."""

    def __init__(self, dataset: ParquetDataset):
        self.dataset = dataset

    def __iter__(self):
        return self.dataset.chunks()


class LocalLoader:
    """Batches of `dataset` read by `num_workers` worker processes on this machine.

    Built on torch's DataLoader: chunks go to the workers round-robin and come back in order;
    an exception in a worker is raised here as one line naming the worker, what it read and
    the original error (recxla.data.loader_chunks.in_worker_processes); a worker that dies is
    reported instead of waited for. Batches travel as CompactBatch buffers (zstd when
    `compress`: worth it only where the link is slower than zstd, not between local
    processes).

    Args:
        dataset: what to read (its position, epochs and sharding apply).
        num_workers: worker processes (>= 1).
        compress: zstd the buffers between processes.
        prefetch_runs: chunks (shuffle windows) each worker reads ahead.
    """

    def __init__(self, dataset: ParquetDataset, num_workers: int = 1, compress: bool = False,
                 prefetch_runs: int = 2):
        self.dataset = dataset
        self.num_workers = check_workers(num_workers, "recxla.data.LocalLoader", 1)
        self.compress = bool(compress)
        self.prefetch_runs = check_workers(prefetch_runs, "recxla.data.LocalLoader", 1)
        self._runs = None  # the worker processes of the latest iterator

    @property
    def metadata(self) -> Dict:
        return self.dataset.metadata

    def check_tables(self, tables: Sequence, num_dense: Optional[int] = None) -> None:
        self.dataset.check_tables(tables, num_dense)

    def num_batches(self, epoch: int = 0) -> int:
        return self.dataset.num_batches(epoch)

    def _pieces(self):
        runs = self._runs = in_worker_processes(
            _ChunkReader(self.dataset, self.compress), _Chunks(self.dataset), self.num_workers,
            self.prefetch_runs)
        try:
            for epoch, pieces in runs:
                for k, blob in pieces:
                    yield epoch, k, CompactBatch.decode(blob)
        finally:
            runs.close()  # stops the workers

    def waiting(self) -> Optional[Tuple[str, float]]:
        """(the worker, time.monotonic() the wait began) while the latest iterator waits for a
        batch from a worker process that is alive (recxla.data.loader_chunks.WorkerRuns);
        None otherwise. Safe to call from another thread."""
        runs = self._runs
        return None if runs is None else runs.waiting()

    def __iter__(self) -> BatchIterator:
        batches = whole_batches(self._pieces(), self.dataset.batch_size)
        return BatchIterator(batches, self.dataset.start, self.dataset.identity)

    def close(self) -> None:
        """Nothing to release: workers stop when their iterator is closed or exhausted."""


def make_loader(
    path: str,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    loader: str = "local",
    num_workers: int = 1,
    position: Optional[Dict] = None,
    *,
    num_epochs: Optional[int] = None,
    shuffle: bool = True,
    shuffle_rows: int = SHUFFLE_ROWS,
    compress: Optional[bool] = None,
    run_dir: Optional[str] = None,
    ray_address: Optional[str] = None,
    row_groups: Optional[Sequence[int]] = None,
):
    """The batches of the Parquet dataset at `path` for one rank: what a trainer iterates.

    Args:
        path: a .parquet file or folder written by `recxla.data.write_parquet`.
        batch_size: samples per batch on this rank.
        rank, world_size: this rank's share of the row groups (every rank yields as many
            batches per epoch).
        seed: the order of row groups and of rows within shuffle windows, new every epoch.
        loader: "local" (worker processes on this machine) or "ray" (Ray Data tasks; needs
            `pip install recxla[ray]`).
        num_workers: worker processes or Ray tasks; 0 with "local" reads in this process, in a
            background thread.
        position: a dict from the iterator's `state_dict()` to resume right after its last
            batch (same seed, batch size, world size, shuffle settings and files; the same on
            every rank).
        num_epochs: epochs to iterate (None: endless; the position carries the epoch).
        shuffle: False reads in file order (row groups in file order, rows as stored).
        shuffle_rows: rows shuffled together: windows of whole row groups of at most this
            many rows (see ParquetDataset); 0 shuffles only the order of row groups.
        compress: zstd between processes (default: off for "local", on for "ray").
        run_dir: "ray" only: the folder for Ray's temporary files (default: a new temporary
            folder, removed when the loader is closed).
        ray_address: "ray" only: an existing cluster to join (None: start a local Ray bound to
            127.0.0.1, shut down by `close()`).
        row_groups: read only these row groups (see ParquetDataset); None: all.
    Returns:
        An iterable of `recxla.data.Batch`; `iter()` gives an iterator with `state_dict()`
        (the JSON-able position) and `close()`. The loader also has `metadata` (features,
        dense width, rows, ...), `check_tables(tables, num_dense)`, `num_batches(epoch)` and
        `close()` (shuts down a Ray the loader started; call it when training ends).
    """
    op = "recxla.data.make_loader"
    if loader not in LOADERS:
        raise ValueError(f"{op}: loader must be one of {LOADERS}, got {loader!r}")
    check_workers(num_workers, op, 0 if loader == "local" else 1)
    dataset = ParquetDataset(path, batch_size, rank, world_size, seed, shuffle=shuffle,
                             shuffle_rows=shuffle_rows, num_epochs=num_epochs,
                             position=position, row_groups=row_groups)
    if loader == "ray":
        return RayLoader(dataset, num_workers, compress=True if compress is None else compress,
                         run_dir=run_dir, address=ray_address)
    if run_dir is not None or ray_address is not None:
        raise ValueError(f"{op}: run_dir and ray_address apply to loader='ray' only")
    if num_workers == 0:
        return dataset
    return LocalLoader(dataset, num_workers, compress=bool(compress))
