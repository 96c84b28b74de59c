"""recxla's collectives.

- `quantized_all_to_all`: rows through an all-to-all in the row codec's wire format
  (recxla.formats).
- `all_reduce_by_node`: a sum over every rank that is summed inside each node first and sends
  each node's share across the nodes once.
"""

from recxla.distributed.all_reduce_by_node import AllReduceByNodeHandle, all_reduce_by_node
from recxla.distributed.quantized_all_to_all import (
    QuantizedAllToAllHandle,
    quantized_all_to_all,
)

__all__ = ["AllReduceByNodeHandle", "QuantizedAllToAllHandle", "all_reduce_by_node",
           "quantized_all_to_all"]
