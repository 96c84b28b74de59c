"""embedding_bag_backward_update reading its gradient where it lies (grad_offsets): each bag's
gradient row anywhere in a flat tensor, as a received gradient message holds them. Against the
same op on the [B, total_dim] gradient those rows make (the same bits on CPU) and against
recxla.reference.embedding_bag; CPU kernels, Triton under TRITON_INTERPRET=1, CUDA and Triton on
a GPU; every bad offset refused by name before a row moves.
"""

import sys

import pytest
import torch

import recxla
from recxla import _extension
from recxla.ops import embedding_bag as ops
from recxla.reference import embedding_bag as ref

from test_embedding_bag import OPTIMS, fused_args, op_inputs, to_cuda, update_args
from test_embedding_bag import interpreted_triton  # noqa: F401  (fixture)

# An offset no read may use: the op reads only non-empty bags' entries.
NEVER_READ = -(10**12)


def scattered_gradient(a, generator):
    """A gradient message for op_inputs' bags: every bag's row in its own slot of a flat
    float32 tensor, the slots shuffled and a random gap before each row, and the empty bags'
    offsets unusable. -> (flat, grad_offsets int64 [F * B], grad [B, total_dim]: the same rows
    where a model's gradient holds them), on the device of a's tensors."""
    batch, feature_table = a["batch_size"], a["feature_table"]
    dims = [a["weights"][t].shape[1] for t in feature_table]
    bags, slot = len(feature_table) * batch, max(dims) + 3
    order = torch.randperm(bags, generator=generator)
    grad_offsets = order * slot + torch.randint(0, 4, (bags,), generator=generator)
    flat = torch.randn(bags * slot + 3, generator=generator)
    grad = torch.zeros(batch, sum(dims))
    column = 0
    for f, dim in enumerate(dims):
        at = grad_offsets[f * batch: (f + 1) * batch]
        grad[:, column: column + dim] = flat[at[:, None] + torch.arange(dim)]
        column += dim
    grad_offsets[a["offsets"].cpu().diff() == 0] = NEVER_READ
    device = a["offsets"].device
    return flat.to(device), grad_offsets.to(device), grad.to(device)


def _updated(update, args, grad_offsets=None):
    """update (backward_update's signature) on a copy of fused_args' weights and states ->
    (weights, states)."""
    args = list(args)
    args[1], args[2] = [w.clone() for w in args[1]], [s.clone() for s in args[2]]
    if grad_offsets is None:
        update(*update_args(args))
    else:
        update(*update_args(args), grad_offsets)
    return args[1], args[2]


def check_scattered_update(update, a, generator, exact=True):
    """update(flat message, grad_offsets) moves the rows as update([B, total_dim] gradient) does
    (the same bits when `exact`), and as the reference does."""
    flat, grad_offsets, grad = scattered_gradient(a, generator)
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    for optim in OPTIMS.values():
        base = fused_args(a, optim, grad, wd=0.01, sign=-1.0)
        want_w, want_s = _updated(update, base)
        message = list(base)
        message[0] = flat
        got_w, got_s = _updated(update, message, grad_offsets)
        for got, want in zip(got_w + got_s, want_w + want_s):
            torch.testing.assert_close(got, want, **tol)
        ref_w, ref_s = _updated(ref.embedding_bag_backward_update_ref,
                                [x.cpu() if isinstance(x, torch.Tensor) else x for x in base])
        for got, want in zip(got_w + got_s, ref_w + ref_s):
            torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-6)
        assert any(not torch.equal(w, w0) for w, w0 in zip(got_w, base[1]))


def _generator():
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))


@pytest.mark.parametrize("dtype,weighted", [(torch.int64, True), (torch.int32, False)])
@pytest.mark.parametrize("order", ["accumulate", "gather"])
def test_scattered_gradient_updates_as_the_placed_one(monkeypatch, dtype, weighted, order):
    """Both of the CPU kernel's orders (csrc/cpu/embedding_bag_backward.cpp) read the rows where
    grad_offsets puts them."""
    monkeypatch.setenv("RECXLA_EMB_BACKWARD", order)
    check_scattered_update(ops.backward_update, op_inputs(dtype, weighted, batch=9),
                           _generator())


def test_scattered_gradient_of_an_empty_batch():
    a = op_inputs(batch=0)
    args = fused_args(a, ops.SGD, torch.zeros(0))
    weights, _ = _updated(ops.backward_update, args, torch.zeros(0, dtype=torch.int64))
    assert all(torch.equal(w, w0) for w, w0 in zip(weights, a["weights"]))


