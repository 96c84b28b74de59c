"""recxla's sharder where it replaces TorchRec's: the models and inputs TorchRec's sharder takes.

Every test runs TorchRec's EmbeddingBagCollectionSharder and recxla's on the same model, plan and
batches (2 gloo ranks, one spawn per test with several cases inside) and compares: meta-device
models, input validation (duplicate keys), data-parallel tables, FP16 tables, variable batch
per feature.
"""

import copy

import pytest
import torch
from distributed_utils import run_distributed

import sharded_cases as cases

pytestmark = pytest.mark.distributed

WORLD = 2
LR = 0.1


def _configs(seed: int, data_type=None, mean: bool = True):
    """Four small tables: two dims, a feature read by two tables (f1), MEAN pooling on one
    (unless mean=False); t2 of `data_type` (default FP32)."""
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType

    generator = torch.Generator().manual_seed(seed)
    rows = [int(r) for r in torch.randint(20, 60, (4,), generator=generator)]
    return [
        EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=rows[0],
                           feature_names=["f0", "f1"]),
        EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=rows[1],
                           feature_names=["f2"],
                           pooling=PoolingType.MEAN if mean else PoolingType.SUM),
        EmbeddingBagConfig(name="t2", embedding_dim=8, num_embeddings=rows[2],
                           feature_names=["f3", "f1"],
                           data_type=data_type if data_type is not None else DataType.FP32),
        EmbeddingBagConfig(name="t3", embedding_dim=12, num_embeddings=rows[3],
                           feature_names=["f4"]),
    ]


def _plan(module, kinds, sharder):
    """TorchRec's planner, one sharding type per table (kinds), for `sharder`."""
    import torch.distributed as dist
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    constraints = {c.name: ParameterConstraints(sharding_types=[k])
                   for c, k in zip(module.embedding_bag_configs(), kinds)}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=WORLD, compute_device="cpu"),
                                       constraints=constraints)
    return planner.collective_plan(module, [sharder], dist.group.WORLD)


def _dmp(module, sharder, plan, device="cpu", init_data_parallel=True):
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    env = ShardingEnv.from_process_group(dist.group.WORLD)
    # DMP rewrites the plan's placements to its device: each DMP gets its own copy.
    return DistributedModelParallel(module, env, torch.device(device), sharders=[sharder],
                                    plan=copy.deepcopy(plan),
                                    init_data_parallel=init_data_parallel)


