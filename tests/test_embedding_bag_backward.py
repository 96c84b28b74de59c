"""The CPU backward's two orders (csrc/cpu/embedding_bag_backward.cpp): accumulate bag by bag into
per-row accumulators, or gather each row's ids' gradients in registers. The kernel picks one per
table from the data (the gather order for tables whose ids rarely repeat and whose accumulators
would leave the cache); RECXLA_EMB_BACKWARD forces one. Whatever the choice and the thread
count, every bit of the result must be the same, and equal to the reference.
"""

import pytest
import torch

from recxla.ops import embedding_bag as ops
from recxla.ops.dedup import segmented_unique
from recxla.reference import embedding_bag as ref

from test_embedding_bag import (
    OPTIMS, assert_lists_close, bag_lookup, fused_args, update_args, zipf_ids,
)

ORDERS = ["accumulate", "gather", "auto"]


def few_repeats_inputs(dtype, weighted, mean):
    """Table 0: 60k rows at dim 64 read by two features (multi-hot, i.i.d. ids: few repeats,
    8 MB of accumulators, so `auto` gathers); table 1: 50 rows at dim 7, skewed (accumulates)."""
    batch, rows = 1024, 60_000
    weights = [torch.randn(rows, 64), torch.randn(50, 7)]
    feature_table = [0, 0, 1]
    lengths = torch.cat([torch.randint(0, 60, (batch,)), torch.randint(1, 3, (batch,)),
                         torch.randint(0, 4, (batch,))])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n0 = int(lengths[: 2 * batch].sum())
    n1 = int(lengths[2 * batch :].sum())
    values = torch.cat([zipf_ids(rows, n0, 0.0), zipf_ids(50, n1, 1.2)])
    uv, uo, inv = segmented_unique(values, torch.tensor([0, n0, values.numel()]))
    assert uo[1] * 64 * 4 > 4 << 20 and n0 < 2 * int(uo[1])  # the gather order's conditions
    return dict(weights=weights, unique_values=uv.to(dtype), unique_offsets=uo, inverse=inv,
                offsets=offsets,
                per_sample_weights=torch.rand(values.numel()) if weighted else None,
                feature_table=feature_table, pooling=[ops.MEAN if mean else ops.SUM, ops.MEAN],
                batch_size=batch)


def run_all(a, order, monkeypatch):
    monkeypatch.setenv("RECXLA_EMB_BACKWARD", order)
    grad = torch.randn(a["batch_size"], 64 * 2 + 7, generator=torch.Generator().manual_seed(3))
    results = [ops.unique_grad(grad, bag_lookup(a))]
    for optim in OPTIMS.values():
        torch.manual_seed(4)  # the same starting optimizer states for every order
        args = fused_args(a, optim, grad, wd=0.01, sign=-1.0)
        ops.backward_update(*update_args(args))
        results.append(args[1] + args[2])
    return grad, results


@pytest.mark.parametrize("dtype,weighted,mean", [(torch.int64, True, False),
                                                 (torch.int32, False, True)])
def test_orders_give_the_same_bits(monkeypatch, dtype, weighted, mean):
    a = few_repeats_inputs(dtype, weighted, mean)
    before = torch.get_num_threads()
    try:
        results = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for order in ORDERS:
                grad, results[(order, threads)] = run_all(a, order, monkeypatch)
    finally:
        torch.set_num_threads(before)
    first = results[("accumulate", 1)]
    for key, got in results.items():
        for g, w in zip(got, first):
            assert all(torch.equal(x, y) for x, y in zip(g, w)), key
    assert_lists_close(first[0], ref.embedding_bag_unique_grad_ref(grad, bag_lookup(a)),
                       rtol=0, atol=0)
