"""The pooled module's output (recxla/torchrec/keyed_output.py): KeyedOutput.to_dict() gives
TorchRec's KeyedTensor.to_dict() pieces, and its backward hands their gradient back without a
copy when the model's own gradient memory already holds them side by side, the same values as
TorchRec's cat otherwise; `side_by_side` finds exactly the pieces that tile one tensor."""

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torchrec.sparse.jagged_tensor import KeyedTensor

from recxla.torchrec.keyed_output import KeyedOutput, side_by_side


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def _lengths(count: int, allow_empty: bool = False):
    return [random.randint(0 if allow_empty else 1, 5) for _ in range(count)]


def test_side_by_side_joins_a_split_of_any_strides_as_a_view(seed):
    lengths = _lengths(random.randint(1, 6), allow_empty=True)
    if sum(lengths) == 0:
        lengths[0] = 1
    rows, width = random.randint(1, 5), sum(lengths)
    # A column range of a wider tensor (rows apart), or its transpose (dim 0).
    wide = torch.randn(rows, width + random.randint(0, 4) * 2 + 3)
    left = random.randint(0, wide.shape[1] - width)
    whole = wide[:, left:left + width]
    for dim, tensor in ((1, whole), (0, whole.t())):
        pieces = tensor.split(lengths, dim=dim)
        joined = side_by_side(pieces, dim, tensor.shape)
        assert joined is not None and torch.equal(joined, tensor)
        assert joined.stride() == tensor.stride() and joined.data_ptr() == tensor.data_ptr()


def test_side_by_side_refuses_pieces_that_do_not_tile_one_tensor(seed):
    lengths = _lengths(random.randint(2, 5))
    rows = random.randint(2, 4)
    tensor = torch.randn(rows, sum(lengths))
    pieces = list(tensor.split(lengths, dim=1))
    shape = tensor.shape
    i = random.randrange(len(pieces))
    copied = pieces[:i] + [pieces[i].clone()] + pieces[i + 1:]
    missing = pieces[:i] + [None] + pieces[i + 1:]
    swapped = pieces[1:] + pieces[:1]
    assert side_by_side(copied, 1, shape) is None      # another storage
    assert side_by_side(missing, 1, shape) is None     # a piece without a gradient
    if lengths[0] != lengths[-1] or len(set(lengths)) > 1:
        assert side_by_side(swapped, 1, shape) is None  # out of order
    apart = torch.randn(rows, sum(lengths) + 1)        # a gap between two pieces
    gap = list(apart[:, :lengths[0]].split([lengths[0]], dim=1)) + \
        list(apart[:, lengths[0] + 1:].split(lengths[1:], dim=1))
    assert side_by_side(gap, 1, shape) is None


def _model_like_dlrm(kt, keys, dense):
    """DLRM's sparse arch and interaction input: the pieces by name, concatenated, reshaped,
    joined with the dense features."""
    pieces = kt.to_dict()
    sparse = torch.cat([pieces[k] for k in keys], dim=1).reshape(dense.shape[0], len(keys), -1)
    return torch.cat([dense.unsqueeze(1), sparse], dim=1)


