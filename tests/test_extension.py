"""recxla without its compiled extension: there is no plain-PyTorch fallback, so every public op
on CPU tensors raises a RuntimeError that names the op and says how to reinstall
(recxla._extension.backend_for). `import recxla` itself keeps working: tests/test_build.py
checks that in a child process whose `recxla._C` fails to import."""

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import recxla
from recxla import _extension
from recxla.ops import embedding_bag as ops
from recxla.ops.dedup import segmented_unique
from recxla.ops.route_ids import route_ids

from test_embedding_bag import bag_lookup, fused_args, op_inputs, update_args
from test_route_ids import random_batch, random_tables

LOAD_ERROR = "recxla._C: cannot open shared object file (test_extension.py)"


@pytest.fixture
def no_extension(monkeypatch):
    monkeypatch.setattr(_extension, "HAVE_EXTENSION", False)
    monkeypatch.setattr(_extension, "_LOAD_ERROR", ImportError(LOAD_ERROR))


def _route_ids_call():
    tables = random_tables(3, 2, True)
    values, lengths, weights = random_batch(tables[0], 4, torch.int64, torch.int64, True)
    return route_ids(values, lengths, weights, 4, *tables, 2)


def _fused_lookup_call():
    a = op_inputs(batch=5)
    plan = ops.LookupPlan(a["feature_table"], a["pooling"], a["batch_size"])
    return ops.FusedPooledLookup.apply(plan, a["unique_values"], a["unique_offsets"],
                                       a["inverse"], a["offsets"], a["per_sample_weights"],
                                       *a["weights"])


def _kjt():
    return KeyedJaggedTensor(["a", "b"], torch.arange(12), lengths=torch.ones(12, dtype=torch.long),
                             stride=6)


# (the op named in the message, a call of it on CPU tensors)
CALLS = [
    ("recxla.quantize_rows", lambda: recxla.quantize_rows(torch.randn(3, 8), "e4m3")),
    ("recxla.quantize_rows", lambda: recxla.quantize_rows(
        torch.randn(3, 8), "e5m2", out=torch.empty(3, 12, dtype=torch.uint8))),
    ("recxla.dequantize_rows", lambda: recxla.dequantize_rows(
        torch.zeros(3, 12, dtype=torch.uint8), 8, "e4m3")),
    ("recxla.segmented_unique", lambda: segmented_unique(torch.arange(6), torch.tensor([0, 2, 6]))),
    ("recxla.segmented_unique", lambda: recxla.unique_keys(torch.arange(6), torch.tensor([0, 6]))),
    ("recxla.ops.embedding_bag.pooled_forward",
     lambda: ops.pooled_forward(bag_lookup(op_inputs()))),
    ("recxla.ops.embedding_bag.unique_grad", lambda: ops.unique_grad(
        torch.randn(7, 34), bag_lookup(op_inputs()))),
    ("recxla.ops.embedding_bag.backward_update", lambda: ops.backward_update(
        *update_args(fused_args(op_inputs(), ops.SGD, torch.randn(7, 34))))),
    ("recxla.ops.embedding_bag.FusedPooledLookup", _fused_lookup_call),
    ("recxla.cluster_samples", lambda: recxla.cluster_samples(_kjt(), 2)),
    ("recxla.route_ids", _route_ids_call),
]


@pytest.mark.parametrize("op,call", CALLS, ids=[f"{i}-{op}" for i, (op, _) in enumerate(CALLS)])
def test_every_op_names_itself_and_says_to_reinstall(no_extension, op, call):
    with pytest.raises(RuntimeError) as info:
        call()
    message = str(info.value)
    assert message.startswith(f"{op}: the compiled kernels are not available ({LOAD_ERROR})")
    assert "reinstall recxla with `pip install --no-build-isolation .` (README" in message


def test_the_ops_run_with_the_extension():
    """The same calls, with the extension loaded, run (no other error hides behind the one
    above)."""
    for _, call in CALLS:
        call()


def test_plain_cast_formats_need_no_kernel(no_extension):
    """bf16/fp16/fp32 rows are a torch cast, not a kernel: they work without the extension."""
    x = torch.randn(3, 8)
    packed = recxla.quantize_rows(x, "bf16")
    assert torch.equal(recxla.dequantize_rows(packed, 8, "bf16"), x.bfloat16().float())


def test_backend_for(no_extension):
    with pytest.raises(RuntimeError, match=r"^recxla.some_op: the compiled kernels"):
        _extension.backend_for(torch.zeros(1), "recxla.some_op")


def test_backend_for_with_the_extension():
    assert _extension.backend_for(torch.zeros(1), "recxla.some_op") == "cpu"
