"""Shared helpers of the sharded-module tests: tables, hand-made plans, batches split by rank, and
the unsharded reference step. Imported by the ranks that tests/distributed_utils.py spawns."""

from typing import Dict, List, Optional, Sequence

import torch
from torchrec.distributed.types import EnumerableShardingSpec, ParameterSharding, ShardMetadata
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def tables(mean: bool = True) -> List[EmbeddingBagConfig]:
    """Four tables: two dims, a feature shared by two tables (f1), multi-hot bags, MEAN."""
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=53, feature_names=["f0", "f1"]),
        EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=31, feature_names=["f2"],
                           pooling=PoolingType.MEAN if mean else PoolingType.SUM),
        EmbeddingBagConfig(name="t2", embedding_dim=16, num_embeddings=70, feature_names=["f3", "f1"]),
        EmbeddingBagConfig(name="t3", embedding_dim=24, num_embeddings=9, feature_names=["f4"],
                           pooling=PoolingType.MEAN if mean else PoolingType.SUM),
    ]


def _spec(sharding_type: str, shards) -> ParameterSharding:
    """shards: (row_offset, rows, col_offset, cols, rank)."""
    return ParameterSharding(
        sharding_type=sharding_type, compute_kernel="fused",
        ranks=sorted({s[4] for s in shards}),
        sharding_spec=EnumerableShardingSpec([
            ShardMetadata(shard_offsets=[r0, c0], shard_sizes=[nr, nc], placement=f"rank:{rank}/cpu")
            for r0, nr, c0, nc, rank in shards]))


def plan(configs: Sequence[EmbeddingBagConfig], kind: str, world: int) -> Dict[str, ParameterSharding]:
    """A plan of one kind for every table: table_wise, row_wise (TorchRec's ceil(E / W) blocks,
    the last ones short or empty), column_wise (uneven column blocks: the first table keeps two
    of its three blocks on one rank), or mixed (one kind per table)."""
    out = {}
    for t, c in enumerate(configs):
        e, d = c.num_embeddings, c.embedding_dim
        k = kind if kind != "mixed" else ("table_wise", "row_wise", "column_wise", "table_wise")[t % 4]
        if k == "table_wise":
            out[c.name] = _spec(k, [(0, e, 0, d, (t + 1) % world)])
        elif k == "row_wise":
            block = -(-e // world)
            out[c.name] = _spec(k, [(min(r * block, e), max(0, min(block, e - r * block)), 0, d, r)
                                    for r in range(world)])
        elif k == "column_wise":
            widths = [d // 4, d // 2, d - d // 4 - d // 2]
            starts = [0, widths[0], widths[0] + widths[1]]
            ranks = [0, (t + 1) % world, 0] if t == 0 else [(t + j) % world for j in range(3)]
            out[c.name] = _spec(k, [(0, e, s, w, r) for s, w, r in zip(starts, widths, ranks)])
        else:
            raise ValueError(kind)
    return out


def features(configs) -> List[str]:
    return list(dict.fromkeys(f for c in configs for f in c.feature_names))


def global_batch(configs, batch: int, generator: torch.Generator, weighted: bool = False,
                 max_len: int = 4, zipf_rows: bool = False) -> KeyedJaggedTensor:
    """A batch of `batch` samples over every feature (ids valid for every table reading it)."""
    keys = features(configs)
    rows = {f: min(c.num_embeddings for c in configs if f in c.feature_names) for f in keys}
    lengths = torch.randint(0, max_len + 1, (len(keys), batch), generator=generator)
    values = []
    for k, f in enumerate(keys):
        n = int(lengths[k].sum())
        if zipf_rows:  # heavy repeats, so dedup has work to do
            ids = (torch.rand(n, generator=generator) ** 4 * rows[f]).long()
        else:
            ids = torch.randint(0, rows[f], (n,), generator=generator)
        values.append(ids)
    weights = torch.rand(int(lengths.sum()), generator=generator) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=lengths.flatten(),
                             weights=weights)


def sample_slice(kjt: KeyedJaggedTensor, start: int, stop: int) -> KeyedJaggedTensor:
    """Samples [start, stop) of every feature."""
    batch = kjt.stride()
    lengths = kjt.lengths().view(len(kjt.keys()), batch)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), kjt.lengths().cumsum(0)])
    take = torch.cat([torch.arange(int(offsets[k * batch + start]), int(offsets[k * batch + stop]))
                      for k in range(len(kjt.keys()))]).long()
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values()[take],
                             lengths=lengths[:, start:stop].flatten(),
                             weights=None if weights is None else weights[take])


def shard_errors(state_dict, reference: Dict[str, torch.Tensor],
                 start: Optional[Dict[str, torch.Tensor]] = None) -> float:
    """Largest relative difference between the local shards of a sharded state_dict and the
    same blocks of the reference tensors; with `start` (the weights both began from), between
    the updates (shard - start vs reference - start)."""
    worst = 0.0
    for key, value in state_dict.items():
        if not hasattr(value, "local_shards"):
            continue
        for shard in value.local_shards():
            (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            block = (slice(r0, r0 + nr), slice(c0, c0 + nc))
            got, want = shard.tensor, reference[key][block]
            if start is not None:
                got, want = got - start[key][block], want - start[key][block]
            worst = max(worst, relative(got, want))
    return worst


def gradient_factor(world: int) -> float:
    """What the sharded module's embedding gradients are scaled by against the unsharded
    module on the ranks' summed losses: 1 / world under TorchRec's gradient division (its
    default), else 1."""
    from torchrec.distributed.comm_ops import get_gradient_division

    return 1.0 / world if get_gradient_division() else 1.0


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-12) if b.numel() else 0.0