def _sharders(fused_params=None):
    """TorchRec's sharder and recxla's (fp32 wire formats: the comparison is exact)."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    import recxla.torchrec as rt

    return (EmbeddingBagCollectionSharder(fused_params=fused_params),
            rt.EmbeddingBagCollectionSharder(fused_params=fused_params, fwd_comm="fp32",
                                             bwd_comm="fp32"))


def _quiet():
    import logging

    logging.getLogger("torchrec").setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore")


def _shard_layout(value):
    """(offsets, sizes, placement) of every shard of a ShardedTensor, in metadata order."""
    return [(list(m.shard_offsets), list(m.shard_sizes), str(m.placement))
            for m in value.metadata().shards_metadata]


def _keyed_error(got, want) -> float:
    """Largest relative difference between two KeyedTensors, key by key (TorchRec's sharded
    output orders its keys by sharding type; recxla's keeps the unsharded module's order)."""
    if sorted(got.keys()) != sorted(want.keys()):
        return float("inf")
    got_dict, want_dict = got.to_dict(), want.to_dict()
    return max(cases.relative(got_dict[k].detach(), want_dict[k].detach()) for k in want.keys())


# ---------------------------------------------------------------------------- meta device


def _meta_body(rank, world, seed):
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    _quiet()
    configs = _configs(seed)
    kinds = ["table_wise", "column_wise", "table_column_wise", "table_wise"]
    torchrec_sharder, recxla_sharder = _sharders()
    meta = torch.device("meta")
    plan = _plan(EmbeddingBagCollection(configs, device=meta), kinds, torchrec_sharder)
    checks = {}

    # 1. DistributedModelParallel(device="meta"): shapes, keys and layouts, no values.
    states = []
    for sharder in (torchrec_sharder, recxla_sharder):
        dmp = _dmp(EmbeddingBagCollection(configs, device=meta), sharder, plan, device="meta")
        states.append(dmp.state_dict())
    want, got = states
    checks["meta_keys"] = (sorted(got), sorted(want))
    checks["meta_layouts"] = all(
        isinstance(got[k], ShardedTensor) and _shard_layout(got[k]) == _shard_layout(want[k])
        and all(s.tensor.device.type == "meta" for s in got[k].local_shards())
        and [tuple(s.tensor.shape) for s in got[k].local_shards()]
        == [tuple(s.tensor.shape) for s in want[k].local_shards()]
        for k in want)

    # 2. A model built on meta, materialised by DMP on the CPU: weights from each table's
    # init_fn (uniform in +-sqrt(1 / rows), as TorchRec's), then TorchRec's weights load
    # into it and both forward alike.
    models = [_dmp(EmbeddingBagCollection(configs, device=meta), s, plan)
              for s in (torchrec_sharder, recxla_sharder)]
    in_range = True
    for key, value in models[1].state_dict().items():
        bound = (1.0 / next(c.num_embeddings for c in configs
                            if key == f"embedding_bags.{c.name}.weight")) ** 0.5
        for shard in value.local_shards():
            t = shard.tensor
            in_range &= bool(t.numel() == 0 or (t.abs().max() <= bound and t.std() > 0))
    checks["init_in_range"] = in_range
    missing = models[1].load_state_dict(models[0].state_dict())
    checks["load_missing"] = (list(missing.missing_keys), list(missing.unexpected_keys))
    generator = torch.Generator().manual_seed(seed + 1 + rank)
    errors = []
    for _ in range(2):
        batch = cases.global_batch(configs, 6, generator)
        errors.append(_keyed_error(models[1](batch).wait(), models[0](batch).wait()))
    checks["forward_errors"] = errors
    return checks


def test_meta_device_models_match_torchrec(seed):
    for checks in run_distributed(_meta_body, WORLD, args=(seed,), timeout=300):
        got_keys, want_keys = checks["meta_keys"]
        assert got_keys == want_keys
        assert checks["meta_layouts"], "meta-device ShardedTensors differ from TorchRec's"
        assert checks["init_in_range"], "materialised shards are not from the tables' init_fn"
        assert checks["load_missing"] == ([], [])
        assert max(checks["forward_errors"]) < 1e-6, checks["forward_errors"]


# ---------------------------------------------------------------------------- input validation


def _raises(fn):
    """The exception fn() raises, as (type name, message), or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares what each sharder raises
        return type(e).__name__, str(e), isinstance(e, ValueError)
    return None


