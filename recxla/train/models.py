"""The models the trainer trains: TorchRec's own DLRM and DLRM_DCN, unchanged, with a BCE loss,
and DLRM with target attention over the user's history (`--model history`,
recxla/train/sequence_model.py).

The model code is TorchRec's (`torchrec.models.dlrm`): recxla changes only the sharder passed
to DMP, and with tables of several dims (--embedding-dims) the sparse arch, whose pooled rows
are padded to the one dim DLRM's interaction needs (`PaddedSparseArch`). Its embedding tables
are built on the meta device (DMP allocates each rank's shards), then `init_embedding_tables`
fills every shard from a generator seeded per table, so that the initial weights are the same
whatever the plan, and the same for the recxla path and for the TorchRec baseline. Dense layers are initialised from the run's seed on every rank alike.
"""

import dataclasses
import functools
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from recxla.data import hashing
from recxla.ops.copy_runs import Run, copy_runs, pack
from recxla.train.config import TrainConfig

_TAG_INIT = 0x1A17


def build_model(config: TrainConfig, tables: List[EmbeddingBagConfig],
                num_dense: int, device: torch.device, weighted: bool = False,
                history: Optional[Tuple[str, str]] = None) -> DLRMTrain:
    """DLRMTrain(DLRM, DLRM_DCN or HistoryDLRM) on `tables` (meta-device embeddings, all of
    one dim, dense layers on `device`); `weighted`: the batches' KJTs carry per-id weights;
    history: --model history's (history feature, candidate feature): the history's table
    becomes the EmbeddingCollection's. forward(torchrec Batch of B samples, dense float32
    [B, num_dense]) -> (loss scalar, (loss, logits [B], labels [B]))."""
    if config.model == "history":
        return _history_model(config, tables, num_dense, device, history)
    dims = sorted({t.embedding_dim for t in tables})
    # DLRM's interaction needs one dim: with per-table dims (--embedding-dims), every table's
    # pooled rows are padded to the run's dim, after they crossed the wire at their own.
    dim = config.embedding_dim or dims[-1]
    if dims[-1] > dim:
        raise ValueError(f"recxla-train: build_model: tables of dim {dims[-1]} above the run's "
                         f"--embedding-dim {dim}: --embedding-dims may only make tables smaller")
    torch.manual_seed(config.seed)
    if config.dense_floor:
        ebc = FixedPooledEmbeddings(tables, config.batch_size, config.seed, device)
    else:
        ebc = EmbeddingBagCollection(tables=tables, is_weighted=weighted,
                                     device=torch.device("meta"))
    uniform = ebc
    if dims != [dim]:  # DLRM checks one dim on the collection it is given
        uniform = EmbeddingBagCollection(
            tables=[dataclasses.replace(t, embedding_dim=dim) for t in tables],
            is_weighted=weighted, device=torch.device("meta"))
    dense_arch = list(config.dense_arch) + [dim]
    over_arch = list(config.over_arch) + [1]
    if config.model == "dcn":
        model = DLRM_DCN(uniform, num_dense, dense_arch, over_arch,
                         dcn_num_layers=config.dcn_layers, dcn_low_rank_dim=config.dcn_low_rank,
                         dense_device=device)
    else:
        model = DLRM(uniform, num_dense, dense_arch, over_arch, dense_device=device)
    if uniform is not ebc:
        model.sparse_arch = PaddedSparseArch(ebc, dim)
    return DLRMTrain(model)


def _history_model(config: TrainConfig, tables: List[EmbeddingBagConfig], num_dense: int,
                   device: torch.device, history: Tuple[str, str]) -> DLRMTrain:
    """--model history: HistoryDLRM with the history feature's table as an
    EmbeddingCollection (one row per id) and the others pooled."""
    from recxla.train.sequence_model import HistoryDLRM

    if config.dense_floor or len({t.embedding_dim for t in tables}) > 1:
        raise ValueError("recxla-train: --model history takes tables of one dim, not "
                         "--embedding-dims or --dense-floor")
    feature, candidate = history
    dim = tables[0].embedding_dim
    if dim % config.attention_heads:
        raise ValueError(f"recxla-train: --attention-heads {config.attention_heads} must "
                         f"divide the embedding dim {dim}")
    sequence = [t for t in tables if feature in t.feature_names]
    pooled = [t for t in tables if feature not in t.feature_names]
    torch.manual_seed(config.seed)
    meta = torch.device("meta")
    model = HistoryDLRM(
        EmbeddingBagCollection(tables=pooled, device=meta),
        EmbeddingCollection(tables=[EmbeddingConfig(num_embeddings=t.num_embeddings,
                                                    embedding_dim=t.embedding_dim, name=t.name,
                                                    feature_names=list(t.feature_names))
                                    for t in sequence], device=meta),
        feature, candidate, num_dense, list(config.dense_arch) + [dim],
        list(config.over_arch) + [1], config.history_length, config.attention_heads,
        dense_device=device)
    return DLRMTrain(model)


