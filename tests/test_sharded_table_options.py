"""TorchRec table options that recxla's sharders do not have (virtual tables, bucketized ids,
pruned tables, EmbeddingCollection's update API) are refused by name, on the pooled and the
sequence sharder alike, instead of a plain table being sharded in their place; the options
TorchRec's sharded modules do not read either are accepted."""

import pytest

import sequence_cases
import sharded_cases
from distributed_utils import run_distributed
from recxla.nn.table_config import UNSHARDABLE_TABLE_OPTIONS

# A value of each refused option that TorchRec's own configs accept.
REFUSED = {"use_virtual_table": True, "total_num_buckets": 4,
           "num_embeddings_post_pruning": 20, "enable_embedding_update": True}
ACCEPTED = {"need_pos": True, "stash_weights": True, "input_dim": 64}


def _shard_body(rank, world, options):
    """Per (module kind, option): None when the sharder took the table with that option set,
    else (exception type, message)."""
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    import recxla.torchrec as rt

    env = ShardingEnv.from_process_group(dist.group.WORLD)
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
    kinds = {
        "pooled": (rt.EmbeddingBagCollectionSharder(fused_params=fused), EmbeddingBagCollection,
                   sharded_cases.tables, "embedding_bag_configs"),
        "sequence": (rt.EmbeddingCollectionSharder(fused_params=fused), EmbeddingCollection,
                     lambda: sequence_cases.tables(dim=8), "embedding_configs"),
    }
    results = {}
    for kind, (sharder, module_type, make_configs, read_configs) in kinds.items():
        for option, value in options.items():
            configs = make_configs()  # fresh: the module shares its config objects
            module = module_type(configs)
            # Set on the module's own config, past whatever TorchRec's constructor does with it.
            setattr(getattr(module, read_configs)()[1], option, value)
            plan = sharded_cases.plan(configs, "table_wise", world)
            try:
                sharder.shard(module, plan, env, torch.device("cpu"))
                results[(kind, option)] = None
            except Exception as e:  # noqa: BLE001 -- the test asserts the type
                results[(kind, option)] = (type(e).__name__, str(e))
    return results


def test_every_unshardable_option_is_tested():
    assert set(REFUSED) == {option for option, _, _ in UNSHARDABLE_TABLE_OPTIONS}


def test_refused_options_name_the_table_and_option():
    results = run_distributed(_shard_body, world_size=1, args=(REFUSED,), timeout=120)[0]
    for (kind, option), caught in results.items():
        assert caught is not None, f"{kind} sharder took a table with {option} set"
        name, message = caught
        assert name == "NotImplementedError", (kind, option, caught)
        owner = "ShardedEmbeddingBagCollection" if kind == "pooled" else \
            "ShardedEmbeddingCollection"
        assert owner in message and f"sets {option}={REFUSED[option]!r}" in message, message
        assert "table 't1'" in message, message


@pytest.mark.parametrize("kind", ["pooled", "sequence"])
def test_options_torchrec_does_not_read_are_accepted(kind):
    results = run_distributed(_shard_body, world_size=1, args=(ACCEPTED,), timeout=120)[0]
    assert all(results[(kind, option)] is None for option in ACCEPTED), results
