"""The trainer's data: this rank's shard of the synthetic ranking logs, as TorchRec batches.

Training step k of this rank trains on batch k mod `train_batches` of its shard of
`recxla.data.SyntheticRankingDataset` (rank r of W takes the global batches r, r + W, ...), so
the data position is the step count alone and a resumed run sees exactly the batches an
uninterrupted one would. The held-out split for AUC is a disjoint range of batch indices of the
same logs (same users, items and hidden label model; other requests).
"""

from typing import Iterator

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


class TrainData:
    """This rank's training and held-out batches.

    Args:
        config: batch size, seed, profile, train/eval batch counts.
        rank, world_size: this rank's shard.
    """

    def __init__(self, config: TrainConfig, rank: int, world_size: int):
        self.config = config
        self.profile = make_profile(config)
        self.dataset = SyntheticRankingDataset(
            self.profile, batch_size=config.batch_size, seed=config.seed, rank=rank,
            world_size=world_size)

    def tables(self, embedding_dim: int) -> list:
        """TorchRec EmbeddingBagConfigs of the profile, `embedding_dim` columns each."""
        return self.dataset.embedding_bag_configs(embedding_dim)

    @property
    def num_dense(self) -> int:
        return self.profile.num_dense

    def train(self, start_step: int, end_step: int) -> Iterator[TorchRecBatch]:
        """The batches of steps start_step .. end_step - 1, in order."""
        for step in range(start_step, end_step):
            yield to_torchrec(self.dataset.batch(step % self.config.train_batches))

    def held_out(self) -> Iterator[TorchRecBatch]:
        """The held-out batches (`config.eval_batches` of them)."""
        for i in range(self.config.eval_batches):
            yield to_torchrec(self.dataset.batch(HELD_OUT_START + i))
