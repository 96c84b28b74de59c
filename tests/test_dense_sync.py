"""The pipeline's dense gradient sync (recxla.pipeline.dense_sync) on 2 gloo ranks: a deferred
all-reduce leaves each rank's own gradient in .grad until wait(), then the average over the
ranks, bit for bit what DDP's own all-reduce gives (fp32 and bf16 on the wire), and fp8 and
powersgd bit for bit what DDP gives with recxla's fp8_compress_hook / powersgd_compress_hook;
without gradient_as_bucket_view it does not defer. By node (4 ranks as 2 nodes x 2): the same
average up to rounding (fp8, powersgd: bit for bit the hook's by node), the same bits on every
rank."""

import pytest
import torch
from distributed_utils import run_distributed

pytestmark = pytest.mark.distributed


def _sync_body(rank, world, seed, wire, bucket_view, by_node=False):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from recxla.pipeline.dense_sync import DenseAllReduce, MicroBatchGradientSync

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed + 1 + rank))

    def grads(m):
        return torch.cat([p.grad.flatten().clone() for p in m.parameters()])

    nodes = None
    if by_node:
        from types import SimpleNamespace

        from test_all_reduce_by_node import _node_groups

        node_group, cross_group = _node_groups(world, 2)
        nodes = SimpleNamespace(num_nodes=world // 2, ranks_per_node=2,
                                shard_group=node_group, replica_group=cross_group)
    # DDP's own all-reduce, with the same bucket layout: the reference.
    reference = DistributedDataParallel(model, gradient_as_bucket_view=bucket_view,
                                        bucket_cap_mb=0.001)
    if wire == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        reference.register_comm_hook(None, default_hooks.bf16_compress_hook)
    groups = {} if nodes is None else {"node_group": nodes.shard_group,
                                       "cross_group": nodes.replica_group}
    if wire == "fp8":
        from recxla.distributed import FP8AllReduce, fp8_compress_hook

        reference.register_comm_hook(FP8AllReduce.for_ddp(reference, **groups),
                                     fp8_compress_hook)
    if wire == "powersgd":  # compressed from the first step
        from recxla.distributed import PowerSGDAllReduce, powersgd_compress_hook

        reference.register_comm_hook(
            PowerSGDAllReduce.for_ddp(reference, start_step=0, **groups),
            powersgd_compress_hook)
    reference(x).sum().backward()
    want = grads(reference)
    reference.zero_grad(set_to_none=True)

    ddp = DistributedDataParallel(model, gradient_as_bucket_view=bucket_view,
                                  bucket_cap_mb=0.001)
    sync = MicroBatchGradientSync.for_ddp(ddp)
    powersgd = {"powersgd_start": 0} if wire == "powersgd" else {}
    sync.begin_step(DenseAllReduce(wire, nodes, **powersgd))
    ddp(x).sum().backward()
    before_wait = grads(ddp)
    pending = len(sync.in_flight)
    sync.wait()
    after = grads(ddp)
    sync.reset()
    local = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    mine = torch.cat([g.flatten() for g in local])
    gathered = [torch.zeros_like(after) for _ in range(world)]
    dist.all_gather(gathered, after)
    return {"pending": pending, "own_before_wait": torch.equal(before_wait, mine),
            "equals_ddp": torch.equal(after, want),
            "error_vs_ddp": ((after - want).abs().max() / want.abs().max()).item(),
            "same_on_ranks": all(torch.equal(g, gathered[0]) for g in gathered)}


@pytest.mark.parametrize("wire", ["fp32", "bf16", "fp8", "powersgd"])
def test_deferred_all_reduce_equals_ddp(seed, wire):
    for r in run_distributed(_sync_body, 2, (seed, wire, True)):
        assert r["pending"] >= 1, r  # the buckets in flight until wait()
        assert r["own_before_wait"] and r["equals_ddp"] and r["same_on_ranks"], r


@pytest.mark.parametrize("wire", ["fp32", "fp8", "powersgd"])
def test_no_deferral_without_bucket_views(seed, wire):
    for r in run_distributed(_sync_body, 2, (seed, wire, False)):
        assert r["pending"] == 0 and not r["own_before_wait"], r
        assert r["equals_ddp"] and r["same_on_ranks"], r


@pytest.mark.parametrize("wire", ["fp32", "bf16", "fp8", "powersgd"])
def test_deferred_all_reduce_by_node_equals_ddp(seed, wire):
    # fp32: the sums differ from the ring's in order only; bf16: both round to bf16 on the
    # wire; fp8 and powersgd: the reference is the hook by node, the same computation.
    tolerance = {"fp32": 1e-6, "bf16": 2 ** -6, "fp8": 0.0, "powersgd": 0.0}[wire]
    for r in run_distributed(_sync_body, 4, (seed, wire, True, True)):
        assert r["pending"] >= 1, r
        assert r["own_before_wait"] and r["same_on_ranks"], r
        assert r["error_vs_ddp"] <= tolerance, r


