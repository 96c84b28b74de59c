"""The input dist's id routing: the C++ kernel and the vectorized torch path that ids on a GPU
take (`route_ids_torch`, run here on CPU tensors) against the reference, a plain loop over the
ids, on random routing tables (several row blocks per slot, several routes per block, row-group
routes) and batches, and the op's errors."""

import random

import pytest
import torch

from recxla.ops.route_ids import route_ids, route_ids_torch
from recxla.reference.route_ids import route_ids_ref


def random_tables(num_slots: int, num_send_slots: int, row_groups: bool):
    """Routing tables as a sharded module builds them: each slot's rows cut in 1-3 blocks, each
    block sent along 1-3 routes to send slots (or, with row_groups, some to row groups)."""
    slot_rows, first_block, starts, first_route = [], [0], [], [0]
    send_slot, row_group, row_offset = [], [], []
    for _ in range(num_slots):
        rows = random.randint(1, 500)
        cuts = sorted(random.sample(range(1, rows), min(rows - 1, random.randint(0, 2))))
        slot_rows.append(rows)
        for start in [0, *cuts]:
            starts.append(start)
            for _ in range(random.randint(1, 3)):
                to_rows = row_groups and random.random() < 0.3
                send_slot.append(-1 if to_rows else random.randrange(num_send_slots))
                row_group.append(random.randrange(4) if to_rows else -1)
                row_offset.append(start)
            first_route.append(len(send_slot))
        first_block.append(len(starts))

    def long(x):
        return torch.tensor(x, dtype=torch.int64)

    return (long(slot_rows), long(first_block), long(starts), long(first_route), long(send_slot),
            long(row_group), long(row_offset))


def random_batch(slot_rows, batch: int, id_dtype, length_dtype, weighted: bool):
    lengths = torch.randint(0, 6, (slot_rows.numel(), batch))
    values = torch.cat([torch.randint(0, int(rows), (int(n),)) for rows, n in
                        zip(slot_rows, lengths.sum(1))]) if lengths.numel() else \
        torch.zeros(0, dtype=torch.int64)
    weights = torch.rand(values.numel()) if weighted else None
    return values.to(id_dtype), lengths.flatten().to(length_dtype), weights


def assert_same(got, want):
    for name, a, b in zip(want._fields, got, want):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), name
        else:
            assert a == b, name


# The C++ kernel (through the public function) and the torch ops of ids on a GPU.
IMPLEMENTATIONS = {"kernel": route_ids, "torch": route_ids_torch}


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("length_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("row_groups", [False, True])
def test_equals_reference(seed, impl, id_dtype, length_dtype, weighted, row_groups):
    route = IMPLEMENTATIONS[impl]
    for _ in range(5):
        num_slots, num_send = random.randint(1, 8), random.randint(1, 12)
        tables = random_tables(num_slots, num_send, row_groups)
        batch = random.randint(0, 40)
        values, lengths, weights = random_batch(tables[0], batch, id_dtype, length_dtype,
                                                weighted)
        got = route(values, lengths, weights, batch, *tables, num_send)
        want = route_ids_ref(values, lengths, weights, batch, *tables, num_send)
        assert_same(got, want)
        assert got.first_bad == -1
        # Every route of every id is somewhere: sent or to a row group.
        assert got.send_ids.numel() + got.row_ids.numel() >= values.numel()
        assert int(got.slot_counts.sum()) == got.send_ids.numel() == int(got.slot_lengths.sum())


@pytest.mark.parametrize("weighted", [False, True])
def test_torch_path_on_an_id_outside_its_table(seed, weighted):
    """`route_ids_torch` returns what the reference returns for a batch with an id outside its
    table, field for field: first_bad and nothing else (the kernel's other fields are
    unspecified then)."""
    for row_groups in (False, True):
        tables = random_tables(6, 5, row_groups)
        values, lengths, weights = random_batch(tables[0], 24, torch.int64, torch.int32, weighted)
        values[values.numel() // 2] = -3
        got = route_ids_torch(values, lengths, weights, 24, *tables, 5)
        assert got.first_bad == values.numel() // 2
        assert_same(got, route_ids_ref(values, lengths, weights, 24, *tables, 5))


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("bad", [-1, 0])
def test_first_id_outside_its_table(seed, impl, bad):
    tables = random_tables(5, 4, True)
    values, lengths, _ = random_batch(tables[0], 16, torch.int64, torch.int64, False)
    i = random.randrange(values.numel())
    slot = int(torch.searchsorted(lengths.view(5, 16).sum(1).cumsum(0), torch.tensor(i),
                                  right=True))
    values[i] = -1 if bad < 0 else int(tables[0][slot])  # just below 0, or just past the table
    later = min(i + 1 + random.randrange(3), values.numel() - 1)
    if later > i:
        values[later] = -5
    got = IMPLEMENTATIONS[impl](values, lengths, None, 16, *tables, 4)
    assert got.first_bad == i == route_ids_ref(values, lengths, None, 16, *tables, 4).first_bad


def test_errors_name_the_op_and_the_argument():
    tables = random_tables(3, 2, False)
    values, lengths, _ = random_batch(tables[0], 4, torch.int64, torch.int64, False)
    with pytest.raises(ValueError, match=r"recxla.route_ids: lengths must have slots x batch = 12"):
        route_ids(values, lengths[:-1], None, 4, *tables, 2)
    bad_lengths = lengths.clone()
    bad_lengths[0] = -1
    with pytest.raises(ValueError, match=r"recxla.route_ids: lengths\[0\] is negative"):
        route_ids(values, bad_lengths, None, 4, *tables, 2)
    with pytest.raises(ValueError, match=r"recxla.route_ids: lengths sum to"):
        route_ids(torch.cat([values, values[:1]]), lengths, None, 4, *tables, 2)
    with pytest.raises(TypeError, match=r"recxla.route_ids: values must be int32 or int64"):
        route_ids(values.float(), lengths, None, 4, *tables, 2)
    with pytest.raises(TypeError, match=r"recxla.route_ids: weights must be float32"):
        route_ids(values, lengths, torch.ones(values.numel(), dtype=torch.float64), 4, *tables, 2)
    with pytest.raises(ValueError, match=r"recxla.route_ids: route 0 has send slot"):
        route_ids(values, lengths, None, 4, *tables, 0)
    broken = list(tables)
    broken[2] = broken[2] + 1  # a slot's first block must start at row 0
    with pytest.raises(ValueError, match=r"recxla.route_ids: slot 0 must have at least one row"):
        route_ids(values, lengths, None, 4, *broken, 2)
