"""Variable batch per feature (TorchRec's "VBE" KeyedJaggedTensors) for recxla's sharded module.

A VBE batch gives each feature its own number of bags (`stride_per_key_per_rank`, one
column: this rank) and, in `inverse_indices` = (keys, int [F, B]), which of its bags each of
the batch's B samples uses: often only the distinct bags of a feature are sent (a user
feature repeated over the candidates of one request). TorchRec's EmbeddingBagCollection pools
each feature's bags and returns, for every sample b, the pooled row of bag inverse[f][b]: a
KeyedTensor [B, sum of dims], as for a regular batch of B samples.

recxla expands such a batch into the regular batch of B samples that means the same
(`expand_variable_batch`) before its input dist: the same output, and the same gradients
(a bag used by several samples receives the sum of their gradients in both). Repeated bags
cost little on the wire, since the input dist sends each destination's unique ids once; the
pooled rows travel once per sample (B rows per feature, where TorchRec's table-wise output
dist sends each feature's distinct bags and expands them at the receiver).
"""

from typing import List

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recxla.torchrec.shard_layout import OWNER


def expand_variable_batch(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """features: a KeyedJaggedTensor; with variable batch per feature it must carry
    inverse_indices (keys, int [F, B]). -> the regular KeyedJaggedTensor of B samples whose bag
    (f, b) is features' bag inverse[f][b] of feature f (values, lengths and weights gathered);
    a regular batch is returned as it is. Raises ValueError on inconsistent VBE metadata."""
    if not isinstance(features, KeyedJaggedTensor) or not features.variable_stride_per_key():
        return features
    inverse = features.inverse_indices_or_none()
    if inverse is None:
        raise ValueError(f"{OWNER}: a KeyedJaggedTensor with variable batch per feature needs "
                         "inverse_indices (keys, [features, batch]) to say which bag each sample "
                         "uses, as TorchRec's EmbeddingBagCollection does")
    inverse_keys, inverse_index = inverse
    keys = features.keys()
    position = {k: i for i, k in enumerate(inverse_keys)}
    missing = [k for k in keys if k not in position]
    if missing:
        raise ValueError(f"{OWNER}: inverse_indices has no row for feature '{missing[0]}' "
                         f"(its keys: {list(inverse_keys)})")
    if inverse_index.dim() != 2 or inverse_index.shape[0] != len(inverse_keys):
        raise ValueError(f"{OWNER}: inverse_indices must be [{len(inverse_keys)} features, "
                         f"batch], got {list(inverse_index.shape)}")
    strides: List[int] = features.stride_per_key()
    lengths = features.lengths()
    if lengths.numel() != sum(strides):
        raise ValueError(f"{OWNER}: lengths has {lengths.numel()} entries, but the features' "
                         f"batch sizes {strides} sum to {sum(strides)}")
    batch = inverse_index.shape[1]
    device = lengths.device
    first_bag = torch.tensor([0] + strides[:-1], dtype=torch.int64, device=device).cumsum(0)
    rows = inverse_index.to(device=device, dtype=torch.int64)[
        torch.tensor([position[k] for k in keys], dtype=torch.int64, device=device)]
    limits = torch.tensor(strides, dtype=torch.int64, device=device).unsqueeze(1)
    bad = (rows < 0) | (rows >= limits)
    if bool(bad.any()):
        f, b = (int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(f"{OWNER}: inverse_indices of feature '{keys[f]}' gives sample {b} bag "
                         f"{int(rows[f, b])}, outside the feature's {strides[f]} bags")
    bags = (rows + first_bag.unsqueeze(1)).flatten()  # [F * B], the source bag of each
    new_lengths = lengths[bags]
    starts = torch.nn.functional.pad(torch.cumsum(lengths.to(torch.int64), 0), (1, 0))[bags]
    total = int(new_lengths.sum())
    new_starts = torch.cumsum(new_lengths.to(torch.int64), 0) - new_lengths
    take = torch.arange(total, device=device) + torch.repeat_interleave(
        starts - new_starts, new_lengths.to(torch.int64), output_size=total)
    weights = features.weights_or_none()
    return KeyedJaggedTensor(keys=keys, values=features.values()[take], lengths=new_lengths,
                             weights=None if weights is None else weights[take], stride=batch)
