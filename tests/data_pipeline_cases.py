"""Shared cases of the data pipeline tests: random batches, an exact comparison, and a row-wise
Python oracle for reading rows back in other batch sizes."""

from typing import List, Optional, Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recxla.data import Batch, write_parquet

FEATURES = ("user", "item.id", "history", "tags")


def random_batch(
    batch_size: int,
    features: Sequence[str] = FEATURES,
    num_dense: int = 3,
    max_len: int = 6,
    weighted: bool = False,
    request_ids: bool = True,
    values_dtype=torch.int64,
    lengths_dtype=torch.int32,
    dense_dtype=torch.float32,
    id_range: int = 1000,
) -> Batch:
    """A Batch of fresh random data: bag lengths in [0, max_len] (empty bags included), ids in
    [0, id_range) with repeats, dense normal, labels 0/1, request ids in a small range."""
    lengths = torch.randint(0, max_len + 1, (len(features) * batch_size,))
    n = int(lengths.sum())
    kjt = KeyedJaggedTensor(
        keys=list(features),
        values=torch.randint(0, id_range, (n,)).to(values_dtype),
        lengths=lengths.to(lengths_dtype),
        weights=torch.rand(n) if weighted else None,
        stride=batch_size,
    )
    dense = torch.randn(batch_size, num_dense).to(dense_dtype)
    labels = torch.randint(0, 2, (batch_size,)).float()
    rid = torch.randint(0, max(batch_size // 4, 1), (batch_size,)) if request_ids else None
    return Batch(kjt, dense, labels, rid)


def random_batches(count: int, batch_size: int, **kwargs) -> List[Batch]:
    return [random_batch(batch_size, **kwargs) for _ in range(count)]


def write(batches, path, **kwargs) -> str:
    return write_parquet(batches, str(path), **kwargs)


def assert_batches_equal(got: Batch, want: Batch) -> None:
    """Exact equality: keys, stride, dtypes and the bits of every element (NaNs included)."""
    g, w = got.sparse, want.sparse
    assert g.keys() == w.keys()
    assert g.stride() == w.stride()
    pairs = [(g.values(), w.values()), (g.lengths(), w.lengths()), (got.dense, want.dense),
             (got.labels, want.labels)]
    if w.weights_or_none() is not None or g.weights_or_none() is not None:
        pairs.append((g.weights(), w.weights()))
    if want.request_ids is not None or got.request_ids is not None:
        pairs.append((got.request_ids, want.request_ids))
    for a, b in pairs:
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def to_rows(batch: Batch) -> list:
    """Row-wise Python form of a batch: per sample, (bags per feature, weights, dense, label,
    request id), with plain lists and floats."""
    kjt = batch.sparse
    bags = {k: [t.tolist() for t in jt.to_dense()] for k, jt in kjt.to_dict().items()}
    weights = None
    if kjt.weights_or_none() is not None:
        weights = {k: [t.tolist() for t in jt.to_dense_weights()] for k, jt in
                   kjt.to_dict().items()}
    rows = []
    for i in range(kjt.stride()):
        rows.append((
            [bags[k][i] for k in kjt.keys()],
            None if weights is None else [weights[k][i] for k in kjt.keys()],
            batch.dense[i].tolist(),
            batch.labels[i].item(),
            None if batch.request_ids is None else batch.request_ids[i].item(),
        ))  # fmt: skip
    return rows


def from_rows(rows: list, like: Batch) -> Batch:
    """A Batch of `rows` (from to_rows) with the keys and dtypes of `like`."""
    kjt = like.sparse
    keys = kjt.keys()
    lengths, values, weights = [], [], []
    for f in range(len(keys)):
        for bags, wts, *_ in rows:
            lengths.append(len(bags[f]))
            values.extend(bags[f])
            if wts is not None:
                weights.extend(wts[f])
    w: Optional[torch.Tensor] = None
    if kjt.weights_or_none() is not None:
        w = torch.tensor(weights, dtype=kjt.weights().dtype)
    sparse = KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor(values, dtype=kjt.values().dtype),
        lengths=torch.tensor(lengths, dtype=kjt.lengths().dtype),
        weights=w,
        stride=len(rows),
    )
    dense = torch.tensor([r[2] for r in rows], dtype=like.dense.dtype).reshape(
        len(rows), like.dense.shape[1])
    labels = torch.tensor([r[3] for r in rows], dtype=like.labels.dtype)
    rid = None if like.request_ids is None else torch.tensor([r[4] for r in rows])
    return Batch(sparse, dense, labels, rid)
