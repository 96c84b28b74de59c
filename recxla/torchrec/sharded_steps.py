"""The steps of a recxla sharded module: `ShardedSteps`, one object over the module's parts,
the same for the pooled and the sequence module (recxla/torchrec/types.py: `EmbeddingSteps`).

TorchRec's interface (`input_dist`, `compute_and_output_dist`, the awaitables; see
sharded_embedding_bag.py and sharded_embedding.py) composes these steps for one batch;
recxla's pipeline (recxla.pipeline) calls them one by one, placing each where its schedule
wants it (docs/architecture.md maps them to the schedule). In the order one step calls them:

    start_input_dist   ids to their owners (two all-to-alls, awaited in two steps)
    receive_lengths    what the receiver needs of this rank's bag lengths
    to_device          the decoded LookupInput on the module's device
    lookup_rows        the owner gathers its row-exchange tables' requested rows
    lookup_pooled      the owner's pooled lookup (fused optimizer in its backward)
    output_message     what this rank receives in one exchange (a micro-batch)
    start_output       the owner's rows to the ranks whose samples they are
    assemble_output    the received rows as this rank's output values
    form_output        those values as the module's output (KeyedTensor or jagged tensors)
    stage_output       the next forward returns that output (or calls for it)
    end_staging        after that forward: did it call the module (once)?
    start_gradient     the gradient of those values back to their owners
    count_step         one fused optimizer step counted, before the lookup's backward
    update_from_message  one micro-batch: the fused update reads the gradient message in place
    average_replicas   (2D, sync="weights") the replicas averaged now, before a checkpoint

and, for DBP's early lookup (the next batch looked up before this batch's update),
`early_lookup` (-> an EarlyLookup whose `corrected()` is that lookup after the update) and
`tables_version` (what changes when the tables change); and `start_early_rows`, the next
batch's rows that this batch's update leaves as they are, sent before it.

The steps read the parts (sharded_parts.py) and nothing else of the module.
"""

import functools
from itertools import accumulate
from typing import Any, Callable, List, Optional, Sequence, Union

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recxla.host_copy import to_device
from recxla.ops.copy_runs import copy_runs, pack
from recxla.ops.embedding_bag import FusedPooledLookup, LookupPlan
from recxla.torchrec.early_lookup import EarlyLookup
from recxla.torchrec.early_rows import EarlyRows
from recxla.torchrec.input_dist import LookupInput, SizesInFlight
from recxla.torchrec.output_dist import Message
from recxla.torchrec.replicas import ReplicatedLookup, update_replicated_rows
from recxla.torchrec.replicas import average_replicas as average_replica_tensors
from recxla.torchrec.row_exchange import (RowBags, RowInput, RowLookup, requested_rows,
                                          update_requested_rows)
from recxla.torchrec.shard_layout import ShardLayout
from recxla.torchrec.sharded_parts import ShardedParts
from recxla.torchrec.types import PooledTables, TablesVersion


