"""recxla's sharders: the one line that moves a TorchRec model's embeddings onto recxla.

    sharders = recxla.torchrec.sharders(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05},
        fwd_comm="e4m3", bwd_comm="bf16")
    plan = EmbeddingShardingPlanner(topology).collective_plan(model, sharders, pg)
    model = DistributedModelParallel(model, env, device, sharders=sharders, plan=plan)

`EmbeddingBagCollectionSharder` is TorchRec's EmbeddingBagCollectionSharder with recxla's
pooled module (`recxla.torchrec.ShardedEmbeddingBagCollection`); `EmbeddingCollectionSharder`
is TorchRec's EmbeddingCollectionSharder with recxla's sequence module
(`recxla.torchrec.ShardedEmbeddingCollection`). Both offer row-wise sharding on CPU as well
(TorchRec's CPU sharders cannot: gloo has no reduce-scatter). Tables the plan makes
data_parallel are replicated, as TorchRec does (data_parallel.py). DistributedModelParallel
picks a sharder by the module's exact type, so one sharder serves one module type: TorchRec's
EmbeddingBagCollection by default, `recxla.nn.EmbeddingBagCollection` with
`module_type=recxla.nn.EmbeddingBagCollection`, TorchRec's EmbeddingCollection;
`sharders(...)` returns all three. DistributedModelParallel leaves a module no given sharder
handles unsharded; `recxla.torchrec.unsharded_embedding_modules` names such modules.
"""

from typing import Any, Dict, List, Optional, Sequence, Type, Union

import torch
from torchrec.distributed.embedding import (
    EmbeddingCollectionSharder as TorchRecEmbeddingCollectionSharder,
)
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder as TorchRecEmbeddingBagCollectionSharder,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from recxla.formats import DEFAULT_BWD_COMM, DEFAULT_FWD_COMM, get_format
from recxla.torchrec.replicas import ReplicaSync
from recxla.torchrec.sharded_embedding import SEQUENCE_SHARDING_TYPES, ShardedEmbeddingCollection
from recxla.torchrec.sharded_embedding_bag import (
    SUPPORTED_SHARDING_TYPES,
    ShardedEmbeddingBagCollection,
)

NAME = "recxla.torchrec.EmbeddingBagCollectionSharder"
SEQUENCE_NAME = "recxla.torchrec.EmbeddingCollectionSharder"


def _check_options(name: str, fwd_comm: str, bwd_comm: str, dedup_ids: bool,
                   replicas: Optional[ReplicaSync]) -> None:
    """The options both sharders take (TypeError/ValueError naming the sharder)."""
    get_format(fwd_comm, name, "fwd_comm")
    get_format(bwd_comm, name, "bwd_comm")
    if not isinstance(dedup_ids, bool):
        raise TypeError(f"{name}: dedup_ids must be a bool, got {dedup_ids!r}")
    if replicas is not None and not isinstance(replicas, ReplicaSync):
        raise TypeError(f"{name}: replicas must be a recxla.torchrec.replicas.ReplicaSync, "
                        f"got {type(replicas).__name__}")


def _compute_kernels(sharding_type: str) -> List[str]:
    if sharding_type == ShardingType.DATA_PARALLEL.value:
        # Data-parallel tables get ordinary gradients (TorchRec's dense kernel).
        return [EmbeddingComputeKernel.DENSE.value]
    # recxla's lookup (the planner's estimates treat it as TorchRec's fused kernel).
    return [EmbeddingComputeKernel.FUSED.value]


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

    def __init__(self, fused_params: Optional[Dict[str, Any]] = None,
                 fwd_comm: str = DEFAULT_FWD_COMM, bwd_comm: str = DEFAULT_BWD_COMM,
                 dedup_ids: bool = True,
                 module_type: Optional[Type[EmbeddingBagCollection]] = None,
                 replicas: Optional[ReplicaSync] = None,
                 row_exchange: Union[str, Sequence[str]] = "off") -> None:
        super().__init__(fused_params=fused_params)
        _check_options(NAME, fwd_comm, bwd_comm, dedup_ids, replicas)
        module_type = EmbeddingBagCollection if module_type is None else module_type
        if not (isinstance(module_type, type) and issubclass(module_type, EmbeddingBagCollection)):
            raise TypeError(f"{NAME}: module_type must be torchrec's EmbeddingBagCollection or a "
                            f"subclass, got {module_type!r}")
        self._fwd_comm, self._bwd_comm, self._dedup_ids = fwd_comm, bwd_comm, dedup_ids
        self._module_type = module_type
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
        return _compute_kernels(sharding_type)

    def reshard(self, *args, **kwargs):
        raise NotImplementedError(f"{NAME}: resharding a live module is not supported; save a "
                                  "checkpoint and load it into a module sharded the new way")

    @property
    def module_type(self) -> Type[EmbeddingBagCollection]:
        return self._module_type

    @property
    def sharded_module_type(self) -> Type[ShardedEmbeddingBagCollection]:
        return ShardedEmbeddingBagCollection


