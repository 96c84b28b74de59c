"""What every loader of a ParquetDataset does with a chunk (`ParquetDataset.chunks`: the
batches of one shuffle window): read it and encode its pieces as CompactBatch buffers, the form
in which they travel from a reader process or a Ray task to the consumer; and the check of a
loader's worker count. `recxla.data.loaders` (the local loader, `make_loader`) and
`recxla.data.ray_loader` both build on it.
"""

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
