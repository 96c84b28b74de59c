"""recxla's training pipeline: the one place that decides what overlaps what.

One batch n, split into M micro-batches (see micro_batches.py), on every rank:

    comm:    O(0) O(1) sizes(n+1)          | ids(n+1) O(2) G(0) | ... G(M-2) | G(M-1)  AR ...
    compute: L  load, split(n+1) step(n-1) | D(0)               | D(1) A(0)  | ... D(M-1) A(M-2) |
             A(M-1) decode(n+1) U

    L     the owners look up every micro-batch's bags at once (the tables are frozen for the
          batch: FrozenWindow);
    O(k)  micro-batch k's pooled rows to their ranks (FP8 in forward), in flight while the
          previous micro-batch computes;
    D(k)  the model's forward and backward on micro-batch k (the sharded modules return the
          rows O(k) brought, waited for when the forward first calls one of them: the layers
          it runs before, DLRM's bottom MLP, compute while they travel); its loss is weighted
          by its share of the batch;
    G(k)  the gradient of those rows back to the owners, started from inside D(k)'s backward
          as soon as autograd has it, in flight during D(k + 1);
    A(k)  G(k)'s rows into the owner's gradient buffer;
    U     the lookup's backward on the whole batch: the fused optimizer, once per row;
    AR    the dense gradients, accumulated over the micro-batches and all-reduced once, by
          DDP's buckets from inside D(M-1)'s backward, waited for only at the dense optimizer
          step, so A(M-1) and U run while they travel (dense_sync.py);
    step(n-1)  that dense optimizer step, at the next batch's start while its O(0) travels
          (it reads none of its rows; D(0) is the first to read the weights it updates);
    ids(n+1)  double buffering across batches (DBP): the next batch is loaded and split, its
          block sizes sent while O(0) travels, and its ids while D(0) computes (the links are
          otherwise idle then); they are decoded after D(M-1). Its lookup waits for U(n): the
          tables it reads are then the ones the sequential loop would read. On a GPU its
          dense fields (when it is split) and decoded ids (when decoded) go to the device on a
          copy stream, under this batch's kernels (copy_stream.py).
    E(n+1)    early rows (early_rows=True): DBP runs two batches ahead (batch n+1 decoded during
          step n-1, batch n+2 loaded in step n); the masks of batch n+1's row-exchange rows
          leave with O(0), and before D(0) its rows that U(n) leaves as they are, travelling
          during D(0) .. D(M-1) (recxla.torchrec.early_rows); its O(k) carries the rest.

Every step equals the sequential step (model forward, backward, optimizer) on the same batch up
to the order of float additions: same weights read, same gradients summed, one update.
`overlap=False` runs the same schedule with every exchange waited at once (sequential recxla);
`dbp=False` prepares each batch's ids when its step starts.

What a model needs for this: it calls each recxla-sharded module once per forward, on the
micro-batch's sparse features (TorchRec's DLRM and DLRM_DCN do: any order of dense and sparse
arches works, because the rows of micro-batch k are already in flight before its forward
starts; what runs before the first sharded module overlaps them), its forward returns (loss,
output) with the loss a mean over the micro-batch's samples (DLRMTrain does), and no layer
mixes samples across the batch (no batch norm): each micro-batch's gradient must be its
samples' part of the whole batch's. The model is never traced or rewritten: Python control
flow and torch.compile'd parts are fine.

The user's loop is TorchRec's (docs/pipeline.md): progress(it) until StopIteration, a new
iterator for the next epoch; a model in eval mode gets forward only (no backward, no update);
detach() hands the model back for use on its own, attach() (or the next progress) resumes.
"""

import collections
import contextlib
import functools
import warnings
from typing import Any, Callable, Deque, Iterator, List, Optional, Tuple, Union

import torch
from torch.nn.parallel import DistributedDataParallel

from recxla.distributed.compressed_all_reduce import CompressedAllReduce
from recxla.pipeline.choices import DBP_LOOKUPS, SPLITS
from recxla.pipeline.copy_stream import CopyStream
from recxla.pipeline.dense_sync import (
    COMPRESSED,
    DenseAllReduce,
    MicroBatchGradientSync,
    check_nodes,
)
from recxla.pipeline.input_stage import (
    PreparedBatch,
    advance,
    arrive,
    arrive_lookup,
    prepare_batch,
)
from recxla.pipeline.micro_batches import OWNER
from recxla.pipeline.timeline import Timeline
from recxla.pipeline.window import FrozenWindow
from recxla.torchrec.types import EmbeddingSteps, PipelinedModule


