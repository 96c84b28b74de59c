"""The embedding_bag ops (pooled lookup over deduplicated ids, its gradient, the fused optimizer
update) against recxla.reference.embedding_bag: CPU kernels, Triton under TRITON_INTERPRET=1,
CUDA and Triton on a GPU. Random tables and bags: empty bags, odd dims, features out of table
order, int32/int64 ids, per-sample weights, mean pooling. The input helpers are shared with
tests/test_embedding_bag_collection.py.
"""

import importlib.util
import os

import pytest
import torch
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

import recxla
from recxla.ops import embedding_bag as ops
from recxla.ops.dedup import segmented_unique
from recxla.ops.embedding_bag_checks import check_feature_columns
from recxla.reference import embedding_bag as ref


OPTIMS = {"sgd": ops.SGD, "adagrad": ops.ADAGRAD, "rowwise_adagrad": ops.ROWWISE_ADAGRAD}


# ---------------------------------------------------------------------------------------------
# Inputs


def zipf_ids(rows: int, n: int, exponent: float) -> torch.Tensor:
    """n ids in [0, rows): uniform when exponent == 0, else rank r drawn with p ~ (r + 1)^-exponent
    and ranks scattered over the table by a random permutation."""
    if exponent == 0:
        return torch.randint(0, rows, (n,))
    p = torch.arange(1, rows + 1, dtype=torch.float64).pow(-exponent)
    ranks = torch.multinomial(p, n, replacement=True) if n else torch.empty(0, dtype=torch.long)
    return torch.randperm(rows)[ranks]


def make_kjt(tables, keys, batch, exponent=1.05, max_len=4, dtype=torch.int64, weighted=False):
    """A KeyedJaggedTensor over `keys` (in that order) with bags of 0..max_len ids (so some are
    empty), ids of each key's table."""
    rows = {f: c.num_embeddings for c in tables for f in c.feature_names}
    lengths = torch.randint(0, max_len + 1, (len(keys) * batch,))
    per_key = lengths.view(len(keys), batch).sum(1).tolist() if batch else [0] * len(keys)
    values = torch.cat([zipf_ids(rows[k], n, exponent) for k, n in zip(keys, per_key)]
                       or [torch.empty(0, dtype=torch.long)])
    weights = torch.rand(values.numel()) + 0.5 if weighted else None
    return KeyedJaggedTensor(keys=keys, values=values.to(dtype), lengths=lengths, weights=weights)


def make_tables(mean=False, shared=True):
    pool = PoolingType.MEAN if mean else PoolingType.SUM
    tables = [
        EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=300,
                           feature_names=["f0", "f1"], pooling=pool),
        EmbeddingBagConfig(name="t1", embedding_dim=5, num_embeddings=7, feature_names=["f2"]),
        EmbeddingBagConfig(name="t2", embedding_dim=33, num_embeddings=1000, feature_names=["f3"],
                           pooling=pool),
    ]
    if shared:  # a feature read by two tables: output keys become "f0@t0" and "f0@t3"
        tables.append(EmbeddingBagConfig(name="t3", embedding_dim=3, num_embeddings=300,
                                         feature_names=["f0"]))
    return tables


def op_inputs(dtype=torch.int64, weighted=False, batch=7, exponent=1.05,
              dims_rows=((40, 8), (7, 17), (500, 1))):
    """Random op arguments whose features are not in table order (feature_table [0, 2, 1, 0]);
    dims_rows: the three tables' (rows, dim)."""
    weights = [torch.randn(rows, dim) for rows, dim in dims_rows]
    feature_table, pooling = [0, 2, 1, 0], [ops.SUM, ops.MEAN, ops.SUM]
    lengths = torch.randint(0, 4, (len(feature_table) * batch,))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    values = torch.cat([
        zipf_ids(dims_rows[t][0], int(lengths[f * batch : (f + 1) * batch].sum()), exponent)
        for f, t in enumerate(feature_table)
    ])
    # Dedup per table: gather each table's ids (scattered over features), unique, map back.
    inverse = torch.empty_like(values)
    uniques, bounds = [], [0]
    for t in range(len(weights)):
        idx = torch.cat([torch.arange(int(offsets[f * batch]), int(offsets[(f + 1) * batch]))
                         for f, tt in enumerate(feature_table) if tt == t])
        u, inv = torch.unique(values[idx], return_inverse=True)
        inverse[idx] = inv + bounds[-1]
        uniques.append(u)
        bounds.append(bounds[-1] + u.numel())
    psw = torch.rand(values.numel()) if weighted else None
    return dict(weights=weights, unique_values=torch.cat(uniques).to(dtype),
                unique_offsets=torch.tensor(bounds), inverse=inverse, offsets=offsets,
                per_sample_weights=psw, feature_table=feature_table, pooling=pooling,
                batch_size=batch)


