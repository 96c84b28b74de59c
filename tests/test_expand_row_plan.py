"""recxla::expand_row_plan (recxla.ops.row_ids): the C++ kernel and the torch path against the
plain-Python reference on fresh random layouts (tables cut into row blocks of column shards,
micro-batches including empty ones, repeated ids), the plan expanding the message's rows to
every id's full row in the output's order, and the errors, which name the op, the argument and
the limit."""

import random

import pytest
import torch

from recxla.ops.embedding_bag import SUM, BagLookup, pooled_forward
from recxla.ops.row_ids import (encode_row_ids, expand_row_plan, expand_row_plan_torch,
                                expand_sections)
from recxla.reference.row_ids import expand_row_plan_ref


def random_layout():
    """Tables, each cut into row blocks of the same column shards (one row group a shard):
    (per table its blocks' groups [block][shard], per group (table, first chunk, chunks),
    chunks_per_row)."""
    chunks_per_row = random.choice([1, 2, 4])
    tables, groups = [], []
    for t in range(random.randint(1, 3)):
        # The table's column shards: a random cut of the row's chunks.
        cuts = sorted(random.sample(range(1, chunks_per_row), random.randint(
            0, chunks_per_row - 1))) if chunks_per_row > 1 else []
        edges = [0] + cuts + [chunks_per_row]
        blocks = []
        for _ in range(random.randint(1, 2)):
            block = []
            for first, last in zip(edges, edges[1:]):
                block.append(len(groups))
                groups.append((t, first, last - first))
            blocks.append(block)
        tables.append(blocks)
    # Row groups in a random global order (owners' order), renumbered.
    perm = list(range(len(groups)))
    random.shuffle(perm)
    new_of = {old: new for new, old in enumerate(perm)}
    tables = [[[new_of[g] for g in block] for block in blocks] for blocks in tables]
    groups = [groups[old] for old in perm]
    return tables, groups, chunks_per_row


def random_case():
    """A batch's routed ids through a random layout, encoded: (expand_row_plan's arguments,
    the batch's ids per slot and sample, per slot its table, the layout)."""
    tables, groups, chunks_per_row = random_layout()
    features = [random.randint(1, 2) for _ in tables]  # each table's features
    slot_table = [t for t, f in enumerate(features) for _ in range(f)]
    slot_position = [p for f in features for p in range(f)]
    order_of_slots = list(range(len(slot_table)))
    random.shuffle(order_of_slots)
    slot_table = [slot_table[s] for s in order_of_slots]
    slot_position = [slot_position[s] for s in order_of_slots]
    micro = [random.randint(0, 4) for _ in range(random.randint(1, 3))]
    batch = sum(micro)
    lengths = torch.randint(0, 4, (len(slot_table), batch))
    rows_per_table = 12
    group, slot, sample, local, bag_ids = [], [], [], [], []
    for s, t in enumerate(slot_table):
        blocks = tables[t]
        per_sample = []
        for b in range(batch):
            ids = [random.randrange(rows_per_table) for _ in range(int(lengths[s, b]))]
            per_sample.append(ids)
            for i in ids:
                block = blocks[i % len(blocks)]  # the id's row block
                for g in block:  # its column shards, one route each
                    group.append(g)
                    slot.append(s)
                    sample.append(b)
                    local.append(i)
        bag_ids.append(per_sample)
    long = dict(dtype=torch.int64)
    group, slot, sample, local = (torch.tensor(x, **long) for x in (group, slot, sample, local))
    group_features = [features[t] for t, _, _ in groups]
    encoded = encode_row_ids(group, slot, sample, local, None, slot_position, group_features,
                             micro)
    routes = [len(tables[t][0]) for t in slot_table]
    args = (encoded.order, encoded.inverse, encoded.counts, encoded.bounds, slot, sample,
            lengths.to(random.choice([torch.int32, torch.int64])), routes, micro,
            [c for _, _, c in groups], [f for _, f, _ in groups], chunks_per_row)
    return args, encoded, bag_ids, slot_table, groups, chunks_per_row


def test_kernel_and_torch_path_equal_reference():
    for _ in range(60):
        args = random_case()[0]
        want = expand_row_plan_ref(*args)
        got = expand_row_plan(*args)
        assert got.dtype == torch.int64 and torch.equal(got, want)
        assert torch.equal(expand_row_plan_torch(*args), want)