class TrainPipeline:
    """Frozen-window micro-batch pipelining (FWP) and staleness-free double buffering (DBP) for
    models whose embeddings are sharded by `recxla.torchrec.EmbeddingBagCollectionSharder`.

    It has TorchRec's pipeline interface (`TrainPipelineSparseDist`): `progress(dataloader_iter)`
    runs one batch and returns the model's output for it (micro-batch outputs joined, in the
    loader's sample order), raising StopIteration when the loader is exhausted; a new iterator
    starts a new epoch. In train mode a batch trains (forward, backward, update); with the
    model in eval mode (`model.eval()`) it runs forward only, without gradients, and changes
    no weight. `detach()` / `attach(model)` as TorchRec's.

    Batches: any type TorchRec's pipelines move (a dataclass, NamedTuple, dict or object whose
    fields hold the KeyedJaggedTensor(s) and the per-sample tensors; see batch_fields.py).

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
            recxla.torchrec.early_lookup). Both give the sequential result.
        dense_allreduce: how the dense gradients are all-reduced (DDP's buckets, see
            dense_sync.py): a recxla.pipeline.DenseAllReduce (wire, node layout, PowerSGD's
            rank and start), or a wire's name for one over DDP's group: "fp32", "bf16", "fp8"
            (e4m3 with error feedback, recxla.distributed.FP8AllReduce) or "powersgd"
            (low-rank factors with error feedback, recxla.distributed.PowerSGDAllReduce). By
            node (`DenseAllReduce(wire, nodes=recxla.torchrec.make_topology_2d())`): summed
            inside each node, 1/ranks_per_node of them per rank across the nodes, gathered
            inside the node (recxla.distributed.all_reduce_by_node; 2 nodes x 2 ranks: a third
            fewer bytes across the nodes than the ring); it needs DDP over every rank with
            gradient_as_bucket_view (TorchRec's default). The compressed wires' state, to
            checkpoint, is `dense_allreduce_state`.
        defer_dense_update: apply each batch's dense update (wait for its all-reduce, step
            the dense optimizer) at the next batch's first dense forward instead of at the end
            of its own step, so the all-reduce travels during the next batch's lookup, id
            exchange and embedding all-to-all. No step reads a stale weight (only the dense
            forward reads the dense weights), but between two progress calls the dense
            weights lag one update: call flush() before reading them outside the pipeline
            (detach() and an eval-mode progress flush on their own).
        early_rows: with dbp, run two batches ahead and send the next batch's row-exchange
            rows that this batch's update leaves as they are (recxla.torchrec.early_rows)
            before this batch's first dense forward, so they travel during the dense forward
            and backward; only the rows this batch read wait for the update. Bit for bit the
            same step. Between two progress calls the model may change only after detach().
        timeline: a Timeline to record spans into (None: none recorded).
        phase: a context-manager factory told which phase each part of the step is in
            ("input", "forward", "backward", "optimizer"; e.g. recxla-train's CommMeter.phase).
        loss_is_sample_mean: the model's loss is a mean over the samples of per-sample terms
            (DLRMTrain's BCE is), which is what makes micro-batches exact: each micro-batch's
            loss is weighted by its share of the batch. An in-batch softmax, a batch norm, any
            loss that mixes samples is not, and micro-batches change it. None: the pipeline
            cannot tell, and with num_micro_batches > 1 warns once; True: no warning; False:
            num_micro_batches > 1 is refused.
    """

    DBP_LOOKUPS = DBP_LOOKUPS  # recxla.pipeline.choices

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device, num_micro_batches: int = 1, overlap: bool = True,
                 dbp: bool = True, split: str = "contiguous", dbp_lookup: str = "after_update",
                 dense_allreduce: Union[str, DenseAllReduce] = "fp32",
                 defer_dense_update: bool = False, early_rows: bool = False,
                 timeline: Optional[Timeline] = None,
                 phase: Optional[Callable[[str], Any]] = None,
                 loss_is_sample_mean: Optional[bool] = None) -> None:
        if not isinstance(num_micro_batches, int) or isinstance(num_micro_batches, bool) \
                or num_micro_batches < 1:
            raise ValueError(f"{OWNER}: num_micro_batches must be an int >= 1, got "
                             f"{num_micro_batches!r}")
        for name, flag in (("overlap", overlap), ("dbp", dbp),
                           ("defer_dense_update", defer_dense_update),
                           ("early_rows", early_rows)):
            if not isinstance(flag, bool):
                raise TypeError(f"{OWNER}: {name} must be a bool, got {flag!r}")
        if loss_is_sample_mean not in (None, True, False):
            raise TypeError(f"{OWNER}: loss_is_sample_mean must be None or a bool, got "
                            f"{loss_is_sample_mean!r}")
        if num_micro_batches > 1 and loss_is_sample_mean is False:
            raise ValueError(f"{OWNER}: num_micro_batches={num_micro_batches} with "
                             "loss_is_sample_mean=False: micro-batches weight each part's loss "
                             "by its share of the batch, which is the whole batch's loss only "
                             "for a mean of per-sample terms; use num_micro_batches=1")
        if num_micro_batches > 1 and loss_is_sample_mean is None:
            warnings.warn(f"{OWNER}: num_micro_batches={num_micro_batches} weights each "
                          "micro-batch's loss by its share of the batch: the step is the whole "
                          "batch's only for a loss that is a mean of per-sample terms "
                          "(DLRMTrain's BCE); an in-batch softmax, a batch norm or any loss "
                          "that mixes samples changes. Pass loss_is_sample_mean=True to say "
                          "yours is, or False to refuse micro-batches", stacklevel=2)
        if split not in SPLITS:
            raise ValueError(f"{OWNER}: split must be one of {SPLITS}, got {split!r}")
        if dbp_lookup not in self.DBP_LOOKUPS:
            raise ValueError(f"{OWNER}: dbp_lookup must be one of {self.DBP_LOOKUPS}, got "
                             f"{dbp_lookup!r}")
        self._dense_allreduce = DenseAllReduce.of(dense_allreduce)
        self._set_model(model)
        self._optimizer = optimizer
        self._device = torch.device(device)
        # A GPU's host-to-device copies of the next batch run under this batch's kernels.
        self._copies = CopyStream(self._device)
        self._num_micro = num_micro_batches
        self._overlap = overlap
        self._dbp = dbp
        self._split = split
        self._dbp_lookup = dbp_lookup
        self._defer_dense_update = defer_dense_update
        self._early_rows = early_rows and dbp
        self._check_replicas()
        self._check_foreign_modules()
        self._dense_update_pending = False
        # The batches loaded ahead, oldest first: one with DBP; two with early rows, so that
        # the next batch's ids are decoded before this step's dense forward (early rows of it
        # leave then) while the one after it is loaded and split.
        self._ahead: Deque[PreparedBatch] = collections.deque()
        self._depth = 2 if self._early_rows else 1
        self._loader: Optional[Iterator] = None
        self._exhausted = False
        self._attached = True
        self.timeline = timeline if timeline is not None else Timeline(enabled=False)
        self._phase = phase

    def _check_replicas(self) -> None:
        """ValueError where a sharded module has 2D replicas and the schedule reads the next
        batch before this update (dbp_lookup="early", early_rows): both hold back or correct
        only the rows this rank's batch changes, while the replicas' sync changes the rows
        every node's batch touched (and with sync="weights" every row at a sync)."""
        early = [name for name, on in (("dbp_lookup='early'", self._dbp_lookup == "early"),
                                       ("early_rows", self._early_rows)) if on]
        replicated = [path or "the model" for path, steps in self._modules
                      if steps.replicas is not None]
        if early and replicated:
            raise ValueError(f"{OWNER}: {' and '.join(early)} with 2D replicas "
                             f"({replicated[0]}) is not supported: the next batch would read "
                             "rows that the other nodes' batches change in this update; use "
                             "dbp_lookup='after_update' and early_rows=False")

    def _check_foreign_modules(self) -> None:
        """ValueError where micro-batches would update a sharded module the pipeline does not
        drive (one TorchRec's own sharder sharded) once per micro-batch: its fused optimizer
        runs in every backward."""
        if self._num_micro == 1:
            return
        from torchrec.distributed.embedding_types import ShardedEmbeddingModule

        foreign = [(path or "the model", m) for path, m in self._model.named_modules()
                   if isinstance(m, ShardedEmbeddingModule)
                   and not isinstance(m, PipelinedModule)]
        if foreign:
            path, module = foreign[0]
            raise ValueError(f"{OWNER}: num_micro_batches={self._num_micro} with '{path}' "
                             f"sharded by another sharder ({type(module).__module__}."
                             f"{type(module).__name__}): its fused optimizer updates its tables "
                             "in every backward, so micro-batches would update them once per "
                             "micro-batch; shard it with recxla.torchrec.sharders(...) or use "
                             "num_micro_batches=1")

    def _set_model(self, model: torch.nn.Module) -> None:
        # Each recxla-sharded module's steps (recxla.torchrec.types): all the pipeline calls.
        self._modules: List[Tuple[str, EmbeddingSteps]] = [
            (path, m.steps) for path, m in model.named_modules()
            if isinstance(m, PipelinedModule)]
        if not self._modules:
            raise ValueError(f"{OWNER}: the model has no module sharded by "
                             "recxla.torchrec.EmbeddingBagCollectionSharder")
        self._model = model
        _warn_unsharded(model)
        ddp = next((m for m in model.modules() if isinstance(m, DistributedDataParallel)), None)
        self._gradient_sync = None
        self.dense_allreduce_state: Optional[CompressedAllReduce] = None
        if ddp is not None:
            check_nodes(self._dense_allreduce.nodes, ddp)
            self._gradient_sync = MicroBatchGradientSync.for_ddp(ddp)
            allreduce = self._dense_allreduce
            if allreduce.wire in COMPRESSED:
                # Made now, so that a checkpoint can be loaded into it before the first step.
                self.dense_allreduce_state = self._gradient_sync.compressor(
                    allreduce.wire, allreduce.nodes, **allreduce.compressor_options)

    @property
    def dense_buckets_together(self) -> Tuple[int, int]:
        """(steps whose dense buckets went together, steps) of the model's dense sync so far
        (DenseAllReduce's bucket_merge); (0, 0) without DDP."""
        sync = self._gradient_sync
        return (0, 0) if sync is None else (sync.steps_together, sync.steps)

    def _span(self, name: str, phase: str, **args):
        """A timeline span that also tells `phase` (see __init__) what runs."""
        if self._phase is None:
            return self.timeline.span(name, **args)
        stack = contextlib.ExitStack()
        stack.enter_context(self.timeline.span(name, **args))
        stack.enter_context(self._phase(phase))
        return stack

    # ------------------------------------------------------------------ TorchRec's interface

    def detach(self) -> torch.nn.Module:
        """The model, for use on its own (plain forward, backward, optimizer step, eval): the
        pipeline never rewrote it, and between two progress calls no all-to-all is in flight
        and DDP all-reduces as without the pipeline. The batches already loaded stay queued
        and run at the next progress calls (TorchRec's detach keeps its in-flight batches
        too); an early DBP lookup made before the model was changed outside is made again, and
        early rows sent before are dropped (every rank detaches at the same point)."""
        self.flush()
        self._attached = False
        self.drop_early_lookups()
        for batch in self._ahead:
            batch.drop_early_rows()
        return self._model

    def drop_early_lookups(self) -> None:
        """The next batch's early DBP lookup (dbp_lookup="early"), made before this step's
        update, is made again after it, from the tables as they are now: as a run resumed
        from a checkpoint taken now looks that batch up. Called at each checkpoint, it makes a
        resumed run end bit for bit where an uninterrupted one does (the early lookup plus its
        correction equals the late lookup only up to float rounding). Costs that one batch's
        early-lookup overlap; with dbp_lookup="after_update" it changes nothing. (Early rows
        stay: they are the rows' values after the update, bit for bit.)"""
        for batch in self._ahead:
            batch.drop_early_lookups()

    def attach(self, model: Optional[torch.nn.Module] = None, sparse_dist: bool = True) -> None:
        """Resumes pipelining, on `model` if given (else the detached one). A different model
        gets the queued batches' input dist again. `sparse_dist` is TorchRec's argument; recxla
        starts no input dist at attach, so it changes nothing."""
        if model is not None and model is not self._model:
            self._set_model(model)
            self._check_replicas()
            self._check_foreign_modules()
            for batch in self._ahead:
                batch.drop_early_rows()
            # Prepared again for the new model when their turn comes.
            self._ahead = collections.deque(PreparedBatch(b.raw) for b in self._ahead)
        self._attached = True

    def progress(self, dataloader_iter: Iterator) -> Any:
        """Runs one batch (trains it, or forward only when the model is in eval mode);
        -> the model's output for it. StopIteration when dataloader_iter and the queued batch
        are exhausted; the next call with a new iterator starts a new epoch."""
        if not self._attached:
            self.attach()
        if dataloader_iter is not self._loader:
            self._loader, self._exhausted = dataloader_iter, False
        with self._span("input dist", "input"):
            current = self._ahead.popleft() if self._ahead else None
            if current is None or current.micro is None and current.error is None:
                try:
                    raw = current.raw if current is not None else self._load(dataloader_iter)
                except StopIteration:
                    self.flush()  # the epoch's last update
                    raise
                current = self._prepare(raw)
            advance(current, decode=True, modules=self._modules, copies=self._copies)
        if current.error is not None:
            self.flush()
            raise current.error
        arrive(current)
        if not self._model.training:
            self.flush()
            with torch.no_grad():
                return self._step(current, dataloader_iter, training=False)
        try:
            return self._step(current, dataloader_iter, training=True)
        except BaseException:
            # What this step left in flight is waited for; its update is not applied (one
            # left pending by the previous step still is, at the next flush).
            if self._gradient_sync is not None:
                self._gradient_sync.reset()
            raise

    def flush(self) -> None:
        """Applies the dense update that the last step left pending (defer_dense_update):
        waits for its all-reduce and steps the dense optimizer. Does nothing when none is
        pending; progress, detach and an eval-mode progress call it themselves."""
        if not self._dense_update_pending:
            return
        self._dense_update_pending = False
        sync = self._gradient_sync
        try:
            if sync is not None:
                with self._span("wait dense gradients", "backward"):
                    sync.wait()
            with self._span("update", "optimizer"):
                self._optimizer.step()
        finally:
            if sync is not None:
                sync.reset()

    # ------------------------------------------------------------------ input

    def _load(self, dataloader_iter: Iterator) -> Any:
        """The next batch; StopIteration once the iterator is exhausted (never calling next
        on it again: some loaders hang when asked twice)."""
        if self._exhausted:
            raise StopIteration
        try:
            return next(dataloader_iter)
        except StopIteration:
            self._exhausted = True
            raise

    def _prepare(self, batch: Any) -> PreparedBatch:
        return prepare_batch(batch, self._modules, self._num_micro, self._split, self._copies)

    # ------------------------------------------------------------------ one step

    def _step(self, current: PreparedBatch, dataloader_iter: Iterator, training: bool) -> Any:
        """One batch on the schedule of the module docstring; without `training`, only its
        forward half (L, O, D without backward): no gradient, no update."""
        windows = self._open_windows(current)
        ahead = 2 if self._overlap else 1
        for k in range(min(ahead, self._num_micro)):
            for w in windows:
                w.start_output(k)
        early_rows = self._start_early_rows(windows) if training else []
        fresh = self._load_ahead(dataloader_iter)
        if training:
            # The previous batch's dense update, if it was left pending, lands before the first
            # dense forward that reads the weights, and while O(0) travels: it needs none of
            # this batch's rows, so the host applies it instead of waiting for them.
            self.flush()
            self._optimizer.zero_grad()
            if self._gradient_sync is not None:
                self._gradient_sync.begin_step(self._dense_allreduce)
        outputs = [self._micro_batch(windows, current.micro, k, training,
                                     early_rows if k == 0 else [], fresh if k == 0 else [])
                   for k in range(self._num_micro)]
        if fresh:
            with self._span("next batch", "input"):
                for batch in fresh:
                    advance(batch, decode=True, modules=self._modules, copies=self._copies)
        if training:
            following = self._ahead[0] if self._ahead else None
            if following is not None and self._dbp_lookup == "early" and _decoded(following):
                self._early_lookup(windows, following)
            self._update(windows, following)
        return current.micro.merge(outputs)

    def _open_windows(self, current: PreparedBatch) -> List[FrozenWindow]:
        """L: each module's window over the batch, its lookup made (or the early one taken)."""
        windows = []
        with self._span("lookup", "forward"):
            for (_, steps), state in zip(self._modules, current.inputs):
                row_bags = None if state.row_bags is None else state.row_bags.to(self._device)
                windows.append(FrozenWindow(steps, steps.to_device(state.lookup_input),
                                            state.bag_lengths, row_bags,
                                            current.early_lookup(state, steps),
                                            current.early_rows(state, steps)))
        return windows

    def _micro_batch(self, windows: List[FrozenWindow], micro, k: int, training: bool,
                     early_rows: list, fresh: List[PreparedBatch]) -> Any:
        """D(k): the model's forward (its sharded modules get O(k)'s rows when they ask) and,
        training, its backward and G(k) -> the model's output for micro-batch k."""
        # O(k)'s rows are waited for when the model's forward first calls a sharded module,
        # so that the layers it runs before (DLRM's bottom MLP) compute while they travel.
        arrival = _Arrival(functools.partial(self._receive_output, windows, k, training,
                                             early_rows, fresh))
        for i, w in enumerate(windows):
            w.steps.stage_output(functools.partial(arrival.output, i))
        if training and self._gradient_sync is not None:
            self._gradient_sync.micro_batch(last=k + 1 == self._num_micro)
        with self._span("dense", "backward" if training else "forward", micro_batch=k):
            try:
                loss, output = self._model(micro.micro_batch(k))
            finally:
                uncalled = [path for (path, _), w in zip(self._modules, windows)
                            if not w.steps.end_staging()]
            if uncalled:
                raise ValueError(f"{OWNER}: the model's forward did not call the sharded "
                                 f"module(s) {uncalled}; the pipeline sends every sharded "
                                 "module's rows for each micro-batch, so a model calls each "
                                 "one exactly once per forward")
            if training:
                # An empty micro-batch (a batch smaller than M) still runs, so that every
                # rank joins each micro-batch's collectives; its weight is 0.
                (loss * (micro.sizes[k] / max(micro.batch_size, 1))).backward()
        if training:
            arrival.embeddings()  # received, whether the model asked for them or not
            self._exchange_gradients(windows, k)
        return output

    def _early_lookup(self, windows: List[FrozenWindow], following: PreparedBatch) -> None:
        """dbp_lookup="early", while the last gradients travel: the next batch's lookup with
        the weights before this update; its FrozenWindow corrects the rows the update
        changes."""
        with self._span("early lookup", "input"):
            for w, state in zip(windows, following.inputs):
                if state.early is not None:
                    continue  # made at this step's start (early rows)
                arrive_lookup(state)
                state.lookup_input = w.steps.to_device(state.lookup_input)
                state.early = w.steps.early_lookup(state.lookup_input, w.input)

    def _update(self, windows: List[FrozenWindow], following: Optional[PreparedBatch]) -> None:
        """U: the last gradients received, the fused embedding update, the dense one (now or
        left pending, defer_dense_update); what the next batch read early is marked as read
        from the tables as they are after it."""
        with self._span("wait gradients", "backward", micro_batch=self._num_micro - 1):
            for w in windows:
                for j in w.pending_gradients():
                    w.receive_gradient(j)
        with self._span("update", "optimizer"):
            for w in windows:
                w.update()
        self._dense_update_pending = True
        if not self._defer_dense_update:
            self.flush()
        if following is not None:
            for (_, steps), state in zip(self._modules, following.inputs):
                if state.early is not None:
                    state.early_tables = steps.tables_version()
                if state.early_rows is not None:
                    state.early_rows_tables = steps.tables_version()

    def _load_ahead(self, dataloader_iter: Iterator) -> List[PreparedBatch]:
        """DBP: batches loaded and split until `_depth` wait ahead (a batch queued unprepared,
        after attach() with another model, is prepared again here) -> the batches prepared in
        this step, whose ids this step sends and decodes."""
        if not self._dbp:
            return []
        fresh = []
        with self._span("next batch", "input"):
            for i, batch in enumerate(self._ahead):
                if batch.micro is None and batch.error is None:
                    self._ahead[i] = self._prepare(batch.raw)
                    fresh.append(self._ahead[i])
            while len(self._ahead) < self._depth and not self._exhausted:
                try:
                    batch = self._prepare(self._load(dataloader_iter))
                except StopIteration:
                    break
                self._ahead.append(batch)
                fresh.append(batch)
        return fresh

    def _start_early_rows(self, windows: List[FrozenWindow]) -> list:
        """Early rows: the next batch, decoded in an earlier step, is looked up now (its early
        lookup, corrected after this update) and its cells that this update leaves as they are
        are found; their masks leave now, with O(0), the cells at D(0) (-> the EarlyRows to
        send then)."""
        following = self._ahead[0] if self._ahead else None
        if not self._early_rows or following is None or not _decoded(following):
            return []
        started = []
        # Their bytes and time are the forward embeddings' (the meter files them there).
        with self._span("early rows", "forward"):
            for w, state in zip(windows, following.inputs):
                arrive_lookup(state)
                state.lookup_input = w.steps.to_device(state.lookup_input)
                row_bags = None if state.row_bags is None else state.row_bags.to(self._device)
                state.early_rows = w.steps.start_early_rows(
                    state.lookup_input, w.input, row_bags)
                if state.early_rows.early is not None:
                    state.early = state.early_rows.early
                started.append(state.early_rows)
        return started

    def _receive_output(self, windows: List[FrozenWindow], k: int, training: bool,
                        early_rows: list, fresh: List[PreparedBatch]) -> list:
        """O(k)'s rows, waited for (-> each window's KeyedTensor), then what follows their
        arrival: O(k + 1) starts, the gradient hooks; at k = 0 the early rows and the ids of
        the batches loaded in this step leave."""
        with self._span("wait embeddings", "forward", micro_batch=k):
            embeddings = [w.receive_output(k) for w in windows]
        if self._overlap and k + 1 < self._num_micro:
            for w in windows:
                w.start_output(k + 1)
        if training and self._overlap:
            for w in windows:
                w.send_on_arrival(k)
        if early_rows:
            # The masks travelled with O(0): the early rows leave now, during this batch's
            # dense forward and backward.
            with self._span("early rows", "forward"):
                for rows in early_rows:
                    rows.send()
        if fresh:
            # The ids of the batches loaded in this step leave now, so they travel during this
            # batch's dense compute, when the links are otherwise idle (their sizes went at the
            # start of the step and have long arrived), and not beside O(0).
            with self._span("next batch", "input"):
                for batch in fresh:
                    advance(batch, decode=False)
        return embeddings

    def _exchange_gradients(self, windows: List[FrozenWindow], k: int) -> None:
        """After D(k)'s backward: G(k) sent (at once without overlap; with it, the autograd
        hook already did), and the gradients of earlier micro-batches received."""
        if not self._overlap:
            with self._span("send gradients", "backward", micro_batch=k):
                for w in windows:
                    grad = w.arrived_gradient(k)
                    if grad is not None:
                        w.start_gradient(k, grad)
        with self._span("wait gradients", "backward", micro_batch=k):
            for w in windows:
                for j in w.pending_gradients():
                    if j < k or not self._overlap:
                        w.receive_gradient(j)


