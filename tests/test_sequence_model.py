"""A model with pooled and sequence embeddings (the trainer's HistoryDLRM: an
EmbeddingBagCollection and an EmbeddingCollection) sharded onto recxla by
DistributedModelParallel, against TorchRec's own sharders on the same plan:

- the plain training loop: losses and tables agree to float rounding (fp32 wires, row-wise
  Adagrad fused), and TorchRec's TrainPipelineSparseDist drives recxla's modules to the same;
- recxla.pipeline.TrainPipeline (DBP, micro-batches, the early lookup, early rows) equals its
  own sequential schedule bit for bit on this model;
- a checkpoint (state_dict of both modules) moves from recxla's plan to TorchRec's and back.
"""

import pytest
import torch
from distributed_utils import run_distributed

import sharded_cases
import test_pipeline

pytestmark = pytest.mark.distributed

DIM, NUM_DENSE, HISTORY, MAX_LENGTH = 8, 5, "h", 10


@pytest.mark.parametrize("heads,max_length", [(1, 5), (2, 5), (4, 3)])
def test_history_attention_is_multihead_attention_on_the_padded_history(seed, heads,
                                                                          max_length):
    """recxla.train.sequence_model.attend on the jagged history equals torch's
    MultiheadAttention (the same module's parameters, biases included) on the padded history
    with the candidate's own key, forward and every gradient: empty histories, histories cut
    at max_length."""
    from torch import nn
    from torchrec.sparse.jagged_tensor import JaggedTensor

    from recxla.train.sequence_model import attend

    generator = torch.Generator().manual_seed(seed)
    batch, dim = 9, 16
    attention = nn.MultiheadAttention(dim, heads, batch_first=True)
    with torch.no_grad():
        for p in attention.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    lengths = torch.randint(0, 2 * max_length, (batch,), generator=generator)
    lengths[0] = 0
    values = torch.randn(int(lengths.sum()), dim, generator=generator, requires_grad=True)
    candidate = torch.randn(batch, dim, generator=generator, requires_grad=True)
    got = attend(attention, candidate, values, lengths, max_length)
    padded = JaggedTensor(values=values, lengths=lengths).to_padded_dense(
        desired_length=max_length)
    keys = torch.cat([padded, candidate.unsqueeze(1)], dim=1)
    position = torch.arange(max_length + 1)
    padding = (position < max_length) & (position >= lengths.clamp(max=max_length).unsqueeze(1))
    want = attention(candidate.unsqueeze(1), keys, keys, key_padding_mask=padding,
                     need_weights=False)[0].squeeze(1)
    assert sharded_cases.relative(got.detach(), want.detach()) <= 1e-5
    coef = torch.randn(batch, dim, generator=generator)
    inputs = [values, candidate, *attention.parameters()]
    for g, w in zip(torch.autograd.grad((got * coef).sum(), inputs),
                    torch.autograd.grad((want * coef).sum(), inputs)):
        assert sharded_cases.relative(g, w) <= 1e-5


def _model(seed):
    from torchrec.models.dlrm import DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    from recxla.train.sequence_model import HistoryDLRM

    torch.manual_seed(seed)
    bags = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=40 + 13 * i,
                               feature_names=[f"f{i}"]) for i in range(3)]
    history = [EmbeddingConfig(name="t_hist", embedding_dim=DIM, num_embeddings=57,
                               feature_names=[HISTORY])]
    model = DLRMTrain(HistoryDLRM(
        EmbeddingBagCollection(bags), EmbeddingCollection(history), HISTORY, "f0", NUM_DENSE,
        [16, DIM], [16, 1], MAX_LENGTH, heads=2))
    return model, bags + history


