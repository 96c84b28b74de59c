"""The sharder whose sharding types the planner may choose from.

recxla's own sharder (`recxla.torchrec.EmbeddingBagCollectionSharder`) offers row-wise sharding
on CPU as well, since recxla owns the all-to-all that row-wise needs there; the planner uses
it. `RowWiseEverywhereSharder` gives TorchRec's own planner the same sharding types (TorchRec's
EmbeddingBagCollectionSharder with row_wise added for every device), so that a comparison of
planners is not a comparison of sharding types.
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
    """recxla's EmbeddingBagCollectionSharder (default comms: e4m3 forward, e5m2 backward:
    recxla.formats.DEFAULT_FWD_COMM / DEFAULT_BWD_COMM)."""
    from recxla.torchrec import EmbeddingBagCollectionSharder

    return EmbeddingBagCollectionSharder()