def _warn_unsharded(model: torch.nn.Module) -> None:
    """One warning per embedding module DistributedModelParallel left unsharded (it had no
    sharder for its type): every rank then holds a full copy, trained by the dense optimizer
    through DDP, and an optimizer attached to it with apply_optimizer_in_backward never runs."""
    from torchrec.modules.embedding_modules import (EmbeddingBagCollection,
                                                    EmbeddingCollection)

    for path, m in model.named_modules():
        if isinstance(m, (EmbeddingBagCollection, EmbeddingCollection)):
            warnings.warn(
                f"{OWNER}: {type(m).__name__} '{path}' is not sharded: DistributedModelParallel "
                "had no sharder for its type, so every rank holds a full copy trained by the "
                "dense optimizer (an optimizer attached with apply_optimizer_in_backward does "
                "not run); pass recxla.torchrec.sharders(...) to the planner and to "
                "DistributedModelParallel", stacklevel=3)


def _decoded(batch: PreparedBatch) -> bool:
    """The batch's ids are decoded at the owners (and it has no error)."""
    return batch.micro is not None and batch.error is None and \
        all(state.lookup_input is not None for state in batch.inputs)


class _Arrival:
    """One micro-batch's rows, received once (`receive()` -> each window's output) by
    whichever asks first: a sharded module's forward (`output(i)`, what the pipeline stages)
    or the pipeline after the model's forward and backward (`embeddings()`)."""

    def __init__(self, receive: Callable[[], list]):
        self._receive = receive
        self._embeddings: Optional[list] = None

    def embeddings(self) -> list:
        if self._embeddings is None:
            self._embeddings = self._receive()
        return self._embeddings

    def output(self, i: int):
        return self.embeddings()[i]
