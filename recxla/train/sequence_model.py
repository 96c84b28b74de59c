"""The trainer's sequence model (`--model history`): TorchRec's DLRM with target attention over the
user's history, the candidate item attending over the items the user interacted with (DIN's
target attention, as one torch MultiheadAttention).

    pooled features   EmbeddingBagCollection (one id or a bag each)      -> [B, F, D]
    history           EmbeddingCollection: one row per id of the user's history (unpooled)
    target attention  query: the candidate item's pooled row; keys and values: the history's
                      rows (its first `max_length`) and the candidate's own (an empty history
                      attends to the candidate alone), torch MultiheadAttention's function on
                      the jagged rows                                      -> [B, D]
    interaction       DLRM's, over the F pooled features and the attention's output

Built from TorchRec and torch modules only: DLRM's arches, an EmbeddingCollection and the
parameters of a torch.nn.MultiheadAttention. Each sample attends over its own history, so no
layer mixes samples (recxla.pipeline's micro-batches keep the step exact), and the loss is
DLRMTrain's mean BCE over the samples.
"""

from typing import List, Optional

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, InteractionArch, OverArch, choose
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class HistoryAttention(nn.Module):
    """The candidate item's attention over the user's history: torch.nn.MultiheadAttention's
    parameters and result, computed on the jagged history (no padding).

    Query: the candidate's row; keys and values: the history's rows (its first `max_length`)
    and the candidate's own row, so that an empty history attends to the candidate alone. The
    same function as `attention(candidate, keys, keys, key_padding_mask=...)` on the padded
    history (tests/test_sequence_model.py checks it), in O(ids x dim^2): each history row is
    projected once, per key and value, where the padded call also projects every padding row,
    and the key bias, which adds one constant to all of a query's scores, drops out of the
    softmax.

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
        self.heads = heads
        self.attention = nn.MultiheadAttention(dim, heads, batch_first=True, device=device)

    def forward(self, features: KeyedJaggedTensor, candidate: torch.Tensor) -> torch.Tensor:
        history = self.embedding_collection(features)[self.feature]
        return attend(self.attention, candidate, history.values(),
                      history.lengths().to(candidate.device), self.max_length)


def attend(attention: nn.MultiheadAttention, candidate: torch.Tensor, values: torch.Tensor,
           lengths: torch.Tensor, max_length: int) -> torch.Tensor:
    """`attention`'s output for the query `candidate` float32 [B, D] over each sample's keys
    and values: its history rows (values float32 [N, D], sample by sample, lengths int [B]; the
    first max_length of each) and its own row. -> float32 [B, D]."""
    batch, dim = candidate.shape
    heads = attention.num_heads
    head_dim = dim // heads
    w_q, w_k, w_v = attention.in_proj_weight.chunk(3)
    b_q, _, b_v = attention.in_proj_bias.chunk(3)
    q = nn.functional.linear(candidate, w_q, b_q).view(batch, heads, head_dim) * head_dim ** -0.5
    ids = values.shape[0]
    sample = torch.repeat_interleave(torch.arange(batch, device=values.device), lengths,
                                     output_size=ids)
    first = torch.cumsum(lengths, 0) - lengths
    kept = (torch.arange(ids, device=values.device) - first.index_select(0, sample)) < max_length
    keys = nn.functional.linear(values, w_k).view(ids, heads, head_dim)
    scores = (keys * q.index_select(0, sample)).sum(-1).masked_fill(~kept.unsqueeze(1),
                                                                     float("-inf"))  # [N, H]
    own_key = nn.functional.linear(candidate, w_k).view(batch, heads, head_dim)
    own = (own_key * q).sum(-1)  # [B, H]
    # A softmax per sample over its ids and its own key; the largest score, subtracted for
    # range only, carries no gradient.
    top = own.detach().scatter_reduce(0, sample.unsqueeze(1).expand(ids, heads),
                                      scores.detach(), "amax")
    weight = torch.exp(scores - top.index_select(0, sample))
    own_weight = torch.exp(own - top)
    total = own_weight.index_add(0, sample, weight)  # [B, H]
    spread = lambda w: w.repeat_interleave(head_dim, dim=1)  # noqa: E731  [., H] -> [., D]
    pooled = (spread(own_weight) * nn.functional.linear(candidate, w_v)).index_add(
        0, sample, spread(weight) * nn.functional.linear(values, w_v))
    # The value bias once: the weights of a softmax sum to 1.
    return attention.out_proj(pooled / spread(total) + b_v)


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
