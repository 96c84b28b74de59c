"""recxla::encode_row_ids (recxla.ops.row_ids): the C++ kernel and the torch path against the
plain-Python reference on fresh random ids (row groups of one or more features, micro-batches
including empty ones, repeats, weights, no ids at all), the plan's sections pooling as each bag
alone, and the errors, which name the op, the argument and the limit."""

import random

import pytest
import torch

from recxla.ops.embedding_bag import SUM, BagLookup, pooled_forward
from recxla.ops.row_ids import EncodedRows, encode_row_ids, encode_row_ids_torch, plan_sections
from recxla.reference.row_ids import encode_row_ids_ref


def random_case(weighted):
    """Routed ids of a random layout: (group, slot, sample, ids, weights, slot_position,
    group_features, micro)."""
    groups = random.randint(1, 4)
    group_features = [random.randint(1, 3) for _ in range(groups)]
    # Input slots: each a feature of one group's table (slot -> (group, position)).
    slot_of = [(g, f) for g in range(groups) for f in range(group_features[g])]
    random.shuffle(slot_of)
    slot_position = [f for _, f in slot_of]
    micro = [random.randint(0, 5) for _ in range(random.randint(1, 3))]
    batch = sum(micro)
    n = random.randint(0, 60) if batch else 0
    slot = torch.randint(0, len(slot_of), (n,))
    group = torch.tensor([slot_of[s][0] for s in slot.tolist()], dtype=torch.int64)
    sample = torch.randint(0, max(batch, 1), (n,))
    ids = torch.randint(0, random.choice([3, 10, 2**40]), (n,))  # few distinct: repeats
    weights = torch.rand(n) if weighted else None
    return group, slot, sample, ids, weights, slot_position, group_features, micro


def assert_equal(got, want):
    for name, g, w in zip(want._fields, got, want):
        if w is None:
            assert g is None, name
            continue
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), (name, g, w)


@pytest.mark.parametrize("weighted", [False, True])
def test_kernel_and_torch_path_equal_reference(weighted):
    for _ in range(40):
        case = random_case(weighted)
        want = encode_row_ids_ref(*case)
        assert_equal(encode_row_ids(*case), want)
        assert_equal(encode_row_ids_torch(*case), want)


@pytest.mark.parametrize("weighted", [False, True])
def test_plan_pools_each_micro_batch_as_each_bag_alone(weighted):
    """The plan's lookup of micro-batch k over the rows the owner would send (each run's
    distinct ids, here rows of a table indexed by id) gives every bag (group, feature, sample)
    the sum of its ids' rows, times their weights."""
    for _ in range(10):
        group, slot, sample, ids, weights, slot_position, group_features, micro = \
            random_case(weighted)
        ids = ids % 10
        encoded = encode_row_ids(group, slot, sample, ids, weights, slot_position,
                                 group_features, micro)
        table = [torch.randn(10, random.choice([1, 4])) for _ in group_features]
        counts, bounds = encoded.counts.flatten().tolist(), encoded.bounds.tolist()
        unique = encoded.unique.split(encoded.counts.flatten().tolist())
        num_micro, first = len(micro), 0
        for k, section in enumerate(plan_sections(counts, bounds, micro, group_features)):
            rows = [table[g][unique[g * num_micro + k]] for g in range(len(group_features))]
            feature_table = [g for g, f in enumerate(group_features) for _ in range(f)]
            lookup = BagLookup(rows, encoded.plan[section.unique_values],
                               encoded.plan[section.unique_offsets],
                               encoded.plan[section.inverse], encoded.plan[section.offsets],
                               None if weights is None else
                               encoded.message_weights[section.weights],
                               feature_table, [SUM] * len(rows), micro[k])
            out = pooled_forward(lookup)
            column = 0
            for g, features in enumerate(group_features):
                dim = table[g].shape[1]
                for f in range(features):
                    for b in range(micro[k]):
                        want = torch.zeros(dim)
                        for i in range(ids.numel()):
                            if group[i] == g and slot_position[slot[i]] == f and \
                                    sample[i] == first + b:
                                weight = 1.0 if weights is None else float(weights[i])
                                want += weight * table[g][ids[i]]
                        torch.testing.assert_close(out[b, column: column + dim], want)
                    column += dim
            first += micro[k]


def test_arguments_are_checked():
    group = torch.tensor([0, 1])
    slot = torch.tensor([0, 1])
    sample = torch.tensor([0, 1])
    ids = torch.tensor([5, 6])
    ok = dict(slot_position=[0, 0], group_features=[1, 1], micro=[1, 1])

    def call(**changes):
        args = dict(group=group, slot=slot, sample=sample, ids=ids, weights=None, **ok)
        args.update(changes)
        return encode_row_ids(**args)

    call()
    with pytest.raises(ValueError, match=r"encode_row_ids: group\[1\] = 2 is outside \[0, 2\)"):
        call(group=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"slot\[0\] = -1 is outside \[0, 2\)"):
        call(slot=torch.tensor([-1, 1]))
    with pytest.raises(ValueError, match=r"sample\[1\] = 2 is outside \[0, 2\)"):
        call(sample=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="slot 1 is feature 1 of its table, but row group 1 "
                                         "has 1 features"):
        call(slot_position=[0, 1])
    with pytest.raises(ValueError, match="micro-batch 1 has a negative size"):
        call(micro=[2, -1])
    with pytest.raises(ValueError, match="row group 0 must have at least one feature"):
        call(group_features=[0, 1])
    with pytest.raises(ValueError, match="slot must have 2 entries like group, got 1"):
        call(slot=torch.tensor([0]))
    with pytest.raises(TypeError, match="ids must be int64, got Int"):
        call(ids=ids.int())
    with pytest.raises(ValueError, match="weights must be a contiguous 1-D CPU tensor of 2"):
        call(weights=torch.ones(3))
    with pytest.raises(TypeError, match="encode_row_ids: sample must be a torch.Tensor"):
        call(sample=[0, 1])


def test_opcheck():
    group, slot, sample, ids, weights, slot_position, group_features, micro = \
        random_case(True)
    torch.library.opcheck(torch.ops.recxla.encode_row_ids.default,
                          (group, slot, sample, ids, weights, slot_position, group_features,
                           micro))


@pytest.mark.gpu
@pytest.mark.parametrize("weighted", [False, True])
def test_ids_on_a_gpu_take_the_torch_path_equal_to_the_reference(weighted):
    for _ in range(10):
        case = random_case(weighted)
        got = encode_row_ids(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in case))
        assert got.order.is_cuda
        assert_equal(EncodedRows(*(None if t is None else t.cpu() for t in got)),
                     encode_row_ids_ref(*case))
