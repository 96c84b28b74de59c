"""The one check of an EmbeddingBagConfig that recxla's modules take: recxla.nn's
EmbeddingBagCollection (FP32 tables) and the sharded module of
recxla.torchrec.EmbeddingBagCollectionSharder (FP32 or FP16). Errors name the module, the
table and the rule, as TorchRec's module would raise them."""

from typing import Sequence

from torchrec.modules.embedding_configs import DataType, PoolingType


def check_table_config(config, weighted: bool, owner: str,
                       data_types: Sequence[DataType] = (DataType.FP32,)) -> None:
    """TypeError for a data type outside `data_types`; ValueError for a pooling other than SUM
    or MEAN; NotImplementedError for MEAN pooling with per-sample weights, as TorchRec's
    EmbeddingBagCollection (torch's embedding_bag raises NotImplementedError for it)."""
    if config.data_type not in data_types:
        allowed = " or ".join(d.name for d in data_types)
        raise TypeError(f"{owner}: table '{config.name}' must be {allowed}, got "
                        f"{config.data_type}")
    if config.pooling not in (PoolingType.SUM, PoolingType.MEAN):
        raise ValueError(f"{owner}: table '{config.name}' pooling must be SUM or MEAN, got "
                         f"{config.pooling}")
    if weighted and config.pooling == PoolingType.MEAN:
        raise NotImplementedError(
            f"{owner}: table '{config.name}' has MEAN pooling, which per-sample weights "
            "(is_weighted=True) do not support, as in TorchRec's EmbeddingBagCollection")
