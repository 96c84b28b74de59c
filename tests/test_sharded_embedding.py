"""recxla.torchrec.EmbeddingCollectionSharder: the sharded sequence module equals the unsharded
EmbeddingCollection and TorchRec's own EC sharder.

Every distributed test trains a few steps on gloo ranks with fused SGD and compares, against
the unsharded module trained on the whole batch (the ranks' batches one after another) and
against TorchRec's ShardedEmbeddingCollection on the same plan: the jagged outputs every step
(values and lengths, key by key), and the weights after the last step. Batches hold empty
sequences, repeated ids and a sequence three times the usual longest.
"""

import pytest
import torch
from distributed_utils import run_distributed

import sequence_cases as cases
import sharded_cases

pytestmark = pytest.mark.distributed


def _sharders(fwd, bwd, **options):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder

    import recxla.torchrec as rt

    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": cases.LR}
    return (rt.EmbeddingCollectionSharder(fused_params=fused, fwd_comm=fwd, bwd_comm=bwd,
                                          **options),
            EmbeddingCollectionSharder(fused_params=fused))


def _equal_body(rank, world, seed, kinds, batch_sizes, fwd, bwd, steps, with_torchrec):
    """recxla's sharded module, the unsharded one and (with_torchrec) TorchRec's sharded one,
    trained alike -> per kind (output error vs unsharded per step, weight error vs unsharded,
    max output error vs TorchRec, weight error vs TorchRec, comm stats)."""
    import torch.distributed as dist
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_modules import EmbeddingCollection

    env = ShardingEnv.from_process_group(dist.group.WORLD)
    ours_sharder, torchrec_sharder = _sharders(fwd, bwd)
    start, stop = sum(batch_sizes[:rank]), sum(batch_sizes[:rank + 1])
    results = {}
    for kind in kinds:
        torch.manual_seed(seed)
        configs = cases.tables()
        reference = EmbeddingCollection(configs)
        plan = cases.plan(configs, kind, world, even=with_torchrec)
        copies = []
        for sharder in (ours_sharder, torchrec_sharder) if with_torchrec else (ours_sharder,):
            module = EmbeddingCollection(configs)
            module.load_state_dict(reference.state_dict())
            copies.append(sharder.shard(module, plan, env, torch.device("cpu")))
        generator = torch.Generator().manual_seed(seed + 1)
        errors = {"unsharded": [], "torchrec": []}
        for _ in range(steps):
            batch = cases.batch(configs, sum(batch_sizes), generator)
            mine = sharded_cases.sample_slice(batch, start, stop)
            want = reference(batch)
            coef = cases.coefficients(want, generator)
            outputs = [m(mine).wait() for m in copies]
            # recxla's keys in the unsharded module's order (TorchRec's sharded module orders
            # them by sharding type).
            assert list(outputs[0].keys()) == list(want.keys()), (list(outputs[0]), list(want))
            for out in outputs:
                assert sorted(out.keys()) == sorted(want.keys()), (list(out), list(want))
                for key, jagged in out.items():
                    assert torch.equal(jagged.lengths(),
                                       want[key].lengths()[start:stop]), (kind, key)
            errors["unsharded"].append(max(
                sharded_cases.relative(outputs[0][k].values().detach(),
                                       cases.samples_of(want[k], start, stop).detach())
                for k in want))
            if with_torchrec:
                errors["torchrec"].append(max(
                    sharded_cases.relative(outputs[0][k].values().detach(),
                                           outputs[1][k].values().detach()) for k in want))
            for out in outputs:
                cases.loss(out, coef, start, stop, want).backward()
            cases.loss(want, coef, 0, sum(batch_sizes), want).backward()
            cases.sgd_step(reference, world)
        weights = {k: v.detach() for k, v in reference.state_dict().items()}
        state = copies[0].state_dict()
        versus_torchrec = 0.0
        if with_torchrec:
            theirs = copies[1].state_dict()
            for key, value in state.items():
                for mine_shard, their_shard in zip(value.local_shards(),
                                                   theirs[key].local_shards()):
                    assert mine_shard.metadata == their_shard.metadata, key
                    versus_torchrec = max(versus_torchrec, sharded_cases.relative(
                        mine_shard.tensor, their_shard.tensor))
        results[kind] = (errors["unsharded"], sharded_cases.shard_errors(state, weights),
                         max(errors["torchrec"], default=0.0), versus_torchrec,
                         copies[0].comm_stats.as_dict())
    return results


