"""What every loader of a ParquetDataset does with a chunk (`ParquetDataset.chunks`: the
batches of one shuffle window): read it and encode its pieces as CompactBatch buffers, the form
in which they travel from a reader process or a Ray task to the consumer; the check of a
loader's worker count; and the worker processes of the local loaders (`in_worker_processes`).
`recxla.data.loaders` (the local loader, `make_loader`), `recxla.data.ray_loader` and
`recxla.data.synthetic_loader` build on it.
"""

from typing import Iterable, Iterator

import torch

from recxla.data.compact_batch import CompactBatch
from recxla.data.parquet_dataset import ParquetDataset


def check_workers(num_workers, op: str, lo: int) -> int:
    """`num_workers` when it is an int >= `lo`; else ValueError naming `op`."""
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < lo:
        raise ValueError(f"{op}: num_workers must be an int >= {lo}, got {num_workers!r}")
    return num_workers


def encode_chunk(dataset: ParquetDataset, epoch: int, window: int, lo: int, hi: int,
                 compress: bool) -> list:
    """The pieces of a chunk (`ParquetDataset.read_chunk`) as [(k, CompactBatch bytes)]: k is
    the batch's index in the epoch, a piece a whole batch or the part of one in this window."""
    return [(k, CompactBatch.encode(piece, compress=compress))
            for k, piece in dataset.read_chunk(epoch, window, lo, hi, use_threads=False)]


def _as_is(item):
    return item


def in_worker_processes(dataset: torch.utils.data.Dataset, items: Iterable,
                        num_workers: int, prefetch: int) -> Iterator:
    """dataset[item] for each of `items`, in order, made by `num_workers` worker processes
    (torch's DataLoader: items go to the workers round-robin, `prefetch` ahead each, and come
    back in order; a worker's exception is raised here, naming it). A generator: `close()` (or
    running to the end) stops the workers at once."""
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, sampler=items, num_workers=num_workers,
        prefetch_factor=prefetch, collate_fn=_as_is,
        # Without a generator of its own, DataLoader draws its workers' seed from torch's
        # global generator: a trainer that starts its loader after restoring a checkpoint's
        # generator state then trains on with another state than an uninterrupted run. The
        # items decide every result, so the workers need no seed of the run's.
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    results = iter(loader)
    try:
        yield from results
    finally:
        # Stops the workers now rather than when the garbage collector gets to it.
        shutdown = getattr(results, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
