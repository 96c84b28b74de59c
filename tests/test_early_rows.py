"""DBP's early rows (recxla.torchrec.early_rows): the next batch's row-exchange rows that the
current update leaves as they are, sent before it.

The split of an owner's requests against a by-hand oracle; on 2 gloo ranks, the pipeline with
early rows against the same pipeline without them, with FP8 rows on the wire (each row
travels once with the bytes it would have had, so the two runs agree bit for bit), the share
counters, detach() dropping them, and a change of the tables behind the pipeline's back
refused. (tests/test_pipeline.py checks them against the sequential loop and catches a planted
stale read.)
"""

import pytest
import torch
from distributed_utils import run_distributed

import test_sharded_dlrm as dlrm
from test_pipeline import _build, _state


def test_split_requests_matches_by_hand_split(seed):
    from recxla.torchrec.early_rows import split_requests
    from recxla.torchrec.row_exchange import RowInput

    g = torch.Generator().manual_seed(seed)
    num_micro, world = 3, 4
    ids, counts, masks = [], [], []
    for _ in range(2):  # two row groups
        per = torch.randint(0, 6, (num_micro, world), generator=g)
        n = int(per.sum())
        ids.append(torch.randint(0, 1000, (n,), generator=g))
        counts.append(per.tolist())
        masks.append(torch.rand(n, generator=g) < 0.4)
    early, late = split_requests(RowInput(torch.cat(ids), counts), torch.cat(masks))
    for group, (i, c, m) in enumerate(zip(ids, counts, masks)):
        start = 0
        want_early, want_late = [], []
        early_counts, late_counts = [], []
        for k in range(num_micro):
            early_counts.append([])
            late_counts.append([])
            for s in range(world):
                segment, segment_mask = i[start: start + c[k][s]], m[start: start + c[k][s]]
                want_early += segment[~segment_mask].tolist()
                want_late += segment[segment_mask].tolist()
                early_counts[k].append(int((~segment_mask).sum()))
                late_counts[k].append(int(segment_mask.sum()))
                start += c[k][s]
        assert early.ids[group].tolist() == want_early
        assert late.ids[group].tolist() == want_late
        assert early.counts[group] == early_counts and late.counts[group] == late_counts
        # RowInput's cuts still find each (micro-batch, source)'s rows.
        for k in range(num_micro):
            for s in range(world):
                first = late.start(group, k, s)
                assert late.rows(group, k, s) == late_counts[k][s]
                assert first == sum(map(sum, late_counts[:k])) + sum(late_counts[k][:s])


def _early_rows_body(rank, world, seed, fwd, bwd, steps, batch, options):
    """The same batches through TrainPipeline without and with early rows -> (max |difference|
    of every state tensor, outputs equal, rows sent early, rows sent late, rows requested)."""
    from recxla.pipeline import TrainPipeline

    options = dict(options)
    row_exchange = options.pop("row_exchange")
    generator = torch.Generator().manual_seed(seed + 1)
    _, _, configs = _build(seed, world, "table_wise", fwd, bwd, row_exchange)
    batches = [dlrm._batch(configs, world * batch, generator) for _ in range(steps)]
    mine = [dlrm._slice(b, rank * batch, (rank + 1) * batch) for b in batches]
    runs = []
    for early_rows in (False, True):
        model, dense, _ = _build(seed, world, "table_wise", fwd, bwd, row_exchange)
        pipeline = TrainPipeline(model, dense, torch.device("cpu"), early_rows=early_rows,
                                 **options)
        modules = [m for m in model.modules() if hasattr(m, "steps")]
        for m in modules:
            m.comm_stats.reset()
        data, outputs = iter(mine), []
        while True:
            try:
                outputs.append(pipeline.progress(data))
            except StopIteration:
                break
        stats = [m.comm_stats for m in modules]
        runs.append((_state(model), outputs, sum(s.rows_sent_early for s in stats),
                     sum(s.rows_sent_late for s in stats)))
    (want, want_out, _, _), (got, got_out, early, late) = runs
    difference = max(float((g - w).abs().max()) if g.numel() else 0.0
                     for key in want for g, w in zip(got[key], want[key]))
    same_outputs = all(torch.equal(a, b) for x, y in zip(want_out, got_out)
                       for a, b in zip(x, y))
    return difference, same_outputs, early, late


