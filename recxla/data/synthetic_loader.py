"""Synthetic batches made ahead in worker processes: `synthetic_batches`.

`SyntheticRankingDataset.batch(i)` costs the calling thread about 4 ms at batch 1024 and 10 ms
at batch 4096 (one CPU thread). A trainer that makes its batches inline spends that every
step on its main thread: on a GPU, where the host's launches are the step's critical path,
the device idles meanwhile. Worker processes make the batches while the step runs instead
(torch's DataLoader: worker w of N makes the w-th, (w + N)-th, ... of the indices, and they
come back in order through shared memory), the same Batch for the same index as inline.
"""

from typing import Iterator, Sequence

import torch

from recxla.data.loader_chunks import check_workers, in_worker_processes
from recxla.data.synthetic import Batch, SyntheticRankingDataset

# Batches each worker makes ahead of the one the trainer takes.
PREFETCH_PER_WORKER = 2


class _Indexed(torch.utils.data.Dataset):
    """Map-style view of the synthetic logs: item i is batch i."""

    def __init__(self, dataset: SyntheticRankingDataset):
        self.dataset = dataset

    def __getitem__(self, index: int) -> Batch:
        return self.dataset.batch(index)

    def describe(self, index: int) -> str:
        """What making item `index` is, for an error in a worker."""
        return f"making synthetic batch {index!r}"


def synthetic_batches(dataset: SyntheticRankingDataset, indices: Sequence[int],
                      num_workers: int) -> Iterator[Batch]:
    """`dataset.batch(i)` for each of `indices` (non-negative ints), in order, made by
    `num_workers` worker processes (0: here, when asked for). The result is a generator:
    `close()` stops the workers at once (so does running to the end); an exception in a worker
    is raised here, naming it."""
    op = "recxla.data.synthetic_batches"
    if not isinstance(dataset, SyntheticRankingDataset):
        raise TypeError(f"{op}: dataset must be a SyntheticRankingDataset, got "
                        f"{type(dataset).__name__}")
    check_workers(num_workers, op, 0)
    indices = list(indices)
    if num_workers == 0:
        return (dataset.batch(i) for i in indices)
    return in_worker_processes(_Indexed(dataset), indices, num_workers,
                               PREFETCH_PER_WORKER)
