"""recxla.nn.EmbeddingBagCollection and the embedding_bag ops against plain PyTorch and TorchRec.

Ops (CPU kernels, Triton under TRITON_INTERPRET=1, CUDA on a GPU) are checked against
recxla.reference.embedding_bag on random tables and bags (empty bags, odd dims, shared tables,
int32/int64 ids, per-sample weights, mean pooling); the module against TorchRec's unsharded
EmbeddingBagCollection and torch optimizers stepping on dense gradients.
"""

import importlib.util
import os

import pytest
import torch
import torchrec
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecEBC

import recxla
from recxla.nn import EmbeddingBagCollection
from recxla.ops import embedding_bag as ops
from recxla.ops.dedup import segmented_unique
from recxla.reference import embedding_bag as ref

from conftest import HAS_CUDA

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


def op_inputs(dtype=torch.int64, weighted=False, batch=7, exponent=1.05):
    """Random op arguments whose features are not in table order (feature_table [0, 2, 1, 0])."""
    dims_rows = [(40, 8), (7, 17), (500, 1)]
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
    weights = [w.clone() for w in a["weights"]]
    states = [torch.rand(w.shape) if optim == ops.ADAGRAD else torch.rand(w.shape[0])
              for w in weights]
    rest = [a[k] for k in ("unique_values", "unique_offsets", "inverse", "offsets",
                           "per_sample_weights", "feature_table", "pooling", "batch_size")]
    return [grad, weights, states, *rest, [optim] * len(weights), [lr, eps, wd, sign] * len(weights)]


def op_args(a):
    return [a[k] for k in ("weights", "unique_values", "unique_offsets", "inverse", "offsets",
                           "per_sample_weights", "feature_table", "pooling", "batch_size")]


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
    out = ops.pooled_forward(*op_args(a))
    torch.testing.assert_close(out, ref.embedding_bag_forward_ref(*op_args(a)), rtol=0, atol=0)
    grad = torch.randn_like(out)
    assert_lists_close(ops.unique_grad(grad, *op_args(a)),
                       ref.embedding_bag_unique_grad_ref(grad, *op_args(a)), rtol=0, atol=0)
    for optim in OPTIMS.values():
        got, want = fused_args(a, optim, grad, wd=0.01, sign=-1.0), None
        want = [x.clone() if isinstance(x, torch.Tensor) else
                ([t.clone() for t in x] if isinstance(x, list) and x and isinstance(x[0], torch.Tensor) else x)
                for x in got]
        ops.backward_update(*got)
        ref.embedding_bag_backward_update_ref(*want)
        # Row-wise Adagrad sums a row's squares in another order than torch's mean.
        assert_lists_close(got[1], want[1], rtol=1e-6, atol=1e-6)
        assert_lists_close(got[2], want[2], rtol=1e-6, atol=1e-6)
        assert any(not torch.equal(w, w0) for w, w0 in zip(got[1], a["weights"]))


def test_ops_empty_and_non_contiguous():
    a = op_inputs(batch=0)
    assert ops.pooled_forward(*op_args(a)).shape == (0, 8 + 1 + 17 + 8)
    a = op_inputs(batch=5)
    base = torch.randn(len(a["inverse"]) * 2)
    a["per_sample_weights"] = base[::2]  # strided
    out = ops.pooled_forward(*op_args(a))
    torch.testing.assert_close(out, ref.embedding_bag_forward_ref(*op_args(a)))
    grad = torch.randn(out.shape[1], out.shape[0]).t()  # non-contiguous
    assert_lists_close(ops.unique_grad(grad, *op_args(a)),
                       ref.embedding_bag_unique_grad_ref(grad, *op_args(a)))


def test_ops_opcheck():
    a = op_inputs(weighted=True)
    torch.library.opcheck(torch.ops.recxla.embedding_bag_forward, op_args(a))
    grad = torch.randn(a["batch_size"], 8 + 1 + 17 + 8)
    torch.library.opcheck(torch.ops.recxla.embedding_bag_unique_grad, [grad, *op_args(a)],
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))
    torch.library.opcheck(torch.ops.recxla.embedding_bag_backward_update,
                          fused_args(a, ops.ROWWISE_ADAGRAD, grad),
                          test_utils=("test_schema", "test_autograd_registration"))


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
            [a["weights"][0], a["weights"][1].double(), a["weights"][2]], *op_args(a)[1:])
    with pytest.raises(ValueError, match=r"feature_table\[1\] = 5 is not a table index"):
        torch.ops.recxla.embedding_bag_forward(*op_args(a)[:6], [0, 5, 1, 0], *op_args(a)[7:])
    assert all(torch.equal(x, y) for x, y in zip(args[1] + args[2], before))