def fused_args(a, optim, grad, lr=0.05, eps=1e-3, wd=0.0, sign=1.0):
    """The flat arguments of torch.ops.recxla.embedding_bag_backward_update (fresh weights and
    states); update_args gives them as recxla.ops.embedding_bag.backward_update's."""
    weights = [w.clone() for w in a["weights"]]
    # The optimizer state lives where its table does.
    states = [torch.rand(w.shape if optim == ops.ADAGRAD else w.shape[0], device=w.device)
              for w in weights]
    rest = [a[k] for k in ("unique_values", "unique_offsets", "inverse", "offsets",
                           "per_sample_weights", "feature_table", "pooling", "batch_size")]
    return [grad, weights, states, *rest, [optim] * len(weights),
            [lr, eps, wd, sign] * len(weights)]


def update_args(args):
    """fused_args (the op's flat arguments) as backward_update takes them: (grad_output,
    lookup, states, optim, hparams), the lookup holding the same weights list."""
    grad, weights, states, *rest, optim, hparams = args
    return grad, ops.BagLookup(weights, *rest), states, optim, hparams


def bag_lookup(a):
    """op_inputs' dict as the ops' argument."""
    return ops.BagLookup(**{k: a[k] for k in ops.BagLookup._fields})


def assert_lists_close(got, want, **tol):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)


# ---------------------------------------------------------------------------------------------
# Ops against the reference


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("weighted", [False, True])
def test_ops_match_reference(dtype, weighted):
    a = op_inputs(dtype, weighted)
    out = ops.pooled_forward(bag_lookup(a))
    torch.testing.assert_close(out, ref.embedding_bag_forward_ref(bag_lookup(a)), rtol=0, atol=0)
    grad = torch.randn_like(out)
    assert_lists_close(ops.unique_grad(grad, bag_lookup(a)),
                       ref.embedding_bag_unique_grad_ref(grad, bag_lookup(a)), rtol=0, atol=0)
    for optim in OPTIMS.values():
        got, want = fused_args(a, optim, grad, wd=0.01, sign=-1.0), None
        want = [x.clone() if isinstance(x, torch.Tensor) else
                ([t.clone() for t in x]
                 if isinstance(x, list) and x and isinstance(x[0], torch.Tensor) else x)
                for x in got]
        ops.backward_update(*update_args(got))
        ref.embedding_bag_backward_update_ref(*update_args(want))
        # Row-wise Adagrad sums a row's squares in another order than torch's mean.
        assert_lists_close(got[1], want[1], rtol=1e-6, atol=1e-6)
        assert_lists_close(got[2], want[2], rtol=1e-6, atol=1e-6)
        assert any(not torch.equal(w, w0) for w, w0 in zip(got[1], a["weights"]))


def test_ops_empty_and_non_contiguous():
    a = op_inputs(batch=0)
    assert ops.pooled_forward(bag_lookup(a)).shape == (0, 8 + 1 + 17 + 8)
    a = op_inputs(batch=5)
    base = torch.randn(len(a["inverse"]) * 2)
    a["per_sample_weights"] = base[::2]  # strided
    out = ops.pooled_forward(bag_lookup(a))
    torch.testing.assert_close(out, ref.embedding_bag_forward_ref(bag_lookup(a)))
    grad = torch.randn(out.shape[1], out.shape[0]).t()  # non-contiguous
    assert_lists_close(ops.unique_grad(grad, bag_lookup(a)),
                       ref.embedding_bag_unique_grad_ref(grad, bag_lookup(a)))


