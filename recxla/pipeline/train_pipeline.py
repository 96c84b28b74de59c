"""recxla's training pipeline: the one place that decides what overlaps what.

One batch n, split into M micro-batches (see micro_batches.py), on every rank:

    comm:    O(0) O(1)    | O(2)  G(0) | ...  G(M-2) | G(M-1) ids(n+1) ... AR(dense, in D(M-1))
    compute: L   ids(n+1) | D(0)       | D(1) A(0)   | ... D(M-1) A(M-2) | A(M-1) U  step

    L     the owners look up every micro-batch's bags at once (the tables are frozen for the
          batch: FrozenWindow);
    O(k)  micro-batch k's pooled rows to their ranks (FP8 in forward), in flight while the
          previous micro-batch computes;
    D(k)  the model's forward and backward on micro-batch k (the sharded modules return the
          rows O(k) brought); its loss is weighted by its share of the batch;
    G(k)  the gradient of those rows back to the owners, started from inside D(k)'s backward
          as soon as autograd has it, in flight during D(k + 1);
    A(k)  G(k)'s rows into the owner's gradient buffer;
    U     the lookup's backward on the whole batch: the fused optimizer, once per row;
    AR    the dense gradients, accumulated over the micro-batches and all-reduced once, by
          DDP's bucketed all-reduce during D(M-1)'s backward;
    ids(n+1)  double buffering across batches (DBP): the next batch is loaded, split and its ids
          sent to their owners (two small all-to-alls) while batch n computes. Its lookup waits
          for U(n): the tables it reads are then the ones the sequential loop would read.

Every step equals the sequential step (model forward, backward, optimizer) on the same batch up
to the order of float additions: same weights read, same gradients summed, one update.
`overlap=False` runs the same schedule with every exchange waited at once (sequential recxla);
`dbp=False` prepares each batch's ids when its step starts.

What a model needs for this: it calls each recxla-sharded module once per forward, on the
micro-batch's sparse features (TorchRec's DLRM and DLRM_DCN do: any order of dense and sparse
arches works, because the rows of micro-batch k are already in flight before its forward
starts), its forward returns (loss, output) with the loss a mean over the micro-batch's
samples (DLRMTrain does), and no layer mixes samples across the batch (no batch norm): each
micro-batch's gradient must be its samples' part of the whole batch's.
"""

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from recxla.pipeline.micro_batches import (
    OWNER,
    SPLITS,
    MicroBatches,
    batch_parts,
    split_batch,
)
from recxla.pipeline.dense_sync import MicroBatchGradientSync
from recxla.pipeline.timeline import Timeline
from recxla.pipeline.window import EarlyLookup, FrozenWindow
from recxla.torchrec.sharded_embedding_bag import ShardedEmbeddingBagCollection


@dataclass
class _ModuleInput:
    """One sharded module's input dist for one batch, advanced stage by stage."""

    meta: Any = None          # the first all-to-all (sizes) in flight
    data: Any = None          # the second (ids) in flight
    lookup_input: Any = None  # decoded at the owner
    bag_lengths: Optional[torch.Tensor] = None
    row_bags: Any = None  # this rank's bags of row-exchange tables
    early: Optional[EarlyLookup] = None  # dbp_lookup="early": looked up before the update


@dataclass
class _Batch:
    micro: Optional[MicroBatches]
    inputs: List[_ModuleInput] = field(default_factory=list)
    # An error of this batch's input dist, raised when the batch's own step starts, so that a
    # bad next batch never interrupts the current step halfway.
    error: Optional[BaseException] = None


