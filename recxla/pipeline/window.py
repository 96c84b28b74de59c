"""The frozen window of one sharded module over one batch.

Inside a batch the tables do not change: the owner looks up every micro-batch's bags once, at
the start (L), with the weights the sequential step would read, and gathers every rank's
requested rows of its row-exchange tables. Each micro-batch k then only moves data: its pooled
rows and requested rows go to their ranks (O(k)), its model runs on them, and their gradient
comes back (G(k)) into the owner's gradient buffers, at the rows the lookup produced. At the
end the buffers hold exactly the gradient the whole batch's backward would give the lookup,
and the lookup's own backward applies the fused optimizer once per row (U). Only the order of
the float additions differs from the sequential step. With one micro-batch (DBP's default) the
batch's gradient is one message, and the fused update reads each bag's row where the message
holds it: no buffer, no copy.

On CPU the all-to-alls progress in gloo's threads while the caller computes; on GPU they run
on NCCL's stream, and waits order the streams without blocking the host. The same code serves
both.
"""

import functools
from typing import Any, Dict, List, Optional

import torch

from recxla.torchrec.early_lookup import EarlyLookup
from recxla.torchrec.early_rows import EarlyRows
from recxla.torchrec.input_dist import LookupInput
from recxla.torchrec.row_exchange import RowBags
from recxla.torchrec.types import EmbeddingSteps


class _GradientTap(torch.autograd.Function):
    """values -> values, whose gradient goes to `arrived(grad)` as the backward hands it over
    (any strides), not into a leaf's .grad: a leaf copies a gradient whose strides are not its
    own, and the model's cat and reshape hand over a column range of a wider gradient, which
    the gradient exchange reads in place. `anchor`: an empty tensor that requires grad, so that
    the output does; it gets no gradient."""

    @staticmethod
    def forward(ctx, anchor, values, arrived):
        ctx.arrived = arrived
        return values.view_as(values)

    @staticmethod
    def backward(ctx, grad):
        arrived, ctx.arrived = ctx.arrived, None
        arrived(grad)
        return None, None, None


_ANCHORS: Dict[torch.device, torch.Tensor] = {}


def _anchor(device: torch.device) -> torch.Tensor:
    """The gradient tap's anchor on `device`: one per device, made once (it never gets a
    gradient, so windows can share it)."""
    if device not in _ANCHORS:
        _ANCHORS[device] = torch.empty(0, device=device, requires_grad=True)
    return _ANCHORS[device]


