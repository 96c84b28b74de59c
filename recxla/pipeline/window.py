"""The frozen window of one sharded module over one batch.

Inside a batch the tables do not change: the owner looks up every micro-batch's bags once, at
the start (L), with the weights the sequential step would read. Each micro-batch k then only
moves rows: its pooled rows go to their ranks (O(k)), its model runs on them, and their
gradient comes back (G(k)) into the owner's gradient buffer, at the rows the lookup produced.
At the end the buffer holds exactly the gradient the whole batch's backward would give the
lookup, and the lookup's own backward applies the fused optimizer once (U). Only the order of
the float additions differs from the sequential step.

On CPU the all-to-alls progress in gloo's threads while the caller computes; on GPU they run
on NCCL's stream, and waits order the streams without blocking the host. The same code serves
both.
"""

from typing import List, Optional

import torch
from torchrec.distributed.embedding_types import KJTList
from torchrec.sparse.jagged_tensor import KeyedTensor

from recxla.torchrec.input_dist import LookupInput


class FrozenWindow:
    """One sharded module's state for one batch.

    Args:
        module: a recxla ShardedEmbeddingBagCollection.
        lookup_input: the batch's LookupInput (micro-batches in order at the owner).
        bag_lengths: float32 [B_local, ranges] lengths of this rank's row-sharded MEAN bags in
            micro-batch order (None when the module has none).
        lookup_output: the lookup's output when it was already done (an early DBP lookup,
            corrected), else None: the window looks up now.
    """

    def __init__(self, module, lookup_input: LookupInput, bag_lengths: Optional[torch.Tensor],
                 lookup_output: Optional[torch.Tensor] = None):
        self.module = module
        self.input = lookup_input
        self.bag_lengths = bag_lengths
        self.my_rows = list(lookup_input.micro_batch_sizes[module.layout.rank])
        self.num_micro = len(self.my_rows)
        # L: one lookup for every micro-batch, its autograd node kept for the update.
        ctx = module.create_context()
        self.output = lookup_output if lookup_output is not None else \
            module.compute(ctx, KJTList([lookup_input]))
        self.pooled = self.output.detach()
        self.out_dim = self.pooled.shape[1]
        self.gradient = self.pooled.new_empty(self.pooled.shape) \
            if self.output.requires_grad else None
        self._sent = [None] * self.num_micro
        self._returning = [None] * self.num_micro

    def _my_range(self, k: int):
        start = sum(self.my_rows[:k])
        return start, start + self.my_rows[k]

    def _lengths(self, k: int) -> Optional[torch.Tensor]:
        if self.bag_lengths is None:
            return None
        start, stop = self._my_range(k)
        return self.bag_lengths[start:stop]

    def start_output(self, k: int) -> None:
        """O(k): micro-batch k's pooled rows to the ranks whose samples they are."""
        if self._sent[k] is not None:
            return
        start = self.input.micro_batch_start(k)
        rows = self.input.micro_batch_rows(k)
        pooled = self.pooled[start: start + sum(rows)]
        self._sent[k] = self.module._output.start(pooled, rows, self.my_rows[k])

    def receive_output(self, k: int) -> KeyedTensor:
        """Waits for O(k); -> this rank's micro-batch k embeddings, a leaf that requires grad
        (its gradient is what G(k) sends back)."""
        self.start_output(k)
        handle, _, _ = self._sent[k]
        values = self.module._output.assemble(handle.wait(), self.my_rows[k], self._lengths(k))
        self._sent[k] = None
        values.requires_grad_(self.gradient is not None)
        return KeyedTensor(keys=self.module._embedding_names,
                           length_per_key=self.module._embedding_dims, values=values)

    def start_gradient(self, k: int, grad: torch.Tensor) -> None:
        """G(k): the gradient of micro-batch k's embeddings back to their owners."""
        self._returning[k] = self.module._output.start_gradient(
            grad, self.input.micro_batch_rows(k), self.my_rows[k], self._lengths(k))

    def receive_gradient(self, k: int) -> None:
        """Waits for G(k) and puts its rows into the gradient buffer (A(k))."""
        handle = self._returning[k]
        if handle is None:
            return
        rows = handle.wait()
        self._returning[k] = None
        if self.out_dim:
            start = self.input.micro_batch_start(k)
            count = sum(self.input.micro_batch_rows(k))
            self.gradient[start: start + count].copy_(rows.view(count, self.out_dim))

    def pending_gradients(self) -> List[int]:
        return [k for k, h in enumerate(self._returning) if h is not None]

    def update(self) -> None:
        """U: the lookup's backward on the whole batch's gradient: the fused optimizer updates
        every touched row once (tables without one get their ordinary gradient)."""
        self.module.fused_optimizer.count_step()
        if self.gradient is not None and self.output.requires_grad:
            torch.autograd.backward(self.output, self.gradient)
        self.output = None
