"""CompactBatch: exact round trips, and every corruption or truncation detected."""

import random
import struct

import pytest
import torch
from data_pipeline_cases import assert_batches_equal, random_batch

from recxla.data import Batch, CompactBatch, DataFormatError
from recxla.data.compact_batch import HEADER_BYTES


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("case", ["plain", "weighted", "dtypes", "empty", "no_dense"])
def test_round_trip_is_exact(compress, case):
    b = 0 if case == "empty" else random.randint(1, 300)
    kwargs = {
        "weighted": dict(weighted=True),
        "dtypes": dict(values_dtype=torch.int32, lengths_dtype=torch.int64,
                       dense_dtype=torch.bfloat16, request_ids=False),
        "no_dense": dict(num_dense=0),
    }.get(case, {})
    batch = random_batch(b, **kwargs)
    if case == "dtypes":
        batch.labels = batch.labels.double()
        batch.dense[0:1] = float("nan")  # NaN bits travel as they are
    data = CompactBatch.encode(batch, compress=compress)
    assert isinstance(data, bytes)
    assert_batches_equal(CompactBatch.decode(data), batch)
    assert_batches_equal(CompactBatch.decode(bytearray(data)), batch)
    assert_batches_equal(CompactBatch.decode(memoryview(data)), batch)


def test_non_contiguous_inputs():
    batch = random_batch(40, num_dense=6)
    batch.dense = batch.dense.t().contiguous().t()  # column-major view
    assert not batch.dense.is_contiguous()
    got = CompactBatch.decode(CompactBatch.encode(batch))
    assert torch.equal(got.dense, batch.dense) and got.dense.is_contiguous()


def test_decoded_tensors_are_writable_and_independent_of_the_buffer():
    batch = random_batch(50)
    data = bytearray(CompactBatch.encode(batch, compress=False))
    got = CompactBatch.decode(data)
    data[HEADER_BYTES:] = bytes(len(data) - HEADER_BYTES)
    assert_batches_equal(got, batch)
    got.dense.add_(1.0)  # owned memory: writing to it is allowed


def test_compression_shrinks_repetitive_batches():
    batch = random_batch(2000, id_range=5, max_len=20)
    assert len(CompactBatch.encode(batch, compress=True)) < 0.5 * len(
        CompactBatch.encode(batch, compress=False))


@pytest.mark.parametrize("compress", [False, True])
def test_every_bit_flip_is_detected(compress):
    data = CompactBatch.encode(random_batch(random.randint(1, 60), weighted=True), compress)
    positions = random.sample(range(len(data)), min(len(data), 200))
    for pos in positions:
        bad = bytearray(data)
        bad[pos] ^= 1 << random.randrange(8)
        with pytest.raises(DataFormatError, match="^compact batch: "):
            CompactBatch.decode(bytes(bad))


@pytest.mark.parametrize("compress", [False, True])
def test_truncation_and_trailing_bytes_are_detected(compress):
    data = CompactBatch.encode(random_batch(random.randint(1, 60)), compress)
    for size in random.sample(range(len(data)), min(len(data), 100)):
        with pytest.raises(DataFormatError, match="^compact batch: "):
            CompactBatch.decode(data[:size])
    with pytest.raises(DataFormatError, match="trailing bytes"):
        CompactBatch.decode(data + b"\0")


def test_foreign_and_malformed_buffers():
    with pytest.raises(DataFormatError, match="not a compact batch"):
        CompactBatch.decode(bytes(random.getrandbits(8) for _ in range(200)))
    with pytest.raises(DataFormatError, match="shorter than the 72-byte header"):
        CompactBatch.decode(b"RXCB")
    data = bytearray(CompactBatch.encode(random_batch(5)))
    struct.pack_into("<H", data, 4, 99)
    with pytest.raises(DataFormatError, match="version 99"):
        CompactBatch.decode(data)
    with pytest.raises(TypeError, match="bytes-like"):
        CompactBatch.decode(12)


def test_encode_rejects_what_it_cannot_carry():
    batch = random_batch(8)
    with pytest.raises(TypeError, match="expected a recxla.data.Batch"):
        CompactBatch.encode(batch.sparse)
    with pytest.raises(ValueError, match=r"labels must be \[B=8\]"):
        CompactBatch.encode(Batch(batch.sparse, batch.dense, batch.labels[:3]))
    with pytest.raises(ValueError, match="dense must have dtype"):
        CompactBatch.encode(Batch(batch.sparse, batch.dense.int(), batch.labels))
