"""CommMeter on 2 gloo ranks: collectives still give their results, and the meter counts the
bytes each rank sends to the other, the time in flight and the caller's blocked time, by phase
and step."""

import random

import pytest
import torch
import torch.distributed as dist
from distributed_utils import run_distributed

from recxla.train.comm_meter import CommMeter, _union_length


def _splits(seed, rank, rows):
    rng = random.Random(seed * 7 + rank)
    first = rng.randrange(0, rows + 1)
    return [first, rows - first]


def _body(rank, world, seed, ranks_per_node):
    gen = torch.Generator().manual_seed(seed + rank)
    rows, dim = 37 + rank, 5
    x = torch.randn(rows, dim, generator=gen)
    ids = torch.randint(0, 1000, (rows,), generator=gen)
    in_splits = _splits(seed, rank, rows)
    table = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(table, torch.tensor(in_splits))
    out_splits = [int(table[src][rank]) for src in range(world)]
    expect = torch.empty(sum(out_splits), dim)
    dist.all_to_all_single(expect, x, out_splits, in_splits)  # before the meter: the oracle

    meter = CommMeter(ranks_per_node=ranks_per_node)
    original = dist.all_to_all_single
    with meter.installed():
        assert dist.all_to_all_single is not meter._originals["all_to_all_single"]
        meter.begin_step(0)
        with meter.phase("forward"):
            got = torch.empty_like(expect)
            dist.all_to_all_single(got, x, out_splits, in_splits)  # synchronous, float
        with meter.phase("input"):
            got_ids = torch.empty(sum(out_splits), dtype=torch.int64)
            work = dist.all_to_all_single(got_ids, ids, out_splits, in_splits, async_op=True)
            assert isinstance(work, dist.Work)  # TorchRec checks isinstance(req, dist.Work)
        with meter.phase("backward"):
            dense = torch.randn(11, generator=gen)
            summed = dense.clone()
            dist.all_reduce(summed)
            # all_reduce_by_node's collectives; the deprecated name counts once, not twice.
            part = torch.empty(6)
            dist.reduce_scatter_single(part, torch.randn(12, generator=gen))
            whole = torch.empty(12)
            dist.all_gather_single(whole, part)
            dist.all_gather_into_tensor(whole, part)
        meter.end_step()
        meter.begin_step(1)
        with meter.phase("forward"):
            work.wait()  # blocked time counts in the step (and phase) of the wait
        meter.end_step()
    assert dist.all_to_all_single is original  # uninstalled
    step0, step1 = meter.step_comm(0), meter.step_comm(1)
    return {
        "ok": torch.equal(got, expect), "ids": got_ids.tolist(), "sent_ids": ids.tolist(),
        "in_splits": in_splits,
        "out_splits": out_splits, "summed": summed.tolist(), "dense": dense.tolist(),
        "step0": step0, "step1": step1, "records": [(r.op, r.phase, r.kind, r.step)
                                                    for r in meter.records],
        "done": all(r.done is not None and r.done >= r.issued for r in meter.records),
    }


@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_meter_counts_bytes_time_and_phases(seed, ranks_per_node):
    results = run_distributed(_body, 2, args=(seed, ranks_per_node))
    for rank, res in enumerate(results):
        other = results[1 - rank]
        assert res["ok"]
        assert res["summed"] == pytest.approx([a + b for a, b in zip(res["dense"],
                                                                     other["dense"])])
        # ids: this rank's own split, then what the other rank sent it (rank order)
        mine = sum(res["in_splits"][:rank])
        theirs = sum(other["in_splits"][:rank])
        expected = {rank: res["sent_ids"][mine:mine + res["in_splits"][rank]],
                    1 - rank: other["sent_ids"][theirs:theirs + other["in_splits"][rank]]}
        assert res["ids"] == expected[0] + expected[1]
        assert res["records"] == [("all_to_all_single", "forward", "embeddings", 0),
                                  ("all_to_all_single", "input", "ids", 0),
                                  ("all_reduce", "backward", "dense", 0),
                                  ("reduce_scatter_single", "backward", "dense", 0),
                                  ("all_gather_single", "backward", "dense", 0),
                                  ("all_gather_into_tensor", "backward", "dense", 0)]
        sent_rows = res["in_splits"][1 - rank]
        s0 = res["step0"]
        assert s0.bytes_sent == {"forward/embeddings": sent_rows * 5 * 4,
                                 "input/ids": sent_rows * 8,
                                 # the all-reduce, then (W-1) slices of 6 floats each
                                 "backward/dense": 2 * (2 - 1) * 11 * 4 // 2 + 3 * 6 * 4}
        assert s0.bytes_received == res["out_splits"][1 - rank] * (5 * 4 + 8) + 11 * 4 + 72
        cross = s0.total_bytes_sent if ranks_per_node == 1 else 0
        assert s0.cross_node_bytes_sent == cross
        assert s0.calls == 6 and res["step1"].calls == 0
        assert res["done"]
        # synchronous calls block for their whole flight; the async one only in its wait
        assert 0 < s0.exposed_s and set(s0.exposed_by_phase) == {"forward", "backward"}
        assert s0.comm_s > 0 and res["step1"].exposed_by_phase.keys() == {"forward"}


def test_union_length():
    assert _union_length([]) == 0
    assert _union_length([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.5, 3.6)]) == pytest.approx(3.0)
    assert _union_length([(2.0, 2.0)]) == 0


def test_a_collective_missing_from_torch_is_left_alone(monkeypatch):
    """Older torch releases lack some collectives (2.11 has no all_gather_single): the meter
    wraps the others and puts them back."""
    import torch.distributed.distributed_c10d as c10d

    monkeypatch.delattr(c10d, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    original = c10d.all_reduce
    meter = CommMeter()
    with meter.installed():
        assert c10d.all_reduce is not original and dist.all_reduce is c10d.all_reduce
        assert not hasattr(c10d, "all_gather_single")
    assert c10d.all_reduce is original and dist.all_reduce is original
