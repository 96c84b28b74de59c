"""The static side of recxla's sharded module, without processes: the layout built from a
plan (routes of ids, output columns), the sharder's and the fused optimizer's argument checks."""

import random

import pytest
import torch

import sharded_cases as cases
from recxla.ops.embedding_bag import ADAGRAD, NONE, ROWWISE_ADAGRAD, SGD, SUM
from recxla.torchrec.shard_layout import Shard, ShardLayout, TableInfo


def _layout(kind, world, rank=0):
    configs = cases.tables()
    plan = cases.plan(configs, kind, world)
    tables = [TableInfo(c.name, c.num_embeddings, c.embedding_dim, list(c.feature_names),
                        SUM) for c in configs]
    shards = [[Shard(t, k, md.placement.rank(), md.shard_offsets[0], md.shard_sizes[0],
                     md.shard_offsets[1], md.shard_sizes[1])
               for k, md in enumerate(plan[c.name].sharding_spec.shards)]
              for t, c in enumerate(configs)]
    return ShardLayout.build(tables, shards, rank, world), configs


@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise", "mixed"])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_every_id_reaches_every_owner_of_its_row(kind, world):
    """Brute force: for random ids, the routes name exactly the shards that hold the id's row
    (every column block of it), with the id made local to the shard."""
    layout, configs = _layout(kind, world)
    for slot, (t, f) in enumerate(zip(layout.input_slot_table, layout.input_slot_feature)):
        rows = configs[t].num_embeddings
        for row in random.sample(range(rows), min(rows, 12)):
            starts = layout.block_starts[slot]
            block = max(k for k, s in enumerate(starts) if s <= row)
            got = sorted((r.dest, layout.local_tables[r.dest][layout.slots[r.dest][r.dest_slot][0]]
                          .shard.col_offset, row - r.row_offset)
                         for r in layout.block_routes[slot][block])
            want = sorted((s.rank, s.col_offset, row - s.row_offset) for s in layout.shards[t]
                          if s.row_offset <= row < s.row_offset + s.rows)
            assert got == want, (kind, world, f, row)
            assert all(layout.slots[r.dest][r.dest_slot][1] == f
                       for r in layout.block_routes[slot][block])


@pytest.mark.parametrize("kind", ["table_wise", "row_wise", "column_wise", "mixed"])
def test_output_columns_cover_the_module_output(kind):
    """Every output column is fed by one owner column per row block of its table (row-wise
    tables several, summed), and the wire rows divide every owner's width."""
    world = 3
    layout, configs = _layout(kind, world)
    columns = layout.output_columns(0).tolist()
    total = sum(layout.embedding_dims)
    counts = [columns.count(c) for c in range(total)]
    offset = 0
    for t, dim in zip(layout.input_slot_table, layout.embedding_dims):
        blocks = len({s.row_offset for s in layout.shards[t]})
        assert counts[offset: offset + dim] == [blocks] * dim, (kind, t)
        offset += dim
    assert all(layout.output_dim(r) % layout.wire_row_dim == 0 for r in range(world))
    assert len(columns) == sum(layout.output_dim(r) for r in range(world))


def test_layout_rejects_a_plan_that_does_not_cover_a_table():
    tables = [TableInfo("t", 10, 4, ["f"], SUM)]
    with pytest.raises(ValueError, match="cover 20 of its 40 values"):
        ShardLayout.build(tables, [[Shard(0, 0, 0, 0, 5, 0, 4)]], 0, 2)
    with pytest.raises(ValueError, match="outside the group of 2 ranks"):
        ShardLayout.build(tables, [[Shard(0, 0, 2, 0, 10, 0, 4)]], 0, 2)
    with pytest.raises(ValueError, match="outside the table"):
        ShardLayout.build(tables, [[Shard(0, 0, 0, 5, 10, 0, 4)]], 0, 2)


