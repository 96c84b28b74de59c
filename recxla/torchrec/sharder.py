"""recxla's sharder: the one line that moves a TorchRec model's embeddings onto recxla.

    sharder = recxla.torchrec.EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05},
        fwd_comm="e4m3", bwd_comm="bf16")
    plan = EmbeddingShardingPlanner(topology).collective_plan(model, [sharder], pg)
    model = DistributedModelParallel(model, env, device, sharders=[sharder], plan=plan)

It is TorchRec's EmbeddingBagCollectionSharder with recxla's sharded module
(`recxla.torchrec.ShardedEmbeddingBagCollection`), and it offers row-wise sharding on CPU as
well (TorchRec's CPU sharder cannot: gloo has no reduce-scatter). Tables the plan makes
data_parallel are sharded by TorchRec's own sharder inside the module (data_parallel.py).
DistributedModelParallel picks
a sharder by the module's exact type, so one sharder serves one module type: TorchRec's
EmbeddingBagCollection by default, `recxla.nn.EmbeddingBagCollection` with
`module_type=recxla.nn.EmbeddingBagCollection`; `sharders(...)` returns both.
"""

from typing import Any, Dict, List, Optional, Sequence, Type, Union

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder as TorchRecEmbeddingBagCollectionSharder,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from recxla.formats import DEFAULT_BWD_COMM, DEFAULT_FWD_COMM, get_format
from recxla.torchrec.replicas import ReplicaSync
from recxla.torchrec.sharded_embedding_bag import (
    SUPPORTED_SHARDING_TYPES,
    ShardedEmbeddingBagCollection,
)

NAME = "recxla.torchrec.EmbeddingBagCollectionSharder"


class EmbeddingBagCollectionSharder(TorchRecEmbeddingBagCollectionSharder):
    """Shards EmbeddingBagCollections onto recxla's kernels and quantized all-to-alls.

    Args:
        fused_params: as for TorchRec's sharder: {"optimizer": EmbOptimType.EXACT_SGD |
            EXACT_ADAGRAD | EXACT_ROWWISE_ADAGRAD, "learning_rate": float, "eps": float,
            "weight_decay": float}. An optimizer attached to a table with
            `apply_optimizer_in_backward` takes precedence. No optimizer named (None
            included): FBGEMM's default, EXACT_SGD at learning rate 0.01, as TorchRec's
            sharder. Tables the plan puts on the "dense" compute kernel get ordinary
            gradients (TorchRec's dense kernel).
        fwd_comm: wire format of the pooled embeddings: "e4m3" (default), "e5m2", "bf16",
            "fp16" or "fp32".
        bwd_comm: wire format of their gradients (default "e5m2": recxla.formats.DEFAULT_BWD_COMM,
            the one default of the library and the trainer).
        dedup_ids: the input dist may send unique ids plus an inverse index (default True).
        module_type: the module class to shard: torchrec's EmbeddingBagCollection (default)
            or a subclass such as recxla.nn.EmbeddingBagCollection.
        replicas: 2D training: a recxla.torchrec.replicas.ReplicaSync for the replica group
            (plan and shard over one node's shard group; see make_topology_2d). None: 1D.
        row_exchange: tables whose owners send each rank the unique rows its bags need
            instead of pooled bags (fewer bytes when keys repeat; see
            recxla/torchrec/row_exchange.py): "off", "all" or a list of table names.
    """

    def __init__(self, fused_params: Optional[Dict[str, Any]] = None, fwd_comm: str = DEFAULT_FWD_COMM,
                 bwd_comm: str = DEFAULT_BWD_COMM, dedup_ids: bool = True,
                 module_type: Optional[Type[EmbeddingBagCollection]] = None,
                 replicas: Optional[ReplicaSync] = None,
                 row_exchange: Union[str, Sequence[str]] = "off") -> None:
        super().__init__(fused_params=fused_params)
        get_format(fwd_comm, NAME, "fwd_comm")
        get_format(bwd_comm, NAME, "bwd_comm")
        if not isinstance(dedup_ids, bool):
            raise TypeError(f"{NAME}: dedup_ids must be a bool, got {dedup_ids!r}")
        module_type = EmbeddingBagCollection if module_type is None else module_type
        if not (isinstance(module_type, type) and issubclass(module_type, EmbeddingBagCollection)):
            raise TypeError(f"{NAME}: module_type must be torchrec's EmbeddingBagCollection or a "
                            f"subclass, got {module_type!r}")
        self._fwd_comm, self._bwd_comm, self._dedup_ids = fwd_comm, bwd_comm, dedup_ids
        self._module_type = module_type
        if replicas is not None and not isinstance(replicas, ReplicaSync):
            raise TypeError(f"{NAME}: replicas must be a recxla.torchrec.replicas.ReplicaSync, "
                            f"got {type(replicas).__name__}")
        self._replicas = replicas
        self._row_exchange = row_exchange

    def shard(self, module: EmbeddingBagCollection, params: Dict[str, ParameterSharding],
              env: ShardingEnv, device: Optional[torch.device] = None,
              module_fqn: Optional[str] = None) -> ShardedEmbeddingBagCollection:
        return ShardedEmbeddingBagCollection(
            module, params, env, fused_params=self.fused_params, device=device,
            fwd_comm=self._fwd_comm, bwd_comm=self._bwd_comm, dedup_ids=self._dedup_ids,
            module_fqn=module_fqn, replicas=self._replicas, row_exchange=self._row_exchange)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(SUPPORTED_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            # Data-parallel tables are TorchRec's (recxla/torchrec/data_parallel.py).
            return [EmbeddingComputeKernel.DENSE.value]
        # recxla's lookup (the planner's estimates treat it as TorchRec's fused kernel).
        return [EmbeddingComputeKernel.FUSED.value]

    def reshard(self, *args, **kwargs):
        raise NotImplementedError(f"{NAME}: resharding a live module is not supported; save a "
                                  "checkpoint and load it into a module sharded the new way")

    @property
    def module_type(self) -> Type[EmbeddingBagCollection]:
        return self._module_type

    @property
    def sharded_module_type(self) -> Type[ShardedEmbeddingBagCollection]:
        return ShardedEmbeddingBagCollection


def sharders(**kwargs) -> List[EmbeddingBagCollectionSharder]:
    """One recxla sharder for torchrec's EmbeddingBagCollection and one for
    recxla.nn.EmbeddingBagCollection, with the same arguments (those of the sharder)."""
    from recxla.nn import EmbeddingBagCollection as RecxlaEmbeddingBagCollection

    return [EmbeddingBagCollectionSharder(**kwargs),
            EmbeddingBagCollectionSharder(module_type=RecxlaEmbeddingBagCollection, **kwargs)]
