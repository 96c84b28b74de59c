"""Synthetic ranking-log data for recxla's benchmarks, tests and demo trainer.

- `SyntheticRankingDataset`: seeded batches (`Batch`: a TorchRec KeyedJaggedTensor, dense
  float32 [B, 13], labels float32 [B]) built from requests (one user, several candidate items),
  Zipf-distributed users and items, and labels from a hidden logistic model.
- `criteo_kaggle_profile`: the default layout, 26 sparse features with the Criteo Kaggle table
  sizes, split into user-side and item-side features (see `recxla.data.profiles`).
- `embedding_bag_configs`: the matching TorchRec EmbeddingBagConfig tables.
"""

from recxla.data.profiles import (
    CRITEO_KAGGLE_NUM_EMBEDDINGS,
    Profile,
    SparseFeature,
    criteo_kaggle_profile,
    embedding_bag_configs,
)
from recxla.data.synthetic import Batch, SyntheticRankingDataset

__all__ = [
    "Batch",
    "CRITEO_KAGGLE_NUM_EMBEDDINGS",
    "Profile",
    "SparseFeature",
    "SyntheticRankingDataset",
    "criteo_kaggle_profile",
    "embedding_bag_configs",
]