def test_plan_expands_every_id_to_its_row():
    """Micro-batch k's lookup over the message's wire rows (each group's distinct ids in turn,
    its columns of the table's row) gives the output every id's full row, slot by slot, sample
    by sample, in bag order."""
    for _ in range(20):
        args, encoded, bag_ids, slot_table, groups, chunks_per_row = random_case()
        micro, group_chunks = args[8], args[9]
        wire = 3
        tables = [torch.randn(12, chunks_per_row * wire) for _ in range(len(bag_ids) + 3)]
        plan = expand_row_plan(*args)
        counts, bounds = encoded.counts.flatten().tolist(), encoded.bounds.tolist()
        sections = expand_sections(counts, bounds, micro, group_chunks)
        assert sections[-1].offsets.stop == plan.numel()
        num_micro, at = len(micro), 0
        for k, section in enumerate(sections):
            message = []
            for g, (t, first, chunks) in enumerate(groups):
                r = g * num_micro + k
                distinct = encoded.unique[sum(counts[:r]): sum(counts[:r + 1])]
                cols = slice(first * wire, (first + chunks) * wire)
                message.append(tables[t][distinct][:, cols].reshape(-1, wire))
            rows = torch.cat(message) if message else torch.zeros(0, wire)
            lookup = BagLookup([rows], plan[section.unique_values],
                               plan[section.unique_offsets], plan[section.index],
                               plan[section.offsets], None, [0], [SUM],
                               section.index.stop - section.index.start)
            got = pooled_forward(lookup).view(-1, chunks_per_row * wire)
            samples = range(at, at + micro[k])
            want = [tables[slot_table[s]][i] for s in range(len(slot_table))
                    for b in samples for i in bag_ids[s][b]]
            want = torch.stack(want) if want else torch.zeros(0, chunks_per_row * wire)
            assert torch.equal(got, want)
            at += micro[k]


def test_arguments_are_checked():
    # Two ids of one slot, one micro-batch of 2 samples, one row group of the whole row.
    slot, sample = torch.tensor([0, 0]), torch.tensor([0, 1])
    local = torch.tensor([5, 5])
    encoded = encode_row_ids(torch.tensor([0, 0]), slot, sample, local, None, [0], [1], [2])
    lengths = torch.tensor([[1, 1]])

    def call(**changes):
        args = dict(order=encoded.order, inverse=encoded.inverse, counts=encoded.counts,
                    bounds=encoded.bounds, slot=slot, sample=sample, input_lengths=lengths,
                    routes_per_slot=[1], micro=[2], group_chunks=[1], group_first_chunk=[0],
                    chunks_per_row=1)
        args.update(changes)
        return expand_row_plan(**args)

    assert call().tolist() == [0, 0, 1, 0, 0, 0, 1, 2]
    op = r"recxla::expand_row_plan: "
    with pytest.raises(ValueError, match=op + "the lengths give 3 routes"):
        call(input_lengths=torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match=op + "chunk 1 of output row 0 of micro-batch 0 is "
                                              "filled by no route"):
        call(chunks_per_row=2)
    with pytest.raises(ValueError, match=op + r"row group 0 fills chunks \[1, 2\), outside "
                                              r"\[0, 1\)"):
        call(group_first_chunk=[1])
    with pytest.raises(ValueError, match=op + r"sample\[1\] = 3 is outside micro-batch 0's "
                                              r"samples \[0, 2\)"):
        call(sample=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=op + r"inverse\[1\] = 4 is outside \[0, 1\)"):
        call(inverse=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=op + r"input_lengths must be a contiguous CPU tensor "
                                              r"\[slots, 2\]"):
        call(input_lengths=torch.tensor([[2]]))
    with pytest.raises(ValueError, match=op + "routes_per_slot must have one entry per input "
                                              r"slot \(1\), got 2"):
        call(routes_per_slot=[1, 1])
    with pytest.raises(ValueError, match=op + "bounds must run from 0 to 2"):
        call(bounds=torch.tensor([0, 1]))
    with pytest.raises(TypeError, match=op + "slot must be int64, got Int"):
        call(slot=slot.int())
    with pytest.raises(TypeError, match="recxla.expand_row_plan: order must be a torch.Tensor"):
        call(order=[0, 1])


def test_overlapping_routes_are_refused():
    """Two routes of one id that fill the same chunk (column shards that overlap)."""
    slot, sample = torch.tensor([0, 0]), torch.tensor([0, 0])
    encoded = encode_row_ids(torch.tensor([0, 1]), slot, sample, torch.tensor([3, 3]), None,
                             [0], [1, 1], [1])
    with pytest.raises(ValueError, match="recxla::expand_row_plan: chunk 0 of output row 0 of "
                                         "micro-batch 0 is filled twice"):
        expand_row_plan(encoded.order, encoded.inverse, encoded.counts, encoded.bounds, slot,
                        sample, torch.tensor([[1]]), [2], [1], [1, 1], [0, 0], 2)


def test_opcheck():
    args = random_case()[0]
    torch.library.opcheck(torch.ops.recxla.expand_row_plan.default, args)


@pytest.mark.gpu
def test_ids_on_a_gpu_take_the_torch_path_equal_to_the_reference():
    for _ in range(10):
        args = random_case()[0]
        want = expand_row_plan_ref(*args)
        got = expand_row_plan(*(a.cuda() if isinstance(a, torch.Tensor) else a for a in args))
        assert got.is_cuda and torch.equal(got.cpu(), want)