def _bad_batches(configs, generator):
    """Batches TorchRec's input validation refuses: a key twice, weights of the wrong size."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    good = cases.global_batch(configs, 5, generator)
    keys = good.keys()
    lengths = good.lengths().view(len(keys), -1)
    twice = KeyedJaggedTensor(
        keys=keys + [keys[0]],
        values=torch.cat([good.values(), good.values()[: int(lengths[0].sum())]]),
        lengths=torch.cat([lengths, lengths[:1]]).flatten())
    weights = KeyedJaggedTensor(keys=keys, values=good.values(), lengths=good.lengths(),
                                weights=torch.rand(good.values().numel() + 1, generator=generator))
    return good, {"duplicate_keys": twice, "weights_size": weights}


def _validation_body(rank, world, seed):
    import torch.distributed as dist
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    _quiet()
    configs = _configs(seed)
    kinds = ["table_wise", "column_wise", "table_wise", "table_column_wise"]
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    torch.manual_seed(seed)
    unsharded = EmbeddingBagCollection(configs)
    modules = []
    for sharder in _sharders():
        plan = _plan(unsharded, kinds, sharder)
        module = EmbeddingBagCollection(configs)
        module.load_state_dict(unsharded.state_dict())
        modules.append(sharder.shard(module, plan.plan[""], env, torch.device("cpu")))
    generator = torch.Generator().manual_seed(seed + 1)
    good, bad = _bad_batches(configs, generator)
    checks = {}
    for name, batch in bad.items():
        # Every rank passes the bad batch (TorchRec's sharder raises before any collective).
        checks[name] = [_raises(lambda m=m: m(batch).wait()) for m in modules]
    # Only rank 1's batch is bad: recxla raises on both ranks, no rank waits forever.
    checks["one_rank"] = _raises(lambda: modules[1](bad["duplicate_keys"] if rank == 1
                                                     else good).wait())
    # A good batch afterwards: recxla's module (which copied the unsharded weights) still
    # gives the unsharded module's output.
    checks["after"] = _keyed_error(modules[1](good).wait(), unsharded(good))
    return checks


def test_input_validation_refuses_what_torchrec_refuses(seed):
    ranks = run_distributed(_validation_body, WORLD, args=(seed,), timeout=300)
    for rank, checks in enumerate(ranks):
        for name, reason in (("duplicate_keys", "keys must be unique"),
                             ("weights_size", "weights size must equal to values size")):
            torchrec_error, recxla_error = checks[name]
            assert torchrec_error is not None and reason in torchrec_error[1], torchrec_error
            assert recxla_error is not None, f"recxla accepted the batch with {name}"
            assert recxla_error[2] and reason in recxla_error[1], recxla_error
            assert "ShardedEmbeddingBagCollection" in recxla_error[1]
        error = checks["one_rank"]
        assert error is not None and error[2], error
        assert ("keys must be unique" if rank == 1 else "rank(s) [1]") in error[1], error
        assert checks["after"] < 1e-6, checks["after"]


# ---------------------------------------------------------------------------- data parallel


def _train_keyed(model, optimizer, batch, coef):
    """One step: loss = sum over keys of <output[key], coef[key]>, backward, dense step (the
    fused optimizers update in backward). -> the output."""
    out = model(batch).wait()
    by_key = out.to_dict()
    sum((by_key[k] * coef[k]).sum() for k in coef).backward()
    optimizer.step()
    optimizer.zero_grad()
    return out


def _data_parallel_body(rank, world, seed):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torchrec.distributed import comm_ops
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    _quiet()
    # Both sharders sum the pooled embeddings' gradients here, so the comparison does not
    # depend on the gradient-division setting; data-parallel gradients are DDP's mean.
    comm_ops.set_gradient_division(False)
    configs = _configs(seed)
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
    checks = {}
    for case, kinds in (("mixed", ["table_wise", "data_parallel", "column_wise",
                                   "data_parallel"]),
                        ("all", ["data_parallel"] * 4)):
        sharders = _sharders(fused)
        torch.manual_seed(seed)
        unsharded = EmbeddingBagCollection(configs)
        plan = _plan(unsharded, kinds, sharders[1])
        checks[f"{case}_plan"] = [plan.plan[""][c.name].sharding_type for c in configs]
        models = []
        for sharder in sharders:
            module = EmbeddingBagCollection(configs)
            module.load_state_dict(unsharded.state_dict())
            models.append(_dmp(module, sharder, plan, init_data_parallel=False))
        # TorchRec's sharder does not copy the unsharded weights: start both from its state.
        models[1].load_state_dict(models[0].state_dict())
        optimizers = [torch.optim.SGD([p for _, p in in_backward_optimizer_filter(
            m.named_parameters())], lr=LR) for m in models]
        generator = torch.Generator().manual_seed(seed + 1 + rank)  # each rank its own batch
        errors = []
        for _ in range(3):
            batch = cases.global_batch(configs, 5, generator)
            keys = models[0](batch).wait()
            coef = {k: torch.randn(5, v.shape[1], generator=generator)
                    for k, v in keys.to_dict().items()}
            outs = [_train_keyed(m, o, batch, coef) for m, o in zip(models, optimizers)]
            errors.append(_keyed_error(outs[1], outs[0]))
        checks[f"{case}_errors"] = errors
        states = [m.state_dict() for m in models]
        checks[f"{case}_keys"] = (sorted(states[1]), sorted(states[0]))
        worst = 0.0
        for key, want in states[0].items():
            got = states[1][key]
            if isinstance(want, ShardedTensor):
                worst = max([worst] + [cases.relative(a.tensor, b.tensor) for a, b in
                                       zip(got.local_shards(), want.local_shards())])
            else:
                same_type = isinstance(got, torch.Tensor) and not isinstance(got, ShardedTensor)
                worst = max(worst, cases.relative(got, want) if same_type else float("inf"))
        checks[f"{case}_weights"] = worst
    return checks


def test_data_parallel_tables_train_as_torchrec(seed):
    for checks in run_distributed(_data_parallel_body, WORLD, args=(seed,), timeout=400):
        assert checks["mixed_plan"] == ["table_wise", "data_parallel", "column_wise",
                                        "data_parallel"]
        for case in ("mixed", "all"):
            got_keys, want_keys = checks[f"{case}_keys"]
            assert got_keys == want_keys
            assert max(checks[f"{case}_errors"]) < 1e-5, checks[f"{case}_errors"]
            assert checks[f"{case}_weights"] < 1e-5, checks[f"{case}_weights"]


def _pipelines_body(rank, world, seed, steps, batch):
    """TorchRec's DLRM with two data-parallel tables, sharded by recxla: the plain loop,
    recxla's TrainPipeline (micro-batches, double buffering) and TorchRec's
    TrainPipelineSparseDist must train it alike."""
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import recxla.torchrec
    import test_pipeline
    import test_sharded_dlrm as dlrm
    from recxla.pipeline import TrainPipeline

    _quiet()
    kinds = ["row_wise", "data_parallel", "table_wise", "data_parallel"]

    def build():
        model, configs = dlrm._dlrm(seed)
        sharder = recxla.torchrec.EmbeddingBagCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1},
            fwd_comm="fp32", bwd_comm="fp32")
        constraints = {c.name: ParameterConstraints(sharding_types=[k])
                       for c, k in zip(configs, kinds)}
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=world,
                                                             compute_device="cpu"),
                                           constraints=constraints)
        plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
        model = DistributedModelParallel(model, ShardingEnv.from_process_group(dist.group.WORLD),
                                         torch.device("cpu"), sharders=[sharder], plan=plan)
        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                      lambda params: torch.optim.SGD(params, lr=0.1))
        return model, dense, configs

    generator = torch.Generator().manual_seed(seed + 1)
    model, dense, configs = build()
    batches = [dlrm._batch(configs, world * batch, generator) for _ in range(steps)]
    mine = [dlrm._slice(b, rank * batch, (rank + 1) * batch) for b in batches]
    for b in mine:
        dense.zero_grad()
        loss, _ = model(b)
        loss.backward()
        dense.step()
    want = test_pipeline._state(model)
    errors = {}
    for name in ("recxla", "torchrec"):
        model, dense, _ = build()
        if name == "recxla":
            pipeline = TrainPipeline(model, dense, torch.device("cpu"), num_micro_batches=2)
        else:
            pipeline = TrainPipelineSparseDist(model, dense, torch.device("cpu"))
        data, trained = iter(mine), 0
        while True:
            try:
                pipeline.progress(data)
            except StopIteration:
                break
            trained += 1
        got = test_pipeline._state(model)
        errors[name] = (trained, max(cases.relative(g, w) for key in want
                                     for g, w in zip(got[key], want[key])))
    return errors


def test_pipelines_train_data_parallel_tables(seed):
    for errors in run_distributed(_pipelines_body, WORLD, args=(seed, 5, 6), timeout=400):
        for name, (trained, error) in errors.items():
            assert trained == 5, (name, trained)
            assert error < 1e-5, (name, error)


# ---------------------------------------------------------------------------- FP16 tables


def _fp16_ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of float16's spacing at want (both hold float16 values)."""
    want = want.to(torch.float16)
    spacing = (torch.nextafter(want.abs(), torch.tensor(float("inf"), dtype=torch.float16))
               - want.abs()).float()
    return (got.float() - want.float()).abs() / spacing


