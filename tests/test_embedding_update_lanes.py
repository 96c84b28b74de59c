"""The embedding-bag fused update's GPU variants (family "embedding_update": warp_per_row and
batched_ids) without a GPU, and with one (`make gpu-campaign`).

Without a GPU: tests/embedding_update_harness.cpp, built here with g++, replays the batched_ids
kernel's lane code (csrc/include/recxla/embedding_update_lanes.h) over every lane of every
unique row, the warp's shuffles included, on the ids-per-row CSR its launcher builds. Its sums
add the same products in the same order as warp_per_row and the C++ CPU kernel, so the rows it
writes (SGD, Adagrad) and the gradients (no optimizer) must equal the CPU kernel's bit for bit;
row-wise Adagrad reduces its squares by the warp's xor tree, the CPU kernel by its own lanes,
so those agree to rounding. Rows with hundreds of ids (more than a warp's 32 and not a multiple
of the 4 loaded ahead) and dims from 1 to the 256 a lane's registers hold are covered.
With a GPU: both variants on CUDA against each other (bit for bit) and against the CPU kernel.
"""

import ctypes

import pytest
import torch

import cpu_harness
import recxla
from recxla.ops import embedding_bag as ops
from test_embedding_bag import bag_lookup, fused_args, op_inputs, to_cuda

ROWWISE = ops.ROWWISE_ADAGRAD
OPTIMS = [ops.SGD, ops.ADAGRAD, ROWWISE]
NO_OPTIMIZER = 0  # recxla::emb::Optim::None: the rows' gradients are written out
# (rows, dim) of the three tables: a 7-row table whose rows each get dozens of ids, dims that
# leave a lane 1 to 8 columns (256: every register of a lane) and partial last columns.
TABLES = [((40, 8), (7, 17), (500, 1)), ((60, 200), (7, 256), (300, 33))]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    lib = cpu_harness.build("embedding_update_harness.cpp",
                            tmp_path_factory.mktemp("embedding_update"))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.fits.argtypes = [i64]
    lib.replay_update.argtypes = [i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, ptr, ptr,
                                  ptr, ptr]
    return lib


def ids_by_row(a, signs):
    """The CSR of ids per unique row that the CUDA launcher's group_ids builds: (start [U + 1],
    grad_offset [N] of each id's output-gradient row, scale [N]: grad sign x 1 / bag length for
    mean pooling x the per-sample weight), ids in id order within a row."""
    batch, offsets, inverse = a["batch_size"], a["offsets"], a["inverse"]
    dims = [a["weights"][t].shape[1] for t in a["feature_table"]]
    columns = torch.tensor([sum(dims[:f]) for f in range(len(dims))])
    total_dim = sum(dims)
    lengths = offsets[1:] - offsets[:-1]
    bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    feature = bag // batch
    grad_offset = (bag - feature * batch) * total_dim + columns[feature]
    table = torch.tensor(a["feature_table"])[feature]
    sign = torch.tensor(signs, dtype=torch.float32)[table]
    mean = torch.tensor([p == ops.MEAN for p in a["pooling"]])[table]
    inv_len = torch.reciprocal(lengths[bag].to(torch.float32))
    scale = torch.where(mean, sign * inv_len, sign)
    if a["per_sample_weights"] is not None:
        scale = a["per_sample_weights"] * scale
    order = torch.sort(inverse, stable=True).indices
    unique = int(a["unique_offsets"][-1])
    count = torch.zeros(unique, dtype=torch.long).index_add_(0, inverse, torch.ones_like(inverse))
    start = torch.cat([torch.zeros(1, dtype=torch.long), count.cumsum(0)])
    return start, grad_offset[order].contiguous(), scale[order].contiguous()


def pointers(tensors):
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() if t is not None else None
                                               for t in tensors])


def replay(lib, a, grad, optim, hparams, weights, states, grad_out):
    tables = len(weights)
    signs = [hparams[4 * t + 3] for t in range(tables)]
    start, grad_offset, scale = ids_by_row(a, signs)
    rows = a["unique_values"].to(torch.int64).contiguous()
    unique_offsets = a["unique_offsets"].contiguous()
    dims = torch.tensor([w.shape[1] for w in weights])
    kinds = torch.tensor([optim] * tables)
    hp = torch.tensor(hparams, dtype=torch.float32)
    lib.replay_update(rows.numel(), rows.data_ptr(), start.data_ptr(), grad_offset.data_ptr(),
                      scale.data_ptr(), grad.data_ptr(), tables, unique_offsets.data_ptr(),
                      dims.data_ptr(), kinds.data_ptr(), hp.data_ptr(),
                      pointers(weights), pointers(states), pointers(grad_out))


def batch(tables, weighted):
    a = op_inputs(torch.int64, weighted, batch=300, dims_rows=tables)
    total_dim = sum(a["weights"][t].shape[1] for t in a["feature_table"])
    return a, torch.randn(a["batch_size"], total_dim)


def test_lane_registers_hold_rows_up_to_256(harness):
    assert harness.fits(1) and harness.fits(256)
    assert not harness.fits(257)


@pytest.mark.parametrize("tables", TABLES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("optim", OPTIMS)
def test_replayed_update_matches_the_cpu_kernel(harness, tables, weighted, optim):
    a, grad = batch(tables, weighted)
    sign = -1.0 if weighted else 1.0  # maximize on one of the two
    args = fused_args(a, optim, grad, lr=0.05, eps=1e-3, wd=0.01, sign=sign)
    weights, states, hparams = args[1], args[2], args[-1]
    want_w, want_s = [w.clone() for w in weights], [s.clone() for s in states]
    torch.ops.recxla.embedding_bag_backward_update(grad, want_w, want_s, *args[3:])
    replay(harness, a, grad, optim, hparams, weights, states, [None] * len(weights))
    assert any(not torch.equal(w, b) for w, b in zip(weights, a["weights"])), "nothing updated"
    for got, want in zip(weights + states, want_w + want_s):
        if optim == ROWWISE:
            torch.testing.assert_close(got, want)
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("tables", TABLES)
@pytest.mark.parametrize("weighted", [False, True])
def test_replayed_gradients_match_the_cpu_kernel(harness, tables, weighted):
    a, grad = batch(tables, weighted)
    want = ops.unique_grad(grad, bag_lookup(a))
    got = [torch.full_like(w, float("nan")) for w in want]
    replay(harness, a, grad, NO_OPTIMIZER, [0.0, 0.0, 0.0, 1.0] * len(got), a["weights"],
           [None] * len(got), got)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("tables", TABLES)
@pytest.mark.parametrize("optim", OPTIMS)
def test_gpu_variants_agree_bit_for_bit(monkeypatch, tables, optim):
    from recxla.ops import gpu_variants

    if not recxla.built_with_cuda():
        pytest.skip("this build has no CUDA kernels")
    monkeypatch.setenv("RECXLA_BACKEND", "cuda")
    a, grad = batch(tables, weighted=True)
    a, grad = to_cuda(a), grad.cuda()
    results = {}
    for variant in gpu_variants.variants("embedding_update"):
        args = fused_args(a, optim, grad, lr=0.05, eps=1e-3, wd=0.01)
        torch.manual_seed(0)  # the same states for every variant
        args[2] = [torch.rand_like(s) for s in args[2]]
        with gpu_variants.use_variant("embedding_update", variant):
            torch.ops.recxla.embedding_bag_backward_update(*args)
        results[variant] = [t.cpu() for t in args[1] + args[2]]
    first, *others = results.values()
    for other in others:
        for x, y in zip(first, other):
            assert torch.equal(x, y)
