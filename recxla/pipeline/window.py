"""The frozen window of one sharded module over one batch.

Inside a batch the tables do not change: the owner looks up every micro-batch's bags once, at
the start (L), with the weights the sequential step would read, and gathers every rank's
requested rows of its row-exchange tables. Each micro-batch k then only moves data: its pooled
rows and requested rows go to their ranks (O(k)), its model runs on them, and their gradient
comes back (G(k)) into the owner's gradient buffers, at the rows the lookup produced. At the
end the buffers hold exactly the gradient the whole batch's backward would give the lookup,
and the lookup's own backward applies the fused optimizer once per row (U). Only the order of
the float additions differs from the sequential step.

On CPU the all-to-alls progress in gloo's threads while the caller computes; on GPU they run
on NCCL's stream, and waits order the streams without blocking the host. The same code serves
both.
"""

from typing import List, Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedTensor

from recxla.ops.embedding_bag import MEAN
from recxla.torchrec.input_dist import LookupInput
from recxla.torchrec.row_exchange import RowBags


class FrozenWindow:
    """One sharded module's state for one batch.

    Args:
        module: a recxla ShardedEmbeddingBagCollection.
        lookup_input: the batch's LookupInput (micro-batches in order at the owner).
        bag_lengths: float32 [B_local, ranges] lengths of this rank's row-sharded MEAN bags in
            micro-batch order (None when the module has none).
        row_bags: this rank's bags of row-exchange tables (None when there are none).
        early: the pooled lookup when it already ran before the previous batch's update
            (DBP); None: the window looks up now.
        correct: apply the early lookup's correction (False plants a stale read, for tests).
    """

    def __init__(self, module, lookup_input: LookupInput, bag_lengths: Optional[torch.Tensor],
                 row_bags: Optional[RowBags] = None, early: Optional["EarlyLookup"] = None,
                 correct: bool = True):
        self.module = module
        self.input = lookup_input
        self.bag_lengths = bag_lengths
        self.row_bags = row_bags
        self.my_rows = list(lookup_input.micro_batch_sizes[module.layout.rank])
        self.num_micro = len(self.my_rows)
        # L: one lookup for every micro-batch, its autograd nodes kept for the update.
        self.row_output = module.lookup_rows(lookup_input)
        if early is None:
            self.output = module.lookup_pooled(lookup_input, rows_follow=bool(self.row_output))
            self.pooled = self.output.detach()
        else:
            self.output = early.output
            self.pooled = self.output.detach() + early.correction() if correct else \
                self.output.detach()
        self.rows = [r.detach() for r in self.row_output]
        self.out_dim = self.pooled.shape[1]
        self._pooled_gradient = self.output.requires_grad
        # With one micro-batch and pooled rows only, the gradient message is laid out as the
        # buffer (each source's rows in turn) and becomes it (receive_gradient): no copy.
        self._message_is_gradient = self.num_micro == 1 and not self.rows
        self.gradient = self.pooled.new_empty(self.pooled.shape) \
            if self._pooled_gradient and not self._message_is_gradient else None
        self.row_gradients = [r.new_empty(r.shape) for r in self.rows]
        self._messages = [module.output_message(n, row_bags, k)
                          for k, n in enumerate(self.my_rows)]
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

    @property
    def needs_gradient(self) -> bool:
        return self._pooled_gradient or bool(self.rows)

    def start_output(self, k: int) -> None:
        """O(k): micro-batch k's pooled rows and requested rows to the ranks that use them."""
        if self._sent[k] is not None:
            return
        start = self.input.micro_batch_start(k)
        sources = self.input.micro_batch_rows(k)
        pooled = self.pooled[start: start + sum(sources)]
        self._sent[k] = self.module.start_output(pooled, sources, self._messages[k], self.rows,
                                                 self.input.rows)

    def receive_output(self, k: int) -> KeyedTensor:
        """Waits for O(k); -> this rank's micro-batch k embeddings, a leaf that requires grad
        (its gradient is what G(k) sends back)."""
        self.start_output(k)
        handle, _, _ = self._sent[k]
        embeddings = self.module.assemble_output(handle.wait(), self._messages[k],
                                                 self._lengths(k), self.needs_gradient)
        self._sent[k] = None
        return embeddings

    def start_gradient(self, k: int, grad: torch.Tensor) -> None:
        """G(k): the gradient of micro-batch k's embeddings back to their owners."""
        self._returning[k] = self.module.start_gradient(
            grad, self.input.micro_batch_rows(k), self._messages[k], self._lengths(k),
            self.input.rows)

    def receive_gradient(self, k: int) -> None:
        """Waits for G(k) and puts its rows into the gradient buffers (A(k))."""
        if self._returning[k] is None:
            return
        handle, from_sources = self._returning[k]
        flat = handle.wait().reshape(-1)
        self._returning[k] = None
        if self._message_is_gradient:
            if self._pooled_gradient:
                self.gradient = flat.view(self.pooled.shape)
            return
        rows = self.input.rows
        start = self.input.micro_batch_start(k)
        offset = 0
        for s, (samples, size) in enumerate(zip(self.input.micro_batch_rows(k), from_sources)):
            if self.out_dim:
                self.gradient[start: start + samples].copy_(
                    flat[offset: offset + samples * self.out_dim].view(samples, self.out_dim))
            start += samples
            position = offset + samples * self.out_dim
            for g, buffer in enumerate(self.row_gradients):
                count, cols = rows.rows(g, k, s), buffer.shape[1]
                first = rows.start(g, k, s)
                buffer[first: first + count].copy_(
                    flat[position: position + count * cols].view(count, cols))
                position += count * cols
            offset += size

    def pending_gradients(self) -> List[int]:
        return [k for k, h in enumerate(self._returning) if h is not None]

    def update(self) -> None:
        """U: the lookup's backward on the whole batch's gradient: the fused optimizer updates
        every touched row once (tables without one get their ordinary gradient)."""
        self.module.fused_optimizer.count_step()
        outputs, grads = [], []
        if self.gradient is not None and self.output.requires_grad:
            outputs.append(self.output)
            grads.append(self.gradient)
        for out, grad in zip(self.row_output, self.row_gradients):
            if out.requires_grad:
                outputs.append(out)
                grads.append(grad)
        if outputs:
            torch.autograd.backward(outputs, grads)
        self.output, self.row_output = None, ()