class EmbeddingCollectionSharder(TorchRecEmbeddingCollectionSharder):
    """Shards EmbeddingCollections (sequence embeddings) onto recxla: each row a rank needs
    sent once, FP8 row-wise by default (recxla.torchrec.ShardedEmbeddingCollection).

    Args:
        fused_params: as for TorchRec's sharder (see EmbeddingBagCollectionSharder); every
            model-parallel table gets the fused optimizer (an optimizer attached with
            `apply_optimizer_in_backward` takes precedence).
        fwd_comm: wire format of the rows: "e4m3" (default), "e5m2", "bf16", "fp16" or "fp32".
        bwd_comm: wire format of their gradients (default "e5m2", recxla.formats).
        dedup_ids: as for EmbeddingBagCollectionSharder (the rows' ids always travel
            deduplicated).
        replicas: 2D training: a recxla.torchrec.replicas.ReplicaSync for the replica group.
        max_sequence_length: the longest sequence a batch may hold (None: no limit); a
            longer one raises a ValueError naming the feature on every rank.
    """

    def __init__(self, fused_params: Optional[Dict[str, Any]] = None,
                 fwd_comm: str = DEFAULT_FWD_COMM, bwd_comm: str = DEFAULT_BWD_COMM,
                 dedup_ids: bool = True, replicas: Optional[ReplicaSync] = None,
                 max_sequence_length: Optional[int] = None) -> None:
        super().__init__(fused_params=fused_params)
        _check_options(SEQUENCE_NAME, fwd_comm, bwd_comm, dedup_ids, replicas)
        if max_sequence_length is not None and (
                not isinstance(max_sequence_length, int) or isinstance(max_sequence_length, bool)
                or max_sequence_length < 1):
            raise ValueError(f"{SEQUENCE_NAME}: max_sequence_length must be None or an int "
                             f">= 1, got {max_sequence_length!r}")
        self._fwd_comm, self._bwd_comm, self._dedup_ids = fwd_comm, bwd_comm, dedup_ids
        self._replicas = replicas
        self._max_sequence_length = max_sequence_length

    def shard(self, module: EmbeddingCollection, params: Dict[str, ParameterSharding],
              env: ShardingEnv, device: Optional[torch.device] = None,
              module_fqn: Optional[str] = None) -> ShardedEmbeddingCollection:
        return ShardedEmbeddingCollection(
            module, params, env, fused_params=self.fused_params, device=device,
            fwd_comm=self._fwd_comm, bwd_comm=self._bwd_comm, dedup_ids=self._dedup_ids,
            module_fqn=module_fqn, replicas=self._replicas,
            max_sequence_length=self._max_sequence_length)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(SEQUENCE_SHARDING_TYPES)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        return _compute_kernels(sharding_type)

    def reshard(self, *args, **kwargs):
        raise NotImplementedError(f"{SEQUENCE_NAME}: resharding a live module is not "
                                  "supported; save a checkpoint and load it into a module "
                                  "sharded the new way")

    @property
    def module_type(self) -> Type[EmbeddingCollection]:
        return EmbeddingCollection

    @property
    def sharded_module_type(self) -> Type[ShardedEmbeddingCollection]:
        return ShardedEmbeddingCollection


def sharders(max_sequence_length: Optional[int] = None,
             **kwargs) -> List[Union[EmbeddingBagCollectionSharder, EmbeddingCollectionSharder]]:
    """recxla's sharders for every module type it shards, with the same arguments: one for
    torchrec's EmbeddingBagCollection and one for recxla.nn.EmbeddingBagCollection (the
    arguments of EmbeddingBagCollectionSharder), and one for torchrec's EmbeddingCollection
    (fused_params, fwd_comm, bwd_comm, dedup_ids, replicas, and max_sequence_length)."""
    from recxla.nn import EmbeddingBagCollection as RecxlaEmbeddingBagCollection

    sequence = {k: v for k, v in kwargs.items()
                if k in ("fused_params", "fwd_comm", "bwd_comm", "dedup_ids", "replicas")}
    return [EmbeddingBagCollectionSharder(**kwargs),
            EmbeddingBagCollectionSharder(module_type=RecxlaEmbeddingBagCollection, **kwargs),
            EmbeddingCollectionSharder(max_sequence_length=max_sequence_length, **sequence)]
