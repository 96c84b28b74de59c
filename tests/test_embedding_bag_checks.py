"""Input checks of the embedding_bag ops on every backend, and of the fused optimizers'
hyperparameters.

The CUDA and Triton kernels trust their arguments; the public entries check the data first on
the device (`check_lookup_data`, one flag tensor read per call or per step). Here the Triton
path runs under TRITON_INTERPRET=1 on CPU tensors: bad input must raise what the CPU kernel
raises, before any row or optimizer state changes (before these checks existed, a row listed
twice was updated twice and an id pointing into another table's segment read that table's row,
silently).
"""

import math
import sys

import pytest
import torch

from recxla import _extension
from recxla.nn import EmbeddingBagCollection
from recxla.ops import embedding_bag as ops
from recxla.ops import embedding_bag_checks as checks

from test_embedding_bag import (  # noqa: F401  (interpreted_triton is a fixture)
    _bad_inputs,
    fused_args,
    bag_lookup,
    interpreted_triton,
    make_kjt,
    make_tables,
    op_inputs,
    update_args,
)

NAMES = ["unique_values", "unique_offsets", "inverse", "offsets", "per_sample_weights"]


def more_bad_inputs(a):
    """Wrong data that stays inside every array's bounds: silently wrong before the checks."""
    uv, bounds = a["unique_values"], a["unique_offsets"].tolist()
    repeated = uv.clone()
    t = max(range(3), key=lambda k: bounds[k + 1] - bounds[k])  # a table with >= 2 rows
    repeated[bounds[t] + 1] = repeated[bounds[t]]
    inverse = a["inverse"].clone()
    inverse[0] = bounds[2]  # feature 0 (table 0) pointing at table 2's first row
    # Bag 0 ends at the last id and bag 1 at 0: decreasing whenever there is an id at all (the
    # bags are random and may all be empty up to any given one), yet every offset in bounds.
    decreasing = a["offsets"].clone()
    assert decreasing[-1] > 0, "op_inputs drew no ids at all"
    decreasing[1], decreasing[2] = decreasing[-1], 0
    return [
        ("unique_values", repeated, ValueError, f"table {t}'s are not"),
        ("inverse", inverse, IndexError, "outside the unique_values segment of its table"),
        ("unique_values", uv - uv.max() - 1, IndexError, "unique_values of table 0 must lie"),
        ("offsets", decreasing, ValueError, "offsets must"),
    ]