def _fp16_body(rank, world, seed, steps):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import comm_ops
    from torchrec.modules.embedding_configs import DataType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    _quiet()
    comm_ops.set_gradient_division(False)  # both sum the ranks' gradients, as the reference
    configs = _configs(seed, data_type=DataType.FP16)  # t2 is FP16
    fp32_configs = _configs(seed)
    kinds = ["table_wise", "column_wise", "table_column_wise", "table_wise"]
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
    sharders = _sharders(fused)
    plan = _plan(EmbeddingBagCollection(configs, device=torch.device("meta")), kinds,
                 sharders[0])
    models = [_dmp(EmbeddingBagCollection(configs, device=torch.device("meta")), s, plan,
                   init_data_parallel=False) for s in sharders]
    checks = {}
    states = [m.state_dict() for m in models]
    # TorchRec's weights into recxla's as TorchRec's test harness moves them (copy_state_dict):
    # in place into the tensors state_dict returned, which are the live tables.
    with torch.no_grad():
        for key, value in states[1].items():
            for shard in value.local_shards():
                shard.tensor.copy_(_local_shard(states[0][key], shard.metadata.shard_offsets))
    checks["dtypes"] = [{k: v.dtype for k, v in sd.items()} for sd in states]
    # The reference: the unsharded module in float32 from the same weights, plain SGD on the
    # whole batch, t2 rounded to float16 once after each step.
    reference = EmbeddingBagCollection(fp32_configs)
    full = {}
    for key, value in states[0].items():
        whole = torch.zeros(value.size(), dtype=torch.float32) if rank == 0 else None
        value.gather(0, whole)
        full[key] = whole
    generator = torch.Generator().manual_seed(seed + 1)
    batch_sizes = [4, 5]
    start = sum(batch_sizes[:rank])
    out_errors, torchrec_out = [], []
    if rank == 0:
        reference.load_state_dict(full)
    for _ in range(steps):
        batch = cases.global_batch(configs, sum(batch_sizes), generator)
        mine = cases.sample_slice(batch, start, start + batch_sizes[rank])
        coef = {n: torch.randn(sum(batch_sizes), dims, generator=generator)
                for n, dims in zip(*_output_names(configs))}
        outs = []
        for m in models:
            out = m(mine).wait()
            outs.append(out)
            by_key = out.to_dict()
            sum((by_key[k] * coef[k][start: start + batch_sizes[rank]]).sum()
                for k in coef).backward()
        checks.setdefault("out_dtype", [o.values().dtype for o in outs])
        out_errors.append(_keyed_error(outs[1], outs[0]))
        if rank == 0:
            reference_out = reference(batch)
            want = reference_out.to_dict()
            checks.setdefault("reference_errors", []).append(max(
                cases.relative(outs[1].to_dict()[k].detach(), want[k].detach()[:batch_sizes[0]])
                for k in coef))
            sum((want[k] * coef[k]).sum() for k in coef).backward()
            with torch.no_grad():
                for p in reference.parameters():
                    p -= LR * p.grad
                    p.grad = None
                reference.embedding_bags["t2"].weight.copy_(
                    reference.embedding_bags["t2"].weight.half())
    checks["out_errors"] = out_errors
    # The tensors state_dict returned before training hold the trained tables (both sharders).
    checks["live"] = [all(torch.equal(shard.tensor, _local_shard(m.state_dict()[key],
                                                                  shard.metadata.shard_offsets))
                          for key, value in before.items() for shard in value.local_shards())
                      for m, before in zip(models, states)]
    # Gather both sharded models' t2 and compare with the reference on rank 0.
    ulps, gathered = [], []
    for m in models:
        value = m.state_dict()["embedding_bags.t2.weight"]
        whole = torch.zeros(value.size(), dtype=torch.float16) if rank == 0 else None
        value.gather(0, whole)
        if rank == 0:
            ulps.append(_fp16_ulps(whole, reference.embedding_bags["t2"].weight.detach()))
            gathered.append(whole.float())
    if rank == 0:
        checks["recxla_ulps"] = (float(ulps[1].max()), float((ulps[1] > 0).float().mean()))
        checks["torchrec_error"] = cases.relative(
            gathered[0], reference.embedding_bags["t2"].weight.detach())
    return checks