def test_sharder_argument_errors():
    from recxla.torchrec import EmbeddingBagCollectionSharder

    with pytest.raises(ValueError, match="fwd_comm must be one of"):
        EmbeddingBagCollectionSharder(fwd_comm="int8")
    with pytest.raises(ValueError, match="bwd_comm must be one of"):
        EmbeddingBagCollectionSharder(bwd_comm=None)
    with pytest.raises(TypeError, match="dedup_ids must be a bool"):
        EmbeddingBagCollectionSharder(dedup_ids="yes")
    with pytest.raises(TypeError, match="module_type must be torchrec's EmbeddingBagCollection"):
        EmbeddingBagCollectionSharder(module_type=torch.nn.Linear)
    sharder = EmbeddingBagCollectionSharder()
    offered = sharder.sharding_types("cpu")
    # The five model-parallel types are recxla's own lookup; data_parallel is offered too but
    # runs TorchRec's dense data-parallel kernel (the planner must not cost it as recxla's).
    assert set(offered) == {"table_wise", "column_wise", "table_column_wise", "row_wise",
                            "table_row_wise", "data_parallel"}
    assert sharder.compute_kernels("data_parallel", "cpu") == ["dense"]
    for sharding_type in set(offered) - {"data_parallel"}:
        assert sharder.compute_kernels(sharding_type, "cpu") == ["fused"], sharding_type


def test_fused_optimizer_from_fused_params_and_attached_optimizers():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torch.distributed.optim import _apply_optimizer_in_backward

    from recxla.torchrec.fused_optimizer import table_update

    weight = torch.nn.Parameter(torch.randn(4, 2))
    # As TorchRec's sharder: no optimizer named -> FBGEMM's EXACT_SGD at 0.01; the plan's
    # dense kernel -> an ordinary gradient.
    for fused in (None, {}, {"learning_rate": 0.3}):
        update = table_update("t", weight, fused)
        assert update.kind == SGD, fused
        assert update.hyperparameters["lr"] == (fused or {}).get("learning_rate", 0.01)
    assert table_update("t", weight, None, "dense").kind == NONE
    update = table_update("t", weight, {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                        "learning_rate": 0.3, "eps": 1e-4})
    assert update.kind == ROWWISE_ADAGRAD
    assert update.hyperparameters["lr"] == 0.3 and update.hyperparameters["eps"] == 1e-4
    assert table_update("t", weight, {"optimizer": EmbOptimType.EXACT_SGD}).kind == SGD
    with pytest.raises(ValueError, match="optimizer .* is not supported"):
        table_update("t", weight, {"optimizer": EmbOptimType.ADAM})
    with pytest.raises(ValueError, match="fused_params key 'beta1' is not supported"):
        table_update("t", weight, {"optimizer": EmbOptimType.EXACT_SGD, "beta1": 0.9})
    attached = torch.nn.Parameter(torch.randn(4, 2))
    _apply_optimizer_in_backward(torch.optim.Adagrad, [attached], {"lr": 0.2},
                                 register_hook=False)
    update = table_update("t", attached, {"optimizer": EmbOptimType.EXACT_SGD})
    assert update.kind == ADAGRAD and update.hyperparameters["lr"] == 0.2
    # TorchRec hands FBGEMM only the kwargs given: FBGEMM's eps, not torch's Adagrad's 1e-10.
    assert update.hyperparameters["eps"] == 1e-8