def test_ops_one_table_holding_most_ids():
    """A long multi-hot feature (over 2^16 ids) is split over threads inside its table: the
    gradient sums and the updates stay those of the reference, in the same order."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        batch, rows = 1024, 5000
        weights = [torch.randn(rows, 16), torch.randn(40, 16)]
        lengths = torch.cat([torch.randint(100, 160, (batch,)), torch.randint(0, 3, (batch,))])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        n0 = int(lengths[:batch].sum())
        values = torch.cat([zipf_ids(rows, n0, 1.05), zipf_ids(40, int(lengths[batch:].sum()), 0)])
        bounds = torch.tensor([0, n0, values.numel()])
        uv, uo, inv = segmented_unique(values, bounds)
        a = dict(weights=weights, unique_values=uv, unique_offsets=uo, inverse=inv,
                 offsets=offsets, per_sample_weights=torch.rand(values.numel()),
                 feature_table=[0, 1], pooling=[ops.MEAN, ops.SUM], batch_size=batch)
        grad = torch.randn(batch, 32)
        assert_lists_close(ops.unique_grad(grad, bag_lookup(a)),
                           ref.embedding_bag_unique_grad_ref(grad, bag_lookup(a)), rtol=0, atol=0)
        got = fused_args(a, ops.ROWWISE_ADAGRAD, grad)
        want = list(got)
        want[1], want[2] = [w.clone() for w in got[1]], [s.clone() for s in got[2]]
        ops.backward_update(*update_args(got))
        ref.embedding_bag_backward_update_ref(*update_args(want))
        assert_lists_close(got[1], want[1], rtol=1e-6, atol=1e-6)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("fused", [False, True])
def test_per_sample_weight_grad_matches_reference_autograd(dtype, fused):
    """d out / d psw through FusedPooledLookup (sum and mean tables) equals autograd through the
    reference forward; with a fused update it is taken from the weights before they move."""
    a = op_inputs(dtype, weighted=True, batch=8)
    psw = a["per_sample_weights"].clone().requires_grad_()
    ref_psw = a["per_sample_weights"].clone().requires_grad_()
    weights = [w.clone().requires_grad_() for w in a["weights"]]

    def sgd():
        return [ops.SGD] * 3, [None] * 3, [0.5, 0.0, 0.0, 1.0] * 3

    plan = ops.LookupPlan(a["feature_table"], a["pooling"], 8,
                          optimizer_step=sgd if fused else None)
    rest = [a[k] for k in ("unique_values", "unique_offsets", "inverse", "offsets")]
    out = ops.FusedPooledLookup.apply(plan, *rest, psw, *weights)
    want = ref.embedding_bag_forward_ref(bag_lookup(a)._replace(per_sample_weights=ref_psw))
    grad = torch.randn_like(out)
    out.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(psw.grad, ref_psw.grad)
    assert fused == any(not torch.equal(w, w0) for w, w0 in zip(weights, a["weights"]))


def test_weighted_mean_is_weighted_sum_over_length():
    """The ops' documented choice (FBGEMM's TBE gives the same; torch.nn.EmbeddingBag and
    TorchRec reject weights with mean, and so does recxla.nn): sum(w * row) / bag length, an
    empty bag giving zeros. Checked against torch's weighted-sum EmbeddingBag per feature."""
    a = op_inputs(weighted=True, batch=10)
    out = ops.pooled_forward(bag_lookup(a))
    ids = a["unique_values"][a["inverse"]].long()
    offsets, b, column = a["offsets"], a["batch_size"], 0
    for f, t in enumerate(a["feature_table"]):
        bags = offsets[f * b : (f + 1) * b + 1]
        first, last = int(bags[0]), int(bags[-1])
        want = torch.nn.functional.embedding_bag(
            ids[first:last], a["weights"][t], bags - first, mode="sum",
            per_sample_weights=a["per_sample_weights"][first:last], include_last_offset=True)
        if a["pooling"][t] == ops.MEAN:
            want = want / bags.diff().clamp(min=1)[:, None]
        dim = a["weights"][t].shape[1]
        torch.testing.assert_close(out[:, column : column + dim], want)
        column += dim
    assert ops.MEAN in a["pooling"]