class ShardedSteps:
    """The steps of one sharded module (see the module docstring), over its parts."""

    def __init__(self, parts: ShardedParts):
        self.parts = parts

    @property
    def layout(self) -> ShardLayout:
        return self.parts.layout

    # ------------------------------------------------------------------ input dist

    def start_input_dist(self, features: KeyedJaggedTensor,
                         micro_batch_sizes: Optional[Sequence[int]] = None) -> SizesInFlight:
        """Checks `features` (a KeyedJaggedTensor of this rank's B samples) and starts the
        sizes' all-to-all; counts one step in `comm_stats`. micro_batch_sizes: M ints summing
        to B (the samples are M micro-batches one after another; None: one), the same M on
        every rank.
        -> SizesInFlight: `.input_lengths` (int [input slots, B], None on bad input) and
        `.row_bags` (RowBags or None) now; wait() starts the ids' all-to-all (-> IdsInFlight,
        whose wait() gives the owner's LookupInput, on the router's device). A bad batch on
        any rank raises on every rank at the first wait()."""
        awaitable = self.parts.router.start(self.ids_on_router(features), micro_batch_sizes)
        self.parts.stats.steps += 1
        return awaitable

    def ids_on_router(self, features):
        """`features` where the input dist runs (CPU for a GPU module)."""
        if isinstance(features, KeyedJaggedTensor) and \
                features.values().device != self.parts.router.device:
            return features.to(self.parts.router.device)
        return features

    def to_device(self, lookup_input: LookupInput) -> LookupInput:
        """The decoded input on the module's device (non-blocking from pinned CPU memory)."""
        return lookup_input.to(self.parts.device)

    def receive_lengths(self, input_lengths: torch.Tensor) -> Optional[torch.Tensor]:
        """What the receiver needs of this rank's bag lengths, one row per sample (so that a
        micro-batch's rows are a slice): input_lengths int [input slots, B] (start_input_dist's
        `.input_lengths`) -> pooled: float32 [B, F] the lengths of its row-sharded MEAN bags
        (their sums arrive in parts and are divided at the receiver), None when there are
        none; sequence: int64 [B, input slots], every bag's length (the jagged output's)."""
        return self.parts.output.assembly.receive_lengths(input_lengths, self.parts.device)

    def stage_output(self, output: Union[Any, Callable[[], Any]]) -> None:
        """The next forward returns `output` (form_output's output for the micro-batch the
        model passes; data-parallel tables are merged in there) instead of running the input
        dist, lookup and output dist (recxla.pipeline's FWP). A callable is called by that
        forward for the output: the pipeline waits for the rows only when the model asks for
        them. Every stage_output is closed by end_staging once the model's forward ran."""
        self.parts.staged_outputs.append(output)
        self.parts.staging = True

    def end_staging(self) -> bool:
        """After the model's forward for which stage_output staged an output: -> whether the
        forward took it (False: it never called the module; the output is dropped)."""
        taken = not self.parts.staged_outputs
        self.parts.staged_outputs.clear()
        self.parts.staging = False
        return taken

    # ------------------------------------------------------------------ lookup

    def lookup(self, lookup_input: LookupInput):
        """compute() without a context: (lookup_pooled, lookup_rows)."""
        row_block = self.lookup_rows(lookup_input)
        return self.lookup_pooled(lookup_input, rows_follow=row_block is not None), row_block

    def lookup_rows(self, lookup_input: LookupInput) -> Optional[torch.Tensor]:
        """The owner's gather of its row-exchange tables, one lookup for all of them:
        lookup_input (on the module's device) -> the row block, float32, every local row
        group's requested rows (lookup_input.rows order) where
        lookup_input.rows.block_layout(the output dist's local_group_cols) puts them
        (row_exchange.RequestedRows; RowLookup: its backward applies the fused update once
        per row); None without row tables."""
        tables = self.parts.tables
        if not tables.row_weights:
            return None
        apply_gradients = update_requested_rows if self.parts.replicas is None else \
            functools.partial(update_replicated_rows, self.parts.replicas, self.parts.optim)
        optim = self.parts.optim
        return RowLookup.apply(lambda: optim.step_arguments(tables.num_pooled),
                               apply_gradients,
                               requested_rows(tables.row_weights, lookup_input.rows.values,
                                              lookup_input.rows.block_layout(
                                                  self.parts.output.local_group_cols)),
                               *tables.row_weights)

    def lookup_pooled(self, lookup_input: LookupInput, rows_follow: bool = False):
        """The owner's pooled lookup of every source's bags: lookup_input (on the module's
        device) -> float32 [lookup_input.batch_size, D_owner] in the input's sample order (its
        backward runs the fused optimizer). rows_follow: lookup_rows also produced outputs (a
        rank with no pooled table then adds no zeros to the graph)."""
        if self.parts.fp16.copies is not None:
            self.parts.fp16.copies.sync()  # writes into state_dict's float16 tensors
        pooled_weights = self.parts.tables.pooled.weights
        if not pooled_weights:
            # Nothing pooled here; with no rows either, the zeros still join the graph, so
            # this rank takes part in the gradient all-to-all of backward.
            pooled = torch.zeros((lookup_input.batch_size, 0), device=self.parts.device,
                                 requires_grad=torch.is_grad_enabled() and not rows_follow)
        elif self.parts.replicas is not None:
            pooled = ReplicatedLookup.apply(
                self.parts.tables.pooled, self.parts.replicas, self.parts.optim,
                lookup_input.unique_values, lookup_input.unique_offsets,
                lookup_input.inverse, lookup_input.offsets, lookup_input.per_sample_weights,
                *pooled_weights)
        else:
            optim, num_pooled = self.parts.optim, self.parts.tables.num_pooled
            plan = LookupPlan(
                feature_table=self.parts.tables.pooled.slot_table,
                pooling=self.parts.tables.pooled.pooling,
                batch_size=lookup_input.batch_size,
                optimizer_step=(lambda: optim.step_arguments(0, num_pooled))
                if self.parts.tables.has_fused_update else None,
                after_update=self.parts.fp16.round_rows,
                checked_upstream=True,  # ids checked by the input dist's sender (id_encoder)
            )
            pooled = FusedPooledLookup.apply(
                plan, lookup_input.unique_values, lookup_input.unique_offsets,
                lookup_input.inverse, lookup_input.offsets, lookup_input.per_sample_weights,
                *pooled_weights)
        return pooled

    def early_lookup(self, next_input: LookupInput, current_input: LookupInput) -> EarlyLookup:
        """DBP's early lookup: the next batch's pooled lookup (next_input, on the module's
        device) made now, before the update of the batch current_input holds; its
        `corrected()`, called after that update, is the lookup the update's tables give, up to
        float rounding (early_lookup.py). Row-exchange tables are not in it: their rows are
        gathered when the next batch's window opens."""
        output = self.lookup_pooled(next_input, rows_follow=self.has_row_tables)
        return EarlyLookup(self.parts.tables.pooled, output, next_input, current_input)

    def start_early_rows(self, next_input: LookupInput, current_input: LookupInput,
                         row_bags: Optional[RowBags]) -> EarlyRows:
        """Starts sending the next batch's rows that the current batch's update leaves as they
        are (early_rows.py: its pooled bags none of whose rows the current batch read, and its
        row-exchange rows the current batch did not read), before that update: the masks of
        which cells come late leave now, the early cells at the result's `send()`.
        next_input / current_input: the two batches' LookupInputs on the module's device;
        row_bags: this rank's bags of row-exchange tables of the next batch (None without
        them). Where at least early_rows.POOLED_EARLY_MIN of this owner's pooled values can
        leave early, it makes the next batch's early lookup (`early_lookup`) now: the result's
        `early`, for the next batch's window. Collective: every rank of the group calls it,
        and send(), at the same point. -> the EarlyRows to hand the next batch's window."""
        # The masks travel where the ids do: through the CPU, on the router's group (gloo on a
        # GPU, where the module's group is NCCL's).
        return EarlyRows(self.parts.output, self.parts.router.group, self.parts.device,
                         self.parts.tables.pooled,
                         lambda li: self.early_lookup(li, current_input),
                         self.parts.tables.row_weights, next_input, current_input, row_bags)

    @property
    def replicas(self):
        """The module's ReplicaSync in 2D training (recxla.torchrec.replicas), else None."""
        return self.parts.replicas

    def average_replicas(self) -> None:
        """2D training with sync="weights": averages this rank's shards (pooled and
        row-exchange) and their fused optimizer state over its replica group now, as every
        `sync_every` steps do (a collective of the replica group: every rank calls it). A
        checkpoint calls it first, so that it holds the one model every node then trains on.
        Nothing elsewhere: in 1D there are no replicas, and with sync="gradients" they are the
        same bits already."""
        replicas = self.parts.replicas
        if replicas is None or replicas.sync != "weights":
            return
        weights = [w.detach() for w in self.parts.tables.weights]
        _, states, _ = self.parts.optim.step_arguments()
        states = [s if s is not None else w.new_empty(0) for s, w in zip(states, weights)]
        with torch.no_grad():
            average_replica_tensors(weights, states, replicas.group)

    @property
    def pooled_tables(self) -> PooledTables:
        """This rank's pooled tables, as a lookup outside the module reads them."""
        return self.parts.tables.pooled

    @property
    def has_row_tables(self) -> bool:
        """This rank owns row-exchange tables (lookup_rows returns their rows)."""
        return bool(self.parts.tables.row_weights)

    def count_step(self) -> None:
        """One fused optimizer step counted (every rank, once per backward through the
        module, before the lookup's backward applies it)."""
        self.parts.optim.count_step()

    def tables_version(self) -> TablesVersion:
        """What changes when the tables change: the fused optimizer's step count (every
        backward through the module counts one) and the local shards' in-place update
        counters. Equal versions: the tables hold the same values."""
        fp16 = self.parts.fp16.copies.versions() if self.parts.fp16.copies is not None else []
        return self.parts.optim.step_count, \
            [w._version for w in self.parts.tables.weights] + fp16

    # ------------------------------------------------------------------ output dist

    def output_message(self, batch: int, row_bags: Optional[RowBags],
                       micro_batch: int = 0) -> Message:
        """The layout of what this rank receives in exchange `micro_batch` (its `batch`
        samples of that micro-batch; row_bags: its bags of row-exchange tables, on the
        module's device, or None)."""
        return self.parts.output.receive_layout(batch, row_bags, micro_batch)

    def start_output(self, pooled: torch.Tensor, source_batches: List[int], message: Message,
                     row_block: Optional[torch.Tensor] = None,
                     rows: Optional[RowInput] = None):
        """Starts the owner's output all-to-all for `message`'s exchange. pooled: float32
        [sum(source_batches), D_owner], the pooled rows for each source rank in turn (a slice
        of lookup_pooled's output); row_block: lookup_rows's output (`rows`: the
        LookupInput's RowInput). Differentiable w.r.t. pooled and row_block. -> (handle
        whose wait() gives the received rows float32 [R, wire_row_dim], values sent to each
        rank, values expected from each rank)."""
        return self.parts.output.start(pooled, source_batches, message, row_block, rows)

    def assemble_output(self, received: torch.Tensor, message: Message,
                        lengths: Optional[torch.Tensor]) -> torch.Tensor:
        """The received rows (start_output's handle.wait()) as this rank's output values:
        pooled float32 [message.batch, sum of dims] (the model-parallel tables' columns);
        sequence float32 [ids of the exchange's samples, dim]. lengths: this exchange's rows
        of receive_lengths. Their gradient, any strides, is what start_gradient sends back."""
        return self.parts.output.assemble(received, message, lengths)

    def form_output(self, values: torch.Tensor, lengths: Optional[torch.Tensor]):
        """assemble_output's values as the module's output: a KeyedTensor of the module's
        model-parallel features (pooled), or per feature a JaggedTensor (sequence; lengths:
        the exchange's rows of receive_lengths)."""
        return self.parts.output.assembly.form(values, lengths)

    def start_gradient(self, grad: torch.Tensor, source_batches: List[int], message: Message,
                       lengths: Optional[torch.Tensor], rows: Optional[RowInput]):
        """Starts the gradient all-to-all of one exchange (no autograd): grad, the gradient of
        assemble_output's values. -> (handle
        whose wait() gives the owner's gradient message, flat float32, divided as TorchRec's
        gradient division divides it; the values it holds per source rank: per source its
        pooled rows [samples, D_owner] then its row groups' rows [count, cols])."""
        return self.parts.output.start_gradient(grad, source_batches, message, lengths, rows)

    def update_from_message(self, flat: torch.Tensor, lookup_input: LookupInput,
                            output: Optional[torch.Tensor],
                            row_output: Optional[torch.Tensor]) -> bool:
        """The lookups' backward (the fused update, after count_step) of a batch sent as one
        exchange, reading the owner's gradient message (flat, what start_gradient's handle
        gave) where it lies, not from the buffers unpack_gradient would copy it into. output:
        lookup_pooled's or early_lookup's output, None when it takes no gradient; row_output:
        lookup_rows's, or None. -> True: done (the caller drops both without their backward);
        False: nothing done, where a lookup's backward is more than the fused update (a table
        without an optimizer, per-sample weights that want a gradient, 2D's replicas): the
        caller unpacks the message and runs the backward."""
        pooled_update = row_update = None
        if output is not None and output.grad_fn is not None:  # a leaf: no table to update
            pooled_update = FusedPooledLookup.message_update(output)
            if pooled_update is None:
                return False
        if row_output is not None and row_output.requires_grad:
            row_update = RowLookup.message_update(row_output)
            if row_update is None:
                return False
        if row_output is None:  # the message is the pooled lookup's [B, D_owner] gradient
            if pooled_update is not None:
                pooled_update(flat.view(output.shape), None)
            return True
        pooled = self.parts.tables.pooled
        columns = list(accumulate((pooled.weights[t].shape[1] for t in pooled.slot_table),
                                  initial=0))[:-1]
        pooled_at, rows_at = self.parts.output.owner_gradient_offsets(
            lookup_input.micro_batch_rows(0), lookup_input.rows, columns)
        # One copy to the device for both.
        both = to_device(torch.from_numpy(np.concatenate([pooled_at, rows_at])), flat.device)
        pooled_at, rows_at = both.split([pooled_at.size, rows_at.size])
        if pooled_update is not None:
            pooled_update(flat, pooled_at)
        if row_update is not None:
            row_update(flat, rows_at)
        return True

    def unpack_gradient(self, flat: torch.Tensor, source_batches: List[int],
                        rows: Optional[RowInput], k: int, first_sample: int,
                        gradient: Optional[torch.Tensor],
                        row_gradient: Optional[torch.Tensor]) -> None:
        """The owner's gradient message of exchange k (flat, what start_gradient's handle gave)
        into the gradient buffers, one op: its pooled rows into `gradient` [B, D_owner] from
        sample `first_sample` on (None: the message has no pooled values to keep), its row
        groups' rows into row_gradient, shaped as lookup_rows's row block (None: no row
        tables)."""
        runs = self.parts.output.owner_message_runs(source_batches, rows, k, first_sample,
                                                    row_gradient is not None)
        if gradient is None:
            runs = [r for r in runs if r.source != 0]
            gradient = flat.new_empty((0,))
        targets = [gradient] if row_gradient is None else [gradient, row_gradient]
        copy_runs([flat], targets, pack(r.transposed() for r in runs))