class FrozenWindow:
    """One sharded module's state for one batch.

    Args:
        steps: the steps of a recxla sharded module (recxla.torchrec.types.EmbeddingSteps).
        lookup_input: the batch's LookupInput (micro-batches in order at the owner).
        bag_lengths: the steps' receive_lengths of this rank's batch, a row per sample in
            micro-batch order (None when the receiver needs none).
        row_bags: this rank's bags of row-exchange tables (None when there are none).
        early: the pooled lookup when it already ran before the previous batch's update
            (DBP); None: the window looks up now.
        early_rows: the cells sent before the previous batch's update (DBP's early rows:
            recxla.torchrec.early_rows); the exchanges then carry only the rest.
    """

    def __init__(self, steps: EmbeddingSteps, lookup_input: LookupInput,
                 bag_lengths: Optional[torch.Tensor], row_bags: Optional[RowBags] = None,
                 early: Optional[EarlyLookup] = None,
                 early_rows: Optional[EarlyRows] = None):
        self.steps = steps
        self.input = lookup_input
        self.bag_lengths = bag_lengths
        self.row_bags = row_bags
        self.my_rows = list(lookup_input.micro_batch_sizes[steps.layout.rank])
        self.num_micro = len(self.my_rows)
        # L: one lookup for every micro-batch, its autograd nodes kept for the update.
        self.row_output = steps.lookup_rows(lookup_input)
        if early is None:
            self.output = steps.lookup_pooled(lookup_input,
                                              rows_follow=self.row_output is not None)
            self.pooled = self.output.detach()
        else:
            self.output = early.output
            self.pooled = early.corrected()
        self.rows = None if self.row_output is None else self.row_output.detach()
        self.out_dim = self.pooled.shape[1]
        self._pooled_gradient = self.output.requires_grad
        # With one micro-batch the batch's gradient arrives in one message, which the update
        # reads where it lies (steps.update_from_message); it is unpacked into the gradient
        # buffers only where that update cannot run (_unpack_message). Several micro-batches'
        # messages are unpacked as they arrive.
        self._message: Optional[torch.Tensor] = None
        self.gradient, self.row_gradient = None, None
        if self.num_micro > 1:
            self._gradient_buffers()
        self._messages = [steps.output_message(n, row_bags, k)
                          for k, n in enumerate(self.my_rows)]
        self.early_rows = early_rows
        self._sent = [None] * self.num_micro
        self._returning = [None] * self.num_micro
        # What the backward hands each micro-batch's embeddings: sent on arrival (G(k) under
        # the backward) or kept for the caller (arrived_gradient).
        self._send_on_arrival = [False] * self.num_micro
        self._arrived: List[Optional[torch.Tensor]] = [None] * self.num_micro

    def _gradient_buffers(self) -> None:
        """The buffers the gradient messages are unpacked into: the pooled lookup's [B, D] and
        the row block's (every requested row's gradient arrives, and the update reads no
        padding of the row block, row_exchange.RowBlockLayout: no fill)."""
        if self._pooled_gradient:
            self.gradient = self.pooled.new_empty(self.pooled.shape)
        if self.rows is not None:
            self.row_gradient = torch.empty_like(self.rows)

    def _unpack_message(self, flat: torch.Tensor) -> None:
        """The one message of a batch into the gradient buffers; with pooled rows only it is
        laid out as the buffer (each source's rows in turn) and becomes it: no copy."""
        if self.rows is None:
            if self._pooled_gradient:
                self.gradient = flat.view(self.pooled.shape)
            return
        self._gradient_buffers()
        self.steps.unpack_gradient(flat, self.input.micro_batch_rows(0), self.input.rows, 0,
                                   0, self.gradient, self.row_gradient)

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
        return self._pooled_gradient or self.rows is not None

    def start_output(self, k: int) -> None:
        """O(k): micro-batch k's pooled rows and requested rows to the ranks that use them."""
        if self._sent[k] is not None:
            return
        if self.early_rows is not None:  # the rest of the message: its late cells
            self._sent[k] = (self.early_rows.start_late(k, self.pooled, self.rows), None, None)
            return
        start = self.input.micro_batch_start(k)
        sources = self.input.micro_batch_rows(k)
        pooled = self.pooled[start: start + sum(sources)]
        self._sent[k] = self.steps.start_output(pooled, sources, self._messages[k], self.rows,
                                                self.input.rows)

    def receive_output(self, k: int) -> Any:
        """Waits for O(k); -> this rank's micro-batch k embeddings as the module's forward
        returns them. Their gradient, when the backward reaches them, is sent (G(k)) if
        send_on_arrival(k) was called, else kept for arrived_gradient(k)."""
        self.start_output(k)
        handle, _, _ = self._sent[k]
        received = handle.wait()
        if self.early_rows is not None:
            received = self.early_rows.merge(received, self._messages[k])
        lengths = self._lengths(k)
        values = self.steps.assemble_output(received, self._messages[k], lengths)
        if self.needs_gradient and torch.is_grad_enabled():
            values = _GradientTap.apply(_anchor(values.device), values,
                                        functools.partial(self._gradient_arrived, k))
        self._sent[k] = None
        return self.steps.form_output(values, lengths)

    def send_on_arrival(self, k: int) -> None:
        """G(k) leaves as soon as micro-batch k's gradient exists, while the rest of the
        backward (the dense arch) still runs."""
        self._send_on_arrival[k] = True

    def arrived_gradient(self, k: int) -> Optional[torch.Tensor]:
        """The gradient of micro-batch k's embeddings that the backward handed over (None:
        none, or it was sent on arrival); the window lets go of it."""
        grad, self._arrived[k] = self._arrived[k], None
        return grad

    def _gradient_arrived(self, k: int, grad: torch.Tensor) -> None:
        if self._send_on_arrival[k]:
            self.start_gradient(k, grad)
        else:
            self._arrived[k] = grad

    def start_gradient(self, k: int, grad: torch.Tensor) -> None:
        """G(k): the gradient of micro-batch k's embeddings back to their owners."""
        self._returning[k] = self.steps.start_gradient(
            grad, self.input.micro_batch_rows(k), self._messages[k], self._lengths(k),
            self.input.rows)

    def receive_gradient(self, k: int) -> None:
        """Waits for G(k) and puts its rows into the gradient buffers (A(k)); with one
        micro-batch keeps the message for the update to read where it lies."""
        if self._returning[k] is None:
            return
        handle, _ = self._returning[k]
        flat = handle.wait().reshape(-1)
        self._returning[k] = None
        if self.num_micro == 1:
            self._message = flat
            return
        self.steps.unpack_gradient(flat, self.input.micro_batch_rows(k), self.input.rows, k,
                                   self.input.micro_batch_start(k), self.gradient,
                                   self.row_gradient)

    def pending_gradients(self) -> List[int]:
        return [k for k, h in enumerate(self._returning) if h is not None]

    def update(self) -> None:
        """U: the lookup's backward on the whole batch's gradient: the fused optimizer updates
        every touched row once (tables without one get their ordinary gradient)."""
        self.steps.count_step()
        if self._message is not None:
            flat, self._message = self._message, None
            pooled = self.output if self._pooled_gradient else None
            if self.steps.update_from_message(flat, self.input, pooled, self.row_output):
                self.output, self.row_output = None, None
                return
            self._unpack_message(flat)
        outputs, grads = [], []
        if self.gradient is not None and self.output.requires_grad:
            outputs.append(self.output)
            grads.append(self.gradient)
        if self.row_output is not None and self.row_output.requires_grad:
            outputs.append(self.row_output)
            grads.append(self.row_gradient)
        if outputs:
            torch.autograd.backward(outputs, grads)
        self.output, self.row_output = None, None