@pytest.mark.parametrize("uses_every_key", [True, False])
def test_to_dict_trains_as_torchrecs_with_no_copy_where_the_model_joins_the_pieces(
        seed, uses_every_key):
    num_keys = random.randint(1 if uses_every_key else 2, 6)
    dim, batch = random.choice([2, 4, 8]), random.randint(1, 9)
    keys = [f"f{i}" for i in range(num_keys)]
    values = torch.randn(batch, num_keys * dim)
    dense = torch.randn(batch, dim)
    used = keys if uses_every_key else keys[:-1]
    weights = torch.randn(batch, len(used) + 1, dim)
    results = {}
    for cls in (KeyedTensor, KeyedOutput):
        leaf = values.clone().requires_grad_()
        kt = cls(keys=keys, length_per_key=[dim] * num_keys, values=leaf * 1.0)
        assert kt.keys() == keys and torch.equal(kt.values(), values)
        seen = []
        kt.values().register_hook(lambda g: seen.append(g))
        out = _model_like_dlrm(kt, used, dense)
        ops = _Ops()
        with ops:
            (out * weights).sum().backward()
        results[cls] = (leaf.grad, seen[0], ops.names,
                        {k: v.detach() for k, v in kt.to_dict().items()})
    (ref_grad, ref_seen, ref_ops, ref_dict), (grad, given, ops, pieces) = \
        results[KeyedTensor], results[KeyedOutput]
    assert torch.equal(grad, ref_grad) and torch.equal(given, ref_seen)
    assert list(pieces) == list(ref_dict) and all(torch.equal(pieces[k], ref_dict[k])
                                                   for k in keys)
    assert "aten::cat" in ref_ops
    if uses_every_key:
        # The gradient handed over is the model's own memory: no cat, no copy.
        assert "aten::cat" not in ops
        assert batch == 1 or given.stride(0) == (num_keys + 1) * dim
    else:
        assert given.is_contiguous()  # a piece without a gradient: TorchRec's cat


def test_without_autograd_it_is_torchrecs_split_and_pytree_sees_a_keyed_tensor(seed):
    num_keys, dim = random.randint(1, 5), random.randint(1, 4)
    keys = [f"k{i}" for i in range(num_keys)]
    values = torch.randn(random.randint(1, 6), num_keys * dim, requires_grad=True)
    kt = KeyedOutput(keys=keys, length_per_key=[dim] * num_keys, values=values)
    with torch.no_grad():
        pieces = kt.to_dict()
    assert all(p.grad_fn is None and p.data_ptr() == values[:, i * dim:].data_ptr()
               for i, p in enumerate(pieces.values()))
    leaves, spec = tree_flatten(kt)
    assert len(leaves) == 1 and leaves[0] is values
    back = tree_unflatten(leaves, spec)
    assert isinstance(back, KeyedTensor) and back.keys() == keys
    assert torch.equal(back.values(), values)


def test_a_piece_changed_in_place_raises_as_torchrecs_does(seed):
    num_keys, dim = random.randint(2, 5), random.randint(1, 4)
    keys = [f"k{i}" for i in range(num_keys)]
    for cls in (KeyedTensor, KeyedOutput):
        values = torch.randn(random.randint(1, 6), num_keys * dim, requires_grad=True) * 1.0
        piece = cls(keys=keys, length_per_key=[dim] * num_keys, values=values).to_dict()["k1"]
        with pytest.raises(RuntimeError, match="returns multiple views"):
            piece.mul_(2.0)


@pytest.mark.parametrize("pieces", [1, 3])
def test_split_by_key_of_rows_gives_torchs_gradient_and_no_copy_for_one_piece(seed, pieces):
    """The sequence module's split of its rows by feature: each feature used on its own (the
    gradients apart: a cat, as torch's), or one feature (its gradient handed back as it is,
    where torch's split copies it; so too a single piece with rows among empty ones)."""
    from recxla.torchrec.keyed_output import split_by_key

    counts = [random.randint(0, 6) for _ in range(pieces)]
    counts[0] += 1
    dim = random.randint(1, 5)
    values = torch.randn(sum(counts), dim)
    weights = [torch.randn(n, dim) for n in counts]
    grads, ops = [], []
    for split in (lambda x: x.split(counts), lambda x: split_by_key(x, counts, 0)):
        leaf = values.clone().requires_grad_()
        parts = split(leaf * 1.0)
        assert all(torch.equal(p, values[sum(counts[:i]):][:n])
                   for i, (p, n) in enumerate(zip(parts, counts)))
        recorded = _Ops()
        with recorded:
            sum((torch.tanh(p) * w).sum() for p, w in zip(parts, weights)).backward()
        grads.append(leaf.grad)
        ops.append(recorded.names)
    assert torch.equal(grads[0], grads[1])
    assert "aten::cat" in ops[0]
    # Empty pieces' gradients lie anywhere: two pieces with rows are what need a cat.
    assert ("aten::cat" in ops[1]) == (sum(n > 0 for n in counts) > 1), counts