class EarlyLookup:
    """A DBP lookup of the next batch's pooled tables before the current batch's update, made
    exact after it. (Row-exchange tables need no early lookup: their gather is a copy, done
    when the next window opens, after the update.)

    The next batch reads, per local table, some rows that the current update changes: those in
    both batches' unique ids (known before the update runs). The lookup runs early with the old
    weights; those rows are kept as they were; after the update, `correction()` adds to each bag
    the change of its rows (w_new - w_old, times the per-sample weight, over the bag's length
    for MEAN), since pooling is a sum. The result is the lookup after the update, up to float
    rounding.

    Args:
        module: the recxla ShardedEmbeddingBagCollection.
        next_input: the next batch's LookupInput; current_input: the current batch's.
    """

    def __init__(self, module, next_input: LookupInput, current_input: LookupInput):
        self.module = module
        self.input = next_input
        self.tables = module.pooled_tables
        self.output = module.lookup_pooled(next_input, rows_follow=module.has_row_tables)
        self.rows: List[torch.Tensor] = []
        self.before: List[torch.Tensor] = []
        nxt, cur = next_input.unique_bounds, current_input.unique_bounds
        for t, weight in enumerate(self.tables.weights):
            reads = next_input.unique_values[nxt[t]: nxt[t + 1]]
            changes = current_input.unique_values[cur[t]: cur[t + 1]]
            rows = reads[torch.isin(reads, changes)]
            self.rows.append(rows)
            self.before.append(weight.detach().index_select(0, rows))

    def correction(self) -> torch.Tensor:
        """After the update: float32 [B, D_owner] to add to the early lookup's output."""
        li, tables = self.input, self.tables
        batch = li.batch_size
        out = self.output.new_zeros((batch, self.output.shape[1]))
        weights = tables.weights
        deltas = [w.detach().index_select(0, rows) - before
                  for w, rows, before in zip(weights, self.rows, self.before)]
        lengths = li.offsets.diff()
        column = 0
        pooling = tables.pooling
        for j, t in enumerate(tables.slot_table):
            cols = weights[t].shape[1]
            first, last = li.slot_bounds(j)
            if self.rows[t].numel() and last > first:
                ids = li.unique_values.index_select(0, li.inverse[first:last])
                where = torch.searchsorted(self.rows[t], ids).clamp(max=self.rows[t].numel() - 1)
                changed = self.rows[t].index_select(0, where) == ids
                sample = torch.repeat_interleave(
                    torch.arange(batch, device=ids.device), lengths[j * batch:(j + 1) * batch],
                    output_size=last - first)
                rows = deltas[t].index_select(0, where[changed])
                if li.per_sample_weights is not None:
                    rows = rows * li.per_sample_weights[first:last][changed].unsqueeze(1)
                block = out[:, column: column + cols]
                block.index_add_(0, sample[changed], rows)
                if pooling[t] == MEAN:
                    block.div_(lengths[j * batch:(j + 1) * batch].clamp(min=1).unsqueeze(1))
            column += cols
        return out
