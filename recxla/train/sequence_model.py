"""The trainer's sequence model (`--model history`): TorchRec's DLRM with target attention over the
user's history, the candidate item attending over the items the user interacted with (DIN's
target attention, as one torch MultiheadAttention).

    pooled features   EmbeddingBagCollection (one id or a bag each)      -> [B, F, D]
    history           EmbeddingCollection: one row per id of the user's history (unpooled)
    target attention  query: the candidate item's pooled row; keys and values: the history's
                      rows (its first `max_length`, padding masked) and the candidate's own
                      (an empty history attends to the candidate alone)   -> [B, D]
    interaction       DLRM's, over the F pooled features and the attention's output

Built from TorchRec and torch modules only: DLRM's arches, an EmbeddingCollection and
torch.nn.MultiheadAttention. Each sample attends over its own history, so no layer mixes
samples (recxla.pipeline's micro-batches keep the step exact), and the loss is DLRMTrain's
mean BCE over the samples.
"""

from typing import List, Optional

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, InteractionArch, OverArch, choose
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class HistoryAttention(nn.Module):
    """The candidate item's attention over the user's history.

    Args:
        embedding_collection: the history's EmbeddingCollection (sharded by DMP in training).
        feature: the history feature (its output key).
        dim: the rows' dim.
        max_length: the ids of a history it attends over (the first ones).
        heads: attention heads (must divide dim).
    forward(features: KeyedJaggedTensor, candidate: float32 [B, dim]) -> float32 [B, dim].
    """

    def __init__(self, embedding_collection: EmbeddingCollection, feature: str, dim: int,
                 max_length: int, heads: int, device: Optional[torch.device] = None):
        super().__init__()
        self.embedding_collection = embedding_collection
        self.feature = feature
        self.max_length = max_length
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True, device=device)

    def forward(self, features: KeyedJaggedTensor, candidate: torch.Tensor) -> torch.Tensor:
        history = self.embedding_collection(features)[self.feature]
        length = self.max_length
        rows = history.to_padded_dense(desired_length=length)  # [B, L, D], zeros after the ids
        keys = torch.cat([rows, candidate.unsqueeze(1)], dim=1)
        position = torch.arange(length + 1, device=keys.device)
        lengths = history.lengths().to(keys.device).clamp(max=length).unsqueeze(1)
        padding = (position < length) & (position >= lengths)  # the candidate's key stays
        out, _ = self.attention(candidate.unsqueeze(1), keys, keys, key_padding_mask=padding,
                                need_weights=False)
        return out.squeeze(1)


class HistoryDLRM(DLRM):
    """DLRM whose interaction also takes the candidate's attention over the history (see the
    module docstring).

    Args:
        embedding_bag_collection: the pooled features' tables (one dim, D).
        embedding_collection: the history's table (dim D).
        history_feature: the history feature, read by embedding_collection.
        candidate_feature: the candidate item's id feature, read by embedding_bag_collection.
        dense_in_features, dense_arch_layer_sizes, over_arch_layer_sizes, dense_device: as
            DLRM's.
        max_length: the history ids attended over; heads: attention heads.
    forward(dense_features float32 [B, dense_in_features], sparse_features KeyedJaggedTensor)
    -> logits float32 [B, 1].
    """

    def __init__(self, embedding_bag_collection: EmbeddingBagCollection,
                 embedding_collection: EmbeddingCollection, history_feature: str,
                 candidate_feature: str, dense_in_features: int,
                 dense_arch_layer_sizes: List[int], over_arch_layer_sizes: List[int],
                 max_length: int, heads: int, dense_device: Optional[torch.device] = None):
        super().__init__(embedding_bag_collection, dense_in_features, dense_arch_layer_sizes,
                         over_arch_layer_sizes, dense_device)
        features = self.sparse_arch.sparse_feature_names
        if candidate_feature not in features:
            raise ValueError(f"HistoryDLRM: the candidate feature {candidate_feature!r} is not "
                             f"a pooled feature ({features})")
        self.candidate = features.index(candidate_feature)
        dim = dense_arch_layer_sizes[-1]
        self.history_arch = HistoryAttention(embedding_collection, history_feature, dim,
                                             max_length, heads, dense_device)
        sparse = len(features) + 1
        self.inter_arch = InteractionArch(num_sparse_features=sparse)
        self.over_arch = OverArch(in_features=dim + choose(sparse, 2) + sparse,
                                  layer_sizes=over_arch_layer_sizes, device=dense_device)

    def forward(self, dense_features: torch.Tensor,
                sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        embedded_dense = self.dense_arch(dense_features)
        embedded_sparse = self.sparse_arch(sparse_features)  # [B, F, D]
        attended = self.history_arch(sparse_features, embedded_sparse[:, self.candidate])
        sparse = torch.cat([embedded_sparse, attended.unsqueeze(1)], dim=1)
        return self.over_arch(self.inter_arch(dense_features=embedded_dense,
                                              sparse_features=sparse))