def test_sequence_module_equals_unsharded_and_torchrec(seed):
    """fp32 wires, every sharding type TorchRec's EC sharder runs on CPU (table-, row- and
    column-wise, and a plan mixing them), two ranks with uneven batches: outputs, lengths and
    updated tables equal the unsharded module's and TorchRec's sharded module's to 1e-5."""
    results = run_distributed(_equal_body, world_size=2, args=(
        seed, ["table_wise", "row_wise", "column_wise", "mixed"], [5, 3], "fp32", "fp32", 3,
        True))
    for rank, per_kind in enumerate(results):
        for kind, (out_errors, weight_error, vs_out, vs_weight, _) in per_kind.items():
            assert max(out_errors) <= 1e-5 and weight_error <= 1e-5, (rank, kind, out_errors,
                                                                      weight_error)
            assert vs_out <= 1e-5 and vs_weight <= 1e-5, (rank, kind, vs_out, vs_weight)


def test_sequence_module_uneven_columns_and_empty_rank(seed):
    """Column blocks of three widths, two on one rank (TorchRec's EC sharder refuses such a
    plan; recxla's layout places it), and a rank with no samples: equal to the unsharded
    module."""
    results = run_distributed(_equal_body, world_size=2, args=(
        seed, ["column_wise", "mixed"], [6, 0], "fp32", "fp32", 2, False))
    for rank, per_kind in enumerate(results):
        for kind, (out_errors, weight_error, _, _, _) in per_kind.items():
            assert max(out_errors) <= 1e-5 and weight_error <= 1e-5, (rank, kind, out_errors,
                                                                      weight_error)


def test_sequence_module_fp8_rows_three_ranks(seed):
    """e4m3 rows forward, e5m2 gradients back, 3 ranks: the first step's values within e4m3's
    rounding (1/16 relative, on each wire row's scale), the tables after 3 steps within e5m2's
    rounding of the gradients that moved them (1/8 relative, plus the forward's drift: 40 seeds
    gave 0.037-0.105); and each unique row crosses the wire once: fewer embedding bytes than
    ids x dim x 4."""
    results = run_distributed(_equal_body, world_size=3, args=(
        seed, ["row_wise", "mixed"], [4, 5, 3], "e4m3", "e5m2", 3, False))
    for rank, per_kind in enumerate(results):
        for kind, (out_errors, weight_error, _, _, stats) in per_kind.items():
            assert 0 < out_errors[0] <= 0.07, (rank, kind, out_errors)
            assert weight_error <= 0.15, (rank, kind, weight_error)
            assert stats["embedding_bytes_received"] > 0, (rank, kind, stats)


def _bytes_body(rank, world, seed):
    """The same batches through fp32 and e4m3 wires -> the bytes each moved, and the ids'
    positions' count (what TorchRec's sequence all-to-all sends a row for)."""
    import torch.distributed as dist
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_modules import EmbeddingCollection

    env = ShardingEnv.from_process_group(dist.group.WORLD)
    configs = cases.tables(dim=32)
    out = {}
    for fwd in ("fp32", "e4m3"):
        torch.manual_seed(seed)
        sharder, _ = _sharders(fwd, "bf16")
        module = sharder.shard(EmbeddingCollection(configs), cases.plan(configs, "table_wise",
                                                                       world), env,
                               torch.device("cpu"))
        generator = torch.Generator().manual_seed(seed + 1)
        batch = cases.batch(configs, 2 * 32, generator, max_len=40)
        mine = sharded_cases.sample_slice(batch, 32 * rank, 32 * rank + 32)
        output = module(mine).wait()
        # Ids whose rows another rank owns: what TorchRec's all-to-all sends rows for.
        remote = sum(j.values().shape[0] for j in output.values())
        out[fwd] = (module.comm_stats.embedding_bytes_received, remote)
    return out


def test_each_unique_row_crosses_once():
    """Zipf ids in long sequences: the fp32 rows received are the unique rows (per owner)
    only, far fewer than one per id; FP8 rows cost (dim + 4) / (4 dim) of fp32's."""
    results = run_distributed(_bytes_body, world_size=2, args=(0,))
    for rank, per_wire in enumerate(results):
        fp32_bytes, ids = per_wire["fp32"]
        e4m3_bytes, _ = per_wire["e4m3"]
        assert 0 < fp32_bytes < 0.6 * ids * 32 * 4, (rank, fp32_bytes, ids)
        assert e4m3_bytes == fp32_bytes // (4 * 32) * (32 + 4), (rank, e4m3_bytes, fp32_bytes)


