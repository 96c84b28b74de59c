"""The trainer's data: this rank's shard of the synthetic ranking logs, or of Parquet files
(--data), as TorchRec batches.

Synthetic logs (the default): training step k of this rank trains on batch k mod
`train_batches` of its shard of `recxla.data.SyntheticRankingDataset` (rank r of W takes the
global batches r, r + W, ...).

Files (--data PATH, written by `recxla.data.write_parquet` or `python -m recxla.data write`):
the batches come from `recxla.data.make_loader(PATH, batch_size, rank, world_size, seed,
loader=--loader, num_workers=--loader-workers)`, endless: an epoch is one pass over this rank's
share of the row groups, a new seeded order every epoch, and --steps may run past the end of
the files. The model's tables stay those of the profile (--profile, --max-rows: tables
`t_cat_<i>` reading features `cat_<i>`), so the files must hold those features with ids below
the tables' rows and 13 dense features; `check_tables` says which feature or table does not
fit, naming the files, before any process group exists (see config.py). `python -m recxla.data
write` writes the default profile capped at the trainer's default --max-rows, so its output
trains with the default flags.

Either way the data position is the step count alone, so a resumed run sees exactly the
batches an uninterrupted one would (see `TrainData.train`).

Held-out split for the AUC: `eval_batches` batches per rank of the synthetic logs at indices
training never reaches (same users, items and hidden label model; other requests), also with
--data: it measures the same task when the files were written from the synthetic logs with the
same --seed and profile. --eval-data PATH takes the held-out batches from files instead (the
first `eval_batches` of this rank's share, in file order).
"""

from typing import Iterator, Optional

from torchrec.datasets.utils import Batch as TorchRecBatch

from recxla.data import Profile, SyntheticRankingDataset, criteo_kaggle_profile
from recxla.train.config import TrainConfig

# First batch index of the held-out split: training never reaches it (2**40 batches of even
# one sample per rank is far beyond any run).
HELD_OUT_START = 1 << 40


def make_profile(config: TrainConfig) -> Profile:
    """The table profile of the run: Criteo Kaggle's 26 tables capped at --max-rows rows
    ("small": also short history bags)."""
    if config.profile == "small":
        return criteo_kaggle_profile(zipf=config.zipf, history_pooling=(2, 10),
                                     max_rows=config.max_rows)
    return criteo_kaggle_profile(zipf=config.zipf, max_rows=config.max_rows)


def to_torchrec(batch) -> TorchRecBatch:
    """recxla.data.Batch -> torchrec.datasets.utils.Batch (what TorchRec's pipelines move and
    DLRMTrain reads): dense_features float32 [B, 13], sparse_features KJT, labels float32 [B]."""
    return TorchRecBatch(dense_features=batch.dense, sparse_features=batch.sparse,
                         labels=batch.labels)


def open_files(path: str, config: TrainConfig, rank: int, world_size: int, tables, num_dense,
               **kwargs):
    """`recxla.data.ParquetDataset` of `path` for this rank (footers only, no reading), checked
    against the model's tables and dense width. Raises FileNotFoundError, or DataFormatError
    (a ValueError) naming the files: unreadable, too few rows for one batch per rank, or
    features that do not fit the tables."""
    from recxla.data import ParquetDataset

    files = ParquetDataset(path, config.batch_size, rank, world_size, config.seed, **kwargs)
    files.check_tables(tables, num_dense)
    return files


