"""recxla.pipeline on CUDA (run by `make gpu-campaign`): the pipelined run equals the plain loop
with NCCL (2 ranks where 2 GPUs exist, else 1), and the steady-state step never synchronizes
the host with the device (torch.cuda.set_sync_debug_mode("warn") reports every sync; they are
counted); with early rows it equals the loop too (their bookkeeping still syncs: not counted).
The equality is checked whatever the syncs, and the failure lists both, so one GPU run says
whether the pipeline is right on the device and where the host still waits."""

import warnings

import pytest
import torch
from distributed_utils import run_distributed

import sharded_cases as cases
import test_sharded_dlrm as dlrm

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


def _gpu_body(rank, world, seed, steps, batch):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import torch.distributed as dist

    import recxla.torchrec
    from recxla.pipeline import TrainPipeline

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)

    def build(row_exchange):
        model, configs = dlrm._dlrm(seed)
        sharder = recxla.torchrec.EmbeddingBagCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                          "learning_rate": 0.1}, fwd_comm="e4m3", bwd_comm="bf16",
            row_exchange=row_exchange)
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=world,
                                                             compute_device="cuda"))
        plan = planner.collective_plan(model, [sharder], dist.group.WORLD)
        model = DistributedModelParallel(model, env=ShardingEnv.from_process_group(
            dist.group.WORLD), device=device, sharders=[sharder], plan=plan)
        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                      lambda params: torch.optim.SGD(params, lr=0.1))
        return model, dense, configs

    generator = torch.Generator().manual_seed(seed + 1)
    _, _, configs = build("off")
    batches = [dlrm._batch(configs, world * batch, generator) for _ in range(steps)]
    mine = [dlrm._slice(b, rank * batch, (rank + 1) * batch) for b in batches]
    results = {}
    # Early rows keep their bookkeeping on the module's device and read counts on the host
    # (recxla.torchrec.early_rows): they are checked for results, not for host syncs.
    for mode, row_exchange, early_rows in (("off", "off", False), ("all", "all", False),
                                           ("all, early rows", "all", True)):
        reference, dense, _ = build(row_exchange)
        for b in mine:
            dense.zero_grad()
            loss, _ = reference(b.to(device))
            loss.backward()
            dense.step()
        model, dense, _ = build(row_exchange)
        pipeline = TrainPipeline(model, dense, device, num_micro_batches=2,
                                 early_rows=early_rows)
        data = iter(mine)
        pipeline.progress(data)
        pipeline.progress(data)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in mine[2:]:
                    pipeline.progress(data)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        # Where each sync happened: the line of Python that made the synchronizing call.
        syncs = sorted({f"{w.filename}:{w.lineno}" for w in caught
                        if "synchroniz" in str(w.message)})
        want, got = reference.state_dict(), model.state_dict()
        error = 0.0
        for key, value in want.items():
            if hasattr(value, "local_shards"):
                for a, b in zip(value.local_shards(), got[key].local_shards()):
                    error = max(error, cases.relative(b.tensor.cpu(), a.tensor.cpu()))
            else:
                error = max(error, cases.relative(got[key].cpu(), value.cpu()))
        results[mode] = (error, [] if early_rows else syncs)
    return results


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pipeline_on_gpu_equals_the_loop_without_host_syncs(seed):
    world = min(torch.cuda.device_count(), 2)
    results = run_distributed(_gpu_body, world_size=world, args=(seed, 6, 8), backend="nccl",
                              timeout=600)
    problems = []
    for rank, per_mode in enumerate(results):
        for mode, (error, syncs) in per_mode.items():
            # FP8 rows quantized one by one: micro-batching changes no code, only the dense
            # gradients' float order (see test_pipeline.py).
            if error > 1e-2:
                problems.append(f"rank {rank}, row exchange {mode}: relative error {error:.2e}")
            if syncs:
                problems.append(f"rank {rank}, row exchange {mode}: host syncs in steady "
                                f"state: {syncs}")
    assert not problems, problems
