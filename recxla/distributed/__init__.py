"""recxla's collectives.

- `quantized_all_to_all`: rows through an all-to-all in the row codec's wire format
  (recxla.formats).
- `all_reduce_by_node`: a sum over every rank that is summed inside each node first and sends
  each node's share across the nodes once; `wait_together` completes several with one
  all-gather inside the node.
- `FP8AllReduce` / `fp8_compress_hook`: dense gradients averaged in FP8 with error feedback,
  by node or over one group; the hook is for any DDP model.
- `PowerSGDAllReduce` / `powersgd_compress_hook`: dense gradients averaged as low-rank
  factors with error feedback (PowerSGD), by node or over one group, the same bits whatever
  DDP's buckets and across a resume; the hook is for any DDP model.
"""

from recxla.distributed.all_reduce_by_node import (
    AllReduceByNodeHandle,
    all_reduce_by_node,
    wait_together,
)
from recxla.distributed.compressed_all_reduce import CompressedAllReduce
from recxla.distributed.fp8_all_reduce import FP8AllReduce, FP8AllReduceHandle, fp8_compress_hook
from recxla.distributed.powersgd_all_reduce import (
    PowerSGDAllReduce,
    PowerSGDAllReduceHandle,
    powersgd_compress_hook,
)
from recxla.distributed.quantized_all_to_all import (
    QuantizedAllToAllHandle,
    quantized_all_to_all,
)

__all__ = ["AllReduceByNodeHandle", "CompressedAllReduce", "FP8AllReduce",
           "FP8AllReduceHandle", "PowerSGDAllReduce", "PowerSGDAllReduceHandle",
           "QuantizedAllToAllHandle", "all_reduce_by_node", "fp8_compress_hook",
           "powersgd_compress_hook", "quantized_all_to_all", "wait_together"]