def test_fused_optimizer_follows_torchrecs_merge_and_fbgemms_semantics():
    """What TorchRec's sharder builds FBGEMM's update from: the sharder's fused_params under
    the attached optimizer's kwargs, also in the spelling TorchRec rewrites them to;
    torchrec.optim's SGD and Adagrad; FBGEMM's weight decay (none for SGD and Adagrad, none in
    row-wise Adagrad's default mode, L2 in mode L2); gradient clipping and decoupled decay
    refused by name."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec import optim as trec_optim

    from recxla.torchrec.fused_optimizer import table_update

    def attached(cls, kwargs):
        weight = torch.nn.Parameter(torch.randn(4, 2))
        _apply_optimizer_in_backward(cls, [weight], kwargs, register_hook=False)
        return weight

    rowwise = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.3}
    # The sharder's eps and weight decay reach an attached optimizer's table (merged).
    update = table_update("t", attached(trec_optim.RowWiseAdagrad, {"lr": 0.05}),
                          {**rowwise, "eps": 1e-3, "weight_decay": 0.5,
                           "weight_decay_mode": WeightDecayMode.L2})
    assert update.kind == ROWWISE_ADAGRAD
    assert (update.hyperparameters["lr"], update.hyperparameters["eps"],
            update.hyperparameters["weight_decay"]) == (0.05, 1e-3, 0.5)
    # Kwargs as TorchRec's planner leaves them: "optimizer" added, "lr" renamed.
    weight = attached(trec_optim.RowWiseAdagrad, {"lr": 0.05})
    weight._optimizer_kwargs[0].update(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                       learning_rate=weight._optimizer_kwargs[0].pop("lr"))
    assert table_update("t", weight, None).hyperparameters["lr"] == 0.05
    for cls, kind in ((trec_optim.SGD, SGD), (trec_optim.Adagrad, ADAGRAD)):
        assert table_update("t", attached(cls, {"lr": 0.1}), None).kind == kind
    # FBGEMM's weight decay: none without mode L2, none at all for SGD and Adagrad.
    plain = torch.nn.Parameter(torch.randn(4, 2))
    for fused in ({**rowwise, "weight_decay": 0.5},
                  {"optimizer": EmbOptimType.EXACT_SGD, "weight_decay": 0.5,
                   "weight_decay_mode": WeightDecayMode.L2},
                  {"optimizer": EmbOptimType.EXACT_ADAGRAD, "weight_decay": 0.5}):
        assert table_update("t", plain, fused).hyperparameters["weight_decay"] == 0.0, fused
    with pytest.raises(ValueError, match="table 't': gradient_clipping=True .*max_gradient=0.01"):
        table_update("t", plain, {**rowwise, "gradient_clipping": True, "max_gradient": 0.01})
    with pytest.raises(ValueError, match="weight_decay_mode .*DECOUPLE.* is not supported"):
        table_update("t", plain, {**rowwise, "weight_decay": 0.1,
                                  "weight_decay_mode": WeightDecayMode.DECOUPLE})
    with pytest.raises(ValueError, match="^recxla.torchrec.ShardedEmbeddingCollection: table "
                                         "'t': the attached optimizer Adam is not supported"):
        table_update("t", attached(torch.optim.Adam, {"lr": 0.1}), None,
                     owner="recxla.torchrec.ShardedEmbeddingCollection")


def test_choose_row_tables_against_counts():
    """A table whose ids repeat within each micro-batch goes to rows; one whose bags hold many
    distinct ids stays pooled; micro-batches count separately."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recxla.torchrec.row_exchange import choose_row_tables

    configs = [EmbeddingBagConfig(name="hot", embedding_dim=4, num_embeddings=100,
                                  feature_names=["a"]),
               EmbeddingBagConfig(name="wide", embedding_dim=4, num_embeddings=10_000,
                                  feature_names=["b"])]
    batch = 64
    hot = torch.randint(0, 5, (batch,))                    # one id per bag, 5 distinct
    wide = torch.randperm(10_000)[: batch * 3]            # three distinct ids per bag
    kjt = KeyedJaggedTensor(keys=["a", "b"], values=torch.cat([hot, wide]),
                            lengths=torch.cat([torch.ones(batch, dtype=torch.int64),
                                               torch.full((batch,), 3)]))
    assert choose_row_tables(configs, kjt, num_micro_batches=1) == ["hot"]
    assert choose_row_tables(configs, kjt, num_micro_batches=4) == ["hot"]
    # 64 distinct ids in 64 one-id bags: rows cost as much as bags.
    unique = KeyedJaggedTensor(keys=["a", "b"], values=torch.cat([torch.randperm(100)[:batch],
                                                                  wide]),
                               lengths=kjt.lengths())
    assert choose_row_tables(configs, unique) == []
    # One rank: nothing travels, so rows would only cost; more ranks judge by bytes.
    assert choose_row_tables(configs, kjt, world_size=1) == []
    assert choose_row_tables(configs, kjt, world_size=2) == ["hot"]
    with pytest.raises(ValueError, match="choose_row_tables: world_size must be an int >= 1"):
        choose_row_tables(configs, kjt, world_size=0)
