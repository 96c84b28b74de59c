"""Dense gradients over micro-batches: accumulated locally, all-reduced once per batch.

DistributedModelParallel wraps the dense part in DDP (static graph by default, which does not
allow `no_sync`). recxla's pipeline keeps DDP and gives it a comm hook instead: for every
micro-batch but the last, a bucket comes back unchanged (its gradients keep accumulating in
place, gradient_as_bucket_view); for the last, each bucket is averaged over the ranks as soon
as DDP has it, while the rest of that backward runs (DDP's bucketed all-reduce, the same one
the sequential step uses). precision="bf16" sends the buckets as bfloat16 (half the bytes;
torch's bf16_compress_hook does the same for one micro-batch); "fp8" as e4m3 with a scale per
128 values and error feedback (recxla.distributed.FP8AllReduce: about a quarter of the bytes);
"powersgd" as low-rank factors with error feedback (recxla.distributed.PowerSGDAllReduce:
about a fiftieth of bf16's bytes on the default DLRM, the backward's buckets sent together
with the last). Both by node or over every rank; their state (residuals, factors) is the
pipeline's `dense_allreduce_state`, which a checkpoint saves.

Deferred wait: inside a pipeline's step the all-reduces are not waited for at the end of the
backward (where DDP waits for its buckets) but just before the dense optimizer step
(`wait()`): the hook hands DDP its bucket unchanged, already complete, and the reduced values
are written into the bucket when `wait()` collects them. The gradient all-to-all's wait, the
next batch's decode and the embedding update run in between while the buckets travel. It needs
gradient_as_bucket_view (TorchRec's DDP wrapper sets it: the parameters' .grad are views of the
buckets), else DDP copies the bucket into .grad at the end of the backward and the deferred
result would never reach it; without it the hook waits as DDP does.

By node: given the node layout (`nodes`, make_topology_2d's groups), a deferred bucket is summed
inside each node, then each rank sends 1/ranks_per_node of it across the nodes
(recxla.distributed.all_reduce_by_node: a third less across 2 nodes of 2 ranks than gloo's
ring). It needs the deferred wait (its last collective runs at `wait()`); a bucket DDP waits
for itself goes by the ring.

Buckets one by one or together (DenseAllReduce's `bucket_merge`, recxla.pipeline.bucket_merge):
deferred buckets leave as DDP hands them over ("off"), or are held and leave as one sum when the
last one is ready ("on": fewer collectives), or, by default ("auto"), whichever rank 0 measured
to make the shorter steps, where that choice cannot change the bits; its choice travels to the
other ranks as one value after the step's first bucket, inside the sum.

The pipeline takes all of this as one value, a `DenseAllReduce` (wire, node layout, PowerSGD's
rank and start), and owns the sync made from it. A DDP module takes one comm hook, so every
pipeline on the same model shares one MicroBatchGradientSync (`for_ddp`), each giving it its
DenseAllReduce at the start of its steps (`begin_step`). Outside a pipeline's step the hook is
DDP's own all-reduce (fp32, averaged over the ranks, waited for by DDP), so the model trains on
its own as without it.
"""

import time
import weakref
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from recxla.distributed.all_reduce_by_node import (AllReduceByNodeHandle, all_reduce_by_node,
                                                    wait_together)
from recxla.distributed.compressed_all_reduce import CompressedAllReduce
from recxla.distributed.fp8_all_reduce import FP8AllReduce
from recxla.distributed.powersgd_all_reduce import DEFAULT_START_STEP, PowerSGDAllReduce
from recxla.pipeline.bucket_merge import MergeTuner, bits_independent_of_grouping
from recxla.pipeline.choices import BUCKET_MERGE, BUCKET_MERGE_WIRES
from recxla.pipeline.choices import DENSE_ALLREDUCE_FORMATS as PRECISIONS
from recxla.pipeline.micro_batches import OWNER

# The wires that a CompressedAllReduce carries (by `precision` name), and its class.
COMPRESSED = {"fp8": FP8AllReduce, "powersgd": PowerSGDAllReduce}


def wire_dtype(precision: str):
    """The all-reduce's wire for `precision`: None (the gradients' own dtype, fp32),
    torch.bfloat16, or the name of a compressed wire (a key of COMPRESSED)."""
    if precision not in PRECISIONS:
        raise ValueError(f"{OWNER}: dense_allreduce must be one of {PRECISIONS}, got "
                         f"{precision!r}")
    return torch.bfloat16 if precision == "bf16" else \
        precision if precision in COMPRESSED else None


