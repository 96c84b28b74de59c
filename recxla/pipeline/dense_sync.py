"""Dense gradients over micro-batches: accumulated locally, all-reduced once per batch.

DistributedModelParallel wraps the dense part in DDP (static graph by default, which does not
allow `no_sync`). recxla's pipeline keeps DDP and gives it a comm hook instead: for every
micro-batch but the last, a bucket comes back unchanged (its gradients keep accumulating in
place, gradient_as_bucket_view); for the last, each bucket is averaged over the ranks as soon
as DDP has it, while the rest of that backward runs (DDP's bucketed all-reduce, the same one
the sequential step uses). precision="bf16" sends the buckets as bfloat16 (half the bytes;
torch's bf16_compress_hook does the same for one micro-batch).

Deferred wait: inside a pipeline's step the all-reduces are not waited for at the end of the
backward (where DDP waits for its buckets) but just before the dense optimizer step
(`wait()`): the hook hands DDP its bucket unchanged, already complete, and the reduced values
are written into the bucket when `wait()` collects them. The gradient all-to-all's wait, the
next batch's decode and the embedding update run in between while the buckets travel. It needs
gradient_as_bucket_view (TorchRec's DDP wrapper sets it: the parameters' .grad are views of the
buckets), else DDP copies the bucket into .grad at the end of the backward and the deferred
result would never reach it; without it the hook waits as DDP does.

A DDP module takes one comm hook, so every pipeline on the same model shares one
MicroBatchGradientSync (`for_ddp`). Outside a pipeline's step it is left at sync=True in fp32,
not deferred: DDP's own all-reduce (average over the ranks), so the model trains on its own as
without it.
"""

import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from recxla.pipeline.micro_batches import OWNER

PRECISIONS = ("fp32", "bf16")


def wire_dtype(precision: str):
    """The all-reduce's wire dtype for `precision` (None: the gradients' own, fp32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"{OWNER}: dense_allreduce must be one of {PRECISIONS}, got "
                         f"{precision!r}")
    return torch.bfloat16 if precision == "bf16" else None


_INSTALLED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class MicroBatchGradientSync:
    """Installs the comm hook on `ddp`; a pipeline sets `sync` before each micro-batch's
    backward, `wire` (wire_dtype) and `deferred` for its step, calls `wait()` before its dense
    optimizer step, and `reset()`s after it."""

    @classmethod
    def for_ddp(cls, ddp: DistributedDataParallel) -> "MicroBatchGradientSync":
        """The one instance of `ddp`, installed on first use."""
        if ddp not in _INSTALLED:
            _INSTALLED[ddp] = cls(ddp)
        return _INSTALLED[ddp]

    def __init__(self, ddp: DistributedDataParallel):
        self.group = ddp.process_group
        self.world = dist.get_world_size(self.group)
        self.sync = True
        self.wire = None
        self.deferred = False
        # Deferring needs the buckets to be the gradients' storage (see the module docstring).
        self.can_defer = bool(getattr(ddp, "gradient_as_bucket_view", False))
        # (bucket buffer, tensor on the wire, in-flight work) of each deferred bucket, in order.
        self.in_flight = []
        try:
            ddp.register_comm_hook(self, self._hook)
        except (RuntimeError, AssertionError) as e:
            raise ValueError(
                f"{OWNER}: the pipeline accumulates dense gradients through a DDP comm hook, and "
                f"this DDP module already has one ({e}); build DistributedModelParallel without "
                "allreduce_comm_precision (pass dense_allreduce='bf16' to the pipeline "
                "instead)") from e

    def wait(self) -> None:
        """Waits for the deferred all-reduces and writes each bucket's average into it (the
        parameters' .grad)."""
        pending, self.in_flight = self.in_flight, []
        for buffer, sent, work in pending:
            work.wait()
            buffer.copy_(sent)

    def reset(self) -> None:
        """DDP's own behaviour: every backward all-reduces (fp32, averaged) and DDP waits. Any
        deferred all-reduce still in flight is waited for first (a step that raised), so no
        collective is left behind."""
        self.wait()
        self.sync, self.wire, self.deferred = True, None, False

    @staticmethod
    def _hook(state: "MicroBatchGradientSync", bucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if not state.sync:
            done = torch.futures.Future()
            done.set_result(buffer)
            return done
        if state.deferred and state.can_defer:
            # The average travels in its own tensor; DDP gets the bucket back as it is.
            sent = (buffer if state.wire is None else buffer.to(state.wire)) / state.world
            state.in_flight.append((buffer, sent, dist.all_reduce(sent, group=state.group,
                                                                 async_op=True)))
            done = torch.futures.Future()
            done.set_result(buffer)
            return done
        if state.wire is None:
            buffer.div_(state.world)
            work = dist.all_reduce(buffer, group=state.group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0])
        compressed = buffer.to(state.wire).div_(state.world)
        work = dist.all_reduce(compressed, group=state.group, async_op=True)

        def decompress(fut):
            buffer.copy_(fut.value()[0])
            return buffer

        return work.get_future().then(decompress)
