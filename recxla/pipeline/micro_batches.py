"""Micro-batches of a training batch: how a batch is split, and how the outputs come back.

A batch is split into M micro-batches of consecutive samples after an optional reordering:
`split="contiguous"` keeps the loader's order; `split="clustered"` takes the order that
`recxla.cluster_samples` chooses (micro-batches whose samples share keys). Sizes differ by at
most one sample (contiguous) or as `cluster_samples` documents (clustered).

Batches are any type TorchRec's pipelines move (see batch_fields.py): every KeyedJaggedTensor
field is cut by sample and every tensor field whose dim 0 is the batch by row; the split keeps
the type. A batch with fewer samples than micro-batches gives empty micro-batches (the
collectives of every micro-batch still run on every rank).
"""

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recxla.ops.cluster import cluster_samples, even_sizes, permute_samples
from recxla.pipeline.batch_fields import OWNER, batch_size, map_samples, sparse_fields
from recxla.pipeline.choices import SPLITS


def slice_samples(kjt: KeyedJaggedTensor, start: int, stop: int) -> KeyedJaggedTensor:
    """Samples [start, stop) of every key (values, lengths and weights).

    A key's samples [start, stop) are one contiguous range of its values, so the cut copies K
    ranges: one read of the 2K range ends to the host, then one cat per tensor. (A gather of
    per-value indices built on the device is 1.2-3.5x slower on CPU:
    bench/bench_micro_batches.py.)"""
    keys = kjt.keys()
    batch = kjt.stride()
    lengths = kjt.lengths().view(len(keys), batch)
    rows = torch.arange(len(keys), device=lengths.device) * batch
    ends = kjt.offsets().index_select(0, torch.cat([rows + start, rows + stop])).tolist()
    ranges = list(zip(ends[: len(keys)], ends[len(keys) :]))

    def cut(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[a:b] for a, b in ranges]) if ranges else t[:0]

    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(keys=keys, values=cut(kjt.values()),
                             lengths=lengths[:, start:stop].flatten(),
                             weights=None if weights is None else cut(weights),
                             stride=stop - start)


@dataclass
class MicroBatches:
    """A batch reordered for its micro-batches: `batch` (same type as the input, samples in
    micro-batch order), `order` ([B] int64: sample i of `batch` is sample order[i] of the
    input; None: unchanged), `sizes` (M ints)."""

    batch: Any
    order: Optional[torch.Tensor]
    sizes: List[int]

    @property
    def batch_size(self) -> int:
        return sum(self.sizes)

    def micro_batch(self, k: int) -> Any:
        if len(self.sizes) == 1:
            return self.batch  # the whole batch: cutting it would copy every id and weight
        start = sum(self.sizes[:k])
        stop = start + self.sizes[k]
        return map_samples(self.batch, self.batch_size,
                           lambda kjt: slice_samples(kjt, start, stop),
                           lambda rows: rows[start:stop])

    def merge(self, outputs: Sequence[Any]) -> Any:
        """The micro-batches' model outputs as one batch's: tensors of B_k samples are joined
        and put back in the input's sample order; scalars are averaged weighted by size."""
        return _merge(list(outputs), self.sizes, self.order)


def split_batch(batch: Any, num_micro_batches: int, split: str = "contiguous") -> MicroBatches:
    """Reorder `batch` (split="clustered": by recxla.cluster_samples of its first
    KeyedJaggedTensor field) and cut it in num_micro_batches pieces. A batch with fewer samples
    than pieces is cut contiguously (some pieces empty). ValueError for an unknown split."""
    if split not in SPLITS:
        raise ValueError(f"{OWNER}: split must be one of {SPLITS}, got {split!r}")
    size = batch_size(batch)
    if num_micro_batches == 1 or split == "contiguous" or size < num_micro_batches:
        return MicroBatches(batch, None, even_sizes(size, num_micro_batches))
    order, bounds = cluster_samples(next(iter(sparse_fields(batch).values())), num_micro_batches)
    bounds = [int(b) for b in bounds]
    sizes = [bounds[k + 1] - bounds[k] for k in range(num_micro_batches)]
    reordered = map_samples(batch, size, lambda kjt: permute_samples(kjt, order),
                            lambda rows: rows.index_select(0, order))
    return MicroBatches(reordered, order, sizes)


def _merge(outputs: List[Any], sizes: List[int], order: Optional[torch.Tensor]) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if len(outputs) == 1:  # one micro-batch: its output is the batch's (x 1.0, no cat)
            return first.detach()
        if first.dim() == 0:
            # Empty micro-batches are left out: their mean over no sample is NaN.
            total = sum(sizes)
            return sum(o.detach() * (n / total) for o, n in zip(outputs, sizes) if n) \
                if total else first.detach()
        joined = torch.cat([o.detach() for o in outputs])
        if order is not None and joined.shape[0] == order.numel():
            return torch.empty_like(joined).index_copy_(0, order, joined)
        return joined
    if isinstance(first, (tuple, list)):
        return type(first)(_merge([o[i] for o in outputs], sizes, order)
                           for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _merge([o[k] for o in outputs], sizes, order) for k in first}
    return first