def test_scattered_gradient_opcheck():
    a = op_inputs(weighted=True)
    flat, grad_offsets, _ = scattered_gradient(a, _generator())
    grad_offsets = grad_offsets.clamp(min=0)  # opcheck's fake run reads nothing, the real one all
    torch.library.opcheck(torch.ops.recxla.embedding_bag_backward_update,
                          [*fused_args(a, ops.ROWWISE_ADAGRAD, flat), grad_offsets],
                          test_utils=("test_schema", "test_autograd_registration"))


def bad_offsets(a, flat, grad_offsets):
    """(grad_output, grad_offsets, exception, message) cases for op_inputs' bags (feature 3 is
    8 wide)."""
    batch = a["batch_size"]
    used = int(torch.nonzero(a["offsets"].diff()[3 * batch:])[0]) + 3 * batch  # of feature 3
    past_end, negative = grad_offsets.clone(), grad_offsets.clone()
    past_end[used] = flat.numel() - 7
    negative[used] = -1
    return [
        (flat, past_end, IndexError,
         rf"grad_offsets\[{used}\] = {flat.numel() - 7} puts bag {used}'s 8-wide gradient row "
         rf"outside grad_output's {flat.numel()} elements"),
        (flat, negative, IndexError, rf"grad_offsets\[{used}\] = -1 puts bag {used}'s"),
        (flat, grad_offsets.int(), TypeError, "grad_offsets must be int64"),
        (flat, grad_offsets[1:], ValueError,
         rf"grad_offsets must be 1-D with num_features \* batch_size = {4 * batch} entries"),
        (torch.stack([flat, flat], 1)[:, 0], grad_offsets, ValueError,
         "grad_output must be contiguous when grad_offsets places its rows"),
        (flat.double(), grad_offsets, TypeError, "grad_output must be float32"),
    ]


def check_bad_offsets_refused(update, a):
    flat, grad_offsets, _ = scattered_gradient(a, _generator())
    args = fused_args(a, ops.ADAGRAD, flat)
    before = [x.clone() for x in args[1] + args[2]]
    for grad_output, offsets, exc, match in bad_offsets(a, flat, grad_offsets):
        bad = list(args)
        bad[0] = grad_output
        with pytest.raises(exc, match=match):
            update(*update_args(bad), offsets)
        assert all(torch.equal(x, y) for x, y in zip(args[1] + args[2], before)), match


def test_bad_offsets_refused_before_a_row_moves():
    check_bad_offsets_refused(ops.backward_update, op_inputs(batch=9))


def test_bad_offsets_refused_by_the_unchecked_backends(monkeypatch, interpreted_triton):
    """On the backends whose kernels trust their arguments recxla.ops.embedding_bag checks the
    offsets first, with the CPU kernel's words."""
    monkeypatch.setattr(_extension, "backend_for", lambda t, op: "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setitem(sys.modules, "recxla.triton_kernels.embedding_bag", interpreted_triton)
    check_bad_offsets_refused(ops.backward_update, op_inputs(batch=9))


@pytest.mark.parametrize("dtype,weighted", [(torch.int64, True), (torch.int32, False)])
def test_triton_interpreted_scattered_gradient(interpreted_triton, monkeypatch, dtype, weighted):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_scattered_update(interpreted_triton.embedding_bag_backward_update_triton,
                           op_inputs(dtype, weighted, batch=5), _generator())


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_scattered_gradient(monkeypatch, backend):
    if backend == "cuda" and not recxla.built_with_cuda():
        pytest.skip("this build has no CUDA kernels")
    monkeypatch.setenv("RECXLA_BACKEND", backend)
    cuda = to_cuda(op_inputs(torch.int64, True, batch=300))
    flat, grad_offsets, grad = scattered_gradient(cuda, _generator())
    for optim in OPTIMS.values():
        base = fused_args(cuda, optim, grad, wd=0.01, sign=-1.0)
        want_w, want_s = _updated(ops.backward_update, base)
        message = list(base)
        message[0] = flat
        got_w, got_s = _updated(ops.backward_update, message, grad_offsets)
        # The same entries in the same order: the same bits on one device.
        for got, want in zip(got_w + got_s, want_w + want_s):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    check_bad_offsets_refused(ops.backward_update, cuda)