class PaddedSparseArch(torch.nn.Module):
    """DLRM's SparseArch for tables of several dims: each feature's pooled rows [B, d] are
    padded with zeros to [B, dim] and stacked as [B, F, dim], what DLRM's interaction takes.
    A table of dim d then meets every other vector in DLRM's dot products through their first
    d columns. No parameters: a linear map to `dim` per table would add its weights to the
    dense all-reduce every step, bytes on the wire that the smaller tables were to save (26
    maps of 32 x 64 add 0.19 MB a step in bf16, about what halving the 26 tables' dims saved
    with --profile small at batch 512).

    The pooled KeyedTensor's values go into the [B, F, dim] output in one copy per run of
    features of one dim (`PadFeatures`), not a pad per feature and a cat of them all."""

    def __init__(self, embedding_bag_collection, dim: int):
        super().__init__()
        self.embedding_bag_collection = embedding_bag_collection
        configs = embedding_bag_collection.embedding_bag_configs()
        self._features = [f for c in configs for f in c.feature_names]
        self.D = dim
        self.F = len(self._features)

    @property
    def sparse_feature_names(self) -> List[str]:
        return list(self._features)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return pad_features(self.embedding_bag_collection(features), self._features, self.D)


# A run of features side by side in the pooled values and in the output alike, all of one dim:
# (first output feature, features, dim, first value column).
FeatureRun = Tuple[int, int, int, int]


@torch.fx.wrap  # TorchRec's pipelines trace the model with torch.fx: one opaque call here
def pad_features(pooled: KeyedTensor, features: List[str], dim: int) -> torch.Tensor:
    """PadFeatures of the pooled values into the output order `features`. The values hold the
    features in the sharded collection's order (TorchRec's groups them by sharding type), so
    the runs are found per order, once."""
    runs = _runs_of(tuple(pooled.keys()), tuple(pooled.length_per_key()), tuple(features))
    return PadFeatures.apply(pooled.values(), runs, len(features), dim)


@functools.lru_cache(maxsize=64)
def _runs_of(keys: Tuple[str, ...], dims: Tuple[int, ...],
             features: Tuple[str, ...]) -> List[FeatureRun]:
    position = {f: i for i, f in enumerate(features)}
    if sorted(keys) != sorted(features):
        raise ValueError(f"PaddedSparseArch: the pooled KeyedTensor's keys {list(keys)} are "
                         f"not the collection's features {list(features)}")
    return feature_runs(keys, dims, position)


def feature_runs(keys: Sequence[str], dims: Sequence[int],
                 position: Dict[str, int]) -> List[FeatureRun]:
    """The runs of pooled values (features `keys` of widths `dims`, side by side) to their
    output features (`position`: feature -> index in the output), adjacent ones merged."""
    runs: List[FeatureRun] = []
    column = 0
    for key, dim in zip(keys, dims):
        first = position[key]
        if runs and runs[-1][2] == dim and runs[-1][0] + runs[-1][1] == first \
                and runs[-1][3] + runs[-1][1] * dim == column:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, dim, runs[-1][3])
        else:
            runs.append((first, 1, dim, column))
        column += dim
    return runs


class PadFeatures(torch.autograd.Function):
    """values [B, sum of the features' dims] -> [B, F, D]: feature f's columns at [:, f, :d_f],
    zeros after them. Each pass is one `recxla::copy_runs` that writes every element once:
    forward the features' columns and the zeros of their padding (read from a [D] zero row
    with stride 0), backward the features' columns into the values' gradient."""

    @staticmethod
    def forward(ctx, values, runs: List[FeatureRun], num_features: int, dim: int):
        batch, total = values.shape
        copies, pads = _pad_runs(runs, batch, total, num_features, dim)
        ctx.copies, ctx.total = copies, total
        out = values.new_empty((batch, num_features, dim))
        sources = [values.contiguous()]
        if pads:
            sources.append(values.new_zeros((dim,)))
        copy_runs(sources, [out], pack(copies + pads))
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_values = grad.new_empty((grad.shape[0], ctx.total))
        copy_runs([grad.contiguous()], [grad_values], pack(r.transposed() for r in ctx.copies))
        return grad_values, None, None, None


