"""recxla.distributed.PowerSGDAllReduce on CUDA with NCCL (run by `make gpu-campaign`; 2 ranks
where 2 GPUs exist, else 1): several steps against the float64 reference of
tests/test_powersgd_all_reduce.py, the same bits on every rank, and no host synchronization
once its state exists (torch.cuda.set_sync_debug_mode("error") raises on any)."""

import pytest
import torch
from distributed_utils import run_distributed

import compressed_all_reduce_cases as cases
from test_powersgd_all_reduce import _reference

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


def _gpu_body(rank, world, seed, shapes, steps, start_step):
    import torch.distributed as dist

    from recxla.distributed import PowerSGDAllReduce

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    params = [torch.nn.Parameter(p.data.to(device)) for p in cases.params_of(shapes)]
    sync = PowerSGDAllReduce([(f"p{i}", p) for i, p in enumerate(params)],
                             start_step=start_step, seed=seed)
    first_qs = [sync.q[i].cpu().clone() if i in sync.q else None for i in range(len(shapes))]
    all_grads = [[cases.grads_of(seed, k, step, shapes) for step in range(steps)]
                 for k in range(world)]
    reference = _reference(all_grads, shapes, steps, start_step, first_qs)
    out = []
    for step in range(steps):
        grads = [g.to(device) for g in all_grads[rank][step]]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            sync.all_reduce(params, grads)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for i, (got, want) in enumerate(zip(grads, reference[step])):
            gathered = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(gathered, got)
            out.append({"step": step, "param": i,
                        "same_on_ranks": all(torch.equal(g, gathered[0]) for g in gathered),
                        "error": ((got.double().cpu() - want).abs().max() /
                                  want.abs().max().clamp_min(1e-30)).item()})
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_powersgd_on_cuda_against_the_reference_without_host_syncs(seed):
    world = min(torch.cuda.device_count(), 2)
    shapes = [(48, 31), (9, 4, 5), (17,)]
    results = run_distributed(_gpu_body, world_size=world, args=(seed, shapes, 4, 1),
                              backend="nccl")
    for per_rank in results:
        assert len(per_rank) == 4 * len(shapes)
        for r in per_rank:
            assert r["same_on_ranks"], r
            assert r["error"] <= 1e-4, r
