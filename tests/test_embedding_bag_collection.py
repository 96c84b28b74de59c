"""recxla.nn.EmbeddingBagCollection against TorchRec's unsharded EmbeddingBagCollection (same
weights: outputs, dense gradients, state_dict both ways) and against torch's optimizers stepping
on dense gradients (the fused sparse update), errors raised before any row changes, and the same
on a GPU with the CUDA and Triton kernels.
"""

import pytest
import torch
import torchrec
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.modules.embedding_modules import EmbeddingBagCollection as TorchRecEBC

import recxla
from recxla.nn import EmbeddingBagCollection
from recxla.reference import embedding_bag as ref

from test_embedding_bag import OPTIMS, make_kjt, make_tables


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
        # Summation order differs between the fused and the dense path, so an entry that ends
        # near 0 by cancellation carries the rounding of the table's largest entries: SGD on this
        # loss lets rows grow to ~30.
        atol = 1e-6 * max(1.0, q.abs().max().item())
        torch.testing.assert_close(p, q, rtol=1e-5, atol=atol, msg=name)
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


def test_weighted_mean_raises_as_in_torchrec():
    tables = make_tables(mean=True)
    kjt = make_kjt(tables, ["f0", "f1", "f2", "f3"], 3, weighted=True)
    with pytest.raises(NotImplementedError, match="per_sample_weights"):
        TorchRecEBC(tables, is_weighted=True)(kjt)
    with pytest.raises(NotImplementedError, match=r"table 't0' has MEAN pooling, which "
                                                  r"per-sample weights \(is_weighted=True\)"):
        EmbeddingBagCollection(tables, is_weighted=True)
    EmbeddingBagCollection(tables)  # unweighted MEAN is fine
    EmbeddingBagCollection(make_tables(), is_weighted=True)  # weighted SUM too


def test_per_sample_weight_grad_matches_torchrec():
    tables = make_tables()
    module = EmbeddingBagCollection(tables, is_weighted=True, optimizer="sgd", lr=0.1)
    twin = twin_of(module, tables, weighted=True)
    kjt = make_kjt(tables, ["f3", "f0", "f2", "f1"], 12, weighted=True)
    grads = []
    for m in (module, twin):
        weights = kjt.weights().detach().clone().requires_grad_()
        k = KeyedJaggedTensor(keys=kjt.keys(), values=kjt.values(), lengths=kjt.lengths(),
                              weights=weights)
        out = m(k).values()
        out.backward(torch.arange(out.numel(), dtype=torch.float32).view(out.shape).cos())
        grads.append(weights.grad)
    torch.testing.assert_close(grads[0], grads[1])


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
# GPU (make gpu-campaign)


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


def test_one_table_config_check_for_both_modules():
    """recxla.nn's module (FP32 tables) and the sharded module (FP32 or FP16) check a table
    config with one function: the same errors, types and words, naming the module given."""
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType

    from recxla.nn.table_config import check_table_config

    def config(**kw):
        return EmbeddingBagConfig(num_embeddings=10, embedding_dim=8, name="h",
                                  feature_names=["f"], **kw)

    sharded = (DataType.FP32, DataType.FP16)
    check_table_config(config(data_type=DataType.FP16), False, "S", sharded)
    with pytest.raises(TypeError, match=r"^N: table 'h' must be FP32, got FP16"):
        check_table_config(config(data_type=DataType.FP16), False, "N")
    with pytest.raises(TypeError, match=r"^S: table 'h' must be FP32 or FP16, got "
                                        r"BF16"):
        check_table_config(config(data_type=DataType.BF16), False, "S", sharded)
    with pytest.raises(ValueError, match=r"^S: table 'h' pooling must be SUM or MEAN"):
        check_table_config(config(pooling=PoolingType.NONE), False, "S", sharded)
    for owner, types in (("N", (DataType.FP32,)), ("S", sharded)):
        with pytest.raises(NotImplementedError, match=rf"^{owner}: table 'h' has MEAN pooling, "
                                                      r"which per-sample weights"):
            check_table_config(config(pooling=PoolingType.MEAN), True, owner, types)
