"""Micro-batches of a training batch: how a batch is split, and how the outputs come back.

A batch is split into M micro-batches of consecutive samples after an optional reordering:
`split="contiguous"` keeps the loader's order; `split="clustered"` takes the order that
`recxla.cluster_samples` chooses (micro-batches whose samples share keys). Sizes differ by at
most one sample (contiguous) or as `cluster_samples` documents (clustered).

Batches are TorchRec's `torchrec.datasets.utils.Batch` (dense_features, sparse_features,
labels) or `recxla.data.Batch` (sparse, dense, labels); the split keeps the type.
"""

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

SPLITS = ("contiguous", "clustered")
OWNER = "recxla.pipeline.TrainPipeline"


def batch_parts(batch: Any):
    """(dense float [B, ...], sparse KeyedJaggedTensor, labels [B]) of a supported batch."""
    if hasattr(batch, "sparse_features"):
        return batch.dense_features, batch.sparse_features, batch.labels
    if hasattr(batch, "sparse") and hasattr(batch, "dense"):
        return batch.dense, batch.sparse, batch.labels
    raise TypeError(f"{OWNER}: batches must be torchrec.datasets.utils.Batch or recxla.data.Batch, "
                    f"got {type(batch).__name__}")


def _rebuild(batch: Any, dense, sparse, labels) -> Any:
    if hasattr(batch, "sparse_features"):
        return type(batch)(dense_features=dense, sparse_features=sparse, labels=labels)
    return type(batch)(sparse=sparse, dense=dense, labels=labels)


def even_sizes(batch_size: int, num_micro_batches: int) -> List[int]:
    """M sizes summing to batch_size, the first batch_size % M one larger."""
    base, extra = divmod(batch_size, num_micro_batches)
    return [base + (1 if k < extra else 0) for k in range(num_micro_batches)]


def slice_samples(kjt: KeyedJaggedTensor, start: int, stop: int) -> KeyedJaggedTensor:
    """Samples [start, stop) of every key (values, lengths and weights), vectorized."""
    keys = kjt.keys()
    batch = kjt.stride()
    lengths = kjt.lengths().view(len(keys), batch)
    offsets = kjt.offsets()
    rows = torch.arange(len(keys), device=offsets.device) * batch
    first, last = offsets[rows + start], offsets[rows + stop]
    counts = (last - first).to(torch.int64)
    total = int(counts.sum())
    shift = torch.repeat_interleave(first.to(torch.int64) - (torch.cumsum(counts, 0) - counts),
                                    counts, output_size=total)
    take = torch.arange(total, device=offsets.device) + shift
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(keys=keys, values=kjt.values()[take],
                             lengths=lengths[:, start:stop].flatten(),
                             weights=None if weights is None else weights[take],
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
        start = sum(self.sizes[:k])
        stop = start + self.sizes[k]
        dense, sparse, labels = batch_parts(self.batch)
        return _rebuild(self.batch, dense[start:stop], slice_samples(sparse, start, stop),
                        labels[start:stop])

    def merge(self, outputs: Sequence[Any]) -> Any:
        """The micro-batches' model outputs as one batch's: tensors of B_k samples are joined
        and put back in the input's sample order; scalars are averaged weighted by size."""
        return _merge(list(outputs), self.sizes, self.order)


def split_batch(batch: Any, num_micro_batches: int, split: str = "contiguous") -> MicroBatches:
    """Reorder `batch` (split="clustered": by recxla.cluster_samples) and cut it in
    num_micro_batches pieces. ValueError for an unknown split or M < 1."""
    if split not in SPLITS:
        raise ValueError(f"{OWNER}: split must be one of {SPLITS}, got {split!r}")
    dense, sparse, labels = batch_parts(batch)
    size = sparse.stride()
    if num_micro_batches == 1 or split == "contiguous" or size == 0:
        return MicroBatches(batch, None, even_sizes(size, num_micro_batches))
    from recxla.clustering import cluster_samples, permute_samples

    order, bounds = cluster_samples(sparse, num_micro_batches)
    bounds = [int(b) for b in bounds]
    sizes = [bounds[k + 1] - bounds[k] for k in range(num_micro_batches)]
    reordered = _rebuild(batch, dense[order], permute_samples(sparse, order), labels[order])
    return MicroBatches(reordered, order, sizes)


def _merge(outputs: List[Any], sizes: List[int], order: Optional[torch.Tensor]) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            total = sum(sizes)
            return sum(o.detach() * (n / total) for o, n in zip(outputs, sizes)) if total else \
                first.detach()
        joined = torch.cat([o.detach() for o in outputs])
        if order is not None and joined.shape[0] == order.numel():
            restored = torch.empty_like(joined)
            restored[order] = joined
            return restored
        return joined
    if isinstance(first, (tuple, list)):
        return type(first)(_merge([o[i] for o in outputs], sizes, order)
                           for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _merge([o[k] for o in outputs], sizes, order) for k in first}
    return first