def _batch(configs, size, generator):
    """Pooled features of 0-3 ids; a history of 0-14 Zipf ids (some past MAX_LENGTH)."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    pooled = sharded_cases.global_batch(configs[:3], size, generator, max_len=3)
    lengths = torch.randint(0, 15, (size,), generator=generator)
    ids = (torch.rand(int(lengths.sum()), generator=generator) ** 3 * 57).long()
    sparse = KeyedJaggedTensor(keys=pooled.keys() + [HISTORY],
                               values=torch.cat([pooled.values(), ids]),
                               lengths=torch.cat([pooled.lengths(), lengths]))
    return Batch(dense_features=torch.randn(size, NUM_DENSE, generator=generator),
                 sparse_features=sparse,
                 labels=torch.randint(0, 2, (size,), generator=generator).float())


def _slice(batch, start, stop):
    from torchrec.datasets.utils import Batch

    return Batch(dense_features=batch.dense_features[start:stop],
                 sparse_features=sharded_cases.sample_slice(batch.sparse_features, start, stop),
                 labels=batch.labels[start:stop])


def _sharders(which, fwd="fp32", bwd="fp32"):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    import recxla.torchrec

    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-8}
    if which == "recxla":
        return recxla.torchrec.sharders(fused_params=fused, fwd_comm=fwd, bwd_comm=bwd)
    return [EmbeddingBagCollectionSharder(fused_params=fused),
            EmbeddingCollectionSharder(fused_params=fused)]


def _dmp(seed, world, which, kind, fwd="fp32", bwd="fp32"):
    """The model sharded by `which` sharders ("recxla" or "torchrec"), the history table
    planned `kind`, the pooled ones too where TorchRec's CPU sharder offers it
    -> (DMP, dense SGD, configs)."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import (EmbeddingShardingPlanner, ParameterConstraints,
                                              Topology)
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    model, configs = _model(seed)
    unsharded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sharders = _sharders(which, fwd, bwd)
    # TorchRec's CPU sharder of pooled tables has no row-wise: they are table-wise then.
    pooled_kind = "table_wise" if kind == "row_wise" else kind
    constraints = {c.name: ParameterConstraints(
        sharding_types=[kind if c.name == "t_hist" else pooled_kind]) for c in configs}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(model, sharders, dist.group.WORLD)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), sharders=sharders, plan=plan)
    # The unsharded model's tables in every shard (TorchRec's pooled module does not copy
    # them from a module built on CPU; recxla's does).
    with torch.no_grad():
        for key, value in dmp.state_dict().items():
            for shard in getattr(value, "local_shards", lambda: [])():
                (r0, c0), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                full = unsharded[key.removeprefix("module.")]
                shard.tensor.copy_(full[r0: r0 + rows, c0: c0 + cols])
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=0.1))
    return dmp, dense, configs


def _batches(seed, world, configs, steps, size):
    generator = torch.Generator().manual_seed(seed + 1)
    batches = [_batch(configs, world * size, generator) for _ in range(steps)]
    return batches


def _tables_of(state):
    """The embedding tables' entries of test_pipeline._state (both modules' weights)."""
    return {k: v for k, v in state.items()
            if k.endswith(".weight") and (".embedding_bags." in k or ".embeddings." in k)}


