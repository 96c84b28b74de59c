"""recxla.torchrec.EmbeddingBagCollectionSharder: the sharded module equals the unsharded one.

Every distributed test trains a few steps on gloo ranks and compares, against the unsharded
module trained on the whole batch (the ranks' batches one after another): the outputs every
step, and the weights (and optimizer state) after the last step. The sharded module divides
the embedding gradients by the world size as TorchRec's does (its gradient division, on by
default), so the reference's gradients are scaled by `cases.gradient_factor`.
"""

import pytest
import torch
from distributed_utils import run_distributed

import sharded_cases as cases

pytestmark = pytest.mark.distributed

LR = 0.1


def _shard(module, kind, world, fwd="fp32", bwd="fp32", fused_params=None, dedup=True,
           module_type=None, row_exchange="off"):
    import torch.distributed as dist
    from torchrec.distributed.types import ShardingEnv

    import recxla.torchrec as rt

    sharder = rt.EmbeddingBagCollectionSharder(fused_params=fused_params, fwd_comm=fwd,
                                               bwd_comm=bwd, dedup_ids=dedup,
                                               module_type=module_type,
                                               row_exchange=row_exchange)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    return sharder.shard(module, cases.plan(module.embedding_bag_configs(), kind, world), env,
                         torch.device("cpu"))


def _sgd_body(rank, world, seed, kinds, batch_sizes, weighted, fwd, bwd, steps, dedup=True,
              row_exchange="off"):
    # TorchRec (and recxla) reject per-sample weights with MEAN pooling: weighted runs use SUM.
    """Sharded (fused SGD from fused_params) vs TorchRec's unsharded module (plain SGD)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    results = {}
    for kind in kinds:
        torch.manual_seed(seed)
        configs = cases.tables(mean=not weighted)
        reference = EmbeddingBagCollection(configs, is_weighted=weighted)
        module = EmbeddingBagCollection(configs, is_weighted=weighted)
        module.load_state_dict(reference.state_dict())
        sharded = _shard(module, kind, world, fwd, bwd,
                         {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}, dedup,
                         row_exchange=row_exchange)
        initial = {k: v.clone() for k, v in reference.state_dict().items()}
        generator = torch.Generator().manual_seed(seed + 1)
        start = sum(batch_sizes[:rank])
        out_errors = []
        for _ in range(steps):
            batch = cases.global_batch(configs, sum(batch_sizes), generator, weighted)
            coef = torch.randn(sum(batch_sizes), sum(module._lengths_per_embedding),
                               generator=generator)
            mine = cases.sample_slice(batch, start, start + batch_sizes[rank])
            out = sharded(mine).wait()
            want = reference(batch)
            assert out.keys() == want.keys(), (out.keys(), want.keys())
            out_errors.append(cases.relative(out.values().detach(),
                                             want.values()[start: start + batch_sizes[rank]]))
            (out.values() * coef[start: start + batch_sizes[rank]]).sum().backward()
            (want.values() * coef).sum().backward()
            with torch.no_grad():
                for p in reference.parameters():
                    p -= LR * cases.gradient_factor(world) * p.grad
                    p.grad = None
        weights = {k: v.detach() for k, v in reference.state_dict().items()}
        state = sharded.state_dict()
        results[kind] = (out_errors, cases.shard_errors(state, weights),
                         cases.shard_errors(state, weights, initial), sharded.comm_stats.as_dict())
    return results


def _sgd_bodies(rank, world, calls):
    """Several `_sgd_body` runs in one process group (starting ranks costs more than a run):
    calls = {name: args after (rank, world)} -> {name: result}."""
    return {name: _sgd_body(rank, world, *args) for name, args in calls.items()}


def _assert_equal_to_unsharded(calls):
    """`calls` on 2 ranks: outputs and weights within 1e-5 of the unsharded module's."""
    results = run_distributed(_sgd_bodies, world_size=2, args=(calls,))
    for rank, per_call in enumerate(results):
        for call, per_kind in per_call.items():
            for kind, (out_errors, weight_error, _, _) in per_kind.items():
                assert max(out_errors) <= 1e-5, (rank, call, kind, out_errors)
                assert weight_error <= 1e-5, (rank, call, kind, weight_error)


def test_row_exchange_equals_unsharded(seed):
    """Owners send unique rows and the ranks pool their own bags (every table, or two of
    them next to pooled ones): same outputs and weights as the unsharded module, MEAN and
    row-sharded tables included; and with per-sample weights on a rank with no samples."""
    kinds = ["table_wise", "row_wise", "column_wise", "mixed"]
    calls = {}
    for row_exchange in ("all", ["t0", "t3"]):
        calls[f"{row_exchange}"] = (seed, kinds, [5, 3], False, "fp32", "fp32", 3, True,
                                    row_exchange)
        calls[f"{row_exchange} weighted"] = (seed, ["mixed"], [6, 0], True, "fp32", "fp32", 2,
                                             True, row_exchange)
    _assert_equal_to_unsharded(calls)