class TrainPipeline:
    """Frozen-window micro-batch pipelining (FWP) and staleness-free double buffering (DBP) for
    models whose embeddings are sharded by `recxla.torchrec.EmbeddingBagCollectionSharder`.

    It has TorchRec's pipeline interface: `progress(dataloader_iter)` trains one batch and
    returns the model's output for it (micro-batch outputs joined, in the loader's sample
    order), raising StopIteration when the loader is exhausted.

    Args:
        model: the model, typically DistributedModelParallel; its forward takes a batch and
            returns (loss, output). Must contain at least one recxla-sharded module.
        optimizer: the dense optimizer (the sharded tables' fused optimizer runs in U).
        device: the device batches are moved to.
        num_micro_batches: M >= 1 micro-batches per batch.
        overlap: overlap the all-to-alls with compute (False: wait for each one at once).
        dbp: prepare the next batch's ids during the current batch.
        split: "contiguous" or "clustered" (see micro_batches.py).
        dbp_lookup: when DBP looks the next batch up: "after_update" (after this batch's
            update, so it reads the updated tables) or "early" (while this batch's last
            gradients travel, then corrected for the rows the update changed; see
            EarlyLookup). Both give the sequential result.
        dense_allreduce: "fp32" or "bf16": the wire format of the dense gradients' all-reduce
            (DDP's buckets, see dense_sync.py).
        timeline: a Timeline to record spans into (None: none recorded).
        phase: a context-manager factory told which phase each part of the step is in
            ("input", "forward", "backward", "optimizer"; e.g. recxla-train's CommMeter.phase).
    """

    DBP_LOOKUPS = ("after_update", "early")

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device, num_micro_batches: int = 1, overlap: bool = True,
                 dbp: bool = True, split: str = "contiguous", dbp_lookup: str = "after_update",
                 dense_allreduce: str = "fp32", timeline: Optional[Timeline] = None,
                 phase: Optional[Callable[[str], Any]] = None) -> None:
        if not isinstance(num_micro_batches, int) or isinstance(num_micro_batches, bool) \
                or num_micro_batches < 1:
            raise ValueError(f"{OWNER}: num_micro_batches must be an int >= 1, got "
                             f"{num_micro_batches!r}")
        for name, flag in (("overlap", overlap), ("dbp", dbp)):
            if not isinstance(flag, bool):
                raise TypeError(f"{OWNER}: {name} must be a bool, got {flag!r}")
        self._modules = [m for m in model.modules()
                         if isinstance(m, ShardedEmbeddingBagCollection)]
        if not self._modules:
            raise ValueError(f"{OWNER}: the model has no module sharded by "
                             "recxla.torchrec.EmbeddingBagCollectionSharder")
        self._model = model
        self._optimizer = optimizer
        self._device = torch.device(device)
        self._num_micro = num_micro_batches
        self._overlap = overlap
        self._dbp = dbp
        self._split = split
        if split not in SPLITS:
            raise ValueError(f"{OWNER}: split must be one of {SPLITS}, got {split!r}")
        if dbp_lookup not in self.DBP_LOOKUPS:
            raise ValueError(f"{OWNER}: dbp_lookup must be one of {self.DBP_LOOKUPS}, got "
                             f"{dbp_lookup!r}")
        self._dbp_lookup = dbp_lookup
        # Tests turn this off to plant a stale read and show that the checks catch it.
        self._correct_early_lookups = True
        ddp = next((m for m in model.modules() if isinstance(m, DistributedDataParallel)), None)
        self._gradient_sync = MicroBatchGradientSync(ddp, dense_allreduce) \
            if ddp is not None else None
        self._next: Optional[_Batch] = None
        self._exhausted = False
        self.timeline = timeline if timeline is not None else Timeline(enabled=False)
        self._phase = phase

    def _span(self, name: str, phase: str, **args):
        """A timeline span that also tells `phase` (see __init__) what runs."""
        if self._phase is None:
            return self.timeline.span(name, **args)
        stack = contextlib.ExitStack()
        stack.enter_context(self.timeline.span(name, **args))
        stack.enter_context(self._phase(phase))
        return stack

    def detach(self) -> torch.nn.Module:
        """TorchRec's pipeline interface: the model, as it was (nothing was rewritten)."""
        return self._model

    # ------------------------------------------------------------------ input dist

    def _prepare(self, dataloader_iter: Iterator) -> _Batch:
        """Loads a batch, splits it and starts its input dists. StopIteration when the loader
        is done; input errors are kept in the batch (every rank keeps them alike)."""
        batch = next(dataloader_iter)
        micro = split_batch(batch, self._num_micro, self._split)
        sparse = batch_parts(micro.batch)[1]
        if self._device.type != "cpu":
            # The dense features and labels go to the device; the ids stay where the input
            # dist runs (on the CPU: see ShardedEmbeddingBagCollection), and the sharded
            # modules never read the model's copy of them.
            dense, _, labels = batch_parts(micro.batch)
            micro.batch = _replace_dense(micro.batch, dense.to(self._device, non_blocking=True),
                                         labels.to(self._device, non_blocking=True))
        prepared = _Batch(micro)
        for module in self._modules:
            meta = module._router.start(module.ids_on_router(sparse), micro.sizes)
            module.comm_stats.steps += 1
            lengths = meta.input_lengths
            prepared.inputs.append(_ModuleInput(
                meta=meta, row_bags=meta.row_bags,
                bag_lengths=None if lengths is None else module.mean_bag_lengths(lengths)))
        return prepared

    def _advance(self, prepared: _Batch, decode: bool) -> None:
        """Waits for the sizes and starts the ids' all-to-all; with decode, also waits for the
        ids and decodes them at the owner."""
        if prepared.error is not None:
            return
        try:
            for state in prepared.inputs:
                if state.meta is not None:
                    state.data, state.meta = state.meta.wait(), None
                if decode and state.data is not None:
                    state.lookup_input, state.data = state.data.wait(), None
        except (ValueError, TypeError, IndexError) as e:
            prepared.error = e

    # ------------------------------------------------------------------ one step

    def progress(self, dataloader_iter: Iterator) -> Any:
        """Trains one batch; -> the model's output for it."""
        if self._exhausted and self._next is None:
            raise StopIteration
        with self._span("input dist", "input"):
            current = self._next if self._next is not None else self._prepare(dataloader_iter)
            self._next = None
            self._advance(current, decode=True)
        if current.error is not None:
            raise current.error
        self._optimizer.zero_grad()
        micro = current.micro
        windows = []
        with self._span("lookup", "forward"):
            for module, state in zip(self._modules, current.inputs):
                row_bags = None if state.row_bags is None else state.row_bags.to(self._device)
                windows.append(FrozenWindow(module, module.to_device(state.lookup_input),
                                            state.bag_lengths, row_bags, state.early,
                                            self._correct_early_lookups))
        ahead = 2 if self._overlap else 1
        for k in range(min(ahead, self._num_micro)):
            for w in windows:
                w.start_output(k)
        if self._dbp and not self._exhausted:
            with self._span("next batch", "input"):
                try:
                    self._next = self._prepare(dataloader_iter)
                except StopIteration:
                    self._exhausted = True
        outputs = []
        for k in range(self._num_micro):
            with self._span("wait embeddings", "forward", micro_batch=k):
                embeddings = [w.receive_output(k) for w in windows]
            if self._overlap and k + 1 < self._num_micro:
                for w in windows:
                    w.start_output(k + 1)
            for w, kt in zip(windows, embeddings):
                w.module.stage_output(kt)
                if self._overlap and kt.values().requires_grad:
                    kt.values().register_hook(functools.partial(_start_gradient, w, k))
            if self._gradient_sync is not None:
                self._gradient_sync.sync = k + 1 == self._num_micro
            with self._span("dense", "backward", micro_batch=k):
                loss, output = self._model(micro.micro_batch(k))
                weight = micro.sizes[k] / max(micro.batch_size, 1)
                (loss * weight).backward()
            outputs.append(output)
            if not self._overlap:
                with self._span("send gradients", "backward", micro_batch=k):
                    for w, kt in zip(windows, embeddings):
                        if kt.values().grad is not None:
                            w.start_gradient(k, kt.values().grad)
            with self._span("wait gradients", "backward", micro_batch=k):
                for w in windows:
                    for j in w.pending_gradients():
                        if j < k or not self._overlap:
                            w.receive_gradient(j)
            if self._next is not None and k == 0:
                with self._span("next batch", "input"):
                    self._advance(self._next, decode=False)
        if self._next is not None:
            with self._span("next batch", "input"):
                self._advance(self._next, decode=True)
            if self._dbp_lookup == "early" and self._next.error is None:
                # While the last gradients travel: the next batch's lookup with the weights
                # before this update; FrozenWindow corrects the rows the update changes.
                with self._span("early lookup", "input"):
                    for w, state in zip(windows, self._next.inputs):
                        state.lookup_input = w.module.to_device(state.lookup_input)
                        state.early = EarlyLookup(w.module, state.lookup_input, w.input)
        with self._span("wait gradients", "backward", micro_batch=self._num_micro - 1):
            for w in windows:
                for j in w.pending_gradients():
                    w.receive_gradient(j)
        with self._span("update", "optimizer"):
            for w in windows:
                w.update()
            self._optimizer.step()
        return micro.merge(outputs)


def _replace_dense(batch: Any, dense: torch.Tensor, labels: torch.Tensor) -> Any:
    """The batch with its dense features and labels replaced (same type)."""
    if hasattr(batch, "sparse_features"):
        return type(batch)(dense_features=dense, sparse_features=batch.sparse_features,
                           labels=labels)
    return type(batch)(sparse=batch.sparse, dense=dense, labels=labels)


def _start_gradient(window: FrozenWindow, k: int, grad: torch.Tensor) -> None:
    """Autograd hook on micro-batch k's embeddings: G(k) leaves as soon as its gradient exists,
    while the rest of the backward (the dense arch) still runs."""
    window.start_gradient(k, grad)
