"""Micro-batches of a batch (recxla/pipeline/micro_batches.py) against a per-sample reference:
the cut of a KeyedJaggedTensor by sample, the split (contiguous and clustered) and the merge of
the micro-batches' outputs back into the batch's sample order."""

from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recxla.pipeline.micro_batches import slice_samples, split_batch

KEYS = ["a", "b", "empty", "c"]


def random_kjt(batch: int, weighted: bool, dtype=torch.int64) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 5, (len(KEYS), batch), dtype=dtype)
    lengths[KEYS.index("empty")] = 0  # a key without any id in the batch
    n = int(lengths.sum())
    return KeyedJaggedTensor(keys=KEYS, values=torch.randint(0, 1000, (n,), dtype=dtype),
                             lengths=lengths.flatten(),
                             weights=torch.rand(n) if weighted else None, stride=batch)


def samples(kjt: KeyedJaggedTensor) -> List[dict]:
    """The per-sample reference: for each sample, {key: (ids, weights)}."""
    out = [{} for _ in range(kjt.stride())]
    for key, jt in kjt.to_dict().items():
        for i, (a, b) in enumerate(zip(jt.offsets()[:-1].tolist(), jt.offsets()[1:].tolist())):
            w = jt.weights_or_none()
            out[i][key] = (jt.values()[a:b].tolist(), None if w is None else w[a:b].tolist())
    return out


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_slice_samples_is_the_samples_in_range(weighted, dtype):
    batch = int(torch.randint(1, 40, ()))
    kjt = random_kjt(batch, weighted, dtype)
    whole = samples(kjt)
    bounds = sorted(torch.randint(0, batch + 1, (2,)).tolist())
    for start, stop in [bounds, (0, batch), (0, 0), (batch, batch), (batch - 1, batch)]:
        cut = slice_samples(kjt, start, stop)
        assert cut.keys() == KEYS and cut.stride() == stop - start
        assert cut.values().dtype == kjt.values().dtype
        assert cut.lengths().dtype == kjt.lengths().dtype
        assert (cut.weights_or_none() is None) == (not weighted)
        assert samples(cut) == whole[start:stop], (start, stop)


def test_slice_samples_of_no_key():
    kjt = KeyedJaggedTensor(keys=[], values=torch.empty(0, dtype=torch.int64),
                            lengths=torch.empty(0, dtype=torch.int64), stride=6)
    cut = slice_samples(kjt, 2, 5)
    assert cut.keys() == [] and cut.stride() == 3 and cut.values().numel() == 0


@dataclass
class Batch:
    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    label: torch.Tensor
    note: Optional[str] = None


def _sample_output(batch: Batch) -> torch.Tensor:
    """A per-sample model output: each sample's dense row plus the sum of its ids and weights."""
    rows = [sum(sum(ids) + sum(w or []) for ids, w in s.values()) for s in samples(batch.sparse)]
    return batch.dense.sum(1) + torch.tensor(rows, dtype=torch.float64)


@pytest.mark.parametrize("split", ["contiguous", "clustered"])
@pytest.mark.parametrize("num_micro_batches", [1, 2, 3])
def test_split_then_merge_is_the_batch(split, num_micro_batches):
    size = int(torch.randint(num_micro_batches, 30, ()))
    batch = Batch(torch.randn(size, 3, dtype=torch.float64), random_kjt(size, weighted=True),
                  torch.rand(size), note="kept")
    parts = split_batch(batch, num_micro_batches, split)
    assert len(parts.sizes) == num_micro_batches and parts.batch_size == size
    order = parts.order if parts.order is not None else torch.arange(size)
    assert sorted(order.tolist()) == list(range(size))
    pieces = [parts.micro_batch(k) for k in range(num_micro_batches)]
    # Each micro-batch holds its samples of the reordered batch, in every field.
    reference, start = samples(batch.sparse), 0
    for piece, n in zip(pieces, parts.sizes):
        taken = order[start : start + n]
        assert piece.note == "kept"
        assert torch.equal(piece.dense, batch.dense[taken])
        assert torch.equal(piece.label, batch.label[taken])
        assert samples(piece.sparse) == [reference[i] for i in taken.tolist()]
        start += n
    # The merge puts per-sample outputs back in the input's order, and averages scalars by size.
    merged = parts.merge([(_sample_output(p), p.label.sum() / max(n, 1))
                          for p, n in zip(pieces, parts.sizes)])
    torch.testing.assert_close(merged[0], _sample_output(batch), rtol=0, atol=1e-9)
    torch.testing.assert_close(merged[1], batch.label.sum() / size)


def test_unknown_split_is_refused():
    batch = Batch(torch.zeros(4, 1), random_kjt(4, False), torch.zeros(4))
    with pytest.raises(ValueError, match="split must be one of"):
        split_batch(batch, 2, "random")
