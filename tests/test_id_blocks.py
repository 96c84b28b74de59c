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