# ---------------------------------------------------------------------------------------------
# The module against TorchRec's EmbeddingBagCollection and torch's optimizers


def twin_of(module, tables, weighted=False):
    twin = TorchRecEBC(tables, is_weighted=weighted)
    twin.load_state_dict(module.state_dict())
    return twin


@pytest.mark.parametrize(
    "mean,weighted,dtype,shared,shuffle",
    [(False, False, torch.int64, False, False), (True, False, torch.int32, True, False),
     (False, True, torch.int64, True, True), (True, False, torch.int64, False, True)],
)
def test_forward_and_dense_grad_match_torchrec(mean, weighted, dtype, shared, shuffle):
    tables = make_tables(mean=mean, shared=shared)
    module = EmbeddingBagCollection(tables, is_weighted=weighted)
    twin = twin_of(module, tables, weighted)
    keys = ["f0", "f1", "f2", "f3"]
    if shuffle:
        keys = [keys[i] for i in torch.randperm(4).tolist()]
    for batch in (11, 1):
        kjt = make_kjt(tables, keys, batch, dtype=dtype, weighted=weighted)
        got, want = module(kjt), twin(kjt)
        assert got.keys() == want.keys()
        assert got.length_per_key() == want.length_per_key()
        torch.testing.assert_close(got.values(), want.values())
        grad = torch.randn_like(want.values())
        got.values().backward(grad)
        want.values().backward(grad)
    for (name, p), q in zip(module.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_state_dict_moves_both_ways():
    tables = make_tables()
    module, twin = EmbeddingBagCollection(tables), TorchRecEBC(tables)
    assert {k: v.shape for k, v in module.state_dict().items()} == \
        {k: v.shape for k, v in twin.state_dict().items()}
    module.load_state_dict(twin.state_dict())  # torchrec -> recxla
    kjt = make_kjt(tables, ["f0", "f1", "f2", "f3"], 6)
    torch.testing.assert_close(module(kjt).values(), twin(kjt).values())
    module2 = EmbeddingBagCollection(tables)
    twin.load_state_dict(module2.state_dict())  # recxla -> torchrec
    torch.testing.assert_close(module2(kjt).values(), twin(kjt).values())


HPARAMS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.05, "eps": 1e-6,
                                      "initial_accumulator_value": 0.1}),
    "rowwise_adagrad": (torchrec.optim.RowWiseAdagrad, {"lr": 0.1, "eps": 1e-5}),
}


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("exponent", [1.05, 0.0])
def test_fused_optimizer_matches_dense_optimizer(optimizer, exponent):
    """Three steps of a quadratic loss: the fused sparse update equals torch's optimizer on the
    dense gradient of TorchRec's module (the same when weight decay is 0)."""
    cls, kwargs = HPARAMS[optimizer]
    tables = make_tables(mean=optimizer == "adagrad")
    weighted = optimizer == "sgd"
    if exponent == 0.0:  # the optimizer set the TorchRec way
        module = EmbeddingBagCollection(tables, is_weighted=weighted)
        with pytest.warns(DeprecationWarning):
            torchrec.optim.apply_optimizer_in_backward(cls, module.parameters(), kwargs)
    else:
        module = EmbeddingBagCollection(tables, is_weighted=weighted, optimizer=optimizer, **kwargs)
    twin = twin_of(module, tables, weighted)
    dense = cls(twin.parameters(), **kwargs)
    keys = ["f2", "f0", "f3", "f1"]
    for step in range(3):
        kjt = make_kjt(tables, keys, 16, exponent, dtype=torch.int32 if step else torch.int64,
                       weighted=weighted)
        target = torch.randn(16, sum(module._lengths_per_embedding))
        ((module(kjt).values() - target) ** 2).sum().backward()
        dense.zero_grad()
        ((twin(kjt).values() - target) ** 2).sum().backward()
        dense.step()
    for (name, p), q in zip(module.named_parameters(), twin.parameters()):
        assert p.grad is None, name
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
        if optimizer != "sgd":
            state = p._in_backward_optimizers[0].state[p]
            torch.testing.assert_close(state["sum"], dense.state[q]["sum"], rtol=1e-5, atol=1e-7)
            assert float(state["step"]) == float(dense.state[q]["step"]) == 3


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_weight_decay_and_maximize_update_only_touched_rows(optimizer):
    """FBGEMM's sparse semantics: rows no id touched keep their values, weight decay included."""
    cls, kwargs = HPARAMS[optimizer]
    kwargs = dict(kwargs, weight_decay=0.2, maximize=True, lr_decay=0.0)
    if optimizer == "sgd":
        del kwargs["lr_decay"]
    tables = make_tables()
    module = EmbeddingBagCollection(tables, optimizer=optimizer, **kwargs)
    twin = twin_of(module, tables)
    kjt = make_kjt(tables, ["f0", "f1", "f2", "f3"], 9)
    grad = torch.randn(9, sum(module._lengths_per_embedding))
    module(kjt).values().backward(grad)
    twin(kjt).values().backward(grad)
    ids = kjt.to_dict()
    for config, p, q in zip(tables, module.parameters(), twin.parameters()):
        rows = torch.unique(torch.cat([ids[f].values() for f in config.feature_names]))
        want = q.detach().clone()
        state = None
        if optimizer == "adagrad":
            state = torch.full_like(want, kwargs["initial_accumulator_value"])
        elif optimizer == "rowwise_adagrad":
            state = torch.zeros(want.shape[0])
        ref.apply_optimizer_ref(want, state, rows, q.grad[rows], OPTIMS[optimizer], kwargs["lr"],
                                kwargs.get("eps", 0.0), kwargs["weight_decay"], grad_sign=-1.0)
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6)
        untouched = torch.ones(want.shape[0], dtype=torch.bool)
        untouched[rows] = False
        assert torch.equal(p.detach()[untouched], q.detach()[untouched])


