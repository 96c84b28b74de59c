"""The pooled module's output: TorchRec's KeyedTensor, whose `to_dict()` hands its pieces'
gradient back without a copy.

TorchRec's `KeyedTensor.to_dict()` splits the values by key (`values.split(lengths, dim)`), and
the split's backward concatenates the pieces' gradients into a new tensor of the values' shape:
one more pass over the whole output a step (DLRM's [B, 26 x 64] float32: 6.8 MB, about 1.4 ms
of a 2-core rank's CPU; a kernel launch on a GPU). A model that splits the output this way
usually puts the pieces back together itself (DLRM's SparseArch concatenates them in order and
its interaction concatenates that with the dense features), so their gradients arrive as
adjacent views of one tensor: as the model's own gradient memory, they already are the values'
gradient. `KeyedOutput.to_dict()` splits the same way (the same views, keys and order), and its
backward hands that memory back as one view when the pieces lie side by side in it; otherwise
(a piece without a gradient, pieces apart) it concatenates them as TorchRec's does. Either way
the gradient holds the same values; only its strides can differ, and recxla's output dist reads
its gradient with any strides.

The sequence module's output splits its values [ids, dim] by feature into JaggedTensors the same
way (`split_by_key`): there the pieces' gradients come from the model's separate uses of each
feature, so with several features they are concatenated as before, but a single feature's
gradient (a split into one piece, which torch's split copies all the same) is handed back as
it is: a module of one sequence feature (a user history, [B x its length, dim]) no longer
copies its rows' gradient a step. (The trainer's history model has two sequence features,
whose gradients come apart, and keeps its cat.)
"""

from itertools import accumulate
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import register_pytree_node
from torchrec.sparse.jagged_tensor import KeyedTensor

__all__ = ["KeyedOutput", "side_by_side", "split_by_key"]


def side_by_side(pieces: Sequence[Optional[torch.Tensor]], dim: int,
                 shape: torch.Size) -> Optional[torch.Tensor]:
    """The tensor of `shape` whose split along `dim` gives `pieces` (in order), as a view of
    their memory when they lie side by side in one storage with the same strides (each piece
    starting where the one before it ends along `dim`); None otherwise. Empty pieces take no
    memory and are passed over."""
    if any(p is None for p in pieces):
        return None
    starts = accumulate((p.shape[dim] for p in pieces), initial=0)
    placed = [(at, p) for at, p in zip(starts, pieces) if p.numel() > 0]
    if not placed:
        return None
    at, first = placed[0]
    strides, storage = first.stride(), first.untyped_storage().data_ptr()
    start = first.storage_offset() - at * strides[dim]
    for at, p in placed:
        if (p.stride() != strides or p.storage_offset() != start + at * strides[dim] or
                p.untyped_storage().data_ptr() != storage or p.dtype != first.dtype or
                p.device != first.device):
            return None
    return first.as_strided(shape, strides, start) if start >= 0 else None


class _SplitByKey(torch.autograd.Function):
    """values.split(lengths, dim), whose backward joins the pieces' gradients without a copy
    where `side_by_side` can, and by a cat otherwise."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, lengths: List[int], dim: int):
        ctx.dim, ctx.shape = dim, values.shape
        return values.split(lengths, dim=dim)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        joined = side_by_side(grads, ctx.dim, ctx.shape)
        if joined is None:
            joined = torch.cat(grads, dim=ctx.dim)
        return joined, None, None


def split_by_key(values: torch.Tensor, lengths: Sequence[int],
                 dim: int) -> Tuple[torch.Tensor, ...]:
    """values.split(lengths, dim): the same views, and where autograd records it, a backward
    that hands the pieces' gradients back as one view when they lie side by side (a single
    piece always does), with no copy (module docstring)."""
    if not (torch.is_grad_enabled() and values.requires_grad):
        return values.split(list(lengths), dim=dim)
    return _SplitByKey.apply(values, list(lengths), dim)


class KeyedOutput(KeyedTensor):
    """A KeyedTensor (TorchRec's, with its keys, lengths and values) whose to_dict() pieces
    hand their gradient back without a copy where they can (module docstring)."""

    def to_dict(self) -> Dict[str, torch.Tensor]:
        pieces = split_by_key(self._values, self._length_per_key, self._key_dim)
        return {key: pieces[index] for key, index in self._key_indices().items()}


# torch's pytree (torch.export, the FX tracing of TorchRec's pipelines) sees it as the
# KeyedTensor it is.
register_pytree_node(
    KeyedOutput,
    lambda kt: ([kt._values], (kt._keys, kt._length_per_key)),
    lambda values, context: KeyedTensor(context[0], context[1], values[0]),
    serialized_type_name="recxla.KeyedOutput",
)