def test_ops_opcheck():
    a = op_inputs(weighted=True)
    torch.library.opcheck(torch.ops.recxla.embedding_bag_forward, list(bag_lookup(a)))
    grad = torch.randn(a["batch_size"], 8 + 1 + 17 + 8)
    torch.library.opcheck(torch.ops.recxla.embedding_bag_unique_grad, [grad, *bag_lookup(a)],
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))
    torch.library.opcheck(torch.ops.recxla.embedding_bag_backward_update,
                          fused_args(a, ops.ROWWISE_ADAGRAD, grad),
                          test_utils=("test_schema", "test_autograd_registration"))
    columns, _, _, out = placed_layout(a, torch.Generator().manual_seed(0))
    torch.library.opcheck(torch.ops.recxla.embedding_bag_forward_out,
                          [*bag_lookup(a), out, columns])
    torch.library.opcheck(torch.ops.recxla.embedding_bag_unique_grad,
                          [torch.randn(out.shape), *bag_lookup(a), columns],
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))


def _bad_inputs(a):
    """(argument name, bad value, exception, message) cases for the op checks."""
    uv, bounds = a["unique_values"], a["unique_offsets"].tolist()
    unsorted = uv.clone()
    unsorted[bounds[2] : bounds[3]] = uv[bounds[2] : bounds[3]].flip(0)  # table 2: many rows
    inverse = a["inverse"].clone()
    inverse[-1] = uv.numel()
    return [
        ("inverse", inverse, IndexError, "outside the unique_values segment of its table"),
        ("offsets", a["offsets"].flip(0), ValueError, "offsets must start at 0"),
        ("unique_values", unsorted, ValueError, "strictly increasing within each table"),
        ("unique_values", uv + 1000, IndexError, r"unique_values of table 0 must lie in \[0, 40\)"),
        ("per_sample_weights", torch.rand(3), ValueError, "one weight per id"),
        ("offsets", a["offsets"].int(), TypeError, "offsets must be int64"),
    ]


def test_ops_errors_leave_rows_untouched():
    a = op_inputs(batch=9)
    grad = torch.randn(a["batch_size"], 34)
    args = fused_args(a, ops.ROWWISE_ADAGRAD, grad)
    before = [w.clone() for w in args[1]] + [s.clone() for s in args[2]]
    names = ["unique_values", "unique_offsets", "inverse", "offsets", "per_sample_weights"]
    for name, value, exc, match in _bad_inputs(a):
        bad = list(args)
        bad[3 + names.index(name)] = value
        with pytest.raises(exc, match=match):
            torch.ops.recxla.embedding_bag_backward_update(*bad)
        assert all(torch.equal(x, y) for x, y in zip(args[1] + args[2], before)), name
    with pytest.raises(ValueError, match=r"hparams must hold 4 values per table"):
        torch.ops.recxla.embedding_bag_backward_update(*args[:-1], [0.1])
    with pytest.raises(ValueError, match=r"states\[0\] must be a contiguous tensor of 40 values"):
        torch.ops.recxla.embedding_bag_backward_update(*args[:2], [torch.rand(3)] * 3, *args[3:])
    with pytest.raises(TypeError, match=r"weights\[1\] must be float32"):
        torch.ops.recxla.embedding_bag_forward(
            [a["weights"][0], a["weights"][1].double(), a["weights"][2]], *bag_lookup(a)[1:])
    with pytest.raises(ValueError, match=r"feature_table\[1\] = 5 is not a table index"):
        torch.ops.recxla.embedding_bag_forward(*bag_lookup(a)._replace(feature_table=[0, 5, 1, 0]))
    assert all(torch.equal(x, y) for x, y in zip(args[1] + args[2], before))


# ---------------------------------------------------------------------------------------------
# feature_columns: pooled straight into (the gradient read straight from) a caller's layout


