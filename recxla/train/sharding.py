"""How the model is spread over the ranks: the sharder, the plan, DMP and the optimizers.

Both paths share everything here except the sharder (`build_sharder`) and, by default, the
plan: the same tables, the same DMP wrapping, the same dense optimizer, and the same embedding
optimizer through `fused_params`, exactly as TorchRec's sharder takes them. The recxla path's
sharder is `recxla.torchrec.EmbeddingBagCollectionSharder` (dedup'd input dist, recxla's lookup
and fused optimizer, quantized output all-to-all); the baseline's is TorchRec's own, with
FBGEMM's CPU codecs for --baseline-comms fp16/bf16.

The plan (`plan_sharding`): the recxla path's comes from TorchRec's planner with every table
model-parallel (table-wise, column-wise or table-column-wise on CPU; also row-wise on GPU),
estimated with TorchRec's sharder. The baseline plans as a TorchRec user's run does
(--baseline-plan torchrec): TorchRec's planner with the baseline's own sharder and no
constraints, so it may make small tables data-parallel (replicated, their gradients in DDP's
all-reduce and updated by the dense optimizer, as TorchRec does); --baseline-plan same gives it
the recxla path's plan. --data-parallel-tables lets the recxla path's plan make tables
data-parallel too, which gives it TorchRec's own plan (recxla's sharder hands those tables to
TorchRec's). An explicit --sharding TYPE is one plan for both.
"""

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torchrec.distributed.comm_ops import set_gradient_division
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper, DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import CommOp, ShardingEnv, ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recxla.distributed.fp8_all_reduce import FP8AllReduce, fp8_compress_hook
from recxla.distributed.powersgd_all_reduce import DEFAULT_START_STEP as DEFAULT_POWERSGD_START
from recxla.torchrec.data_parallel import DATA_PARALLEL, is_data_parallel
from recxla.train.config import TORCHREC_CPU_SHARDINGS, TrainConfig

# TorchRec's gradient division (torchrec.distributed.comm_ops), one setting for both paths:
# recxla's sharder follows TorchRec's global setting as TorchRec's does. Off: the embedding
# gradients are the sum over ranks of each rank's mean-loss gradient (the sparse learning rates
# were tuned so); on (TorchRec's default) they would be divided by the world size.
GRADIENT_DIVISION = False

SPARSE_OPTIMIZERS = {
    "sgd": EmbOptimType.EXACT_SGD,
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
}


def fused_params(config: TrainConfig) -> dict:
    """The embedding optimizer as TorchRec's sharders take it (FBGEMM's fused TBE update)."""
    return {"optimizer": SPARSE_OPTIMIZERS[config.sparse_optimizer],
            "learning_rate": config.sparse_lr}


def _baseline_codecs(comms: str) -> Optional[dict]:
    """TorchRec's own QComms codecs (FBGEMM's) in `comms` both ways, for the pooled and the
    sequence all-to-all; None for fp32. Built per op with get_qcomm_codecs: TorchRec's
    registry helper would turn bf16 into fp16 on CPU, while gloo carries bf16 all-to-alls
    fine."""
    if comms == "fp32":
        return None
    precision = CommType(comms)
    codecs = get_qcomm_codecs(QCommsConfig(forward_precision=precision,
                                           backward_precision=precision))
    return {CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name: codecs,
            CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL.name: codecs}


def build_sharder(config: TrainConfig, row_tables=None, replicas=None):
    """The EmbeddingBagCollection sharder of this run's path: a TorchRec
    EmbeddingBagCollectionSharder (the baseline) or recxla's subclass, for DMP and the
    planner. row_tables: the tables in row exchange (resolve_row_exchange); replicas: 2D's
    ReplicaSync."""
    if config.baseline:
        return EmbeddingBagCollectionSharder(
            fused_params=fused_params(config),
            qcomm_codecs_registry=_baseline_codecs(config.baseline_comms))
    from recxla.torchrec import EmbeddingBagCollectionSharder as RecxlaSharder

    return RecxlaSharder(fused_params=fused_params(config), fwd_comm=config.fwd_comm,
                         bwd_comm=config.bwd_comm, dedup_ids=config.dedup_ids,
                         row_exchange=row_tables if row_tables else "off", replicas=replicas)


def build_sharders(config: TrainConfig, row_tables=None, replicas=None) -> list:
    """Every sharder of this run's path, for DMP and the planner: build_sharder's, and the
    EmbeddingCollection sharder (TorchRec's with the baseline's codecs, or recxla's) that
    --model history's sequence tables need."""
    sharders = [build_sharder(config, row_tables, replicas)]
    if config.model != "history":
        return sharders
    if config.baseline:
        sharders.append(EmbeddingCollectionSharder(
            fused_params=fused_params(config),
            qcomm_codecs_registry=_baseline_codecs(config.baseline_comms)))
    else:
        from recxla.torchrec import EmbeddingCollectionSharder as RecxlaSequenceSharder

        sharders.append(RecxlaSequenceSharder(
            fused_params=fused_params(config), fwd_comm=config.fwd_comm,
            bwd_comm=config.bwd_comm, dedup_ids=config.dedup_ids, replicas=replicas))
    return sharders


