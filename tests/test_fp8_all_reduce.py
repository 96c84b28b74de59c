"""recxla.distributed.FP8AllReduce and fp8_compress_hook on 4 gloo ranks (2 nodes x 2 by node,
4 x 1, 1 x 4, and one flat group): the average against the exact one, the same bits on every
rank, error feedback keeping the accumulated error at one step's, the same bits whatever the
parameters' grouping into buckets and across a save/load of the residuals, DDP trained with the
hook against DDP's own all-reduce, and the errors."""

import pytest
import torch
import compressed_all_reduce_cases as cases
from distributed_utils import run_distributed

pytestmark = pytest.mark.distributed

E4M3_HALF_ULP = 2 ** -4  # e4m3 keeps 3 mantissa bits: rounding to nearest errs by <= 1/16


def _average_body(rank, world, seed, shapes):
    import torch.distributed as dist

    from recxla.distributed import FP8AllReduce

    out = []
    for label, groups in cases.node_layouts(world):
        params = cases.params_of(shapes)
        sync = FP8AllReduce([(f"p{i}", p) for i, p in enumerate(params)], **groups)
        grads = cases.grads_of(seed, rank, 0, shapes)
        sync.all_reduce(params, grads)
        for i, (shape, got) in enumerate(zip(shapes, grads)):
            terms = torch.stack([cases.grads_of(seed, k, 0, shapes)[i].double()
                                 for k in range(world)])
            exact = terms.mean(0)
            gathered = [torch.empty_like(got) for _ in range(world)]
            dist.all_gather(gathered, got)
            out.append({"layout": label, "param": i,
                        "same_on_ranks": all(torch.equal(g, gathered[0]) for g in gathered),
                        "error": (got.double() - exact).abs().max().item(),
                        # Two roundings: of each rank's term (its chunk's largest term at
                        # most) and of the sum (the largest |average| at most).
                        "bound": (E4M3_HALF_ULP * (terms.abs().max() + exact.abs().max())
                                  ).item()})
    return out


def test_average_over_every_rank_in_fp8(seed):
    g = torch.Generator().manual_seed(seed)
    # Sizes off the chunk (128): padded last chunks; a parameter smaller than a chunk.
    shapes = [(int(torch.randint(2, 40, (1,), generator=g)), 13), (1,),
              (int(torch.randint(129, 700, (1,), generator=g)),)]
    for per_rank in run_distributed(_average_body, 4, (seed, shapes)):
        assert len(per_rank) == 4 * len(shapes)
        for r in per_rank:
            assert r["same_on_ranks"], r
            assert r["error"] <= r["bound"], r


def _feedback_body(rank, world, seed, shapes, steps):
    from recxla.distributed import FP8AllReduce

    grads = cases.grads_of(seed, rank, 0, shapes)
    exact = [torch.stack([cases.grads_of(seed, k, 0, shapes)[i].double()
                          for k in range(world)]).mean(0)
             for i in range(len(shapes))]
    errors = {}
    for feedback in (True, False):
        params = cases.params_of(shapes)
        sync = FP8AllReduce([(f"p{i}", p) for i, p in enumerate(params)],
                            error_feedback=feedback)
        total = [torch.zeros(s, dtype=torch.float64) for s in shapes]
        for _ in range(steps):  # the same gradients every step: the worst case without it
            step = [t.clone() for t in grads]
            sync.all_reduce(params, step)
            total = [a + b.double() for a, b in zip(total, step)]
        errors[feedback] = max((t - steps * e).abs().max().item()
                               for t, e in zip(total, exact))
    return errors


def test_error_feedback_keeps_the_accumulated_error_at_one_steps(seed):
    shapes = [(300,), (7, 20)]
    steps = 24
    for errors in run_distributed(_feedback_body, 2, (seed, shapes, steps)):
        # Without feedback the same rounding adds up every step; with it, what was lost is
        # sent the next step, so the sum is off by about one step's error whatever the steps.
        assert errors[False] > 0
        assert errors[True] * 6 < errors[False], errors


def test_same_bits_whatever_the_buckets_and_across_a_resume(seed):
    """DDP regroups the parameters into buckets after its first step, and a resumed run starts
    with the first grouping again: neither may change a bit."""
    shapes = [(50, 3), (129,), (1,), (260,)]
    split = [[3, 1], [0], [2]]
    for r in run_distributed(cases.regroup_and_resume_body, 4,
                             ("FP8AllReduce", {}, seed, shapes, 6, split)):
        assert r["regrouped"] and r["resumed"] and r["changes"], r


def test_ddp_hook_trains_as_ddp_does(seed):
    steps = 40
    fp32 = run_distributed(cases.ddp_training_body, 2, (seed, steps))[0]
    fp8 = run_distributed(cases.ddp_training_body, 2,
                           (seed, steps, ("FP8AllReduce", "fp8_compress_hook"), {}))
    assert all(r["same_on_ranks"] for r in fp8)
    drift = (fp8[0]["weights"] - fp32["weights"]).abs().max().item()
    scale = fp32["weights"].abs().max().item()
    assert drift <= 0.05 * scale, (drift, scale)
    assert fp8[0]["loss"] <= 1.5 * fp32["loss"] + 1e-3, (fp8[0]["loss"], fp32["loss"])


def _errors_body(rank, world):
    import torch.distributed as dist

    from recxla.distributed import FP8AllReduce

    p = torch.nn.Parameter(torch.zeros(3))
    sync = FP8AllReduce([("p", p)])
    frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    return cases.error_messages(
        [lambda kw=kw: FP8AllReduce([("p", p)], **kw)
         for kw in ({"fmt": "bf16"}, {"chunk": 0}, {"node_group": dist.group.WORLD})]
        + [lambda: FP8AllReduce([("p", frozen)]),
           lambda: sync.start([torch.nn.Parameter(torch.zeros(3))], [torch.zeros(3)]),
           lambda: sync.start([], [])]
        + [lambda bad=bad: sync.load_state_dict(bad)
           for bad in ({"q.sent_residual": torch.zeros(1, 128)},
                       {"p.sent_residual": torch.zeros(4)}, {"p.other": torch.zeros(1, 128)})])


def test_errors_name_the_op_and_argument():
    messages = run_distributed(_errors_body, 2, ())[0]
    wants = ["fmt must be one of ('e4m3', 'e5m2'), got 'bf16'", "chunk must be an int >= 1",
             "node_group and cross_group go together", "no parameter that requires grad",
             "not among the named_parameters", "one gradient per parameter, at least one",
             "'q.sent_residual' is no residual",
             "'p.sent_residual' must be rows [1, 128]", "'p.other' is no residual"]
    assert len(messages) == len(wants)
    for message, want in zip(messages, wants):
        assert message.startswith("recxla.distributed.FP8AllReduce: ") and want in message, \
            (message, want)