def _local_shard(sharded, offsets) -> torch.Tensor:
    """This rank's shard of `sharded` at `offsets`."""
    return next(s.tensor for s in sharded.local_shards()
                if s.metadata.shard_offsets == list(offsets))


def _output_names(configs):
    """The unsharded module's output keys and their dims."""
    from torchrec.modules.embedding_modules import get_embedding_names_by_table

    names = get_embedding_names_by_table(configs)
    return ([n for table in names for n in table],
            [c.embedding_dim for c in configs for _ in c.feature_names])


def test_fp16_tables_as_torchrec(seed):
    ranks = run_distributed(_fp16_body, WORLD, args=(seed, 3), timeout=300)
    for checks in ranks:
        torchrec_dtypes, recxla_dtypes = checks["dtypes"]
        assert recxla_dtypes == torchrec_dtypes
        assert torchrec_dtypes["embedding_bags.t2.weight"] == torch.float16
        assert checks["out_dtype"] == [torch.float32, torch.float32]
        assert checks["live"] == [True, True]
        # The first step reads the same float16 weights: equal; later steps differ by
        # TorchRec's own rounding of its updates (a few float16 steps, see below).
        assert checks["out_errors"][0] < 1e-6, checks["out_errors"]
        assert max(checks["out_errors"]) < 2e-2, checks["out_errors"]
    # Every step reads the reference's float16 weights (rounded after each update).
    assert max(ranks[0]["reference_errors"]) < 1e-6, ranks[0]["reference_errors"]
    recxla_max, recxla_off = ranks[0]["recxla_ulps"]
    # recxla's update is the float32 update rounded once: equal to the reference but where
    # the float32 sums' order tips a rounding (at most one float16 step, rarely).
    assert recxla_max <= 1.0 and recxla_off < 0.02, ranks[0]["recxla_ulps"]
    # TorchRec's FBGEMM CPU update rounds its own way (not once to nearest), close to it.
    assert ranks[0]["torchrec_error"] < 1e-2, ranks[0]["torchrec_error"]


