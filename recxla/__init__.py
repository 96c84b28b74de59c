"""recxla: communication and embedding kernels for TorchRec recommendation training.

Public API:
- quantize_rows / dequantize_rows / row_bytes: the row codec (FP8 e4m3/e5m2 with per-row scales,
  or bf16/fp16/fp32), whose output is the wire format of the quantized all-to-all.
- quantized_all_to_all: quantize -> all_to_all_single -> dequantize as one autograd op.
- recxla.torchrec.qcomm_codecs_registry: the same codec for TorchRec's sharders.
- unique_keys / bucketize_by_rank: keys deduplicated per segment (table, or table and owning
  rank) with the inverse index that re-expands them.
- cluster_samples / permute_samples: key-centric sample clustering into micro-batches.
- recxla.nn.EmbeddingBagCollection: TorchRec's EmbeddingBagCollection with deduplicated lookups
  and a fused sparse optimizer.
- recxla.data: the seeded synthetic ranking-log dataset (Criteo-sized by default).
"""

from recxla._extension import built_with_cuda
from recxla.ops.cluster import cluster_samples, permute_samples
from recxla.distributed import quantized_all_to_all
from recxla.formats import FORMATS, row_bytes
from recxla.ops.dedup import bucketize_by_rank, unique_keys
from recxla.ops.fp8_rows import dequantize_rows, quantize_rows

# recxla.nn resolves its modules on first use, so `import recxla` does not import TorchRec.
from recxla import nn  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "FORMATS",
    "bucketize_by_rank",
    "built_with_cuda",
    "cluster_samples",
    "dequantize_rows",
    "nn",
    "permute_samples",
    "quantize_rows",
    "quantized_all_to_all",
    "row_bytes",
    "unique_keys",
]
