"""The checks of TorchRec's table configs that recxla's modules take: `check_table_config`,
of an EmbeddingBagConfig, for recxla.nn's EmbeddingBagCollection (FP32 tables) and the sharded
module of recxla.torchrec.EmbeddingBagCollectionSharder (FP32 or FP16); and
`check_sharded_table_options`, of any table config, for both of recxla's sharders. Errors name
the module, the table and the rule, as TorchRec's module would raise them."""

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


# Table options with which TorchRec's sharded modules behave otherwise than with a plain table,
# and recxla's sharders do not: each changes which rows a table has, where its ids go or what its
# state_dict holds, so a sharder refuses it by name rather than shard a plain table instead.
# (need_pos, input_dim and use_gather_select are not read by TorchRec's sharded EBC and EC;
# stash_weights moves memory, not values.)
UNSHARDABLE_TABLE_OPTIONS = (
    ("use_virtual_table", False, "a virtual table (TorchRec's key-value tables with eviction)"),
    ("total_num_buckets", None, "bucketized ids (TorchRec's zero-collision hashing)"),
    ("num_embeddings_post_pruning", None, "a pruned table (its state_dict has the rows left "
                                          "after pruning)"),
    ("enable_embedding_update", False, "rows written through EmbeddingCollection's update API"),
)


def check_sharded_table_options(config, owner: str) -> None:
    """NotImplementedError naming the table and the option for a table config (TorchRec's
    EmbeddingBagConfig or EmbeddingConfig) that sets an option of UNSHARDABLE_TABLE_OPTIONS."""
    for option, plain, what in UNSHARDABLE_TABLE_OPTIONS:
        value = getattr(config, option, plain)
        if value != plain:
            raise NotImplementedError(
                f"{owner}: table '{config.name}' sets {option}={value!r}: {what} is not "
                f"supported by recxla's sharders (shard it with TorchRec's, or leave {option} "
                f"at {plain!r})")
