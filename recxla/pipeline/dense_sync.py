"""Dense gradients over micro-batches: accumulated locally, all-reduced once per batch.

DistributedModelParallel wraps the dense part in DDP (static graph by default, which does not
allow `no_sync`). recxla's pipeline keeps DDP and gives it a comm hook instead: for every
micro-batch but the last, a bucket comes back unchanged (its gradients keep accumulating in
place, gradient_as_bucket_view); for the last, each bucket is averaged over the ranks as soon
as DDP has it, while the rest of that backward runs (DDP's bucketed all-reduce, the same one
the sequential step uses). precision="bf16" sends the buckets as bfloat16 (half the bytes;
torch's bf16_compress_hook does the same for one micro-batch).
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from recxla.pipeline.micro_batches import OWNER

PRECISIONS = ("fp32", "bf16")


class MicroBatchGradientSync:
    """Installs the comm hook on `ddp`; set `sync` before each micro-batch's backward."""

    def __init__(self, ddp: DistributedDataParallel, precision: str = "fp32"):
        if precision not in PRECISIONS:
            raise ValueError(f"{OWNER}: dense_allreduce must be one of {PRECISIONS}, got "
                             f"{precision!r}")
        self.group = ddp.process_group
        self.world = dist.get_world_size(self.group)
        self.sync = True
        self.wire = torch.bfloat16 if precision == "bf16" else None
        try:
            ddp.register_comm_hook(self, MicroBatchGradientSync._hook)
        except (RuntimeError, AssertionError) as e:
            raise ValueError(
                f"{OWNER}: the pipeline accumulates dense gradients through a DDP comm hook, and "
                f"this DDP module already has one ({e}); build DistributedModelParallel without "
                "allreduce_comm_precision (pass dense_allreduce='bf16' to the pipeline "
                "instead)") from e

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