def _pad_runs(runs: List[FeatureRun], batch: int, total: int, num_features: int,
              dim: int) -> Tuple[List[Run], List[Run]]:
    """PadFeatures' runs: (the copies of the features' columns, source 0: values [batch,
    total] -> target [batch, num_features, dim]; the zeros after each narrower feature, source
    1: a [dim] zero row)."""
    copies, pads = [], []
    for first, count, width, column in runs:
        if width == dim:  # the run's features lie side by side in the output too
            copies.append(Run(0, column, total, 0, first * dim, num_features * dim, batch,
                              count * width))
            continue
        for j in range(count):
            at = (first + j) * dim
            copies.append(Run(0, column + j * width, total, 0, at, num_features * dim, batch,
                              width))
            pads.append(Run(1, 0, 0, 0, at + width, num_features * dim, batch, dim - width))
    return copies, pads


class FixedPooledEmbeddings(torch.nn.Module):
    """What an EmbeddingBagCollection gives DLRM, without tables: every batch's pooled
    embeddings are the same fixed random tensor (precomputed once, the first B rows for a
    batch of B), so that a model built on it does only the dense work: the dense floor of the
    trainer's `--dense-floor`. No parameters and no buffers: DMP finds nothing to shard and
    DDP nothing to broadcast; DLRM reads only `embedding_bag_configs()` and the output."""

    def __init__(self, tables: List[EmbeddingBagConfig], max_batch: int, seed: int,
                 device: torch.device):
        super().__init__()
        self._tables = list(tables)
        self._keys = [f for t in self._tables for f in t.feature_names]
        self._dims = [t.embedding_dim for t in self._tables for _ in t.feature_names]
        gen = torch.Generator().manual_seed(hashing.mix_scalar(seed, _TAG_INIT))
        self._pooled = (torch.rand(max_batch, sum(self._dims), generator=gen) * 0.02 - 0.01
                        ).to(device)

    def embedding_bag_configs(self) -> List[EmbeddingBagConfig]:
        return self._tables

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        # No check of the batch against max_batch (the trainer's batch size, which no batch
        # exceeds): TorchRec's pipelines trace this forward with torch.fx, where a size cannot
        # decide control flow.
        return KeyedTensor(keys=self._keys, length_per_key=self._dims,
                           values=torch.narrow(self._pooled, 0, 0, features.stride()))


def table_init(config: EmbeddingBagConfig, index: int, seed: int) -> torch.Tensor:
    """Table number `index`'s full initial weights: float32 [rows, dim], uniform in
    +-sqrt(1 / rows) (TorchRec's default bound), from a generator seeded by (seed, index)."""
    gen = torch.Generator().manual_seed(hashing.mix_scalar(seed, index, _TAG_INIT))
    bound = (1.0 / config.num_embeddings) ** 0.5
    weights = torch.empty(config.num_embeddings, config.embedding_dim)
    return weights.uniform_(-bound, bound, generator=gen)


@torch.no_grad()
def init_embedding_tables(sharded_tables: Iterable, tables: List[EmbeddingBagConfig],
                          seed: int) -> None:
    """Fill this rank's shards of every table with `table_init`'s values.

    Args:
        sharded_tables: (state_dict key ending in "<table name>.weight", ShardedTensor) pairs.
        tables: the EmbeddingBagConfigs, in the model's order (their index seeds the values).
    """
    index = {t.name: i for i, t in enumerate(tables)}
    for key, sharded in sharded_tables:
        name = key.rsplit(".", 2)[-2]
        if name not in index:
            raise ValueError(f"recxla-train: state_dict key {key!r} names no table of the model")
        shards = sharded.local_shards()
        if not shards:
            continue
        full = table_init(tables[index[name]], index[name], seed)
        for shard in shards:
            r0, c0 = shard.metadata.shard_offsets
            rows, cols = shard.metadata.shard_sizes
            shard.tensor.copy_(full[r0:r0 + rows, c0:c0 + cols])