def resolve_row_exchange(config: TrainConfig, tables, sample, shard_world: int) -> List[str]:
    """The table names in row exchange: --row-exchange auto judges on `sample` (a
    KeyedJaggedTensor every rank builds alike) and the sharding group's size `shard_world`,
    all, off, or the names given."""
    names = [t.name for t in tables]
    choice = config.row_exchange
    if config.baseline or choice == "off":
        return []
    if choice == "all":
        return names
    if choice == "auto":
        from recxla.torchrec import choose_row_tables

        return choose_row_tables(tables, sample, config.micro_batches, world_size=shard_world)
    wanted = [n.strip() for n in choice.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise ValueError(f"--row-exchange: unknown table(s) {unknown}; tables: {names}")
    return wanted


def sharder_description(config: TrainConfig, row_tables=()) -> str:
    sequence = " and EmbeddingCollectionSharder" if config.model == "history" else ""
    if config.baseline:
        plan = "" if config.sharding != "auto" else (
            ", TorchRec's own plan" if config.baseline_plan == "torchrec"
            else ", the recxla path's plan")
        return (f"torchrec EmbeddingBagCollectionSharder{sequence}, {config.baseline_comms} "
                f"comms{plan}")
    dedup = "dedup'd ids" if config.dedup_ids else "ids not dedup'd"
    rows = f", row exchange for {len(row_tables)} tables" if row_tables else ""
    plan = ", TorchRec's own plan" if config.data_parallel_tables else ""
    return (f"recxla EmbeddingBagCollectionSharder{sequence}, {config.fwd_comm}/"
            f"{config.bwd_comm} comms, {dedup}{rows}{plan}")


def gradient_division_description() -> str:
    """How both paths scale the embedding gradients (start-up line and metrics)."""
    if GRADIENT_DIVISION:
        return ("embedding gradients divided by the world size (TorchRec's gradient division "
                "on, both paths)")
    return ("embedding gradients summed over ranks (TorchRec's gradient division off, both "
            "paths)")


def plan_sharding(model: torch.nn.Module, config: TrainConfig, tables, world_size: int,
                  local_world_size: int, device: torch.device,
                  group: Optional[dist.ProcessGroup] = None) -> ShardingPlan:
    """The run's plan, by TorchRec's planner (collectively, so every rank agrees): every table
    restricted to `config.sharding` (auto: the model-parallel types both sharders offer on this
    device, and data_parallel with --data-parallel-tables), estimated with TorchRec's sharder;
    or, for the baseline with --sharding auto and --baseline-plan torchrec, TorchRec's own
    choice with the baseline's sharder (module docstring)."""
    if config.baseline and config.sharding == "auto" and config.baseline_plan == "torchrec":
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world_size, compute_device=device.type,
                              local_world_size=local_world_size),
            batch_size=config.batch_size)
        return planner.collective_plan(model, build_sharders(config),
                                       group or dist.GroupMember.WORLD)
    if config.sharding == "auto":
        # Model-parallel tables only, unless asked: recxla's lookup, dedup and wire formats
        # work on sharded tables (a data-parallel one is TorchRec's dense kernel, its whole
        # gradient in the dense all-reduce). On GPU TorchRec also row-shards.
        types = list(TORCHREC_CPU_SHARDINGS)
        if device.type != "cpu":
            types += ["row_wise", "table_row_wise"]
        if config.data_parallel_tables:
            # With every type TorchRec's sharder offers here, the planner makes TorchRec's own
            # choice (tests/test_train_plan.py).
            types.append(DATA_PARALLEL)
    else:
        types = [config.sharding]
    constraints = {t.name: ParameterConstraints(sharding_types=types) for t in tables}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device=device.type,
                          local_world_size=local_world_size),
        batch_size=config.batch_size, constraints=constraints)
    if config.sharding == "row_wise" and device.type == "cpu":
        sharders = build_sharders(config)  # only recxla's offers it for pooled tables
    else:
        sharders = [EmbeddingBagCollectionSharder(fused_params=fused_params(config))]
        if config.model == "history":
            sharders.append(EmbeddingCollectionSharder(fused_params=fused_params(config)))
    return planner.collective_plan(model, sharders, group or dist.GroupMember.WORLD)


def data_parallel_tables(plan: ShardingPlan) -> List[str]:
    """The tables `plan` makes data-parallel."""
    return [name for module_plan in plan.plan.values() for name, param in module_plan.items()
            if is_data_parallel(param)]


def plan_summary(plan: ShardingPlan) -> Dict[str, dict]:
    """{table: {"sharding": type, "ranks": [...]}} for the metrics file."""
    out = {}
    for module_plan in plan.plan.values():
        for name, param in module_plan.items():
            out[name] = {"sharding": param.sharding_type, "kernel": param.compute_kernel,
                         "ranks": list(param.ranks or [])}
    return out