@pytest.fixture
def unchecked_backend(monkeypatch, interpreted_triton):
    """Routes recxla.ops.embedding_bag's CPU tensors to a backend whose kernels trust their
    arguments: the Triton kernels (interpreted)."""
    monkeypatch.setattr(_extension, "backend_for", lambda t, op: "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "recxla.triton_kernels.embedding_bag", interpreted_triton)
    return "triton"


def _raised(fn, *args):
    try:
        fn(*args)
    except (ValueError, IndexError, TypeError) as e:
        return e
    return None


def test_bad_input_raises_what_the_cpu_kernel_raises(unchecked_backend):
    a = op_inputs(batch=9, weighted=True)
    grad = torch.randn(a["batch_size"], 34)
    args = fused_args(a, ops.ROWWISE_ADAGRAD, grad)
    before = [x.clone() for x in args[1] + args[2]]
    for name, value, exc, match in _bad_inputs(a) + more_bad_inputs(a):
        bad = list(args)
        bad[3 + NAMES.index(name)] = value
        want = _raised(torch.ops.recxla.embedding_bag_backward_update, *bad)  # the CPU kernel
        assert isinstance(want, exc), (name, want)
        with pytest.raises(type(want), match=match) as got:
            ops.backward_update(*update_args(bad))
        # The same words as the CPU kernel's message, up to the values it prints.
        assert str(want).split(", got")[0].split(" (feature")[0] in str(got.value), name
        assert all(torch.equal(x, y) for x, y in zip(args[1] + args[2], before)), name
        lookup = update_args(bad)[1]
        want = _raised(torch.ops.recxla.embedding_bag_forward, *lookup)
        if want is not None:  # the forward does not need strictly increasing rows
            with pytest.raises(type(want)):
                ops.pooled_forward(lookup)


def bad_optimizer_args(args):
    """(argument index, bad value) pairs for the optimizer arguments of backward_update (args of
    fused_args with ADAGRAD): states (dtype, shape, device), optim, hparams."""
    states, optim, hparams = args[2], args[11], args[12]
    with_state = lambda t, s: (2, [s if i == t else x for i, x in enumerate(states)])  # noqa
    return [
        with_state(1, states[1].double()),
        with_state(0, states[0][:-1]),
        with_state(2, states[2].t() if states[2].shape[1] > 1 else states[2][:1]),
        (2, states[:2]),
        (11, optim[:2]),
        (11, [optim[0], 7, optim[2]]),
        (12, hparams[:-1]),
        (12, hparams[:5] + [math.nan] + hparams[6:]),
        (12, hparams[:10] + [-1.0] + hparams[11:]),
        (12, hparams[:3] + [0.5] + hparams[4:]),
    ]


def test_bad_optimizer_arguments_raise_what_the_cpu_kernel_raises(unchecked_backend):
    a = op_inputs(batch=7)
    args = fused_args(a, ops.ADAGRAD, torch.randn(a["batch_size"], 34))
    before = [x.clone() for x in args[1] + args[2]]
    for index, value in bad_optimizer_args(args):
        bad = list(args)
        bad[index] = value
        want = _raised(torch.ops.recxla.embedding_bag_backward_update, *bad)  # the CPU kernel
        assert want is not None, (index, value)
        with pytest.raises(type(want)) as got:
            ops.backward_update(*update_args(bad))
        assert str(want).split(", got")[0] == str(got.value).split(", got")[0], index
        assert all(torch.equal(x, y) for x, y in zip(args[1] + args[2], before)), index
    # A state on another device than its table: the CPU kernel's words, shown with the meta
    # device (the dispatcher would route a meta state to the op's fake kernel instead).
    states = [args[2][0], args[2][1].to("meta"), args[2][2]]
    with pytest.raises(ValueError, match=r"backward_update: states\[1\] is on meta but the "
                                         r"weights are on cpu"):
        checks.check_optimizer("recxla::embedding_bag_backward_update", args[1], states,
                               args[11], args[12])


def test_valid_input_passes_and_matches_cpu(unchecked_backend):
    a = op_inputs(batch=6, weighted=True)
    flags = checks.check_lookup_data(bag_lookup(a), True)
    assert flags.dtype == torch.int64 and flags.device == a["unique_values"].device
    out = ops.pooled_forward(bag_lookup(a))
    torch.testing.assert_close(out, torch.ops.recxla.embedding_bag_forward(*bag_lookup(a)))
    into = torch.full_like(out, float("nan"))
    assert ops.pooled_forward(bag_lookup(a), out=into) is into
    torch.testing.assert_close(into, out, rtol=0, atol=0)


def test_fused_lookup_checks_once_per_step_before_any_kernel(unchecked_backend, monkeypatch):
    calls = []
    check = checks.check_lookup_data
    monkeypatch.setattr(checks, "check_lookup_data", lambda *x: calls.append(x[-1]) or check(*x))
    a = op_inputs(batch=5)
    weights = [w.clone().requires_grad_() for w in a["weights"]]

    def step():
        return [ops.SGD] * 3, [None] * 3, [0.1, 0.0, 0.0, 1.0] * 3

    plan = ops.LookupPlan(a["feature_table"], a["pooling"], 5, optimizer_step=step)
    rest = [a[k] for k in ("unique_values", "unique_offsets", "inverse", "offsets")]
    out = ops.FusedPooledLookup.apply(plan, *rest, None, *weights)
    out.backward(torch.randn_like(out))
    assert calls == [True]  # once, with the strictly-increasing check the update needs
    assert all(not torch.equal(w, w0) for w, w0 in zip(weights, a["weights"]))
    rest[0] = rest[0].clone()
    rest[0][1] = rest[0][0]  # a repeated row in table 0
    frozen = [w.detach().clone() for w in weights]
    with pytest.raises(ValueError, match="strictly increasing"):
        ops.FusedPooledLookup.apply(plan, *rest, None, *weights)
    assert all(torch.equal(w, w0) for w, w0 in zip(weights, frozen))


def test_fused_lookup_checked_upstream_skips_the_data_checks(unchecked_backend, monkeypatch):
    """recxla's sharded module looks up ids its input dist already checked: its plan skips the
    data checks, whose flags cost a host sync every step on a GPU; the layout checks (host
    only) still run, and the result is the checked lookup's."""
    calls = []
    check = checks.check_lookup_data
    monkeypatch.setattr(checks, "check_lookup_data", lambda *x: calls.append(x[-1]) or check(*x))
    a = op_inputs(batch=5)
    rest = [a[k] for k in ("unique_values", "unique_offsets", "inverse", "offsets")]
    outs = []
    for upstream in (False, True):
        plan = ops.LookupPlan(a["feature_table"], a["pooling"], 5, checked_upstream=upstream)
        outs.append(ops.FusedPooledLookup.apply(plan, *rest, None, *a["weights"]))
    assert calls == [False]  # the unchecked plan only (no optimizer: no increasing check)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    plan = ops.LookupPlan(a["feature_table"], a["pooling"], 4, checked_upstream=True)
    with pytest.raises(ValueError):  # a batch size that disagrees with offsets: layout
        ops.FusedPooledLookup.apply(plan, *rest, None, *a["weights"])


# ---------------------------------------------------------------------------------------------
# Hyperparameters: NaN and Inf would turn every touched row into NaN


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name,optimizer", [("lr", "sgd"), ("weight_decay", "sgd"),
                                            ("eps", "rowwise_adagrad"), ("lr", "adagrad"),
                                            ("lr_decay", "adagrad")])
