"""recxla.distributed.PowerSGDAllReduce and powersgd_compress_hook on gloo ranks (4 ranks as 2
nodes x 2 by node, 4 x 1, 1 x 4, and one flat group): several steps against a float64
reference of PowerSGD with error feedback computed from every rank's gradients, the same bits
on every rank, the whole average in the first start_step steps, error feedback carrying what
the factors miss, the same bits whatever the buckets and across a save/load of the state, DDP
trained with the hook, and the errors."""

import pytest
import torch
import compressed_all_reduce_cases as cases
from distributed_utils import run_distributed

pytestmark = pytest.mark.distributed


def _reference(all_grads, shapes, steps, start_step, first_qs):
    """PowerSGD over every rank's gradients in float64 (the module docstring's steps 1-3):
    -> per step, the averages every rank applies."""
    world = len(all_grads)
    residuals = [[torch.zeros(s, dtype=torch.float64) for s in shapes] for _ in range(world)]
    qs = [None if q is None else q.double() for q in first_qs]
    out = []
    for step in range(steps):
        averages = []
        for i, shape in enumerate(shapes):
            grads = [all_grads[w][step][i].double() for w in range(world)]
            if qs[i] is None or step < start_step:
                averages.append(torch.stack(grads).mean(0))
                continue
            n = shape[0]
            ms = [(g + residuals[w][i]).reshape(n, -1) for w, g in enumerate(grads)]
            q, _ = torch.linalg.qr(qs[i])
            p, _ = torch.linalg.qr(sum(m @ q for m in ms))
            # QR's columns may differ from Gram-Schmidt's in sign; P Q^T does not.
            q_mean = sum(m.t() @ p for m in ms) / world
            average = p @ q_mean.t()
            for w, m in enumerate(ms):
                residuals[w][i] = (m - average).reshape(shape)
            qs[i] = q_mean
            averages.append(average.reshape(shape))
        out.append(averages)
    return out


def _steps_body(rank, world, seed, shapes, steps, factor_rank, start_step):
    import torch.distributed as dist

    from recxla.distributed import PowerSGDAllReduce

    all_grads = [[cases.grads_of(seed, k, step, shapes) for step in range(steps)]
                 for k in range(world)]
    out = []
    for label, groups in cases.node_layouts(world):
        params = cases.params_of(shapes)
        sync = PowerSGDAllReduce([(f"p{i}", p) for i, p in enumerate(params)], rank=factor_rank,
                                 start_step=start_step, seed=seed, **groups)
        first_qs = [sync.q[i].clone() if i in sync.q else None for i in range(len(shapes))]
        reference = _reference(all_grads, shapes, steps, start_step, first_qs)
        for step in range(steps):
            grads = [g.clone() for g in all_grads[rank][step]]
            sync.all_reduce(params, grads)
            for i, (got, want) in enumerate(zip(grads, reference[step])):
                gathered = [torch.empty_like(got) for _ in range(world)]
                dist.all_gather(gathered, got)
                matrix = got.reshape(got.shape[0], -1).double()
                out.append({
                    "layout": label, "step": step, "param": i,
                    "compressed": i in sync.q and step >= start_step,
                    "same_on_ranks": all(torch.equal(g, gathered[0]) for g in gathered),
                    "error": ((got.double() - want).abs().max() /
                              want.abs().max().clamp_min(1e-30)).item(),
                    "matrix_rank": int(torch.linalg.matrix_rank(matrix, rtol=1e-5))
                    if got.dim() == 2 else None})
    return out


@pytest.mark.parametrize("factor_rank", [1, 3])
def test_steps_against_a_float64_reference(seed, factor_rank):
    g = torch.Generator().manual_seed(seed)
    # Compressed: a matrix and a 3-D parameter (viewed [shape[0], rest]); whole: a vector, and a
    # matrix too small for its factors to save half its values.
    shapes = [(int(torch.randint(20, 60, (1,), generator=g)), 31), (9, 4, 5), (17,), (3, 2)]
    start_step, steps = 2, 5
    for per_rank in run_distributed(_steps_body, 4,
                                    (seed, shapes, steps, factor_rank, start_step)):
        assert len(per_rank) == 4 * steps * len(shapes)
        for r in per_rank:
            assert r["same_on_ranks"], r
            assert r["error"] <= 1e-4, r
            assert r["compressed"] == (r["param"] in (0, 1) and r["step"] >= start_step), r
            if r["compressed"] and r["matrix_rank"] is not None:
                assert r["matrix_rank"] <= factor_rank, r
            elif r["matrix_rank"] is not None and r["param"] == 0:
                assert r["matrix_rank"] > factor_rank, r  # the whole average, before start


def _feedback_body(rank, world, seed, shape, steps):
    from recxla.distributed import PowerSGDAllReduce

    grad = cases.grads_of(seed, rank, 0, [shape])[0]
    exact = torch.stack([cases.grads_of(seed, k, 0, [shape])[0].double()
                         for k in range(world)]).mean(0)
    errors = {}
    for feedback in (True, False):
        params = cases.params_of([shape])
        sync = PowerSGDAllReduce([("p", params[0])], start_step=0, error_feedback=feedback,
                                 seed=seed)
        total = torch.zeros(shape, dtype=torch.float64)
        for _ in range(steps):  # the same gradient every step: the worst case without it
            step = [grad.clone()]
            sync.all_reduce(params, step)
            total += step[0].double()
        errors[feedback] = ((total - steps * exact).abs().max() / exact.abs().max()).item()
    return errors