def shard_model(model: torch.nn.Module, sharders: list, plan: ShardingPlan,
                device: torch.device, config: Optional[TrainConfig] = None,
                topology=None) -> DistributedModelParallel:
    """DMP of `model` with `sharders` (build_sharders) and `plan`. The dense part's gradient
    all-reduce goes through torch's Python all-reduce hook (the same math as DDP's built-in
    one), so that the communication meter sees it.

    Sets TorchRec's gradient division to GRADIENT_DIVISION, which both sharders read: both
    paths scale the embedding gradients alike (`gradient_division_description`).

    The recxla path's all-reduce hook is recxla.pipeline's (it accumulates micro-batches and
    sends bf16 with --dense-allreduce bf16); the baseline's is torch's allreduce_hook or
    bf16_compress_hook. DDP's buckets: config.ddp_bucket_mb (the recxla path's default:
    config.RECXLA_DDP_BUCKET_MB), else TorchRec's default.
    topology: 2D's Topology2D (DMP over one node's shard group, DDP over every rank)."""
    set_gradient_division(GRADIENT_DIVISION)
    options = {}
    env = ShardingEnv.from_process_group(dist.GroupMember.WORLD)
    ddp_options = {}
    if config is not None and config.ddp_bucket_mb is not None:
        ddp_options["bucket_cap_mb"] = config.ddp_bucket_mb
    if topology is not None:
        from recxla.torchrec.replicas import WorldDataParallelWrapper

        env = topology.shard_env
        options["data_parallel_wrapper"] = WorldDataParallelWrapper(**ddp_options)
    elif ddp_options:
        options["data_parallel_wrapper"] = DefaultDataParallelWrapper(**ddp_options)
    dmp = DistributedModelParallel(model, env=env, device=device, sharders=list(sharders),
                                   plan=plan, **options)
    ddp = dmp._dmp_wrapped_module
    if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and \
            (config is None or config.baseline):
        wire = "fp32" if config is None else config.dense_allreduce
        if wire == "powersgd":
            ddp.register_comm_hook(powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=config.powersgd_rank,
                start_powerSGD_iter=powersgd_start(config), **TORCH_POWERSGD),
                powerSGD_hook.powerSGD_hook)
        elif wire != "fp8":  # fp8: baseline_dense_state
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook if wire == "bf16"
                                   else default_hooks.allreduce_hook)
    return dmp


# torch's PowerSGD hook as the baseline's --dense-allreduce powersgd (--powersgd-rank,
# --powersgd-start as recxla's PowerSGDAllReduce): error feedback and warm start (torch's
# defaults); the seed fixed so that every run compresses alike.
TORCH_POWERSGD = {"use_error_feedback": True, "warm_start": True, "random_seed": 0}


def powersgd_start(config) -> int:
    """--powersgd-start, or PowerSGDAllReduce's default: the same on both paths."""
    return DEFAULT_POWERSGD_START if config.powersgd_start is None else config.powersgd_start


def baseline_dense_state(dmp, config) -> Optional[FP8AllReduce]:
    """The baseline's compressed dense all-reduce whose state the checkpoints carry: with
    --dense-allreduce fp8, recxla's DDP hook registered on TorchRec's DDP as any TorchRec user
    can (recxla.distributed.fp8_compress_hook). None otherwise (the baseline's powersgd is
    torch's hook, its state its own; on the recxla path the pipeline owns the state,
    TrainPipeline.dense_allreduce_state)."""
    if not config.baseline or config.dense_allreduce != "fp8":
        return None
    ddp = dmp._dmp_wrapped_module
    state = FP8AllReduce.for_ddp(ddp)
    ddp.register_comm_hook(state, fp8_compress_hook)
    return state


def dense_optimizer_kwargs(optimizer: str, device_type: str) -> dict:
    """How the dense optimizer runs its update: fused (one kernel over every tensor instead of
    a Python loop of small ops; Adagrad on the default DLRM's 12 dense tensors, 1 thread: 0.39
    against 1.47 ms a step) where torch has that kernel, else foreach (one op per step over
    all tensors). torch's fused Adagrad has no CUDA kernel. Same update and state_dict either
    way, so checkpoints of one load into the other."""
    if optimizer == "adagrad" and device_type == "cuda":
        return {"foreach": True}
    return {"fused": True}


def build_optimizer(dmp: DistributedModelParallel, config: TrainConfig) -> KeyedOptimizer:
    """The embedding tables' fused optimizer (DMP's) combined with the dense one."""
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    device_type = next(iter(dense.values())).device.type if dense else "cpu"
    kwargs = dense_optimizer_kwargs(config.dense_optimizer, device_type)
    if config.dense_optimizer == "adagrad":
        make = lambda params: torch.optim.Adagrad(params, lr=config.dense_lr, **kwargs)  # noqa: E731
    else:
        make = lambda params: torch.optim.SGD(params, lr=config.dense_lr, **kwargs)  # noqa: E731
    return CombinedOptimizer([dmp.fused_optimizer, KeyedOptimizerWrapper(dense, make)])


def embedding_tables(dmp: DistributedModelParallel) -> List[Tuple[str, object]]:
    """(state_dict key, ShardedTensor) of every sharded embedding table."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    return [(k, v) for k, v in dmp.state_dict().items() if isinstance(v, ShardedTensor)]