def _difference(a, b) -> float:
    """Largest relative difference between the local shards of two _tables_of (0 where this
    rank holds none)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((sharded_cases.relative(x, y) for k in a for x, y in zip(a[k], b[k])),
               default=0.0)


def _progress_all(pipeline, batches) -> None:
    """pipeline.progress over `batches` until the epoch ends."""
    data = iter(batches)
    while True:
        try:
            pipeline.progress(data)
        except StopIteration:
            return


def _loop(dmp, dense, batches):
    losses = []
    for b in batches:
        dense.zero_grad()
        loss, _ = dmp(b)
        loss.backward()
        dense.step()
        losses.append(float(loss))
    return losses


def _versus_torchrec_body(rank, world, seed, kinds, steps, size):
    """recxla's and TorchRec's sharders, the same plan and batches: the plain loop, and
    TorchRec's TrainPipelineSparseDist on recxla's modules -> per kind (loss difference,
    table difference, pipeline's loss difference)."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    results = {}
    for kind in kinds:
        runs = {}
        for which in ("torchrec", "recxla"):
            dmp, dense, configs = _dmp(seed, world, which, kind)
            batches = [_slice(b, rank * size, (rank + 1) * size)
                       for b in _batches(seed, world, configs, steps, size)]
            runs[which] = (_loop(dmp, dense, batches), test_pipeline._state(dmp))
        dmp, dense, configs = _dmp(seed, world, "recxla", kind)
        pipeline = TrainPipelineSparseDist(dmp, dense, torch.device("cpu"))
        data, pipelined = iter(batches), []
        while True:
            try:
                pipelined.append(float(pipeline.progress(data)[0]))
            except StopIteration:
                break
        (want_losses, want), (got_losses, got) = runs["torchrec"], runs["recxla"]
        tables = _difference(_tables_of(got), _tables_of(want))
        results[kind] = (max(abs(a - b) / abs(b) for a, b in zip(got_losses, want_losses)),
                         tables,
                         max(abs(a - b) / abs(b) for a, b in zip(pipelined, want_losses)))
    return results


def test_history_model_equals_torchrec(seed):
    """Table-, row- and column-wise plans; 4 steps of 6 samples a rank."""
    results = run_distributed(_versus_torchrec_body, world_size=2,
                              args=(seed, ["table_wise", "row_wise", "column_wise"], 4, 6),
                              timeout=300)
    for rank, per_kind in enumerate(results):
        for kind, (losses, tables, pipelined) in per_kind.items():
            assert losses <= 1e-5 and tables <= 1e-4, (rank, kind, losses, tables)
            assert pipelined <= 1e-5, (rank, kind, pipelined)


PIPELINES = {
    "dbp": dict(num_micro_batches=1),
    "fwp+dbp m=3 clustered": dict(num_micro_batches=3, split="clustered"),
    "fwp+dbp m=2, early lookup": dict(num_micro_batches=2, dbp_lookup="early"),
    "fwp+dbp m=2, early rows": dict(num_micro_batches=2, early_rows=True),
}


def _pipeline_body(rank, world, seed, kind, steps, size, fwd, bwd):
    """recxla's TrainPipeline in each configuration against its sequential schedule (M=1, no
    overlap, no DBP) -> {name: max relative state difference}."""
    from recxla.pipeline import TrainPipeline

    def run(options):
        dmp, dense, configs = _dmp(seed, world, "recxla", kind, fwd, bwd)
        batches = [_slice(b, rank * size, (rank + 1) * size)
                   for b in _batches(seed, world, configs, steps, size)]
        _progress_all(TrainPipeline(dmp, dense, torch.device("cpu"), **options), batches)
        return test_pipeline._state(dmp)

    want = run(dict(num_micro_batches=1, overlap=False, dbp=False))
    results = {}
    for name, options in PIPELINES.items():
        got = run(options)
        results[name] = max(sharded_cases.relative(g, w) for key in want
                            for g, w in zip(got[key], want[key]))
    return results


def test_pipeline_trains_the_history_model_as_its_sequential_schedule(seed):
    """fp32 wires: every configuration within float rounding of the sequential schedule
    (only the dense gradients' summation order differs between micro-batches)."""
    results = run_distributed(_pipeline_body, world_size=2,
                              args=(seed, "row_wise", 5, 7, "fp32", "fp32"), timeout=300)
    for rank, per_config in enumerate(results):
        for name, error in per_config.items():
            assert error <= 1e-5, (rank, name, error)


def test_pipeline_with_fp8_rows_equals_its_sequential_schedule(seed):
    """FP8 rows: each row is quantized on its own, so DBP without micro-batches moves the very
    same bits as the sequential schedule: equal bit for bit."""
    results = run_distributed(_pipeline_body, world_size=2,
                              args=(seed, "table_wise", 4, 6, "e4m3", "e5m2"), timeout=300)
    for rank, per_config in enumerate(results):
        assert per_config["dbp"] == 0.0, (rank, per_config)


def _tables(dmp):
    """{state_dict key: local shards} of the embedding tables (both modules)."""
    return _tables_of(test_pipeline._state(dmp))


def _checkpoint_body(rank, world, seed, kind):
    """A state_dict of recxla's DMP, trained, loaded into TorchRec's on the same plan; that
    one trained on and loaded into recxla's -> (max difference after each move)."""
    dmp, dense, configs = _dmp(seed, world, "recxla", kind)
    batches = [_slice(b, rank * 5, (rank + 1) * 5) for b in _batches(seed, world, configs, 2, 5)]
    _loop(dmp, dense, batches)  # trained weights: not the initial ones the other side has
    theirs, their_dense, _ = _dmp(seed + 7, world, "torchrec", kind)
    theirs.load_state_dict(dmp.state_dict())
    to_torchrec = _difference(_tables(theirs), _tables(dmp))
    _loop(theirs, their_dense, batches)
    back, _, _ = _dmp(seed + 9, world, "recxla", kind)
    back.load_state_dict(theirs.state_dict())
    return to_torchrec, _difference(_tables(back), _tables(theirs))


def test_checkpoint_moves_between_recxla_and_torchrec(seed):
    for kind in ("row_wise", "column_wise"):
        results = run_distributed(_checkpoint_body, world_size=2, args=(seed, kind),
                                  timeout=300)
        for rank, (to_torchrec, to_recxla) in enumerate(results):
            assert to_torchrec == 0.0 and to_recxla == 0.0, (rank, kind, to_torchrec,
                                                              to_recxla)


def _gpu_body(rank, world, seed, steps, size):
    """The history model on CUDA (NCCL), recxla's sharders with fp32 wires: recxla's pipeline
    (DBP, 2 micro-batches) against the plain loop -> max relative state difference."""
    from recxla.pipeline import TrainPipeline

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)

    def run(pipelined):
        dmp, dense, configs = _dmp_on(seed, world, device)
        batches = [_slice(b, rank * size, (rank + 1) * size)
                   for b in _batches(seed, world, configs, steps, size)]
        if not pipelined:
            _loop(dmp, dense, [b.to(device) for b in batches])
            return test_pipeline._state(dmp)
        _progress_all(TrainPipeline(dmp, dense, device, num_micro_batches=2,
                                    loss_is_sample_mean=True), batches)
        return test_pipeline._state(dmp)

    want, got = run(False), run(True)
    return max(sharded_cases.relative(g.cpu(), w.cpu()) for key in want
               for g, w in zip(got[key], want[key]))


