"""TorchRec integration.

- `EmbeddingBagCollectionSharder`: shards TorchRec's (and recxla.nn's) EmbeddingBagCollection
  onto recxla's kernels: deduplicated input dist, recxla's lookup with a fused optimizer, FP8
  quantized output all-to-all, every sharding type including row-wise on CPU. Its sharded
  module is `ShardedEmbeddingBagCollection`; `CommStats` counts its bytes; `choose_row_tables`
  picks the tables worth exchanging as unique rows (row_exchange=...).
- `EmbeddingCollectionSharder`: shards TorchRec's EmbeddingCollection (sequence embeddings):
  each row a rank's batch needs sent once, FP8 row-wise, expanded to the ids' positions by the
  receiver. Its sharded module is `ShardedEmbeddingCollection`.
- `sharders`: one sharder per module type recxla shards, with the same arguments.
- `make_topology_2d`, `ReplicaSync`, `WorldDataParallelWrapper`: 2D parallelism (shard groups
  inside a node, replica groups across nodes).
- `qcomm_codecs_registry`: recxla's row codec as a QComms registry for TorchRec's own sharders.

Importing this package does not import torchrec; the names load it on first use.
"""

from recxla.torchrec.qcomm_codec import (
    CodecStats,
    RecxlaQuantizedCommCodec,
    RowCodecContext,
    qcomm_codecs_registry,
)

_LAZY = {
    "CommStats": "recxla.torchrec.comm_stats",
    "EmbeddingBagCollectionSharder": "recxla.torchrec.sharder",
    "EmbeddingCollectionSharder": "recxla.torchrec.sharder",
    "sharders": "recxla.torchrec.sharder",
    "ShardedEmbeddingBagCollection": "recxla.torchrec.sharded_embedding_bag",
    "ShardedEmbeddingCollection": "recxla.torchrec.sharded_embedding",
    "choose_row_tables": "recxla.torchrec.row_exchange",
    "ReplicaSync": "recxla.torchrec.replicas",
    "make_topology_2d": "recxla.torchrec.replicas",
    "WorldDataParallelWrapper": "recxla.torchrec.replicas",
}

__all__ = ["CodecStats", "RecxlaQuantizedCommCodec", "RowCodecContext", "qcomm_codecs_registry",
           *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'recxla.torchrec' has no attribute {name!r}")