@pytest.mark.distributed
@pytest.mark.parametrize("options", [
    dict(num_micro_batches=1, row_exchange="all"),
    dict(num_micro_batches=3, split="clustered", row_exchange="all"),
    dict(num_micro_batches=2, row_exchange=["t0"], dbp_lookup="early")],
    ids=["dbp, rows", "fwp+dbp m=3 clustered, rows", "fwp+dbp m=2, pooled and rows"])
def test_early_rows_are_bit_for_bit_the_step_without_them(seed, options):
    """FP8 rows forward, e5m2 gradients: a row or bag quantized early has the bytes it would
    have had late, so weights, optimizer state and outputs are equal, not close. (A late bag
    is the early lookup corrected: against DBP's early lookup, which corrects every bag the
    same way, pooled tables are bit for bit too.)"""
    results = run_distributed(_early_rows_body, world_size=2,
                              args=(seed, "e4m3", "e5m2", 6, 9, options), timeout=300)
    for rank, (difference, same_outputs, early, late) in enumerate(results):
        assert difference == 0.0 and same_outputs, (rank, difference, same_outputs)
        # Batches of random ids share some rows and not others: both parts travel (the first
        # batch has no previous update, so its rows all go the ordinary way).
        assert early > 0 and late > 0, (rank, early, late)


def _detach_body(rank, world, seed, steps, batch):
    """Early rows through a detach / attach in the middle of the run, and a change of the
    tables without detach -> (error after detach/attach against the sequential loop,
    the error message of the change without detach)."""
    from recxla.pipeline import TrainPipeline

    generator = torch.Generator().manual_seed(seed + 1)
    model, dense, configs = _build(seed, world, "table_wise", "fp32", "fp32", "all")
    batches = [dlrm._batch(configs, world * batch, generator) for _ in range(steps)]
    mine = [dlrm._slice(b, rank * batch, (rank + 1) * batch) for b in batches]
    for i, b in enumerate(mine):
        dense.zero_grad()
        loss, _ = model(b)
        loss.backward()
        dense.step()
        if i == 1:
            with torch.no_grad():  # the same change the pipelined run makes while detached
                for name, p in model.named_parameters():
                    if "embedding_bags" in name and p.numel():
                        p.mul_(0.5)
    want = _state(model)

    model, dense, _ = _build(seed, world, "table_wise", "fp32", "fp32", "all")
    pipeline = TrainPipeline(model, dense, torch.device("cpu"), early_rows=True)
    data = iter(mine)
    for _ in range(2):
        pipeline.progress(data)
    detached = pipeline.detach()
    with torch.no_grad():
        for name, p in detached.named_parameters():
            if "embedding_bags" in name and p.numel():
                p.mul_(0.5)
    pipeline.attach()
    while True:
        try:
            pipeline.progress(data)
        except StopIteration:
            break
    got = _state(model)
    error = max(float((g - w).abs().max()) for key in want for g, w in zip(got[key], want[key])
                if g.numel())

    model, dense, _ = _build(seed, world, "table_wise", "fp32", "fp32", "all")
    pipeline = TrainPipeline(model, dense, torch.device("cpu"), early_rows=True)
    data = iter(mine)
    for _ in range(2):  # the second step sends the third batch's early rows
        pipeline.progress(data)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embedding_bags" in name and p.numel():
                p.mul_(0.5)
    message = None
    try:
        pipeline.progress(data)
    except RuntimeError as e:
        message = str(e)
    return error, message


@pytest.mark.distributed
def test_detach_drops_early_rows_and_a_change_behind_the_pipeline_is_refused(seed):
    results = run_distributed(_detach_body, world_size=2, args=(seed, 5, 6), timeout=300)
    for rank, (error, message) in enumerate(results):
        assert error <= 1e-5, (rank, error)
        assert message is not None and "call detach() before changing the model" in message, \
            (rank, message)