def test_learning_rate_changes_apply_at_the_next_step():
    tables = make_tables()
    module = EmbeddingBagCollection(tables, optimizer=torch.optim.SGD, lr=0.5)
    before = [p.detach().clone() for p in module.parameters()]
    for p in module.parameters():
        p._in_backward_optimizers[0].param_groups[0]["lr"] = 0.0
    module(make_kjt(tables, ["f0", "f1", "f2", "f3"], 5)).values().sum().backward()
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))


# ---------------------------------------------------------------------------------------------
# Errors


def test_bad_input_raises_before_any_row_changes():
    tables = make_tables()
    module = EmbeddingBagCollection(tables, optimizer="rowwise_adagrad", lr=0.1)
    keys = ["f0", "f1", "f2", "f3"]
    before = [p.detach().clone() for p in module.parameters()]
    kjt = make_kjt(tables, keys, 4, max_len=3)
    values, lengths = kjt.values(), kjt.lengths()
    n3 = int(lengths[12:].sum())  # ids of f3 (table t2, 1000 rows) are the last n3 values
    if n3 == 0:
        lengths[-1] += 1
        values = torch.cat([values, torch.tensor([1])])
    for bad_id, match in ((1000, r"feature 'f3' has id 1000 outside \[0, 1000\)"),
                          (-1, r"feature 'f3' has id -1 outside \[0, 1000\)")):
        bad = values.clone()
        bad[-1] = bad_id
        with pytest.raises(IndexError, match=match):
            module(KeyedJaggedTensor(keys=keys, values=bad, lengths=lengths))
    negative = lengths.clone()  # same total: sample 2 of f1 gets -1, sample 3 of f1 one more
    negative[4 + 2], negative[4 + 3] = -1, lengths[4 + 2] + lengths[4 + 3] + 1
    cases = [
        (KeyedJaggedTensor(keys=keys, values=values[:-1], lengths=lengths), ValueError,
         r"lengths sum to \d+ but the input holds \d+ ids"),
        (KeyedJaggedTensor(keys=keys + ["zz"], values=values,
                           lengths=torch.cat([lengths, torch.zeros(4, dtype=torch.long)])),
         ValueError, r"feature 'zz' names no table"),
        (KeyedJaggedTensor(keys=keys[:3], values=values[: int(lengths[:12].sum())],
                           lengths=lengths[:12]),
         ValueError, r"feature 'f3' of table 't2' is missing"),
        (values, TypeError, r"features must be a KeyedJaggedTensor"),
        (KeyedJaggedTensor(keys=keys, values=values, lengths=negative),
         ValueError, r"feature 'f1' has a negative length \(-1\) at sample 2"),
    ]
    for kjt_bad, exc, match in cases:
        with pytest.raises(exc, match=match):
            module(kjt_bad)
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))
    state = [p._in_backward_optimizers[0].state[p]["sum"] for p in module.parameters()]
    assert all(float(s.abs().sum()) == 0 for s in state)