def placed_layout(a, generator):
    """A caller's layout for op_inputs' features: the features in a random order with random
    gaps, inside a column range of a wider tensor. -> (feature_columns, the layout's width C,
    the wide tensor [B, C + 5], the range of it the ops get: [B, C] at columns 2.., rows
    C + 5 apart)."""
    dims = [a["weights"][t].shape[1] for t in a["feature_table"]]
    order = torch.randperm(len(dims), generator=generator).tolist()
    columns, at = [0] * len(dims), 0
    for f in order:
        at += int(torch.randint(0, 3, (), generator=generator))
        columns[f] = at
        at += dims[f]
    wide = torch.randn(a["batch_size"], at + 5, generator=generator).to(a["weights"][0].device)
    return columns, at, wide, wide[:, 2: 2 + at]


def check_placed_against_reference(forward, grad_fn, a, generator, exact=True):
    """forward(lookup, out, feature_columns) writes the features' columns of the reference's
    output where feature_columns says and nothing else; grad_fn(grad_output, lookup,
    feature_columns) reads each feature's gradient where it lies, as the reference does."""
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-5)
    columns, _, wide, out = placed_layout(a, generator)
    want = wide.clone()
    want[:, 2: 2 + out.shape[1]] = ref.place_features_ref(
        ref.embedding_bag_forward_ref(bag_lookup(a)), bag_lookup(a), out, columns)
    assert forward(bag_lookup(a), out, columns) is out
    torch.testing.assert_close(wide, want, **tol)
    grad_wide = torch.randn(wide.shape, generator=generator).to(wide.device)
    grad = grad_wide[:, 2: 2 + out.shape[1]]
    assert_lists_close(grad_fn(grad, bag_lookup(a), columns),
                       ref.embedding_bag_unique_grad_ref(grad, bag_lookup(a), columns), **tol)


@pytest.mark.parametrize("dtype,weighted", [(torch.int64, True), (torch.int32, False)])
def test_ops_placed_features_match_reference(dtype, weighted):
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    check_placed_against_reference(ops.pooled_forward, ops.unique_grad,
                                   op_inputs(dtype, weighted, batch=9), generator)
    # One sample: its row stride does not matter (here 0).
    a = op_inputs(dtype, weighted, batch=1)
    columns, width, _, _ = placed_layout(a, generator)
    out = torch.zeros(width).as_strided((1, width), (0, 1))
    torch.testing.assert_close(ops.pooled_forward(bag_lookup(a), out, columns),
                               ref.place_features_ref(ref.embedding_bag_forward_ref(
                                   bag_lookup(a)), bag_lookup(a), torch.zeros(1, width),
                                   columns), rtol=0, atol=0)


def _bad_placements(a):
    """(feature_columns, tensor, message) cases of a placed layout, for op_inputs' features
    (dims 8, 1, 17, 8; 34 columns side by side)."""
    B = a["batch_size"]
    side_by_side = [0, 8, 9, 26]
    return [
        ([0, 8, 9], torch.zeros(B, 34), r"feature_columns must have one entry per feature \(4\)"),
        ([0, 8, 9, 27], torch.zeros(B, 34), r"feature_columns\[3\] = 27 puts feature 3's 8 "
                                            r"columns outside \[0, 34\) of"),
        ([0, 8, 9, -1], torch.zeros(B, 34), r"feature_columns\[3\] = -1"),
        ([0, 7, 9, 26], torch.zeros(B, 34), r"features 0 and 1 overlap in"),
        (side_by_side, torch.zeros(B, 68)[:, ::2], r"columns must be adjacent \(column stride 1\)"),
        (side_by_side, torch.zeros(B, 34 + B)[:, :34].as_strided((B, 34), (1, 1)),
         r"rows must not overlap \(row stride >= 34\)"),
        (side_by_side, torch.zeros(B + 1, 34), r"must be \[batch_size, columns\] = \[9, C\]"),
    ]


