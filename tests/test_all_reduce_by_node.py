"""recxla.distributed.all_reduce_by_node on 4 gloo ranks laid out as 2 nodes x 2, 4 x 1 and
1 x 4, fp32 and bf16: the sum over every rank, against the exact sum of every rank's tensor; the same bits
on every rank; sizes that do not split evenly over a node; two sums in flight at once; several
completed together (wait_together: the bits of waiting each); on 2 x 2 the bits of gloo's own
all-reduce and all-gather (its sum across two nodes and its gather are all-to-alls); and the
errors for what it cannot sum."""

import pytest
import torch
from distributed_utils import run_distributed

pytestmark = pytest.mark.distributed


def _tensor(seed, rank, numel, dtype):
    g = torch.Generator().manual_seed(seed * 31 + rank)
    return torch.randn(numel, generator=g).to(dtype)


def _node_groups(world, ranks_per_node):
    """This rank's (node group, cross group), ranks numbered node by node (as
    make_topology_2d lays them out; built here to keep torchrec out of the ranks' imports)."""
    import torch.distributed as dist

    rank, nodes = dist.get_rank(), world // ranks_per_node
    mine = []
    for ranks in ([list(range(n * ranks_per_node, (n + 1) * ranks_per_node)) for n in range(nodes)]
                  + [[n * ranks_per_node + i for n in range(nodes)]
                     for i in range(ranks_per_node)]):
        group = dist.new_group(ranks)  # every rank creates every group, in the same order
        if rank in ranks:
            mine.append(group)
    return mine


def _sum_body(rank, world, seed, sizes):
    import torch.distributed as dist

    from recxla.distributed import all_reduce_by_node

    out = []
    for ranks_per_node in (2, 1, 4):
        node_group, cross_group = _node_groups(world, ranks_per_node)
        for dtype in (torch.float32, torch.bfloat16):
            tensors = [_tensor(seed + i, rank, n, dtype) for i, n in enumerate(sizes)]
            # Several sums in flight together, finished in order: their collectives pair up.
            handles = [all_reduce_by_node(t, node_group, cross_group) for t in tensors]
            results = [h.wait() for h in handles]
            for i, (n, t, r) in enumerate(zip(sizes, tensors, results)):
                terms = torch.stack([_tensor(seed + i, k, n, dtype).double()
                                     for k in range(world)])
                # Float summation error is bounded by the rounding unit times the sum of |terms|.
                error = (t.double() - terms.sum(0)).abs() / terms.abs().sum(0).clamp_min(1e-30)
                gathered = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(gathered, t)
                out.append({"ranks_per_node": ranks_per_node, "dtype": str(dtype), "numel": n,
                            "in_place": r is t, "relative_error": error.max().item(),
                            "same_on_ranks": all(torch.equal(g, gathered[0]) for g in gathered)})
    return out


def test_sum_over_every_rank(seed):
    g = torch.Generator().manual_seed(seed)
    # Odd sizes leave a node's last slice padded; 1 is smaller than a node.
    sizes = [int(torch.randint(1, 3000, (1,), generator=g)) * 2 + 1, 1,
             int(torch.randint(1, 500, (1,), generator=g)) * 4]
    for per_rank in run_distributed(_sum_body, 4, (seed, sizes)):
        assert len(per_rank) == 3 * 2 * len(sizes)
        for r in per_rank:
            # Two levels of rounded sums (inside the node, across the nodes): at most 2
            # rounding units of the sum of |terms| each, with a margin of 2.
            unit = 2 ** -24 if r["dtype"] == "torch.float32" else 2 ** -9
            assert r["in_place"] and r["same_on_ranks"], r
            assert r["relative_error"] <= 8 * unit, r