def test_unsupported_configurations_raise():
    tables = make_tables()
    with pytest.raises(ValueError, match=r"optimizer must be one of 'sgd', 'adagrad'"):
        EmbeddingBagCollection(tables, optimizer="adam")
    with pytest.raises(ValueError, match=r"momentum=0 and nesterov=False only"):
        EmbeddingBagCollection(tables, optimizer="sgd", lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match=r"given without an optimizer"):
        EmbeddingBagCollection(tables, lr=0.1)
    fp16 = [EmbeddingBagConfig(name="h", embedding_dim=4, num_embeddings=5, feature_names=["x"],
                               data_type=torchrec.DataType.FP16)]
    with pytest.raises(TypeError, match=r"table 'h' must be FP32"):
        EmbeddingBagCollection(fp16)
    module = EmbeddingBagCollection(tables)
    _apply_optimizer_in_backward(torch.optim.Adam, [module.embedding_bags["t1"].weight], {"lr": 1})
    with pytest.raises(ValueError, match=r"optimizer must be one of"):
        module(make_kjt(tables, ["f0", "f1", "f2", "f3"], 3))


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
    out = forward(*op_args(a))
    torch.testing.assert_close(out, ref.embedding_bag_forward_ref(*op_args(a)), **tol)
    grad = torch.randn_like(out)
    assert_lists_close(grad_fn(grad, *op_args(a)),
                       ref.embedding_bag_unique_grad_ref(grad, *op_args(a)), **tol)
    for optim in OPTIMS.values():
        got = fused_args(a, optim, grad, wd=0.01, sign=-1.0)
        want = list(got)
        want[1], want[2] = [w.clone() for w in got[1]], [s.clone() for s in got[2]]
        update(*got)
        ref.embedding_bag_backward_update_ref(*want)
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


def test_triton_interpreted_empty(interpreted_triton, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a = op_inputs(batch=0)
    assert interpreted_triton.embedding_bag_forward_triton(*op_args(a)).shape == (0, 34)
    assert [g.shape[0] for g in interpreted_triton.embedding_bag_unique_grad_triton(
        torch.zeros(0, 34), *op_args(a))] == [0, 0, 0]


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


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_gpu_module_matches_dense_optimizer(monkeypatch, backend, optimizer):
    if backend == "cuda" and not recxla.built_with_cuda():
        pytest.skip("this build has no CUDA kernels")
    monkeypatch.setenv("RECXLA_BACKEND", backend)
    cls, kwargs = HPARAMS[optimizer]
    tables = make_tables(mean=True)
    module = EmbeddingBagCollection(tables, device=torch.device("cuda"), optimizer=optimizer,
                                    **kwargs)
    twin = TorchRecEBC(tables, device=torch.device("cuda"))
    twin.load_state_dict(module.state_dict())
    dense = cls(twin.parameters(), **kwargs)
    for _ in range(3):
        kjt = make_kjt(tables, ["f0", "f1", "f2", "f3"], 64).to(torch.device("cuda"))
        target = torch.randn(64, sum(module._lengths_per_embedding), device="cuda")
        ((module(kjt).values() - target) ** 2).sum().backward()
        dense.zero_grad()
        ((twin(kjt).values() - target) ** 2).sum().backward()
        dense.step()
    for p, q in zip(module.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