def test_ops_placed_errors():
    a = op_inputs(batch=9)
    lookup = bag_lookup(a)
    for columns, tensor, match in _bad_placements(a):
        before = tensor.clone()
        with pytest.raises(ValueError, match="recxla::embedding_bag_forward_out: .*" + match):
            torch.ops.recxla.embedding_bag_forward_out(*lookup, tensor, columns)
        assert torch.equal(tensor, before)
        with pytest.raises(ValueError, match="recxla::embedding_bag_unique_grad: .*" + match):
            ops.unique_grad(tensor, lookup, columns)
        # The Triton path's checks in Python, the same words.
        for op, name in (("recxla::embedding_bag_forward_out", "out"),
                         ("recxla::embedding_bag_unique_grad", "grad_output")):
            with pytest.raises(ValueError, match=op + ": .*" + match):
                check_feature_columns(op, lookup, tensor, name, columns)
    with pytest.raises(ValueError, match="pooled_forward: feature_columns places the features in "
                                         "`out`, and out is None"):
        ops.pooled_forward(lookup, feature_columns=[0, 8, 9, 26])


# ---------------------------------------------------------------------------------------------
# Triton kernels under the interpreter (CPU tensors), CUDA and Triton on a GPU


@pytest.fixture(scope="module")
def interpreted_triton():
    """A copy of triton_kernels/embedding_bag.py whose kernels were built by the interpreter
    (TRITON_INTERPRET is read when @triton.jit runs), leaving the imported module as it is."""
    path = importlib.util.find_spec("recxla.triton_kernels.embedding_bag").origin
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        spec = importlib.util.spec_from_file_location("_embedding_bag_interpreted", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    return module


def check_backend_against_reference(forward, grad_fn, update, a, exact=True):
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-5)
    out = forward(bag_lookup(a))
    torch.testing.assert_close(out, ref.embedding_bag_forward_ref(bag_lookup(a)), **tol)
    grad = torch.randn_like(out)
    assert_lists_close(grad_fn(grad, bag_lookup(a)),
                       ref.embedding_bag_unique_grad_ref(grad, bag_lookup(a)), **tol)
    for optim in OPTIMS.values():
        got = fused_args(a, optim, grad, wd=0.01, sign=-1.0)
        want = list(got)
        want[1], want[2] = [w.clone() for w in got[1]], [s.clone() for s in got[2]]
        update(*update_args(got))
        ref.embedding_bag_backward_update_ref(*update_args(want))
        assert_lists_close(got[1], want[1], rtol=1e-5, atol=1e-6)
        assert_lists_close(got[2], want[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype,weighted", [(torch.int64, True), (torch.int32, False)])
def test_triton_interpreted_matches_reference(interpreted_triton, monkeypatch, dtype, weighted):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    t = interpreted_triton
    check_backend_against_reference(
        t.embedding_bag_forward_triton, t.embedding_bag_unique_grad_triton,
        t.embedding_bag_backward_update_triton, op_inputs(dtype, weighted, batch=5),
    )


def test_triton_interpreted_placed_features(interpreted_triton, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    t = interpreted_triton
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    check_placed_against_reference(
        lambda lookup, out, columns: t.embedding_bag_forward_triton(lookup, out, columns),
        t.embedding_bag_unique_grad_triton, op_inputs(torch.int64, True, batch=5), generator)


def test_triton_interpreted_empty(interpreted_triton, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a = op_inputs(batch=0)
    assert interpreted_triton.embedding_bag_forward_triton(bag_lookup(a)).shape == (0, 34)
    assert [g.shape[0] for g in interpreted_triton.embedding_bag_unique_grad_triton(
        torch.zeros(0, 34), bag_lookup(a))] == [0, 0, 0]


def to_cuda(a):
    return {k: ([w.cuda() for w in v] if k == "weights" else
                v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype,weighted", [(torch.int64, True), (torch.int32, False)])
def test_gpu_ops_match_reference(monkeypatch, backend, dtype, weighted):
    if backend == "cuda" and not recxla.built_with_cuda():
        pytest.skip("this build has no CUDA kernels")
    monkeypatch.setenv("RECXLA_BACKEND", backend)
    # GPU kernels may contract a multiply and an add into one FMA (Triton): not bit-exact.
    check_backend_against_reference(ops.pooled_forward, ops.unique_grad, ops.backward_update,
                                    to_cuda(op_inputs(dtype, weighted, batch=300)), exact=False)
    check_placed_against_reference(ops.pooled_forward, ops.unique_grad,
                                   to_cuda(op_inputs(dtype, weighted, batch=300)),
                                   torch.Generator().manual_seed(0), exact=False)