def test_sharded_equals_unsharded_every_sharding_type(seed):
    """Every sharding type; then per-sample weights and a rank with no samples at all. (MEAN
    bags split across row shards, summed at the owners and divided at the receiver, are in
    the row exchange test.)"""
    calls = {"unweighted": (seed, ["table_wise", "row_wise", "column_wise", "mixed"], [5, 3],
                            False, "fp32", "fp32", 3),
             "weighted, empty rank": (seed, ["row_wise", "column_wise"], [6, 0], True, "fp32",
                                      "fp32", 2)}
    _assert_equal_to_unsharded(calls)


def test_sharded_fp8_comms_within_fp8_error(seed):
    """e4m3 forward: the first step's pooled values within e4m3's rounding (1/16 relative; a
    row-sharded bag adds two rounded partial sums) of the fp32 result. The loss is linear in
    the output, so the gradients are exact before the wire: after 3 steps the weight updates
    are within the backward format's rounding of the fp32 run's: each bag's gradient is rounded
    (bf16 2^-8, e5m2 2^-3) before the rows sum them, so a row whose terms cancel can reach a
    few times that, relative to the largest update (2x allowed; a wrong row or sum is O(1)).
    3 ranks."""
    update_bound = {"bf16": 2 * 2**-8, "e5m2": 2 * 2**-3}
    calls = {bwd: (seed, ["row_wise", "mixed"], [4, 5, 3], False, "e4m3", bwd, 3)
             for bwd in update_bound}
    results = run_distributed(_sgd_bodies, world_size=3, args=(calls,))
    for rank, per_bwd in enumerate(results):
        for bwd, per_kind in per_bwd.items():
            for kind, (out_errors, _, update_error, stats) in per_kind.items():
                assert 0 < out_errors[0] <= 0.07, (bwd, rank, kind, out_errors)
                assert 0 < update_error <= update_bound[bwd], (bwd, rank, kind, update_error)
                assert stats["embedding_bytes_sent"] > 0


def _dedup_body(rank, world, seed):
    """dedup on and off give the same outputs; the byte counters match what actually went
    through torch.distributed.all_to_all_single (measured by wrapping it)."""
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    sent = {"bytes": 0}
    original = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        me = dist.get_rank()
        rows = input.shape[0]
        splits = input_split_sizes or [rows // world] * world
        per_row = input.numel() * input.element_size() // max(rows, 1)
        sent["bytes"] += sum(s for r, s in enumerate(splits) if r != me) * per_row
        return original(output, input, output_split_sizes, input_split_sizes, **kwargs)

    dist.all_to_all_single = counting
    outputs, stats = {}, {}
    try:
        for dedup, rows in ((True, "off"), (False, "off"), (True, "all")):
            torch.manual_seed(seed)
            configs = cases.tables()
            module = EmbeddingBagCollection(configs)
            fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR}
            sharded = _shard(module, "mixed", world, fwd="e4m3", bwd="bf16", dedup=dedup,
                             fused_params=fused, row_exchange=rows)
            generator = torch.Generator().manual_seed(seed + 1)
            batch = cases.global_batch(configs, 64, generator, max_len=6, zipf_rows=True)
            mine = cases.sample_slice(batch, 32 * rank, 32 * rank + 32)
            sent["bytes"] = 0
            out = sharded(mine).wait()
            out.values().sum().backward()
            outputs[dedup, rows] = out.values().detach()
            stats[dedup, rows] = (sharded.comm_stats.as_dict(), sent["bytes"])
    finally:
        dist.all_to_all_single = original
    return bool(torch.equal(outputs[True, "off"], outputs[False, "off"])), stats


def test_dedup_saves_id_bytes_and_counters_match_the_wire(seed):
    """Also row exchange: on skewed keys the unique rows cost fewer bytes than pooled bags."""
    for rank, (equal, stats) in enumerate(run_distributed(_dedup_body, world_size=2,
                                                           args=(seed,))):
        assert equal, rank
        for config, (counted, measured) in stats.items():
            total = (counted["id_bytes_sent"] + counted["embedding_bytes_sent"]
                     + counted["gradient_bytes_sent"])
            assert total == measured, (rank, config, counted, measured)
        rows, pooled = stats[True, "all"][0], stats[True, "off"][0]
        assert rows["embedding_bytes_sent"] < pooled["embedding_bytes_sent"], (rows, pooled)
        assert rows["gradient_bytes_sent"] < pooled["gradient_bytes_sent"], (rows, pooled)
        with_dedup, without = stats[True, "off"][0], stats[False, "off"][0]
        assert with_dedup["id_bytes_sent"] < without["id_bytes_sent"], (with_dedup, without)
        assert with_dedup["id_bytes_without_dedup"] == without["id_bytes_without_dedup"]
        # Raw ids travel as int32 (int64 in the batch): less than TorchRec's layout even so.
        assert without["id_bytes_sent"] < without["id_bytes_without_dedup"]