def _merge_body(rank, world, seed, wire, steps, tested_way):
    """Two copies of one model on 2 nodes x 2 ranks, one syncing with bucket_merge "off", the
    other with `tested_way` ("auto": rank 0's tuner changes its way every few steps): per step,
    whether the averages are the same bits, and what each copy did."""
    from types import SimpleNamespace

    from torch.nn.parallel import DistributedDataParallel

    from recxla.pipeline.bucket_merge import MergeTuner
    from recxla.pipeline.dense_sync import DenseAllReduce, MicroBatchGradientSync
    from test_all_reduce_by_node import _node_groups

    node_group, cross_group = _node_groups(world, 2)
    nodes = SimpleNamespace(num_nodes=world // 2, ranks_per_node=2, shard_group=node_group,
                            replica_group=cross_group)
    torch.manual_seed(seed)
    # Over 1 MB of gradients: DDP's first bucket holds 1 MB, and the rest go in buckets of
    # bucket_cap_mb (from the second step: the first holds everything in one).
    model = torch.nn.Sequential(torch.nn.Linear(16, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 1))
    syncs, ddps = {}, {}
    for way in ("off", "tested"):
        copy = torch.nn.Sequential(*[torch.nn.Linear(m.in_features, m.out_features)
                                     if isinstance(m, torch.nn.Linear) else m for m in model])
        copy.load_state_dict(model.state_dict())
        ddps[way] = DistributedDataParallel(copy, gradient_as_bucket_view=True,
                                            bucket_cap_mb=0.001)
        syncs[way] = MicroBatchGradientSync.for_ddp(ddps[way])
    tuner = MergeTuner(block=2, rounds=1, recheck=3)
    if rank == 0:
        syncs["tested"].tuner = tuner
    out = []
    for step in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed + 100 * step + rank))
        record = {}
        for way, sync in syncs.items():
            ddp = ddps[way]
            ddp.zero_grad(set_to_none=False)
            sync.begin_step(DenseAllReduce(wire, nodes,
                                           bucket_merge="off" if way == "off" else tested_way))
            ddp(x).sum().backward()
            record[way] = {"merged": sync.merged, "collectives": len(sync.in_flight)}
            sync.wait()
            record[way]["grads"] = torch.cat([p.grad.flatten().clone()
                                              for p in ddp.module.parameters()])
        out.append({"merged": record["tested"]["merged"],
                    "collectives": (record["off"]["collectives"],
                                    record["tested"]["collectives"]),
                    "same_bits": torch.equal(record["off"]["grads"], record["tested"]["grads"])})
    for sync in syncs.values():
        sync.reset()
    return out


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_buckets_sent_together_give_the_bits_of_each_on_its_own(seed, wire):
    """bucket_merge="on": the step's buckets in one sum by node, the same averages as one sum
    each (by node on gloo over two nodes, every value is summed alike however grouped)."""
    for r in run_distributed(_merge_body, 4, (seed, wire, 3, "on")):
        assert all(s["merged"] and s["same_bits"] for s in r), r
        assert all(s["collectives"][1] == 1 for s in r) and r[-1]["collectives"][0] > 1, r


@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_auto_merge_goes_every_rank_the_same_way_and_keeps_the_bits(seed, wire):
    """bucket_merge="auto": rank 0's tuner chooses a step ahead, its choice carried in the
    step's sum; every rank applies it at the same step, both ways are used, and every step's
    averages are those of the buckets sent one by one."""
    steps = 10
    results = run_distributed(_merge_body, 4, (seed, wire, steps, "auto"))
    ways = [[s["merged"] for s in r] for r in results]
    assert all(w == ways[0] for w in ways), ways
    # The tuner's first proposals: two steps apart, two together (each a step late: the first
    # step goes apart), then its choice.
    assert ways[0][:5] == [False, False, False, True, True], ways[0]
    for r in results:
        for s in r:
            assert s["same_bits"], s
            apart, tested = s["collectives"]
            assert tested == (1 if s["merged"] else apart), s


def _mismatched_nodes_body(rank, world):
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from recxla.pipeline.dense_sync import check_nodes

    ddp = DistributedDataParallel(torch.nn.Linear(4, 1))
    group = dist.group.WORLD
    check_nodes(SimpleNamespace(num_nodes=1, ranks_per_node=world, shard_group=group,
                                replica_group=group), ddp)  # the right layout passes
    with pytest.raises(ValueError) as e:
        check_nodes(SimpleNamespace(num_nodes=2, ranks_per_node=2, shard_group=group,
                                    replica_group=group), ddp)
    return str(e.value)


def test_node_layout_must_match_ddp_group():
    message = run_distributed(_mismatched_nodes_body, 2)[0]
    assert "lay out 2 nodes x 2 ranks, but DDP's group has 2 ranks" in message, message


def test_dense_allreduce_refuses_what_it_cannot_do():
    """One value says how the dense gradients travel; options of another wire, a node layout
    that is none and bad PowerSGD options are refused by name."""
    from recxla.pipeline import DenseAllReduce

    assert DenseAllReduce.of("bf16") == DenseAllReduce("bf16")
    assert DenseAllReduce("powersgd", powersgd_rank=2, powersgd_start=3).compressor_options \
        == {"rank": 2, "start_step": 3}
    with pytest.raises(ValueError, match="dense_allreduce must be one of"):
        DenseAllReduce("fp16")
    with pytest.raises(ValueError, match="powersgd_rank and powersgd_start set the PowerSGD "
                                         "wire, not 'fp8'"):
        DenseAllReduce("fp8", powersgd_rank=2)
    with pytest.raises(ValueError, match="powersgd_rank must be an int >= 1, got 0"):
        DenseAllReduce("powersgd", powersgd_rank=0)
    with pytest.raises(TypeError, match="nodes must be a recxla.torchrec.Topology2D"):
        DenseAllReduce("fp32", nodes=2)
    with pytest.raises(TypeError, match="dense_allreduce must be a wire's name"):
        DenseAllReduce.of(2)