def _together_body(rank, world, seed, sizes):
    import torch.distributed as dist

    from recxla.distributed import all_reduce_by_node, wait_together

    layouts = [_node_groups(world, ranks_per_node) for ranks_per_node in (2, 4)]
    # Sums on two node groups and of two dtypes, interleaved: wait_together gathers each
    # (group, dtype) kind in one call and must pair those calls up alike on every rank.
    kinds = [(layouts[i % 2], (torch.float32, torch.bfloat16)[i // 2 % 2])
             for i in range(len(sizes))]
    tensors = [_tensor(seed + i, rank, n, dtype) for i, (n, (_, dtype)) in
               enumerate(zip(sizes, kinds))]
    alone = [t.clone() for t in tensors]
    for t, ((node_group, cross_group), _) in zip(alone, kinds):
        all_reduce_by_node(t, node_group, cross_group).wait()
    handles = [all_reduce_by_node(t, node_group, cross_group)
               for t, ((node_group, cross_group), _) in zip(tensors, kinds)]
    handles[0].wait()  # one already finished is left as it is
    # What wait_together issues: the gathers inside the node (on gloo all-to-alls; the sums
    # across the nodes were started with the handles).
    issued = []
    names = [n for n in ("all_to_all_single", "all_gather_into_tensor", "all_gather_single")
             if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}

    def counting(name):
        def call(*args, **kwargs):
            issued.append(name)
            return originals[name](*args, **kwargs)
        return call

    for n in names:
        setattr(dist, n, counting(n))
    try:
        wait_together(handles)
        wait_together(handles)  # finished ones: nothing more
    finally:
        for n in names:
            setattr(dist, n, originals[n])
    return {"equal": [torch.equal(a, t) for a, t in zip(alone, tensors)],
            "results": [h.wait() is t for h, t in zip(handles, tensors)],
            "gathers": len(issued)}


def test_wait_together_gives_the_bits_of_each_wait(seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [int(n) for n in torch.randint(1, 2000, (7,), generator=g)]
    for r in run_distributed(_together_body, 4, (seed, sizes)):
        assert all(r["equal"]) and all(r["results"]), r
        # The six left: three of each node group, of both dtypes: four kinds, four gathers.
        assert r["gathers"] == 4, r


def _as_gloo_collectives_body(rank, world, seed, sizes):
    import torch.distributed as dist

    from recxla.distributed import all_reduce_by_node
    from recxla.distributed.all_reduce_by_node import _reduce_scatter_in_node

    node_group, cross_group = _node_groups(world, 2)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for i, n in enumerate(sizes):
            t = _tensor(seed + i, rank, n, dtype)
            # The sum by gloo's own all-reduce across the nodes and all-gather inside them.
            part_len = -(-n // 2)
            padded = torch.cat([t, t.new_zeros(2 * part_len - n)])
            part = padded.new_empty(part_len)
            _reduce_scatter_in_node(part, padded, node_group, 2)
            dist.all_reduce(part, group=cross_group)
            dist.all_gather_into_tensor(padded, part, group=node_group)
            out.append(torch.equal(all_reduce_by_node(t, node_group, cross_group).wait(),
                                   padded[:n]))
    return out


def test_all_to_alls_give_the_bits_of_gloos_all_reduce_and_all_gather(seed):
    """On 2 x 2 gloo ranks the sum across the nodes and the gather inside them are all-to-alls:
    the bits of gloo's all-reduce and all-gather."""
    g = torch.Generator().manual_seed(seed)
    sizes = [int(n) for n in torch.randint(1, 5000, (4,), generator=g)] + [1]
    for r in run_distributed(_as_gloo_collectives_body, 4, (seed, sizes)):
        assert all(r), r


def _errors_body(rank, world, seed):
    from recxla.distributed import all_reduce_by_node, wait_together

    node_group, cross_group = _node_groups(world, 2)
    messages = []
    for bad in (torch.arange(4), torch.randn(4, 4).t(), "tensor"):
        with pytest.raises((TypeError, ValueError)) as e:
            all_reduce_by_node(bad, node_group, cross_group)
        messages.append(str(e.value))
    with pytest.raises(TypeError) as e:
        all_reduce_by_node(torch.randn(4), None, cross_group)
    messages.append(str(e.value))
    with pytest.raises(TypeError) as e:
        wait_together([torch.randn(4)])
    messages.append(str(e.value))
    return messages


def test_errors_name_the_op_and_argument(seed):
    messages = run_distributed(_errors_body, 4, (seed,))[0]
    assert all(m.startswith("recxla.distributed.all_reduce_by_node:") for m in messages), messages
    assert "floating-point" in messages[0] and "contiguous" in messages[1], messages
    assert "floating-point" in messages[2] and "node_group" in messages[3], messages
    assert "wait_together takes the handles" in messages[4] and "Tensor" in messages[4], messages