def _adagrad_body(rank, world, seed, optimizer, kinds):
    """A recxla.nn.EmbeddingBagCollection with a fused (row-wise) Adagrad, sharded through
    `sharders()`, vs the same module unsharded on the whole batch: weights and state."""
    import recxla

    results = {}
    for kind in kinds:
        torch.manual_seed(seed)
        configs = cases.tables(mean=False)
        reference = recxla.nn.EmbeddingBagCollection(configs, optimizer=optimizer, lr=0.2,
                                                     eps=1e-3)
        module = recxla.nn.EmbeddingBagCollection(configs, optimizer=optimizer, lr=0.2,
                                                  eps=1e-3)
        module.load_state_dict(reference.state_dict())
        sharded = _shard(module, kind, world, module_type=recxla.nn.EmbeddingBagCollection)
        generator = torch.Generator().manual_seed(seed + 1)
        for _ in range(3):
            batch = cases.global_batch(configs, 8, generator)
            coef = torch.randn(8, sum(module._lengths_per_embedding), generator=generator)
            out = sharded(cases.sample_slice(batch, 4 * rank, 4 * rank + 4)).wait()
            (out.values() * coef[4 * rank: 4 * rank + 4]).sum().backward()
            ((reference(batch).values() * coef).sum() * cases.gradient_factor(world)).backward()
        weights = {k: v.detach() for k, v in reference.state_dict().items()}
        state = {}
        for name, bag in reference.embedding_bags.items():
            optim = bag.weight._in_backward_optimizers[0]
            state[f"embedding_bags.{name}.weight"] = optim.state[bag.weight]["sum"]
        optimizer_state = sharded.fused_optimizer.state_dict()["state"]
        state_error = 0.0
        for key, entry in optimizer_state.items():
            table = key.split(".")[-2]
            momentum = entry[f"{table}.momentum1"]
            want = state[key]
            for shard in momentum.local_shards():
                # Row-wise state is 1-D, TorchRec's layout (rows at their offsets here: no
                # column blocks in these plans).
                offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                block = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
                reference_state = want.reshape(-1) if len(offsets) == 1 else want
                state_error = max(state_error, cases.relative(shard.tensor,
                                                              reference_state[block]))
        results[kind] = (cases.shard_errors(sharded.state_dict(), weights), state_error)
    return results


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_sharded_recxla_nn_module_with_adagrad(seed, optimizer):
    results = run_distributed(_adagrad_body, world_size=2,
                              args=(seed, optimizer, ["table_wise", "row_wise"]))
    for rank, per_kind in enumerate(results):
        for kind, (weight_error, state_error) in per_kind.items():
            assert weight_error <= 1e-5, (rank, kind, weight_error)
            assert state_error <= 1e-5, (rank, kind, state_error)


def _bad_input_body(rank, world, seed):
    """Rank 1 feeds an id past its table: both ranks raise, nobody hangs, and the next good
    batch goes through."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from recxla.torchrec.input_dist import InputDistError

    torch.manual_seed(seed)
    configs = cases.tables()
    sharded = _shard(EmbeddingBagCollection(configs), "mixed", world)
    generator = torch.Generator().manual_seed(seed + 1)
    batch = cases.sample_slice(cases.global_batch(configs, 8, generator), 4 * rank, 4 * rank + 4)
    values = batch.values().clone()
    if rank == 1:
        values[-1] = 1000  # f4 reads t3, which has 9 rows
    bad = type(batch)(keys=batch.keys(), values=values, lengths=batch.lengths())
    try:
        sharded(bad).wait()
        raised = None
    except (IndexError, InputDistError) as e:
        raised = (type(e).__name__, str(e))
    good = sharded(batch).wait()
    good.values().sum().backward()
    return raised


def test_bad_input_on_one_rank_raises_on_every_rank():
    results = run_distributed(_bad_input_body, world_size=2, args=(0,), timeout=90)
    assert results[1][0] == "IndexError" and "has id 1000 outside" in results[1][1]
    assert results[0][0] == "InputDistError" and "rank(s) [1]" in results[0][1]