def test_error_feedback_carries_what_the_factors_miss(seed):
    steps = 80
    for errors in run_distributed(_feedback_body, 2, (seed, (6, 4), steps)):
        # Without feedback a rank-1 average of a full-rank gradient misses the same part every
        # step, and the sum's error grows with the steps; with it, the missed part is sent on
        # later steps: the error stays what one residual holds (about 3 here, whatever the
        # steps, against about 0.7 a step without).
        assert errors[False] > 0.3 * steps, errors
        assert errors[True] * 6 < errors[False], errors


def test_same_bits_whatever_the_buckets_and_across_a_resume(seed):
    """DDP regroups the parameters into buckets after its first step, and a resumed run starts
    with the first grouping again: neither may change a bit, nor whether a bucket's gradients
    are views of its buffer."""
    shapes = [(50, 3), (129,), (1,), (26, 40)]
    split = [[3, 1], [0], [2]]
    kwargs = {"start_step": 2, "seed": seed}
    for r in run_distributed(cases.regroup_and_resume_body, 4,
                             ("PowerSGDAllReduce", kwargs, seed, shapes, 6, split)):
        # A flat bucket's gradients are views that cost a call each: they are read to check
        # its layout once, then the bucket's buffer is read.
        assert r == {"regrouped": True, "resumed": True, "changes": True,
                     "gradient_reads": [1] + [0] * 5}


def _dropped_body(rank, world, seed):
    from recxla.distributed import PowerSGDAllReduce

    shapes = [(12, 9), (5,)]
    params = cases.params_of(shapes)

    def new():
        return PowerSGDAllReduce([(f"p{i}", p) for i, p in enumerate(params)], start_step=0,
                                 seed=seed)

    fresh, interrupted = new(), new()
    # A backward that raised after its first bucket: that bucket stays held until dropped.
    first = cases.Bucket([params[0]], cases.grads_of(seed, rank, 0, shapes)[:1], last=False)
    held = interrupted.start_bucket(first)
    interrupted.drop_pending()
    out = []
    for sync in (fresh, interrupted):
        grads = cases.grads_of(seed, rank, 1, shapes)
        handle = sync.start_bucket(cases.Bucket(params, grads, last=True))
        sync.finish([handle])
        out.append(torch.cat([g.flatten() for g in grads]))
    return {"held": held is None, "same": torch.equal(out[0], out[1])}


def test_a_dropped_backward_leaves_nothing_behind(seed):
    for r in run_distributed(_dropped_body, 2, (seed,)):
        assert r == {"held": True, "same": True}


def test_ddp_hook_trains_as_ddp_does(seed):
    steps = 60
    fp32 = run_distributed(cases.ddp_training_body, 2, (seed, steps))[0]
    hook = ("PowerSGDAllReduce", "powersgd_compress_hook")
    low_rank = run_distributed(cases.ddp_training_body, 2, (seed, steps, hook, {"start_step": 3}))
    assert all(r["same_on_ranks"] for r in low_rank)
    assert low_rank[0]["loss"] <= 1.5 * fp32["loss"] + 1e-2, (low_rank[0]["loss"],
                                                               fp32["loss"])


def _errors_body(rank, world):
    import torch.distributed as dist

    from recxla.distributed import PowerSGDAllReduce

    p = torch.nn.Parameter(torch.zeros(8, 6))
    sync = PowerSGDAllReduce([("p", p)])
    good = {k: v.clone() for k, v in sync.state_dict().items()}
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    return cases.error_messages(
        [lambda kw=kw: PowerSGDAllReduce([("p", p)], **kw)
         for kw in ({"rank": 0}, {"start_step": -1}, {"seed": 1.5},
                    {"node_group": dist.group.WORLD})]
        + [lambda: PowerSGDAllReduce([("p", frozen)])]
        + [lambda a=a: sync.start(*a)
           for a in (([torch.nn.Parameter(torch.zeros(3))], [torch.zeros(3)]), ([], []),
                     ([p, p], [torch.zeros(8, 6)] * 2), ([p], [torch.zeros(6, 8)]),
                     ([p], [torch.zeros(6, 8).t()]))]
        + [lambda bad=bad: sync.load_state_dict(bad)
           for bad in ({**good, "q.q": torch.zeros(6, 1)}, {**good, "p.q": torch.zeros(8, 1)},
                       {k: v for k, v in good.items() if k != "p.residual"})])


def test_errors_name_the_op_and_argument():
    messages = run_distributed(_errors_body, 2, ())[0]
    wants = ["rank must be an int >= 1, got 0", "start_step must be an int >= 0, got -1",
             "seed must be an int >= 0, got 1.5", "node_group and cross_group go together",
             "no parameter that requires grad", "not among the named_parameters",
             "one gradient per parameter, each parameter once, at least one; got 0",
             "each parameter once", "the gradient of 'p' is shaped [6, 8], its parameter [8, 6]",
             "the gradient of 'p' must be contiguous",
             "'q.q' is no state of these parameters", "'p.q' must be shaped [6, 1]",
             "'p.residual' is missing"]
    assert len(messages) == len(wants)
    for message, want in zip(messages, wants):
        assert message.startswith("recxla.distributed.PowerSGDAllReduce: ") and want in message, \
            (message, want)
