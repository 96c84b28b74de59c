"""recxla's sharder in place of TorchRec's trains and checkpoints as TorchRec's does.

Every test runs TorchRec's own EmbeddingBagCollectionSharder and recxla's on the same tables,
plan and batches on 2 gloo ranks (fp32 comms) and compares the tables, after fused-optimizer
steps, to TorchRec's:
- TorchRec's gradient division (on by default, `set_gradient_division(False)` turns it off), on
  the module's own backward and on recxla.pipeline's micro-batch path, for every sharding type
  TorchRec's CPU sharder offers; row-wise and table-row-wise (which it does not offer on CPU)
  against the unsharded module with the division's factor;
- the default fused optimizer when fused_params name none;
- checkpoints with optimizer state (SGD, Adagrad, row-wise Adagrad) through
  torch.distributed.checkpoint, TorchRec -> recxla -> TorchRec: same keys and ShardedTensor
  layouts, and training goes on identically.
"""

import pytest
import torch
from distributed_utils import run_distributed

import sharded_cases as cases

pytestmark = pytest.mark.distributed

LR = 0.1
STEPS = 2
BATCH = 6  # samples per rank
TORCHREC_CPU_KINDS = ("table_wise", "column_wise", "table_column_wise")


def _plan(configs, kinds, world):
    """A plan TorchRec's CPU sharder runs: per table its kind (kinds[t % len(kinds)]); two
    even column blocks (multiples of 4 columns, as FBGEMM needs), one per rank. (TorchRec's
    own sharded module fails on two column blocks of a table on one rank, and its
    load_state_dict on uneven column blocks.)"""
    out = {}
    for t, c in enumerate(configs):
        kind = kinds[t % len(kinds)]
        e, d = c.num_embeddings, c.embedding_dim
        if kind == "table_wise":
            shards = [(0, e, 0, d, (t + 1) % world)]
        elif kind in ("column_wise", "table_column_wise"):
            shards = [(0, e, 0, d // 2, t % world), (0, e, d // 2, d - d // 2, (t + 1) % world)]
        else:  # row_wise, table_row_wise: TorchRec's ceil(E / W) blocks
            block = -(-e // world)
            shards = [(min(r * block, e), max(0, min(block, e - r * block)), 0, d, r)
                      for r in range(world)]
        out[c.name] = _spec(kind, shards)
    return out


def _spec(kind, shards):
    """ParameterSharding of shards (row_offset, rows, col_offset, cols, rank); `ranks` in shard
    order, which TorchRec's column-wise sharding reads as the placement."""
    from torchrec.distributed.types import EnumerableShardingSpec, ParameterSharding, ShardMetadata

    return ParameterSharding(
        sharding_type=kind, compute_kernel="fused", ranks=[s[4] for s in shards],
        sharding_spec=EnumerableShardingSpec([
            ShardMetadata(shard_offsets=[r0, c0], shard_sizes=[nr, nc], placement=f"rank:{r}/cpu")
            for r0, nr, c0, nc, r in shards]))


def _shard(sharder_name, module, plan, fused_params):
    """module sharded by TorchRec's sharder ("torchrec") or recxla's ("recxla")."""
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.types import ShardingEnv

    import recxla.torchrec

    if sharder_name == "torchrec":
        sharder = EmbeddingBagCollectionSharder(fused_params=fused_params)
    else:
        sharder = recxla.torchrec.EmbeddingBagCollectionSharder(
            fused_params=fused_params, fwd_comm="fp32", bwd_comm="fp32")
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    return sharder.shard(module, plan, env, torch.device("cpu"))


def _set_weights(sharded, full):
    """Copies the blocks of full tensors {key: [rows, cols]} into the local shards (TorchRec's
    sharded module initialises its own shards rather than copying the module's)."""
    with torch.no_grad():
        for key, value in sharded.state_dict().items():
            for shard in getattr(value, "local_shards", list)():
                (r0, c0), (nr, nc) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(full[key][r0: r0 + nr, c0: c0 + nc])


def _train(sharded, configs, rank, world, seed, steps=STEPS):
    """`steps` SGD-like steps of the sharded module on fresh batches (seeded: every call sees
    the same ones), loss = sum(output * random coefficients)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = cases.global_batch(configs, world * BATCH, generator)
        coef = torch.randn(world * BATCH, sum(c.embedding_dim * len(c.feature_names)
                                               for c in configs), generator=generator)
        out = sharded(cases.sample_slice(batch, rank * BATCH, (rank + 1) * BATCH)).wait()
        (_by_key(out) * coef[rank * BATCH: (rank + 1) * BATCH]).sum().backward()


def _by_key(keyed):
    """A KeyedTensor's values with its keys in sorted order (TorchRec's sharded module orders
    them by sharding, recxla's as the unsharded module)."""
    columns = keyed.to_dict()
    return torch.cat([columns[k] for k in sorted(columns)], dim=1)


def _local_shards(state_dict):
    """{key: [local shard tensors]} of a (nested) sharded state dict."""
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif hasattr(value, "local_shards"):
            out[prefix] = [s.tensor.detach().clone() for s in value.local_shards()]
        elif isinstance(value, torch.Tensor):
            out[prefix] = [value.detach().clone()]
    walk("", state_dict)
    return out


def _worst(got, want):
    """Largest relative difference between two _local_shards results (same keys asserted)."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max((cases.relative(g, w) for k in want for g, w in zip(got[k], want[k])),
               default=0.0)


def _against_torchrec(kinds, fused_params, rank, world, seed, attach=None):
    """recxla's tables after STEPS steps vs TorchRec's -> (relative error, how far recxla's
    tables moved). attach: (optimizer class, kwargs) applied to every table of the module
    (built on CPU) with apply_optimizer_in_backward before both sharders take it."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    torch.manual_seed(seed)
    configs = cases.tables()
    plan = _plan(configs, kinds, world)
    module = EmbeddingBagCollection(configs)
    if attach is not None:
        apply_optimizer_in_backward(attach[0], module.parameters(), dict(attach[1]))
    modules = {name: _shard(name, module, plan, fused_params) for name in ("torchrec", "recxla")}
    for sharded in modules.values():
        _set_weights(sharded, module.state_dict())
    start = _local_shards(modules["recxla"].state_dict())
    for sharded in modules.values():
        _train(sharded, configs, rank, world, seed + 1)
    got = _local_shards(modules["recxla"].state_dict())
    want = _local_shards(modules["torchrec"].state_dict())
    moved = max(float((g - s).abs().max()) for k in got for g, s in zip(got[k], start[k])
                if g.numel())
    return _worst(got, want), moved


def _against_unsharded(kind, division, rank, world, seed):
    """recxla's tables (fused SGD) vs the unsharded module's plain SGD on the ranks' summed
    losses, divided by the world size under TorchRec's gradient division."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(seed)
    configs = cases.tables()
    reference = EmbeddingBagCollection(configs)
    module = EmbeddingBagCollection(configs)
    module.load_state_dict(reference.state_dict())
    sharded = _shard("recxla", module, _plan(configs, [kind], world),
                     {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR})
    _train(sharded, configs, rank, world, seed + 1)
    generator = torch.Generator().manual_seed(seed + 1)
    factor = 1.0 / world if division else 1.0
    for _ in range(STEPS):
        batch = cases.global_batch(configs, world * BATCH, generator)
        coef = torch.randn(world * BATCH, sum(c.embedding_dim * len(c.feature_names)
                                               for c in configs), generator=generator)
        (_by_key(reference(batch)) * coef).sum().backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= LR * factor * p.grad
                p.grad = None
    return cases.shard_errors(sharded.state_dict(), reference.state_dict())


def _pipeline_against_torchrec(rank, world, seed):
    """TorchRec's DLRM: TorchRec's sharder with the plain loop vs recxla's sharder under
    recxla.pipeline.TrainPipeline (2 micro-batches), same plan -> tables' relative error."""
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import recxla.torchrec
    import test_sharded_dlrm as dlrm
    from recxla.pipeline import TrainPipeline

    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
    states = {}
    for name in ("torchrec", "recxla"):
        model, configs = dlrm._dlrm(seed)
        sharder = EmbeddingBagCollectionSharder(fused_params=fused) if name == "torchrec" else \
            recxla.torchrec.EmbeddingBagCollectionSharder(fused_params=fused, fwd_comm="fp32",
                                                          bwd_comm="fp32")
        plan = ShardingPlan({"model.sparse_arch.embedding_bag_collection": _plan(
            configs, ["table_wise", "column_wise"], world)})
        full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        dmp = DistributedModelParallel(model, ShardingEnv.from_process_group(dist.group.WORLD),
                                       torch.device("cpu"), sharders=[sharder], plan=plan)
        _set_weights(dmp, full)
        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: torch.optim.SGD(params, lr=LR))
        generator = torch.Generator().manual_seed(seed + 1)
        batches = [dlrm._slice(dlrm._batch(configs, world * BATCH, generator), rank * BATCH,
                               (rank + 1) * BATCH) for _ in range(STEPS)]
        if name == "torchrec":
            for b in batches:
                dense.zero_grad()
                dmp(b)[0].backward()
                dense.step()
        else:
            pipeline = TrainPipeline(dmp, dense, torch.device("cpu"), num_micro_batches=2)
            data = iter(batches)
            for _ in batches:
                pipeline.progress(data)
        states[name] = _local_shards(dmp.state_dict())
    return _worst(states["recxla"], states["torchrec"])


def _division_body(rank, world, seed):
    from torchrec.distributed.comm_ops import set_gradient_division
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    sgd = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
    results = {}
    try:
        for division in (True, False):
            set_gradient_division(division)
            for kind in TORCHREC_CPU_KINDS:
                results[division, kind] = _against_torchrec([kind], sgd, rank, world, seed)[0]
            for kind in ("row_wise", "table_row_wise"):
                results[division, kind] = _against_unsharded(kind, division, rank, world, seed)
        set_gradient_division(True)
        results[True, "pipeline"] = _pipeline_against_torchrec(rank, world, seed)
    finally:
        set_gradient_division(True)
    return results


def test_gradient_division_as_torchrec(seed):
    """With TorchRec's gradient division on (its default) and off, SGD steps move recxla's
    tables exactly as TorchRec's sharder moves them (row-sharded: as the unsharded module
    with the division's factor), through the module and through recxla.pipeline."""
    for rank, results in enumerate(run_distributed(_division_body, world_size=2, args=(seed,),
                                                   timeout=300)):
        for case, error in results.items():
            assert error <= 1e-5, (rank, case, error)


def _default_optimizer_body(rank, world, seed):
    results = {}
    for name, fused in (("None", None), ("no optimizer", {"learning_rate": 0.05})):
        results[name] = _against_torchrec(["table_wise", "column_wise"], fused, rank, world,
                                          seed)
    return results


def test_default_fused_optimizer_as_torchrec(seed):
    """fused_params that name no optimizer (None too): TorchRec's sharder trains the tables
    with FBGEMM's default (EXACT_SGD, lr 0.01 unless given); recxla's does the same."""
    for rank, results in enumerate(run_distributed(_default_optimizer_body, world_size=2,
                                                   args=(seed,), timeout=300)):
        for case, (error, moved) in results.items():
            assert moved > 0, (rank, case)
            assert error <= 1e-5, (rank, case, error)


def _optimizer_semantics_body(rank, world, seed):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import optim as trec_optim

    # (Row-wise Adagrad with weight_decay_mode L2 is not compared here: FBGEMM's CPU build
    # 1.9.0 applies no weight decay in any mode, where its CUDA kernels apply L2; recxla applies
    # L2 as the CUDA kernels and FBGEMM's CPU template do: tests/test_shard_layout.py.)
    rowwise = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    cases_ = {
        "row-wise, weight decay in FBGEMM's default mode (none)": (
            {**rowwise, "weight_decay": 0.5}, None),
        "SGD, weight decay (FBGEMM's SGD has none)": (
            {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.05, "weight_decay": 0.5},
            None),
        "RowWiseAdagrad attached, lr only (FBGEMM's eps)": (
            None, (trec_optim.RowWiseAdagrad, {"lr": 0.05})),
        "torchrec.optim.Adagrad attached over fused_params' eps": (
            {"eps": 1e-3}, (trec_optim.Adagrad, {"lr": 0.05})),
    }
    return {name: _against_torchrec(["table_wise", "column_wise"], fused, rank, world, seed,
                                    attach)
            for name, (fused, attach) in cases_.items()}


def test_fused_optimizer_semantics_as_torchrec(seed):
    """TorchRec builds each table's FBGEMM update from the sharder's fused_params and the
    attached optimizer's kwargs merged over them, with FBGEMM's defaults (eps 1e-8, no weight
    decay unless row-wise Adagrad's weight_decay_mode asks for it); recxla's tables end where
    TorchRec's do (row-wise Adagrad on a CPU-built module included, whose kwargs TorchRec's
    sharder rewrites in place)."""
    for rank, results in enumerate(run_distributed(_optimizer_semantics_body, world_size=2,
                                                   args=(seed,), timeout=300)):
        for case, (error, moved) in results.items():
            assert moved > 0, (rank, case)
            assert error <= 1e-4, (rank, case, error)


def _layout(state_dict):
    """{key: (global size, sorted (offsets, sizes, placement))} of the ShardedTensors in a
    nested state dict, and the plain entries' keys."""
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            out[prefix] = "dict"
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif hasattr(value, "metadata"):
            out[prefix] = (tuple(value.size()), sorted(
                (tuple(m.shard_offsets), tuple(m.shard_sizes), str(m.placement))
                for m in value.metadata().shards_metadata))
        else:
            out[prefix] = type(value).__name__
    walk("", state_dict)
    return out


def _checkpoint_body(rank, world, seed, path):
    """Per optimizer: TorchRec trains and saves (DCP); recxla loads it and both train on;
    recxla saves, TorchRec loads it and both train on. -> per optimizer: layouts equal,
    and the errors after each load and each stretch of training."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    import recxla.torchrec
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    configs = cases.tables()
    plan = ShardingPlan({"": _plan(configs, ["table_wise", "column_wise", "table_column_wise"],
                                   world)})
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    results = {}
    for optimizer in (EmbOptimType.EXACT_SGD, EmbOptimType.EXACT_ADAGRAD,
                      EmbOptimType.EXACT_ROWWISE_ADAGRAD):
        fused = {"optimizer": optimizer, "learning_rate": LR, "eps": 1e-3}

        def build(name, init_seed):
            torch.manual_seed(init_seed)
            sharder = EmbeddingBagCollectionSharder(fused_params=fused) if name == "torchrec" \
                else recxla.torchrec.EmbeddingBagCollectionSharder(
                    fused_params=fused, fwd_comm="fp32", bwd_comm="fp32")
            return DistributedModelParallel(EmbeddingBagCollection(configs), env,
                                            torch.device("cpu"), sharders=[sharder], plan=plan)

        def state(dmp):
            out = {"model": dmp.state_dict()}
            optim = dmp.fused_optimizer.state_dict()
            if any(entry for entry in optim["state"].values()):
                # DCP cannot load a container with no tensors (SGD's state is {} per table).
                out["optim"] = optim
            return out

        def layout(dmp):
            return _layout({**state(dmp), "optim": dmp.fused_optimizer.state_dict()})

        def save(dmp, folder):
            dcp.save(state(dmp), checkpoint_id=folder)

        def load(dmp, folder):
            target = state(dmp)
            dcp.load(target, checkpoint_id=folder)
            dmp.load_state_dict(target["model"])
            if "optim" in target:
                dmp.fused_optimizer.load_state_dict(target["optim"])

        errors = []
        first = build("torchrec", seed)
        _train(first, configs, rank, world, seed + 1)
        folder = f"{path}/{optimizer.value}"
        save(first, f"{folder}/torchrec")
        moved = build("recxla", seed + 7)
        same_layout = layout(moved) == layout(first)
        load(moved, f"{folder}/torchrec")
        errors.append(_worst(_local_shards(state(moved)), _local_shards(state(first))))
        for dmp in (first, moved):
            _train(dmp, configs, rank, world, seed + 2)
        errors.append(_worst(_local_shards(state(moved)), _local_shards(state(first))))
        save(moved, f"{folder}/recxla")
        back = build("torchrec", seed + 9)
        load(back, f"{folder}/recxla")
        errors.append(_worst(_local_shards(state(back)), _local_shards(state(moved))))
        for dmp in (back, moved):
            _train(dmp, configs, rank, world, seed + 3)
        errors.append(_worst(_local_shards(state(back)), _local_shards(state(moved))))
        trained = _worst(_local_shards(state(back)), _local_shards(state(build("torchrec",
                                                                              seed))))
        results[optimizer.value] = (same_layout, errors, trained)
        dist.barrier()
    return results


def test_checkpoint_with_optimizer_state_torchrec_to_recxla_and_back(seed, tmp_path):
    """A DCP checkpoint of TorchRec's sharded tables and fused optimizer state loads into
    recxla's sharded module (same keys, ShardedTensor sizes, offsets and placements) and
    recxla's back into TorchRec's, for SGD, Adagrad and row-wise Adagrad over table-wise,
    column-wise and table-column-wise tables; after each load both train on identically."""
    path = str(tmp_path)
    for rank, results in enumerate(run_distributed(_checkpoint_body, world_size=2,
                                                   args=(seed, path), timeout=300)):
        for optimizer, (same_layout, errors, trained) in results.items():
            assert same_layout, (rank, optimizer)
            assert max(errors) <= 1e-5, (rank, optimizer, errors)
            assert trained > 1e-3, (rank, optimizer, trained)  # the steps changed the tables
