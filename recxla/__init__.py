"""recxla: communication and embedding kernels for TorchRec recommendation training.

Public API:
- quantize_rows / dequantize_rows / row_bytes: the row codec (FP8 e4m3/e5m2 with per-row scales,
  or bf16/fp16/fp32), whose output is the wire format of the quantized all-to-all.
- quantized_all_to_all: quantize -> all_to_all_single -> dequantize as one autograd op.
- recxla.torchrec.qcomm_codecs_registry: the same codec for TorchRec's sharders.
"""

from recxla._extension import built_with_cuda
from recxla.formats import FORMATS, row_bytes
from recxla.ops.fp8_rows import dequantize_rows, quantize_rows
from recxla.ops.dedup import bucketize_by_rank, unique_keys  # noqa: F401  (key dedup)
from recxla.clustering import cluster_samples  # noqa: F401  (key-centric sample clustering)
from recxla.distributed import quantized_all_to_all
from recxla import nn  # noqa: F401  (recxla.nn.EmbeddingBagCollection, imported on use)

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "built_with_cuda",
    "dequantize_rows",
    "quantize_rows",
    "quantized_all_to_all",
    "row_bytes",
]
