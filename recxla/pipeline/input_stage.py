"""The pipeline's input stage: a batch loaded, split, and its ids on their way to the owners.

One `PreparedBatch` per batch, advanced in three steps that the schedule places
(train_pipeline.py): `prepare_batch` (split, find each sharded module's KeyedJaggedTensor,
start the sizes' all-to-all, the dense fields' copy to the device), `advance(decode=False)`
(sizes received, ids' all-to-all started) and `advance(decode=True)` (ids received and decoded
at the owner, their copy to the device started). When a step returns, no all-to-all of a
prepared batch is left in flight; `arrive` makes the batch's copies usable on the current
stream (copy_stream.py) before its step reads them.
"""

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch

from recxla.pipeline.batch_fields import dense_to, module_features
from recxla.pipeline.copy_stream import CopyStream, InFlight, moved
from recxla.pipeline.micro_batches import MicroBatches, split_batch
from recxla.torchrec.early_lookup import EarlyLookup
from recxla.torchrec.early_rows import EarlyRows
from recxla.torchrec.input_dist import IdsInFlight, LookupInput, SizesInFlight
from recxla.torchrec.row_exchange import RowBags
from recxla.torchrec.types import EmbeddingSteps, TablesVersion


@dataclass
class ModuleInput:
    """One sharded module's input dist for one batch, advanced stage by stage: at most one of
    meta, data and lookup_input is set (the stage it is at)."""

    meta: Optional[SizesInFlight] = None  # the first all-to-all (sizes) in flight
    data: Optional[IdsInFlight] = None  # the second (ids) in flight
    lookup_input: Optional[LookupInput] = None  # decoded at the owner
    lookup_copy: Optional[InFlight] = None  # its copy to the module's device
    bag_lengths: Optional[torch.Tensor] = None
    row_bags: Optional[RowBags] = None  # this rank's bags of row-exchange tables
    early: Optional[EarlyLookup] = None  # dbp_lookup="early": looked up before the update
    # The module's tables_version() after the update the early lookup was corrected for: any
    # other change of the tables before it is used (a step outside the pipeline, a load) makes
    # it stale, and the window looks up again.
    early_tables: Optional[TablesVersion] = None
    # DBP's early rows: the next batch's row-exchange rows that this update leaves as they
    # are, sent before it; and the tables_version() they are for.
    early_rows: Optional[EarlyRows] = None
    early_rows_tables: Optional[TablesVersion] = None


@dataclass
class PreparedBatch:
    raw: Any  # the batch as the loader gave it (prepared again if the model changes)
    micro: Optional[MicroBatches] = None
    dense_copy: Optional[InFlight] = None  # micro.batch's dense fields on their way
    inputs: List[ModuleInput] = field(default_factory=list)
    # An error of this batch's input dist, raised when the batch's own step starts, so that a
    # bad next batch never interrupts the current step halfway.
    error: Optional[BaseException] = None

    def early_lookup(self, state: ModuleInput, steps: EmbeddingSteps) -> Optional[EarlyLookup]:
        """The state's early lookup if the module's tables are as it expects, else None."""
        if state.early is None:
            return None
        if state.early_tables != steps.tables_version():
            state.early = None
        return state.early

    def drop_early_lookups(self) -> None:
        for state in self.inputs:
            state.early = None

    def early_rows(self, state: ModuleInput, steps: EmbeddingSteps) -> Optional[EarlyRows]:
        """The state's early rows; an error if the module's tables changed since they were
        sent (they hold the values of then, and the other ranks use theirs)."""
        if state.early_rows is not None and state.early_rows_tables != steps.tables_version():
            raise RuntimeError(
                "recxla.pipeline.TrainPipeline: the tables changed between two progress calls "
                "while the next batch's early rows were on their way; call detach() before "
                "changing the model outside the pipeline (it drops them on every rank)")
        return state.early_rows

    def drop_early_rows(self) -> None:
        """Waits for the early rows' exchanges and forgets them: the window sends every row
        (every rank of the group must call this at the same point)."""
        for state in self.inputs:
            if state.early_rows is not None:
                state.early_rows.wait()
            state.early_rows = None


def prepare_batch(batch: Any, modules: Sequence[Tuple[str, Any]], num_micro_batches: int,
                  split: str, copies: CopyStream) -> PreparedBatch:
    """Splits `batch`, starts the copy of its dense fields to `copies.device` and every
    sharded module's input dist (the sizes' all-to-all; modules: (path, EmbeddingSteps)
    pairs). Errors of the batch are kept in the result (see PreparedBatch.error)."""
    prepared = PreparedBatch(batch)
    try:
        micro = split_batch(batch, num_micro_batches, split)
        features = module_features(micro.batch, modules)
    except (TypeError, ValueError) as e:
        prepared.error = e
        return prepared
    if copies.device.type != "cpu":
        prepared.dense_copy = copies.start(lambda: dense_to(micro.batch, copies.device))
    prepared.micro = micro
    for (_, steps), kjt in zip(modules, features):
        meta = steps.start_input_dist(kjt, micro.sizes)
        lengths = meta.input_lengths
        prepared.inputs.append(ModuleInput(
            meta=meta, row_bags=meta.row_bags,
            bag_lengths=None if lengths is None else steps.receive_lengths(lengths)))
    return prepared


def advance(prepared: PreparedBatch, decode: bool, modules: Sequence[Tuple[str, Any]] = (),
            copies: Optional[CopyStream] = None) -> None:
    """Waits for the sizes and starts the ids' all-to-all; with decode, also waits for the
    ids, decodes them at the owner and starts their copy to each module's device (`modules`:
    the (path, EmbeddingSteps) pairs the batch was prepared for)."""
    if prepared.error is not None:
        return
    try:
        for i, state in enumerate(prepared.inputs):
            if state.meta is not None:
                state.data, state.meta = state.meta.wait(), None
            if decode and state.data is not None:
                state.lookup_input, state.data = state.data.wait(), None
                if copies is not None:
                    steps, lookup_input = modules[i][1], state.lookup_input
                    state.lookup_copy = copies.start(
                        lambda: moved(steps.to_device(lookup_input)))
    except (ValueError, TypeError, IndexError) as e:
        prepared.error = e


def arrive_lookup(state: ModuleInput) -> None:
    """The module's decoded input, on its device and usable on the current stream."""
    if state.lookup_copy is not None:
        state.lookup_input, state.lookup_copy = state.lookup_copy.wait(), None


def arrive(prepared: PreparedBatch) -> None:
    """Every copy of the batch usable on the current stream: called before its step."""
    if prepared.dense_copy is not None:
        prepared.micro.batch, prepared.dense_copy = prepared.dense_copy.wait(), None
    for state in prepared.inputs:
        arrive_lookup(state)
