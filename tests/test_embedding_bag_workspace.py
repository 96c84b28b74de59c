"""An allocation-free steady state on CPU: the ops' out= arguments, recxla.nn.workspace, and a
training step of recxla.nn.EmbeddingBagCollection that takes no new pages once warm.

With glibc's default malloc a freed block of more than 32 MiB goes back to the kernel, and the
next one of that size is fresh memory whose every 4 KiB page faults on first touch; these tests
count those faults with getrusage.
"""

import copy
import pickle
import resource

import pytest
import torch
from torchrec import EmbeddingBagConfig

from recxla.nn import EmbeddingBagCollection
from recxla.nn.workspace import Workspace
from recxla.ops import embedding_bag as ops
from recxla.ops.dedup import segmented_unique
from recxla.reference.dedup import segmented_unique_ref

from test_dedup import KINDS, random_keys, random_offsets
from test_embedding_bag import bag_lookup, make_kjt, op_inputs


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ---------------------------------------------------------------------------------------------
# Workspace


def test_workspace_reuses_only_storages_nobody_holds():
    ws = Workspace(max_per_name=2)
    a = ws.empty("x", (64, 8), torch.float32, "cpu")
    assert a.shape == (64, 8) and a.is_contiguous() and a._base is None
    first = a.data_ptr()
    view = a[3:]
    del a
    b = ws.empty("x", (64, 8), torch.float32, "cpu")  # the view still holds the first
    assert b.data_ptr() != first
    c = ws.empty("x", (64, 8), torch.float32, "cpu")  # over max_per_name: a plain allocation
    assert c.data_ptr() not in (first, b.data_ptr())
    del view
    d = ws.empty("x", (10, 8), torch.int64, "cpu")  # free again; other dtypes and shapes fit
    assert d.data_ptr() == first and d.dtype == torch.int64
    other = ws.empty("y", (64, 8), torch.float32, "cpu")  # names never share
    assert other.data_ptr() not in (first, b.data_ptr())
    del b, c, d, other
    big = ws.empty("x", (1000, 8), torch.float32, "cpu")  # grows (with headroom) in place of one
    assert big.untyped_storage().nbytes() >= 1000 * 8 * 4 * 1.125
    assert ws.nbytes() <= 2 * big.untyped_storage().nbytes() + 2 * 64 * 8 * 4
    copied = copy.deepcopy(ws)
    assert copied.nbytes() == 0 and copied.max_per_name == 2
    assert pickle.loads(pickle.dumps(ws)).headroom == ws.headroom
    with pytest.raises(ValueError, match="max_per_name must be an int >= 1"):
        Workspace(max_per_name=0)


def test_kept_outputs_are_never_overwritten():
    """A step's output that the caller still holds keeps its memory: later steps write elsewhere."""
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50,
                                 feature_names=[f"f{i}"]) for i in range(3)]
    module = EmbeddingBagCollection(tables, optimizer="sgd", lr=0.1)
    kept = []
    for step in range(5):
        out = module(make_kjt(tables, ["f0", "f1", "f2"], 16))
        out.values().sum().backward()
        kept.append((out, out.values().detach().clone()))
    for out, values in kept:
        assert torch.equal(out.values(), values)
    assert len({out.values().data_ptr() for out, _ in kept}) == 5


# ---------------------------------------------------------------------------------------------
# out= arguments of the ops


def test_forward_out_matches_and_writes_in_place():
    a = op_inputs(weighted=True, batch=9)
    want = ops.pooled_forward(bag_lookup(a))
    out = torch.full_like(want, float("nan"))
    got = ops.pooled_forward(bag_lookup(a), out=out)
    assert got is out
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.library.opcheck(torch.ops.recxla.embedding_bag_forward_out, [*bag_lookup(a), out])
    bad = [(out.double(), TypeError, "out must be float32"),
           (out[:, :-1], ValueError, r"out must be \[batch_size, total_dim\] = \[9, 34\]"),
           (torch.empty(34, 9).t(), ValueError, "out must be contiguous")]
    for value, exc, match in bad:
        with pytest.raises(exc, match=match):
            torch.ops.recxla.embedding_bag_forward_out(*bag_lookup(a), value)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_segmented_unique_out_matches_and_keeps_storage(kind, dtype):
    out = (torch.empty(0, dtype=dtype), torch.empty(0, dtype=torch.int64),
           torch.empty(0, dtype=torch.int64))
    pointers = None
    for _ in range(3):
        offsets = random_offsets(7, 3000)
        offsets[-1] = offsets[-2] + 100_000  # one big segment: the partitioned sort too
        values = random_keys(kind, int(offsets[-1]), dtype)
        if pointers is None:  # room for the largest batch, as a workspace gives
            out = tuple(o.resize_(values.numel() + 200_000) for o in out)
            pointers = [o.data_ptr() for o in out]
        got = segmented_unique(values, offsets, out=out)
        for g, w in zip(got, segmented_unique_ref(values, offsets)):
            assert torch.equal(g, w)
        assert [g.data_ptr() for g in got] == pointers


def test_segmented_unique_out_errors():
    values, offsets = torch.arange(10), torch.tensor([0, 4, 10])
    i64 = lambda n: torch.empty(n, dtype=torch.int64)  # noqa: E731
    cases = [
        ((i64(10).int(), i64(3), i64(10)), TypeError, "unique_values must be a torch.int64"),
        ((i64(10), i64(6)[::2], i64(10)), ValueError, "unique_offsets must be a contiguous 1-D"),
        ((i64(10), i64(3)), TypeError, r"out must be a tuple \(unique_values"),
    ]
    for out, exc, match in cases:
        with pytest.raises(exc, match=match):
            segmented_unique(values, offsets, out=out)
    with pytest.raises(ValueError, match="unique_values must not be values itself"):
        torch.ops.recxla.segmented_unique_out(values, offsets, values, i64(3), i64(10))
    torch.library.opcheck(torch.ops.recxla.segmented_unique_out,
                          [values, offsets, i64(10), i64(3), i64(10)],
                          test_utils=("test_schema", "test_autograd_registration"))


# ---------------------------------------------------------------------------------------------
# The module's steady state


def test_steady_state_step_takes_no_new_pages():
    """40 tables of dim 64 and batch 4096: a 42 MB pooled output, above glibc's 32 MiB limit for
    recycling freed blocks in the process. The loop keeps each step's output until the next step
    has run, as a training loop's variable does. The first step pays the first touch of every
    buffer; once warm (two outputs alive at a time), a step may fault only on small things."""
    features = [f"f{i}" for i in range(40)]
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=2000,
                                 feature_names=[f]) for i, f in enumerate(features)]
    module = EmbeddingBagCollection(tables, optimizer="sgd", lr=0.01)
    batches = [make_kjt(tables, features, 4096, max_len=2) for _ in range(3)]
    grad = torch.randn(4096, 40 * 64)
    faults, out = [], None
    for step in range(7):
        before = minor_faults()
        out = module(batches[step % 3])
        out.values().backward(grad)
        faults.append(minor_faults() - before)
    pages_of_output = 4096 * 40 * 64 * 4 // 4096
    assert faults[0] >= pages_of_output // 2, faults  # the measurement sees first touches
    assert max(faults[3:]) <= faults[0] // 50, faults