class TrainData:
    """This rank's training and held-out batches.

    Args:
        config: batch size, seed, profile, train/eval batch counts, --data and its loader.
        rank, world_size: this rank's shard.
    Raises (with --data or --eval-data) FileNotFoundError or DataFormatError naming the files.
    """

    def __init__(self, config: TrainConfig, rank: int, world_size: int):
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.profile = make_profile(config)
        self.dataset = SyntheticRankingDataset(
            self.profile, batch_size=config.batch_size, seed=config.seed, rank=rank,
            world_size=world_size)
        self._loader = self._iter = None
        self.files = self.eval_files = None
        # Any dim will do for the check: only names and rows are compared.
        tables = self.tables(1)
        if config.data is not None:
            self.files = open_files(config.data, config, rank, world_size, tables,
                                    self.num_dense, num_epochs=None)
        if config.eval_data is not None:
            self.eval_files = open_files(config.eval_data, config, rank, world_size, tables,
                                         self.num_dense, shuffle=False, num_epochs=1, prefetch=0)

    def tables(self, embedding_dim: int) -> list:
        """TorchRec EmbeddingBagConfigs of the profile, `embedding_dim` columns each."""
        return self.dataset.embedding_bag_configs(embedding_dim)

    @property
    def num_dense(self) -> int:
        return self.profile.num_dense

    @property
    def fingerprint(self) -> Optional[str]:
        """The training files' fingerprint (names and row groups), None for synthetic logs: a
        checkpoint records it so that --resume on other files fails instead of reading another
        sequence."""
        return None if self.files is None else self.files.identity["dataset"]

    def sample(self) -> TorchRecBatch:
        """Rank 0's first training batch, the same on every rank (row exchange is judged on
        it), read in this process."""
        if self.files is None:
            return to_torchrec(SyntheticRankingDataset(
                self.profile, batch_size=self.config.batch_size, seed=self.config.seed, rank=0,
                world_size=self.world_size).batch(0))
        from recxla.data import ParquetDataset

        first = ParquetDataset(self.config.data, self.config.batch_size, 0, self.world_size,
                               self.config.seed, prefetch=0)
        it = iter(first)
        try:
            return to_torchrec(next(it))
        finally:
            it.close()

    def train(self, start_step: int, end_step: int) -> Iterator[TorchRecBatch]:
        """The batches of steps start_step .. end_step - 1, in order.

        With --data the loader starts at the position after `start_step` batches. The step
        count is the position, not the iterator's `state_dict()` saved at a checkpoint: the
        pipeline pulls batches ahead of the step it trains (the next batch's input dist runs
        during this step), so the iterator is past the steps done by the pipeline's depth,
        while steps done is exactly the batches trained on. Every rank yields as many batches
        per epoch (ParquetDataset's sharding), so the steps map to one position, the same on
        every rank, and a checkpoint's fingerprint check (checkpoint.check_compatible) makes
        sure it is a position in the same files.
        """
        if self.files is None:
            return (to_torchrec(self.dataset.batch(step % self.config.train_batches))
                    for step in range(start_step, end_step))
        from recxla.data import make_loader

        self.close()
        self._loader = make_loader(
            self.config.data, self.config.batch_size, self.rank, self.world_size,
            self.config.seed, loader=self.config.loader, num_workers=self.config.loader_workers,
            position=self.files.position_after(start_step))
        it = self._iter = iter(self._loader)
        # The loader is endless: next() never raises StopIteration here.
        return (to_torchrec(next(it)) for _ in range(start_step, end_step))

    def held_out(self) -> Iterator[TorchRecBatch]:
        """The held-out batches: `config.eval_batches` of the synthetic held-out split, or the
        first ones of this rank's share of --eval-data (fewer if the files hold fewer)."""
        if self.eval_files is None:
            for i in range(self.config.eval_batches):
                yield to_torchrec(self.dataset.batch(HELD_OUT_START + i))
            return
        it = iter(self.eval_files)
        try:
            for _, batch in zip(range(self.config.eval_batches), it):
                yield to_torchrec(batch)
        finally:
            it.close()

    def close(self) -> None:
        """Release the training loader: its worker processes stop, a Ray it started shuts
        down. Idempotent; call it when training ends."""
        it, loader, self._iter, self._loader = self._iter, self._loader, None, None
        if it is not None:
            it.close()  # stops the worker processes
        if loader is not None:
            loader.close()