def _errors_body(rank, world):
    """The sequence module's refusals -> {case: (type, message)}."""
    import torch.distributed as dist
    from torchrec.distributed.types import ShardingEnv
    from torchrec.modules.embedding_configs import DataType, EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recxla.torchrec.input_dist import InputDistError

    env = ShardingEnv.from_process_group(dist.group.WORLD)
    sharder, _ = _sharders("fp32", "fp32", max_sequence_length=5)
    configs = cases.tables(dim=8)
    caught = {}

    def attempt(case, fn):
        try:
            fn()
            caught[case] = None
        except (ValueError, TypeError, IndexError, InputDistError) as e:
            caught[case] = (type(e).__name__, str(e))

    module = sharder.shard(EmbeddingCollection(configs), cases.plan(configs, "row_wise", world),
                           env, torch.device("cpu"))
    features = ["f0", "f1", "f2", "f3"]
    lengths = torch.tensor([2, 0, 1, 1, 3, 1, 1, 0])
    good = KeyedJaggedTensor(keys=features, values=torch.arange(int(lengths.sum())) % 30,
                             lengths=lengths)
    long_lengths = torch.tensor([1, 1, 1, 1, 1, 1, 1, 6 if rank == 1 else 1])
    long = KeyedJaggedTensor(keys=features, lengths=long_lengths,
                             values=torch.zeros(int(long_lengths.sum()), dtype=torch.int64))
    attempt("too long", lambda: module(long).wait())
    vbe = KeyedJaggedTensor(keys=features, values=torch.zeros(5, dtype=torch.int64),
                            lengths=torch.ones(5, dtype=torch.int64),
                            stride_per_key_per_rank=[[1], [1], [1], [2]])
    attempt("variable batch", lambda: module(vbe).wait())
    out = module(good).wait()  # the group still works after the refusals
    sum(j.values().sum() for j in out.values()).backward()

    mixed_dims = EmbeddingCollection(cases.tables(dim=8))
    mixed_dims.embedding_configs()[1].embedding_dim = 16  # past TorchRec's own check
    attempt("several dims", lambda: sharder.shard(mixed_dims, cases.plan(
        configs, "table_wise", world), env, torch.device("cpu")))
    fp16 = [EmbeddingConfig(name="h", embedding_dim=8, num_embeddings=10, feature_names=["x"],
                            data_type=DataType.FP16)]
    attempt("fp16", lambda: sharder.shard(EmbeddingCollection(fp16), cases.plan(
        fp16, "table_wise", world), env, torch.device("cpu")))
    plan = cases.plan(configs, "table_wise", world)
    plan["t1"].sharding_type = "grid_shard"
    attempt("sharding type", lambda: sharder.shard(EmbeddingCollection(configs), plan, env,
                                                  torch.device("cpu")))
    attempt("cap", lambda: _sharders("fp32", "fp32", max_sequence_length=0))
    return caught


def test_errors_name_the_table_feature_and_limit():
    results = run_distributed(_errors_body, world_size=2, args=(), timeout=120)
    mine, other = results[1], results[0]
    assert mine["too long"][0] == "ValueError"
    assert "feature 'f3' has a sequence of 6 ids" in mine["too long"][1]
    assert "max_sequence_length=5" in mine["too long"][1]
    assert other["too long"][0] == "InputDistError" and "rank(s) [1]" in other["too long"][1]
    for caught in results:
        assert "variable batch per feature is not supported for sequence" in \
            caught["variable batch"][1]
        assert caught["several dims"][0] == "ValueError" and \
            "table 't0' has 8" in caught["several dims"][1] \
            and "[8, 16]" in caught["several dims"][1]
        assert caught["fp16"][0] == "TypeError" and "table 'h' must be FP32" in caught["fp16"][1]
        assert "table 't1' is planned grid_shard" in caught["sharding type"][1]
        assert "ShardedEmbeddingCollection" in caught["sharding type"][1]
        assert "max_sequence_length must be None or an int >= 1, got 0" in caught["cap"][1]