# ---------------------------------------------------------------------------- variable batch


def _variable_batch(configs, batch, generator):
    """A batch of `batch` samples with a variable batch per feature (TorchRec's VBE): feature
    f has its own number of distinct bags, and inverse_indices says which one each sample
    uses."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = cases.features(configs)
    rows = {f: min(c.num_embeddings for c in configs if f in c.feature_names) for f in keys}
    strides = [int(s) for s in torch.randint(1, batch + 1, (len(keys),), generator=generator)]
    lengths = [torch.randint(0, 4, (s,), generator=generator) for s in strides]
    values = [torch.randint(0, rows[f], (int(n.sum()),), generator=generator)
              for f, n in zip(keys, lengths)]
    inverse = torch.stack([torch.randint(0, s, (batch,), generator=generator) for s in strides])
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths),
                             stride_per_key_per_rank=[[s] for s in strides],
                             inverse_indices=(keys, inverse))


def _variable_batch_body(rank, world, seed):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import comm_ops
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    _quiet()
    comm_ops.set_gradient_division(False)  # the comparison does not depend on the setting
    configs = _configs(seed)
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
    generator = torch.Generator().manual_seed(seed + 1 + rank)
    checks = {}
    # 1. What TorchRec's sharder runs with VBE on CPU: table-wise, one group of tables per
    # rank (FBGEMM's CPU kernels refuse the merged VBE output of several groups, e.g. SUM and
    # MEAN tables on one rank). Both sharders train alike.
    sharders = _sharders(fused)
    meta = torch.device("meta")
    sum_configs = _configs(seed, mean=False)
    plan = _plan(EmbeddingBagCollection(sum_configs, device=meta), ["table_wise"] * 4,
                 sharders[0])
    models = [_dmp(EmbeddingBagCollection(sum_configs, device=meta), s, plan,
                   init_data_parallel=False) for s in sharders]
    models[1].load_state_dict(models[0].state_dict())
    errors = []
    for _ in range(3):
        batch = _variable_batch(configs, 6, generator)
        outs = []
        for m in models:
            out = m(batch).wait()
            outs.append(out)
            by_key = out.to_dict()
            coef = torch.Generator().manual_seed(seed + 7)
            sum((by_key[k] * torch.randn(by_key[k].shape, generator=coef)).sum()
                for k in sorted(by_key)).backward()
        errors.append(_keyed_error(outs[1], outs[0]))
    checks["shapes"] = [tuple(o.values().shape) for o in outs]
    checks["table_wise_errors"] = errors
    states = [m.state_dict() for m in models]
    checks["table_wise_weights"] = max(
        [cases.relative(a.tensor, b.tensor) for k in states[0]
         for a, b in zip(states[1][k].local_shards(), states[0][k].local_shards())] + [0.0])
    # 2. Every other sharding type recxla offers, against TorchRec's unsharded module.
    torch.manual_seed(seed)
    unsharded = EmbeddingBagCollection(configs)
    kinds = ["row_wise", "column_wise", "table_row_wise", "data_parallel"]
    plan = _plan(unsharded, kinds, sharders[1])
    module = EmbeddingBagCollection(configs)
    module.load_state_dict(unsharded.state_dict())
    model = _dmp(module, sharders[1], plan, init_data_parallel=False)
    errors = []
    for _ in range(2):
        batch = _variable_batch(configs, 5, generator)
        with torch.no_grad():
            errors.append(_keyed_error(model(batch).wait(), unsharded(batch)))
    checks["other_errors"] = errors
    # 3. VBE metadata that does not hold together is refused on every rank.
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    batch = _variable_batch(configs, 5, generator)
    keys, inverse = batch.inverse_indices()
    if rank == 1:
        inverse = inverse.clone()
        inverse[2, 0] = batch.stride_per_key()[2]  # one past the feature's bags
    bad = KeyedJaggedTensor(keys=batch.keys(), values=batch.values(), lengths=batch.lengths(),
                            stride_per_key_per_rank=batch.stride_per_key_per_rank(),
                            inverse_indices=(keys, inverse))
    checks["bad"] = _raises(lambda: model(bad).wait())
    return checks


def test_variable_batch_per_feature_as_torchrec(seed):
    for rank, checks in enumerate(run_distributed(_variable_batch_body, WORLD, args=(seed,),
                                                  timeout=300)):
        got_shape, want_shape = checks["shapes"]
        assert got_shape == want_shape == (6, 8 + 4 + 8 + 8 + 8 + 12)
        assert max(checks["table_wise_errors"]) < 1e-5, checks["table_wise_errors"]
        assert checks["table_wise_weights"] < 1e-5, checks["table_wise_weights"]
        assert max(checks["other_errors"]) < 1e-6, checks["other_errors"]
        error = checks["bad"]
        assert error is not None and error[2], error
        assert ("outside the feature's" if rank == 1 else "rank(s) [1]") in error[1], error