_INSTALLED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def check_nodes(nodes, ddp: Optional[DistributedDataParallel]) -> None:
    """Raises unless `nodes` is None or a node layout (a Topology2D) and, given `ddp`, lays
    out exactly the ranks of its group, which must be every rank (the layout numbers ranks
    globally)."""
    if nodes is None:
        return
    for attr in ("num_nodes", "ranks_per_node", "shard_group", "replica_group"):
        if not hasattr(nodes, attr):
            raise TypeError(f"{OWNER}: DenseAllReduce's nodes must be a "
                            f"recxla.torchrec.Topology2D (make_topology_2d), got "
                            f"{type(nodes).__name__}")
    if ddp is None:
        return
    world = dist.get_world_size(ddp.process_group)
    if world != dist.get_world_size():
        raise ValueError(f"{OWNER}: DenseAllReduce's nodes need DDP over every rank; its group "
                         f"has {world} of {dist.get_world_size()}")
    if nodes.num_nodes * nodes.ranks_per_node != world:
        raise ValueError(f"{OWNER}: DenseAllReduce's nodes lay out {nodes.num_nodes} nodes x "
                         f"{nodes.ranks_per_node} ranks, but DDP's group has {world} ranks")


@dataclass(frozen=True)
class DenseAllReduce:
    """How a TrainPipeline all-reduces the dense gradients (its `dense_allreduce`), one value.

    Args:
        wire: "fp32", "bf16", "fp8" (e4m3 with error feedback, FP8AllReduce) or "powersgd"
            (low-rank factors with error feedback, PowerSGDAllReduce).
        nodes: the node layout (recxla.torchrec.make_topology_2d) to all-reduce by node (see
            the module docstring); None: one all-reduce over DDP's group.
        powersgd_rank: wire "powersgd": the factors' columns per matrix.
        powersgd_start: wire "powersgd": averages of each parameter sent whole before it is
            compressed.
        bucket_merge: wires "fp32" and "bf16": "off" sends each DDP bucket as soon as DDP has
            it, "on" all of a step's buckets together once the last is ready (one sum), "auto"
            chooses each step by measured step time where the bits do not depend on it
            (recxla.pipeline.bucket_merge), else as "off".
    """

    wire: str = "fp32"
    nodes: object = None
    powersgd_rank: int = 1
    powersgd_start: int = DEFAULT_START_STEP
    bucket_merge: str = "auto"

    def __post_init__(self):
        wire_dtype(self.wire)
        check_nodes(self.nodes, None)
        for name, value, least in (("powersgd_rank", self.powersgd_rank, 1),
                                   ("powersgd_start", self.powersgd_start, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{OWNER}: DenseAllReduce's {name} must be an int >= {least}, "
                                 f"got {value!r}")
        if self.bucket_merge not in BUCKET_MERGE:
            raise ValueError(f"{OWNER}: DenseAllReduce's bucket_merge must be one of "
                             f"{BUCKET_MERGE}, got {self.bucket_merge!r}")
        if self.bucket_merge == "on" and self.wire not in BUCKET_MERGE_WIRES:
            raise ValueError(f"{OWNER}: DenseAllReduce's bucket_merge='on' applies to the fp32 "
                             f"and bf16 wires; the {self.wire} wire sends its buckets its own way")
        if self.wire != "powersgd" and (self.powersgd_rank, self.powersgd_start) != \
                (1, DEFAULT_START_STEP):
            raise ValueError(f"{OWNER}: DenseAllReduce's powersgd_rank and powersgd_start set "
                             f"the PowerSGD wire, not {self.wire!r}")

    @classmethod
    def of(cls, value) -> "DenseAllReduce":
        """`value` as a DenseAllReduce: one already, or a wire's name (no node layout)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(value)
        raise TypeError(f"{OWNER}: dense_allreduce must be a wire's name {PRECISIONS} or a "
                        f"recxla.pipeline.DenseAllReduce, got {type(value).__name__}")

    @property
    def dtype(self):
        """wire_dtype(wire)."""
        return wire_dtype(self.wire)

    @property
    def compressor_options(self) -> dict:
        """The CompressedAllReduce's keyword arguments of a compressed wire."""
        return {"rank": self.powersgd_rank, "start_step": self.powersgd_start} \
            if self.wire == "powersgd" else {}


class _DeferredBucket:
    """The average of one or more buckets on its way: `sent` holds their values one after
    another (with bucket_merge's choice after the first one's when `carries`); `handle` is
    the all-reduce's Work, or the AllReduceByNodeHandle. wait() waits for it, writes each
    bucket's average into the bucket and reads the carried choice (`carried`)."""

    def __init__(self, buffers: List[torch.Tensor], sent: torch.Tensor, handle,
                 carries: bool = False):
        self.buffers, self.sent, self.handle, self.carries = buffers, sent, handle, carries
        self.carried: Optional[bool] = None

    def gather(self) -> None:
        """Nothing left to issue (an FP8AllReduceHandle issues its all-gather here)."""

    def wait(self) -> None:
        self.handle.wait()
        at = 0
        for i, buffer in enumerate(self.buffers):
            buffer.copy_(self.sent[at: at + buffer.numel()])
            at += buffer.numel()
            if i == 0 and self.carries:
                # Rank 0's 1.0 or 0.0, every other rank's 0.0: the sum is exact on any wire.
                self.carried = bool(self.sent[at].item() > 0.5)
                at += 1


class MicroBatchGradientSync:
    """Installs the comm hook on `ddp`. A pipeline calls `begin_step(its DenseAllReduce)` at
    the start of each step, `micro_batch(last)` before each micro-batch's backward, `wait()`
    before its dense optimizer step and `reset()` after it."""

    @classmethod
    def for_ddp(cls, ddp: DistributedDataParallel) -> "MicroBatchGradientSync":
        """The one instance of `ddp`, installed on first use."""
        if ddp not in _INSTALLED:
            _INSTALLED[ddp] = cls(ddp)
        return _INSTALLED[ddp]

    def __init__(self, ddp: DistributedDataParallel):
        self.group = ddp.process_group
        self.named_parameters = list(ddp.module.named_parameters())
        # (compressed wire, node layout's id or None: the flat group) -> its CompressedAllReduce
        self._compressors = {}
        self.world = dist.get_world_size(self.group)
        # The running step's DenseAllReduce (None outside a step: DDP's own all-reduce), and
        # whether this backward is the step's last (the one that all-reduces).
        self.running: Optional[DenseAllReduce] = None
        self.last_micro_batch = True
        # Deferring needs the buckets to be the gradients' storage (see the module docstring).
        self.can_defer = bool(getattr(ddp, "gradient_as_bucket_view", False))
        # The deferred buckets (_DeferredBucket), in order.
        self.in_flight = []
        # bucket_merge: whether this step's buckets go together, the buckets held until the
        # last one is ready, and, with "auto", the value this rank appends to the step's first
        # bucket (rank 0's choice for the next step), rank 0's tuner, and how the next step
        # goes (read from the last sum that carried it).
        self.merged = False
        self._held = []
        self._carry: Optional[float] = None
        self.tuner: Optional[MergeTuner] = None
        self._next_merged = False
        self._step_started: Optional[float] = None
        self._ways = (False, False)  # the last two steps' ways, the latest last
        # Steps begun, and those whose buckets went together (the run's summary).
        self.steps = self.steps_together = 0
        try:
            ddp.register_comm_hook(self, self._hook)
        except (RuntimeError, AssertionError) as e:
            raise ValueError(
                f"{OWNER}: the pipeline accumulates dense gradients through a DDP comm hook, and "
                f"this DDP module already has one ({e}); build DistributedModelParallel without "
                "allreduce_comm_precision (pass dense_allreduce='bf16' to the pipeline "
                "instead)") from e

    def begin_step(self, allreduce: DenseAllReduce) -> None:
        """A pipeline step starts: its all-reduce goes as `allreduce` says, deferred to
        wait(), after the last micro-batch's backward."""
        self.running, self.last_micro_batch = allreduce, True
        self._held, self._carry = [], None
        self.steps += 1
        self._choose_way(allreduce)
        self.steps_together += self.merged

    def _choose_way(self, allreduce: DenseAllReduce) -> None:
        """Whether this step's buckets go together (bucket_merge), and with "auto" the value
        this rank carries in the step's first bucket."""
        way = allreduce.bucket_merge
        if way != "auto" or not self.can_defer or \
                not bits_independent_of_grouping(allreduce.nodes, allreduce.wire):
            self.merged = way == "on" and self.can_defer  # DenseAllReduce keeps "on" to its wires
            return
        now = time.perf_counter()
        self.merged = self._next_merged
        if dist.get_rank(self.group) == 0:
            if self.tuner is None:
                self.tuner = MergeTuner()
            elif self._step_started is not None:
                self.tuner.record(now - self._step_started, self._ways[1],
                                  self._ways[0] == self._ways[1])
            self._carry = float(self.tuner.propose())
        else:
            self._carry = 0.0
        self._step_started = now
        self._ways = (self._ways[1], self.merged)

    def micro_batch(self, last: bool) -> None:
        """The next backward is the step's last micro-batch's (it all-reduces) or not (its
        gradients accumulate in place)."""
        self.last_micro_batch = last

    def compressor(self, wire: str, nodes=None, **options) -> CompressedAllReduce:
        """The CompressedAllReduce of compressed wire `wire` ("fp8", "powersgd") for node
        layout `nodes` (None: over every rank), made on first use with `options` (the class's
        keyword arguments, e.g. rank=2 for PowerSGD): its state carries from step to step.
        Options for one already made must be the ones it was made with."""
        if wire not in COMPRESSED:
            raise ValueError(f"{OWNER}: a compressed dense all-reduce is one of "
                             f"{tuple(COMPRESSED)}, got {wire!r}")
        key = (wire, None if nodes is None else id(nodes))
        if key not in self._compressors:
            groups = {"group": self.group} if nodes is None else \
                {"node_group": nodes.shard_group, "cross_group": nodes.replica_group}
            self._compressors[key] = (
                COMPRESSED[wire](self.named_parameters, **groups, **options), options)
        made, made_with = self._compressors[key]
        if options and options != made_with:
            raise ValueError(f"{OWNER}: the {wire} all-reduce was made with {made_with}, "
                             f"not {options}")
        return made

    def wait(self) -> None:
        """Waits for the deferred all-reduces and writes each bucket's average into it (the
        parameters' .grad): every last collective is issued before the first wait."""
        pending, self.in_flight = self.in_flight, []
        # The buckets summed by node end with one all-gather inside the node for all of them.
        wait_together([b.handle for b in pending if isinstance(b, _DeferredBucket) and
                       isinstance(b.handle, AllReduceByNodeHandle)])
        CompressedAllReduce.finish(pending)
        for bucket in pending:
            if getattr(bucket, "carried", None) is not None:
                self._next_merged = bucket.carried

    def reset(self) -> None:
        """DDP's own behaviour: every backward all-reduces (fp32, averaged) and DDP waits. Any
        deferred all-reduce still in flight is waited for first (a step that raised), so no
        collective is left behind, and buckets held for a last one that never came (a
        backward that raised) are dropped."""
        self.wait()
        for made, _ in self._compressors.values():
            made.drop_pending()
        self.running, self.last_micro_batch = None, True
        self._held, self._carry = [], None

    def defer_bucket(self, buffer: torch.Tensor, wire, step: DenseAllReduce,
                     last: bool) -> None:
        """A bucket of the step's last backward (its buffer, in the wire dtype `wire` or None:
        its own): its average travels in a tensor of its own, DDP gets the bucket back as it
        is, and wait() writes the average into it. It leaves now, or with bucket_merge's
        buckets together, held until the `last` one; bucket_merge's choice rides after the
        step's first bucket."""
        carry, self._carry = self._carry, None
        n = buffer.numel()
        sent = buffer.new_empty(n + (carry is not None), dtype=wire or buffer.dtype)
        if sent.dtype == buffer.dtype:  # one pass; the same bits as a copy divided in place
            torch.div(buffer, self.world, out=sent[:n])
        else:  # cast, then divided on the wire dtype (as torch's bf16 compress hook does)
            sent[:n].copy_(buffer).div_(self.world)
        if carry is not None:
            sent[n] = carry
        self._held.append((buffer, sent, carry is not None))
        if not self.merged or last:
            self._send_held(step)

    def _send_held(self, step: DenseAllReduce) -> None:
        """Starts the average of the held buckets (one, or all of the step's when they go
        together: their `sent` concatenated, one copy) as one collective."""
        held, self._held = self._held, []
        sent = held[0][1] if len(held) == 1 else torch.cat([s for _, s, _ in held])
        if step.nodes is None:
            handle = dist.all_reduce(sent, group=self.group, async_op=True)
        else:
            handle = all_reduce_by_node(sent, step.nodes.shard_group, step.nodes.replica_group)
        self.in_flight.append(_DeferredBucket([b for b, _, _ in held], sent, handle,
                                              carries=held[0][2]))

    @staticmethod
    def _hook(state: "MicroBatchGradientSync", bucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if not state.last_micro_batch:
            done = torch.futures.Future()
            done.set_result(buffer)
            return done
        step = state.running
        wire = None if step is None else step.dtype
        deferred = step is not None and state.can_defer
        if wire in COMPRESSED:
            compressor = state.compressor(wire, step.nodes, **step.compressor_options)
            if not deferred:
                return compressor.hook(bucket)
            # Written into the bucket's gradient views at wait().
            handle = compressor.start_bucket(bucket)
            if handle is not None:
                state.in_flight.append(handle)
            done = torch.futures.Future()
            done.set_result(buffer)
            return done
        if deferred:
            state.defer_bucket(buffer, wire, step, last=bucket.is_last())
            done = torch.futures.Future()
            done.set_result(buffer)
            return done
        if wire is None:
            buffer.div_(state.world)
            work = dist.all_reduce(buffer, group=state.group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        compressed = buffer.to(wire).div_(state.world)
        work = dist.all_reduce(compressed, group=state.group, async_op=True)

        def decompress(fut):
            buffer.copy_(fut.value()[0])
            return buffer

        return work.get_future().then(decompress)