def _dmp_on(seed, world, device):
    """_dmp's recxla model (fp32 wires, planner's choice of sharding) on `device`."""
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    model, configs = _model(seed)
    sharders = _sharders("recxla")
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world,
                                                         compute_device=device.type))
    plan = planner.collective_plan(model, sharders, dist.group.WORLD)
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=device, sharders=sharders, plan=plan)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=0.1))
    return dmp, dense, configs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_history_model_on_gpu_pipelined_equals_the_loop(seed):
    world = min(torch.cuda.device_count(), 2)
    for rank, error in enumerate(run_distributed(_gpu_body, world_size=world,
                                                 args=(seed, 5, 8), backend="nccl",
                                                 timeout=600)):
        assert error <= 1e-5, (rank, error)


def _unsharded_body(rank, world, seed):
    """The history model with only recxla's pooled sharder: DMP leaves the EmbeddingCollection
    as it is -> the warnings TrainPipeline gives."""
    import warnings

    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    import recxla.torchrec
    from recxla.pipeline import TrainPipeline

    model, _ = _model(seed)
    sharder = recxla.torchrec.EmbeddingBagCollectionSharder(fwd_comm="fp32", bwd_comm="fp32")
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), sharders=[sharder])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TrainPipeline(dmp, torch.optim.SGD(dmp.parameters(), lr=0.1), torch.device("cpu"))
    return [str(w.message) for w in caught if "is not sharded" in str(w.message)]


def test_pipeline_says_which_embedding_module_was_left_unsharded(seed):
    [messages] = run_distributed(_unsharded_body, world_size=1, args=(seed,))
    assert len(messages) == 1, messages
    assert "EmbeddingCollection '_dmp_wrapped_module.module.model.history_arch." \
        "embedding_collection' is not sharded" in messages[0] and \
        "recxla.torchrec.sharders" in messages[0]


def _foreign_body(rank, world, seed):
    """The history model with recxla's pooled sharder and TorchRec's own EC sharder -> (the
    error num_micro_batches=2 raises, whether one micro-batch trains)."""
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv

    import recxla.torchrec
    from recxla.pipeline import TrainPipeline

    model, configs = _model(seed)
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
    sharders = [recxla.torchrec.EmbeddingBagCollectionSharder(fused_params=fused),
                EmbeddingCollectionSharder(fused_params=fused)]
    dmp = DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                   device=torch.device("cpu"), sharders=sharders)
    dense = torch.optim.SGD(dmp.parameters(), lr=0.1)
    try:
        TrainPipeline(dmp, dense, torch.device("cpu"), num_micro_batches=2,
                      loss_is_sample_mean=True)
        error = None
    except ValueError as e:
        error = str(e)
    batches = [_slice(b, rank * 4, rank * 4 + 4) for b in _batches(seed, world, configs, 2, 4)]
    TrainPipeline(dmp, dense, torch.device("cpu")).progress(iter(batches))
    return error


def test_micro_batches_refuse_a_module_another_sharder_updates(seed):
    for rank, error in enumerate(run_distributed(_foreign_body, world_size=2, args=(seed,))):
        assert error is not None and "num_micro_batches=2 with " \
            "'_dmp_wrapped_module.module.model.history_arch.embedding_collection' sharded by " \
            "another sharder (torchrec.distributed.embedding.ShardedEmbeddingCollection)" in error
