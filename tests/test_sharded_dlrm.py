"""recxla's sharder in a TorchRec training job: TorchRec's own DLRM, its planner,
DistributedModelParallel and TrainPipelineSparseDist, with the sharder as the only change
(the README example), on 2 gloo ranks; and a sharded checkpoint through
torch.distributed.checkpoint."""

import copy

import pytest
import torch
from distributed_utils import run_distributed

import sharded_cases as cases

pytestmark = pytest.mark.distributed

LR = 0.1
DIM = 8
NUM_DENSE = 5


def _dlrm(seed):
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(seed)
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=40 + 13 * i,
                                  feature_names=[f"f{i}"]) for i in range(4)]
    ebc = EmbeddingBagCollection(configs, device=torch.device("cpu"))
    model = DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                           dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1]))
    return model, configs


def _batch(configs, size, generator):
    from torchrec.datasets.utils import Batch

    return Batch(dense_features=torch.randn(size, NUM_DENSE, generator=generator),
                 sparse_features=cases.global_batch(configs, size, generator, max_len=3),
                 labels=torch.randint(0, 2, (size,), generator=generator).float())


def _slice(batch, start, stop):
    from torchrec.datasets.utils import Batch

    return Batch(dense_features=batch.dense_features[start:stop],
                 sparse_features=cases.sample_slice(batch.sparse_features, start, stop),
                 labels=batch.labels[start:stop])


def _dmp(model, sharder, kind, world):
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv

    constraints = {c.name: ParameterConstraints(sharding_types=[kind])
                   for c in model.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"),
                                       constraints=constraints)
    plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
    return DistributedModelParallel(model, env=ShardingEnv.from_process_group(dist.group.WORLD),
                                    device=torch.device("cpu"), sharders=[sharder], plan=plan)


def _pipeline_body(rank, world, seed, kinds, batch):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import recxla.torchrec

    errors = {}
    for kind in kinds:
        model, configs = _dlrm(seed)
        reference = copy.deepcopy(model)
        # The one changed line: recxla's sharder where TorchRec's would be.
        sharder = recxla.torchrec.EmbeddingBagCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR},
            fwd_comm="fp32", bwd_comm="fp32")
        dmp = _dmp(model, sharder, kind, world)
        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: torch.optim.SGD(params, lr=LR))
        pipeline = TrainPipelineSparseDist(dmp, dense, device=torch.device("cpu"))
        generator = torch.Generator().manual_seed(seed + 1)
        batches = [_batch(configs, world * batch, generator) for _ in range(3)]
        local = iter([_slice(b, rank * batch, (rank + 1) * batch) for b in batches])
        for _ in batches:
            pipeline.progress(local)
        # The unsharded model on every rank's samples: the ranks' mean losses summed; DDP
        # averages the dense gradients over ranks, the embedding rows get the sum scaled by
        # TorchRec's gradient division (1 / world by default).
        optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
        for b in batches:
            loss = sum(reference(_slice(b, r * batch, (r + 1) * batch))[0] for r in range(world))
            loss.backward()
            for name, p in reference.named_parameters():
                if "embedding_bags" not in name:
                    p.grad /= world
                else:
                    p.grad *= cases.gradient_factor(world)
            optimizer.step()
            optimizer.zero_grad()
        want = {k: v.detach() for k, v in reference.state_dict().items()}
        state = dmp.state_dict()
        dense_error = max(cases.relative(v, want[k]) for k, v in state.items()
                          if not hasattr(v, "local_shards"))
        errors[kind] = (cases.shard_errors(state, want), dense_error)
    return errors


def test_dlrm_with_recxla_sharder_in_torchrec_pipeline_equals_unsharded(seed):
    """TorchRec's planner places the tables (row-wise too, on CPU), TrainPipelineSparseDist
    runs 3 steps; embeddings and dense weights equal the unsharded model's."""
    results = run_distributed(_pipeline_body, world_size=2,
                              args=(seed, ["table_wise", "row_wise", "column_wise"], 6),
                              timeout=180)
    for rank, per_kind in enumerate(results):
        for kind, (embedding_error, dense_error) in per_kind.items():
            assert embedding_error <= 1e-5, (rank, kind, embedding_error)
            assert dense_error <= 1e-5, (rank, kind, dense_error)


def _checkpoint_body(rank, world, seed, path):
    """Save model and fused-optimizer state with torch.distributed.checkpoint, train on, load:
    everything is back, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    import recxla.torchrec

    model, configs = _dlrm(seed)
    sharder = recxla.torchrec.EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR},
        fwd_comm="e4m3", bwd_comm="bf16")
    dmp = _dmp(model, sharder, "row_wise", world)
    generator = torch.Generator().manual_seed(seed + 1)

    def step():
        loss, _ = dmp(_slice(_batch(configs, 2 * world, generator), 2 * rank, 2 * rank + 2))
        loss.backward()

    def snapshot():
        return {k: [s.tensor.clone() for s in v.local_shards()]
                for k, v in _flat(dmp.state_dict(), dmp.fused_optimizer.state_dict()).items()}

    step()
    saved = snapshot()
    dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()},
             checkpoint_id=path)
    step()
    changed = snapshot()
    state = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    dmp.load_state_dict(state["model"])
    dmp.fused_optimizer.load_state_dict(state["optim"])
    loaded = snapshot()
    return (all(torch.equal(a, b) for k in saved for a, b in zip(saved[k], loaded[k])),
            any(not torch.equal(a, b) for k in saved for a, b in zip(saved[k], changed[k])),
            len(saved))


def _flat(model_state, optim_state):
    out = {k: v for k, v in model_state.items() if hasattr(v, "local_shards")}
    for key, entry in optim_state["state"].items():
        for name, value in entry.items():
            if hasattr(value, "local_shards"):
                out[f"{key}/{name}"] = value
    return out


def test_sharded_checkpoint_round_trip(seed, tmp_path):
    results = run_distributed(_checkpoint_body, world_size=2, args=(seed, str(tmp_path)),
                              timeout=180)
    for rank, (restored, trained_on, tensors) in enumerate(results):
        assert trained_on, rank  # the second step did change the state
        assert restored, rank
        assert tensors == 8, (rank, tensors)  # 4 tables: weight and row-wise state each