def test_non_finite_hyperparameters_raise(name, optimizer, bad):
    tables = make_tables()
    kwargs = {"lr": 0.1, name: bad}
    with pytest.raises(ValueError, match=rf"{name} must be a finite number >= 0, got {bad}"):
        EmbeddingBagCollection(tables, optimizer=optimizer, **kwargs)
    # Set later on the optimizer (a scheduler, a user): rejected at the next forward.
    module = EmbeddingBagCollection(tables, optimizer=optimizer, lr=0.1)
    before = [p.detach().clone() for p in module.parameters()]
    for p in module.parameters():
        p._in_backward_optimizers[0].param_groups[0][name] = bad
    with pytest.raises(ValueError, match=rf"{name} must be a finite number >= 0"):
        module(make_kjt(tables, ["f0", "f1", "f2", "f3"], 4)).values().sum().backward()
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))


@pytest.mark.parametrize("index,bad,match", [(0, math.nan, r"lr of table 0\) must be finite"),
                                             (5, math.inf, r"eps of table 1\) must be finite"),
                                             (10, -1.0, r"weight_decay of table 2\) must be"),
                                             (7, 0.5, r"grad_sign of table 1\) must be 1 or -1")])
def test_op_rejects_bad_hparams_before_writing(index, bad, match):
    a = op_inputs(batch=4)
    args = fused_args(a, ops.ADAGRAD, torch.randn(4, 34))
    before = [x.clone() for x in args[1] + args[2]]
    args[-1][index] = bad
    with pytest.raises(ValueError, match=match):
        torch.ops.recxla.embedding_bag_backward_update(*args)
    assert all(torch.equal(x, y) for x, y in zip(args[1] + args[2], before))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_bad_input_raises_before_any_kernel(monkeypatch, backend):
    """The same cases on a GPU (`make gpu-campaign`): the errors of the CPU kernel, rows and states
    untouched, and no device assert (which would poison the CUDA context for the process)."""
    import recxla

    if backend == "cuda" and not recxla.built_with_cuda():
        pytest.skip("this build has no CUDA kernels")
    monkeypatch.setenv("RECXLA_BACKEND", backend)
    a = op_inputs(batch=9, weighted=True)
    args = fused_args(a, ops.ROWWISE_ADAGRAD, torch.randn(a["batch_size"], 34))
    for name, value, exc, match in _bad_inputs(a) + more_bad_inputs(a):
        bad = list(args)
        bad[3 + NAMES.index(name)] = value
        want = _raised(torch.ops.recxla.embedding_bag_backward_update, *bad)
        cuda = [x.cuda() if isinstance(x, torch.Tensor) else
                [t.cuda() for t in x] if isinstance(x, list) and x and
                isinstance(x[0], torch.Tensor) else x for x in bad]
        before = [x.clone() for x in cuda[1] + cuda[2]]
        with pytest.raises(type(want), match=match):
            ops.backward_update(*update_args(cuda))
        torch.cuda.synchronize()
        assert all(torch.equal(x, y) for x, y in zip(cuda[1] + cuda[2], before)), name
