"""DBP's early lookup: the next batch's pooled lookup made before this batch's update, made
exact after it.

The next batch reads, per local table, some rows that the current update changes: those in
both batches' unique ids (known before the update runs). The lookup runs early with the old
weights; those rows are kept as they were; after the update, `corrected()` adds to each bag
the change of its rows (w_new - w_old, times the per-sample weight, over the bag's length for
MEAN), since pooling is a sum. The result is the lookup after the update, up to float
rounding. (Row-exchange tables need no early lookup: their gather is a copy, done when the
next batch's window opens, after the update.)
"""

from typing import List

import torch

from recxla.ops.embedding_bag import MEAN
from recxla.torchrec.input_dist import LookupInput
from recxla.torchrec.types import PooledTables


class EarlyLookup:
    """One early lookup (see the module docstring); made by the sharded module's
    `early_lookup` step.

    Args:
        tables: the module's pooled tables (their live weights).
        output: the pooled lookup of next_input with the weights as they are now (float32
            [B, D_owner], its backward the next batch's update).
        next_input: the next batch's LookupInput; current_input: the current batch's.
    """

    def __init__(self, tables: PooledTables, output: torch.Tensor, next_input: LookupInput,
                 current_input: LookupInput):
        self.tables = tables
        self.output = output
        self.input = next_input
        self.rows: List[torch.Tensor] = []
        self.before: List[torch.Tensor] = []
        nxt, cur = next_input.unique_bounds, current_input.unique_bounds
        for t, weight in enumerate(tables.weights):
            reads = next_input.unique_values[nxt[t]: nxt[t + 1]]
            changes = current_input.unique_values[cur[t]: cur[t + 1]]
            rows = reads[torch.isin(reads, changes)]
            self.rows.append(rows)
            self.before.append(weight.detach().index_select(0, rows))

    def corrected(self) -> torch.Tensor:
        """After the update: the lookup's values as the updated tables give them (detached)."""
        return self.output.detach() + self.correction()

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
