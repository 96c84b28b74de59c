"""Dense gradients over micro-batches: accumulated locally, all-reduced once per batch.

DistributedModelParallel wraps the dense part in DDP (static graph by default, which does not
allow `no_sync`). recxla's pipeline keeps DDP and gives it a comm hook instead: for every
micro-batch but the last, a bucket comes back unchanged (its gradients keep accumulating in
place, gradient_as_bucket_view); for the last, each bucket is averaged over the ranks as soon
as DDP has it, while the rest of that backward runs (DDP's bucketed all-reduce, the same one
the sequential step uses). precision="bf16" sends the buckets as bfloat16 (half the bytes;
torch's bf16_compress_hook does the same for one micro-batch).

A DDP module takes one comm hook, so every pipeline on the same model shares one
MicroBatchGradientSync (`for_ddp`). Outside a pipeline's step it is left at sync=True in fp32:
DDP's own all-reduce (average over the ranks), so the model trains on its own as without it.
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
    backward and `wire` (wire_dtype) for its step, and `reset()`s both after it."""

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
        try:
            ddp.register_comm_hook(self, self._hook)
        except (RuntimeError, AssertionError) as e:
            raise ValueError(
                f"{OWNER}: the pipeline accumulates dense gradients through a DDP comm hook, and "
                f"this DDP module already has one ({e}); build DistributedModelParallel without "
                "allreduce_comm_precision (pass dense_allreduce='bf16' to the pipeline "
                "instead)") from e

    def reset(self) -> None:
        """DDP's own behaviour: every backward all-reduces (fp32, averaged)."""
        self.sync, self.wire = True, None

    @staticmethod
    def _hook(state: "MicroBatchGradientSync", bucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if not state.sync:
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
