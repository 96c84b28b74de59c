"""recxla::decode_id_blocks (recxla.ops.id_blocks): the C++ kernel against the plain-PyTorch
reference on fresh random blocks (sources, slots, micro-batches, empty bags, raw and both
deduplicated encodings, int32 and int64 ids, weights, row groups), and its errors on damaged
blocks, which name the op, the source and the limit."""

import random

import pytest
import torch

from recxla.ops.id_blocks import decode_id_blocks
from recxla.reference.id_blocks import decode_id_blocks_ref, encode_id_blocks_ref


def random_sources(world, num_slots, num_micro, row_groups, id_bytes, weighted):
    high = 2**31 - 1 if id_bytes == 4 else 2**40
    sources = []
    for _ in range(world):
        micro = [random.randint(0, 6) for _ in range(num_micro)]
        lengths = torch.randint(0, 4, (num_slots, sum(micro)))
        n = int(lengths.sum())
        # Few distinct ids, so that the deduplicated encodings have repeats to fold.
        pool = torch.randint(0, high, (max(1, n // 3 + 1),))
        ids = pool[torch.randint(0, pool.numel(), (n,))]
        counts = torch.randint(0, 4, (row_groups, num_micro))
        sources.append({"lengths": lengths, "ids": ids, "micro": micro,
                        "weights": torch.rand(n), "encoding": random.randint(0, 2),
                        "row_counts": counts,
                        "row_ids": torch.randint(0, high, (int(counts.sum()),))})
    return sources


@pytest.mark.parametrize("id_bytes", [4, 8])
@pytest.mark.parametrize("weighted", [False, True])
def test_equals_reference(id_bytes, weighted):
    for _ in range(30):
        world, num_slots = random.randint(1, 4), random.randint(0, 5)
        num_micro, row_groups = random.randint(1, 3), random.randint(0, 3)
        sources = random_sources(world, num_slots, num_micro, row_groups, id_bytes, weighted)
        args = (*encode_id_blocks_ref(sources, num_slots, num_micro, row_groups, id_bytes,
                                      weighted), num_slots, num_micro, row_groups, id_bytes,
                weighted)
        got, want = decode_id_blocks(*args), decode_id_blocks_ref(*args)
        for name, g, w in zip(got._fields, got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), (name, g, w)


def test_a_sixteen_bit_index_is_unsigned():
    ids = torch.arange(40000, dtype=torch.int64)  # unique ids past 32,767
    lengths = torch.ones(1, 40000, dtype=torch.int64)
    sources = [{"lengths": lengths, "ids": ids.flip(0), "micro": [40000], "encoding": 1}]
    received, blocks = encode_id_blocks_ref(sources, 1, 1, 0, 4, False)
    assert torch.equal(decode_id_blocks(received, blocks, 1, 1, 0, 4, False).values, ids.flip(0))


def damaged():
    """(what is damaged, received, blocks, message): one source, 2 slots, 3 samples."""
    lengths = torch.tensor([[1, 0, 2], [1, 1, 0]])
    sources = [{"lengths": lengths, "ids": torch.tensor([5, 6, 7, 8, 9]), "micro": [3],
                "encoding": 2, "row_counts": torch.tensor([[2]]),
                "row_ids": torch.tensor([3, 4])}]
    received, blocks = encode_id_blocks_ref(sources, 2, 1, 1, 8, False)
    cases = []

    def case(what, change, message):
        r, b = received.clone(), list(blocks)
        change(r, b)
        cases.append((what, r, b, message))

    case("a negative length",
         lambda r, b: r[b[5]: b[5] + 4].view(torch.int32).fill_(-1),
         r"source 0's bag \(slot 0, sample 0\) has a negative length \(-1\)")
    case("lengths past the ids", lambda r, b: b.__setitem__(1, 4),
         r"source 0's lengths sum to 5, but its block holds 4 ids")
    case("an index past the unique ids",
         lambda r, b: r[b[7]: b[7] + 4].view(torch.int32).fill_(9),
         r"source 0's inverse index \[0\] = 9 is outside its 5 unique ids")
    case("a section past the buffer", lambda r, b: b.__setitem__(10, r.numel()),
         r"source 0's row ids section \(2 x 8 bytes at byte \d+\) ends past the received")
    case("a misaligned section", lambda r, b: b.__setitem__(6, 4),
         r"source 0's ids section at byte 4 is not aligned to 8 bytes")
    case("an unknown encoding", lambda r, b: b.__setitem__(3, 3),
         r"source 0's encoding must be 0, 1 or 2, got 3")
    case("row counts past the row ids", lambda r, b: b.__setitem__(4, 1),
         r"source 0's row counts sum to 2, but its block holds 1 row ids")
    case("micro-batches other than the batch", lambda r, b: b.__setitem__(11, 2),
         r"source 0's micro-batch sizes sum to 2, not its batch 3")
    return cases


@pytest.mark.parametrize("case", range(len(damaged())))
def test_damaged_blocks_are_refused_by_name(case):
    what, received, blocks, message = damaged()[case]
    with pytest.raises(ValueError, match="recxla::decode_id_blocks: " + message):
        decode_id_blocks(received, blocks, 2, 1, 1, 8, False)


def test_arguments_are_checked():
    received, blocks = encode_id_blocks_ref([], 1, 1, 0, 4, False)
    with pytest.raises(ValueError, match="id_bytes must be 4 or 8, got 2"):
        decode_id_blocks(received, blocks, 1, 1, 0, 2, False)
    with pytest.raises(ValueError, match="blocks must hold 12 ints per source, got 5"):
        decode_id_blocks(received, [0] * 5, 1, 1, 0, 4, False)
    with pytest.raises(TypeError, match="received must be uint8"):
        decode_id_blocks(received.float(), blocks, 1, 1, 0, 4, False)


def test_opcheck():
    sources = random_sources(2, 3, 2, 1, 8, True)
    received, blocks = encode_id_blocks_ref(sources, 3, 2, 1, 8, True)
    torch.library.opcheck(torch.ops.recxla.decode_id_blocks.default,
                          (received, blocks, 3, 2, 1, 8, True))


def random_send(world, id_bytes, weighted):
    """A sender's inputs for `world` destinations (recxla.ops.pack_id_blocks): its blocks laid
    out back to back (8-byte aligned sections), each destination's ids in one or two
    local-table segments with their unique values and inverse index."""
    from recxla.ops.id_blocks import PackedBlock

    high = 2**31 - 1 if id_bytes == 4 else 2**40
    batch = random.randint(0, 5)
    slots = [random.randint(0, 3) for _ in range(world)]
    slot_lengths = torch.randint(0, 4, (sum(slots) * batch,), dtype=torch.int32)
    ids, unique, inverse, row_ids, row_counts, blocks = [], [], [], [], [], []
    at, n_all, u_all, slot_first, runs_all, rows_all = 0, 0, 0, 0, 0, 0

    def aligned(n):
        return (n + 7) // 8 * 8

    for d in range(world):
        count = int(slot_lengths[slot_first * batch: (slot_first + slots[d]) * batch].sum())
        pool = torch.randint(0, high, (max(1, count // 2),))
        part = pool[torch.randint(0, pool.numel(), (count,))]
        values, index = torch.unique(part, return_inverse=True)
        encoding = random.randint(0, 2) if count else 0
        runs = random.randint(0, 3)
        counts = [random.randint(0, 3) for _ in range(runs)]
        rows = torch.randint(0, high, (sum(counts),))
        width = 2 if encoding == 1 else 4
        sizes = [aligned(slots[d] * batch * 4),
                 aligned((count if encoding == 0 else values.numel()) * id_bytes),
                 aligned(count * width if encoding else 0), aligned(count * 4 if weighted else 0),
                 aligned(runs * 4), aligned(sum(counts) * id_bytes)]
        sections = tuple(at + sum(sizes[:k]) for k in range(6))
        blocks.append(PackedBlock(slot_first * batch, slots[d] * batch, n_all, n_all + count,
                                  u_all, u_all + values.numel(), encoding, id_bytes, runs_all,
                                  runs_all + runs, rows_all, rows_all + sum(counts), sections))
        ids.append(part)
        unique.append(values)
        inverse.append(index + u_all)
        row_ids.append(rows)
        row_counts += counts
        at += sum(sizes)
        n_all, u_all, slot_first = n_all + count, u_all + values.numel(), slot_first + slots[d]
        runs_all, rows_all = runs_all + runs, rows_all + sum(counts)
    long = dict(dtype=torch.int64)

    def cat(parts):
        return torch.cat(parts).to(torch.int64) if parts else torch.zeros(0, **long)

    weights = torch.rand(n_all) if weighted else None
    return (slot_lengths, cat(ids), cat(unique), cat(inverse), weights, cat(row_ids),
            row_counts, blocks, at), batch, slots


@pytest.mark.parametrize("id_bytes", [4, 8])
@pytest.mark.parametrize("weighted", [False, True])
def test_pack_equals_reference_and_decodes_back(id_bytes, weighted):
    from recxla.ops.id_blocks import pack_id_blocks
    from recxla.reference.id_blocks import pack_id_blocks_ref

    for _ in range(30):
        args, batch, slots = random_send(random.randint(1, 4), id_bytes, weighted)
        got = pack_id_blocks(*args)
        assert torch.equal(got, pack_id_blocks_ref(*args))
        # Each destination decodes its own block back to the ids it was sent.
        _, ids, _, _, weights, row_ids, row_counts, blocks, _ = args
        for b, s in zip(blocks, slots):
            counts = list(row_counts[b.runs0: b.runs1])
            fields = [batch, b.id1 - b.id0, b.u1 - b.u0, b.encoding, b.r1 - b.r0,
                      *b.sections, batch]
            decoded = decode_id_blocks(got, fields, s, 1, len(counts), id_bytes, weighted)
            assert torch.equal(decoded.values, ids[b.id0: b.id1])
            assert torch.equal(decoded.row_ids, row_ids[b.r0: b.r1])
            assert decoded.row_counts.flatten().tolist() == counts
            if weighted:
                assert torch.equal(decoded.weights, weights[b.id0: b.id1])


def test_pack_refuses_what_does_not_fit():
    from recxla.ops.id_blocks import PackedBlock, pack_id_blocks

    args, _, _ = random_send(2, 4, False)
    slot_lengths, ids, unique, inverse, weights, row_ids, row_counts, blocks, total = args
    first = blocks[0]
    with pytest.raises(ValueError, match=r"destination 0's ids \[0, 10\) is outside"):
        pack_id_blocks(slot_lengths, ids[:0], unique, inverse[:0], weights, row_ids,
                       row_counts, [first._replace(id0=0, id1=10, encoding=0)], total)
    with pytest.raises(ValueError, match=r"id \[0\] = 8589934592 does not fit its 4 wire"):
        pack_id_blocks(torch.zeros(1, dtype=torch.int32), torch.tensor([2**33]),
                       torch.tensor([2**33]), torch.tensor([0]), None,
                       torch.zeros(0, dtype=torch.int64), [],
                       [first._replace(lengths_first=0, lengths_count=1, id0=0, id1=1, u0=0,
                                       u1=1, encoding=0, runs0=0, runs1=0, r0=0, r1=0,
                                       sections=(0, 8, 16, 16, 16, 16))], 16)
    empty = torch.zeros(0, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"destination 0's lengths section \(2 x 4 bytes at "
                                         r"byte 0\) is misaligned or ends past the 4 bytes"):
        pack_id_blocks(torch.ones(2, dtype=torch.int32), empty, empty, empty, None, empty, [],
                       [PackedBlock(0, 2, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0, (0, 8, 8, 8, 8, 8))], 4)
