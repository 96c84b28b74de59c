"""The sharder whose sharding types the planner may choose from.

recxla's own sharder (`recxla.torchrec.EmbeddingBagCollectionSharder`) offers row-wise sharding
on CPU as well, since recxla owns the all-to-all that row-wise needs there. Until it exists,
planning uses a stand-in: TorchRec's EmbeddingBagCollectionSharder with row_wise added for
every device. The stand-in is for planning and for checking that DistributedModelParallel
accepts a plan; TorchRec's own row-wise forward needs a reduce-scatter that gloo lacks.
"""

from typing import List

from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ShardingType


class RowWiseEverywhereSharder(EmbeddingBagCollectionSharder):
    """TorchRec's EmbeddingBagCollectionSharder offering row_wise on every device type."""

    def sharding_types(self, compute_device_type: str) -> List[str]:
        types = list(super().sharding_types(compute_device_type))
        if ShardingType.ROW_WISE.value not in types:
            types.append(ShardingType.ROW_WISE.value)
        return types


def planning_sharder():
    """recxla's EmbeddingBagCollectionSharder where it exists, the stand-in otherwise."""
    try:
        from recxla.torchrec import EmbeddingBagCollectionSharder as RecxlaSharder
    except ImportError:
        return RowWiseEverywhereSharder()
    return RecxlaSharder()
