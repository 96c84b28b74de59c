"""recxla.pipeline.TrainPipeline equals the sequential training loop.

TorchRec's DLRM sharded with recxla's sharder (row-wise Adagrad as the fused optimizer, so the
optimizer state is checked too) trains the same batches twice on 2 gloo ranks: once with the
plain loop (forward, backward, optimizer step per batch), once with the pipeline in a given
configuration. Embeddings, dense weights and the fused optimizer's state must agree.
"""

import pytest
import torch
from distributed_utils import run_distributed

import sharded_cases as cases
import test_sharded_dlrm as dlrm

pytestmark = pytest.mark.distributed


def _state(dmp):
    """{name: list of local tensors}: model state and fused optimizer state."""
    out = {}
    for key, value in dmp.state_dict().items():
        out[key] = [s.tensor for s in value.local_shards()] if hasattr(value, "local_shards") \
            else [value]
    for key, entry in dmp.fused_optimizer.state_dict()["state"].items():
        for name, value in entry.items():
            if hasattr(value, "local_shards"):
                out[f"{key}/{name}"] = [s.tensor for s in value.local_shards()]
    return out


def _build(seed, world, kind, fwd, bwd, row_exchange="off"):
    """The test DLRM sharded by recxla's sharder (`kind` sharding, row-wise Adagrad fused)
    -> (DMP, its dense SGD, the table configs)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    import recxla.torchrec

    model, configs = dlrm._dlrm(seed)
    sharder = recxla.torchrec.EmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1},
        fwd_comm=fwd, bwd_comm=bwd, row_exchange=row_exchange)
    model = dlrm._dmp(model, sharder, kind, world)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=0.1))
    return model, dense, configs


def _pipeline_body(rank, world, seed, configurations, steps, batch, kind, fwd, bwd):
    from recxla.pipeline import Timeline, TrainPipeline

    def build(row_exchange="off"):
        return _build(seed, world, kind, fwd, bwd, row_exchange)

    def sequential_loop(dense_wire):
        """The plain loop's state after `mine` (forward, backward, dense step per batch), DDP's
        dense all-reduce in fp32 or, for dense_wire "bf16", through torch's own
        bf16_compress_hook: the sequential step that the pipeline's wire must equal."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        model, dense, _ = build()
        if dense_wire == "bf16":
            ddp = next(m for m in model.modules() if isinstance(m, DistributedDataParallel))
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        for b in mine:
            dense.zero_grad()
            loss, _ = model(b)
            loss.backward()
            dense.step()
        return _state(model)

    generator = torch.Generator().manual_seed(seed + 1)
    _, _, configs = build()
    batches = [dlrm._batch(configs, world * batch, generator) for _ in range(steps)]
    mine = [dlrm._slice(b, rank * batch, (rank + 1) * batch) for b in batches]
    # One reference per dense wire that torch's DDP offers as a hook (fp32, bf16); the
    # compressed wires (fp8, powersgd) have their own tests against fp32 (test_dense_sync.py).
    references = {}
    results = {}
    for name, options in configurations.items():
        options = dict(options)
        dense_wire = "bf16" if options.get("dense_allreduce") == "bf16" else "fp32"
        if dense_wire not in references:
            references[dense_wire] = sequential_loop(dense_wire)
        want = references[dense_wire]
        planted = _planted_stale_read(options.pop("stale_read", None))
        model, dense, _ = build(options.pop("row_exchange", "off"))
        timeline = Timeline()
        pipeline = TrainPipeline(model, dense, torch.device("cpu"), timeline=timeline, **options)
        data, trained, outputs = iter(mine), 0, []
        with planted:
            while True:
                try:
                    outputs.append(pipeline.progress(data))
                except StopIteration:
                    break
                trained += 1
        got = _state(model)
        error = max(cases.relative(g, w) for key in want for g, w in zip(got[key], want[key]))
        # The output of the last batch: (loss, logits, labels) in the loader's sample order.
        labels_in_order = bool(torch.equal(outputs[-1][2], mine[-1].labels))
        spans = {s.name for s in timeline.spans}
        # O(k)'s rows are waited for inside D(k), once the model asks for them: DLRM's dense
        # arch, which runs first, computes while they travel.
        dense_spans = [s for s in timeline.spans if s.name == "dense"]
        waits_inside_dense = all(
            any(d.args == w.args and d.start <= w.start and w.end <= d.end for d in dense_spans)
            for w in timeline.spans if w.name == "wait embeddings")
        results[name] = (trained, error, labels_in_order, spans, waits_inside_dense)
        if options.get("defer_dense_update"):
            # Without the epoch's end: every batch trained, the last dense update pending
            # until flush().
            model, dense, _ = build(options.get("row_exchange", "off"))
            pipeline = TrainPipeline(model, dense, torch.device("cpu"), **options)
            data = iter(mine)
            for _ in mine:
                pipeline.progress(data)

            def dense_error():
                got = _state(model)
                return max(cases.relative(g, w) for key in want if "embedding_bags" not in key
                           for g, w in zip(got[key], want[key]))

            before = dense_error()
            pipeline.flush()
            results[name + ", before and after flush"] = (before, dense_error())
    return results


CONFIGURATIONS = {
    "sequential": dict(num_micro_batches=1, overlap=False, dbp=False),
    "dbp": dict(num_micro_batches=1, overlap=True, dbp=True),
    "fwp m=2": dict(num_micro_batches=2, overlap=True, dbp=False),
    "fwp+dbp m=4": dict(num_micro_batches=4, overlap=True, dbp=True),
    "fwp+dbp m=2 clustered, early lookup": dict(num_micro_batches=2, split="clustered",
                                                dbp_lookup="early"),
    "fwp+dbp m=3, row exchange": dict(num_micro_batches=3, row_exchange=["t0", "t2"]),
    "sequential, row exchange": dict(num_micro_batches=1, overlap=False, dbp=False,
                                     row_exchange="all"),
    "dbp, early rows": dict(num_micro_batches=1, row_exchange="all", early_rows=True),
    "fwp+dbp m=2, early rows, pooled tables": dict(num_micro_batches=2, early_rows=True),
    "fwp+dbp m=3, early rows, deferred dense update": dict(
        num_micro_batches=3, row_exchange=["t0", "t2"], early_rows=True,
        defer_dense_update=True),
    "dbp, deferred dense update": dict(num_micro_batches=1, defer_dense_update=True),
    "fwp+dbp m=2, deferred dense update": dict(num_micro_batches=2, defer_dense_update=True),
}


def test_pipeline_equals_sequential_loop(seed):
    """20 steps of 7 samples per rank (not a multiple of 2 or 4), row-wise sharding."""
    results = run_distributed(_pipeline_body, world_size=2,
                              args=(seed, CONFIGURATIONS, 20, 7, "row_wise", "fp32", "fp32"),
                              timeout=300)
    for rank, per_config in enumerate(results):
        for name in [n for n in per_config if n.endswith("before and after flush")]:
            before, after = per_config.pop(name)
            assert before > 1e-4 and after <= 1e-5, (rank, name, before, after)
        for name, (trained, error, labels_in_order, spans, waits_inside_dense) in \
                per_config.items():
            assert trained == 20, (rank, name, trained)
            assert error <= 1e-5, (rank, name, error)
            assert labels_in_order, (rank, name)
            assert {"lookup", "dense", "update", "wait embeddings"} <= spans, (rank, name, spans)
            assert waits_inside_dense, (rank, name)


def test_pipeline_on_one_rank_equals_sequential_loop(seed):
    """A group of one rank sends nothing: its rows stay exact even with FP8 comms (a quantized
    row would be off by ~1e-2), on every schedule."""
    configs = {name: CONFIGURATIONS[name] for name in
               ("sequential", "fwp+dbp m=4", "fwp+dbp m=3, row exchange",
                "sequential, row exchange")}
    [per_config] = run_distributed(_pipeline_body, world_size=1,
                                   args=(seed, configs, 6, 7, "table_wise", "e4m3", "e5m2"),
                                   timeout=300)
    for name, (trained, error, labels_in_order, _, _) in per_config.items():
        assert trained == 6 and labels_in_order, name
        assert error <= 1e-5, (name, error)


def _planted_stale_read(kind):
    """A context in which the pipeline reads stale rows, as a schedule bug would: "uncorrected"
    (the early DBP lookup without its correction for the rows the update changed) or
    "early changed rows" (early rows that send the cells the update changes early too, their
    values from before it); None: nothing planted."""
    import contextlib
    from unittest import mock

    from recxla.torchrec import early_rows

    def none_late(find):
        return lambda *args: torch.zeros_like(find(*args))

    if kind is None:
        return contextlib.nullcontext()
    if kind == "uncorrected":
        return mock.patch("recxla.torchrec.early_lookup.EarlyLookup.corrected",
                          lambda self: self.output.detach())
    assert kind == "early changed rows", kind
    stack = contextlib.ExitStack()
    for name in ("late_bags", "_late_requests"):
        stack.enter_context(mock.patch.object(early_rows, name,
                                              none_late(getattr(early_rows, name))))
    return stack


def test_planted_stale_read_is_caught(seed):
    """The early DBP lookup without its correction, and early rows that send the rows and bags
    the update changes early too, read rows the previous update changed: the comparison with
    the sequential loop fails by far more than rounding."""
    stale = {"stale": dict(num_micro_batches=2, dbp_lookup="early", stale_read="uncorrected"),
             "corrected": dict(num_micro_batches=2, dbp_lookup="early"),
             "stale rows": dict(num_micro_batches=2, row_exchange="all", early_rows=True,
                                stale_read="early changed rows"),
             "stale bags": dict(num_micro_batches=2, early_rows=True,
                                stale_read="early changed rows"),
             "held rows": dict(num_micro_batches=2, row_exchange="all", early_rows=True)}
    results = run_distributed(_pipeline_body, world_size=2,
                              args=(seed, stale, 4, 6, "table_wise", "fp32", "fp32"),
                              timeout=300)
    for rank, per_config in enumerate(results):
        for name in ("corrected", "held rows"):
            assert per_config[name][1] <= 1e-5, (rank, name, per_config[name])
        for name in ("stale", "stale rows", "stale bags"):
            assert per_config[name][1] > 1e-3, (rank, name, per_config[name])


def test_pipeline_with_fp8_comms_matches_sequential(seed):
    """Rows are quantized one by one (a scale each), so micro-batching changes nothing on the
    wire: the FP8 pipeline stays at the FP8 sequential loop's weights. Only the dense gradients'
    float order differs; when that moves a value across an FP8 rounding boundary, one code
    changes by 1/16, hence the looser bound than fp32's (a wrong row or micro-batch costs O(1)).
    The bf16 dense all-reduce is checked against the loop with torch's bf16_compress_hook, the
    same wire: against the fp32 loop, row-wise Adagrad's first update (about lr in size however
    small the gradient) turns a bf16 rounding that flips a near-zero gradient's sign into an
    O(1) difference in the row (0.7 relative in 6 steps at RECXLA_TEST_SEED=1744675256)."""
    configs = {"fwp+dbp m=3": dict(num_micro_batches=3),
               "bf16 dense all-reduce": dict(num_micro_batches=2, dense_allreduce="bf16"),
               "bf16 dense all-reduce, sequential": dict(
                   num_micro_batches=1, overlap=False, dbp=False, dense_allreduce="bf16")}
    results = run_distributed(_pipeline_body, world_size=2,
                              args=(seed, configs, 6, 6, "column_wise", "e4m3", "bf16"),
                              timeout=300)
    # Over 16 seeds (both ranks) the largest relative errors were 1.5e-5 (m=3) and 5.3e-5 (bf16,
    # m=2: the micro-batches' sum rounds to bf16 once, the loop's one gradient too, and the two
    # differ by a bf16 step now and then); the sequential schedule sends what torch's hook sends,
    # bit for bit. Now and then one row moves by up to the learning rate: its row-wise Adagrad
    # state is near zero (3e-6), so a gradient that rounds to another bf16 value on the wire
    # changes that row's first steps by about lr (RECXLA_TEST_SEED=1931970883: one row of 53,
    # 0.0065 apart, 1.7e-2 relative to the table). A wrong row or micro-batch moves every row.
    bounds = {"fwp+dbp m=3": 5e-2, "bf16 dense all-reduce": 5e-2,
              "bf16 dense all-reduce, sequential": 0.0}
    for rank, per_config in enumerate(results):
        for name, (trained, error, _, _, _) in per_config.items():
            assert trained == 6 and error <= bounds[name], (rank, name, trained, error)


def _message_update_body(rank, world, seed, configs, refuse):
    """_pipeline_body's results for `configs`, and how the owners' updates read their gradient:
    messages, those read in place by the fused update, those unpacked into buffers. refuse: the
    lookups say their backward is more than the fused update, so every message is unpacked."""
    from unittest import mock

    from recxla.ops.embedding_bag import FusedPooledLookup
    from recxla.torchrec.row_exchange import RowLookup
    from recxla.torchrec.sharded_steps import ShardedSteps

    counts = {"messages": 0, "in place": 0, "unpacked": 0}
    update_from_message, unpack = ShardedSteps.update_from_message, ShardedSteps.unpack_gradient

    def counted_update(self, *args):
        done = update_from_message(self, *args)
        counts["messages"] += 1
        counts["in place"] += done
        return done

    def counted_unpack(self, *args):
        counts["unpacked"] += 1
        return unpack(self, *args)

    with mock.patch.object(ShardedSteps, "update_from_message", counted_update), \
            mock.patch.object(ShardedSteps, "unpack_gradient", counted_unpack), \
            mock.patch.object(FusedPooledLookup, "message_update",
                              (lambda output: None) if refuse else
                              FusedPooledLookup.message_update), \
            mock.patch.object(RowLookup, "message_update",
                              (lambda output: None) if refuse else RowLookup.message_update):
        results = _pipeline_body(rank, world, seed, configs, 6, 7, "table_wise", "fp32", "fp32")
    return results, counts


@pytest.mark.parametrize("refuse", [False, True])
def test_one_micro_batch_updates_from_the_message(seed, refuse):
    """With one micro-batch the owners' fused update reads the gradient message where it lies:
    pooled tables and row-exchange tables (both in one message), and row tables alone; no
    message is unpacked. Where a lookup's backward is more than the fused update the message
    is unpacked and the backward runs: the same training either way."""
    configs = {"dbp, pooled and row tables": dict(num_micro_batches=1, row_exchange=["t0", "t2"]),
               "dbp, row tables": dict(num_micro_batches=1, row_exchange="all"),
               "dbp, pooled tables": dict(num_micro_batches=1)}
    results = run_distributed(_message_update_body, world_size=2,
                              args=(seed, configs, refuse), timeout=300)
    for rank, (per_config, counts) in enumerate(results):
        for name, (trained, error, _, _, _) in per_config.items():
            assert trained == 6 and error <= 1e-5, (rank, name, trained, error)
        # One message a step of each configuration.
        if refuse:
            assert counts["messages"] == 18 and counts["in place"] == 0, (rank, counts)
        else:
            assert counts == {"messages": 18, "in place": 18, "unpacked": 0}, (rank, counts)
    # A message that holds row tables' rows is unpacked (pooled rows alone are the buffer).
    assert refuse == any(counts["unpacked"] for _, counts in results), results


def test_pipeline_rejects_bad_options():
    from recxla.pipeline import TrainPipeline

    class NoShardedModules(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="no module sharded by"):
        TrainPipeline(NoShardedModules(), None, torch.device("cpu"))
    with pytest.raises(ValueError, match="num_micro_batches must be an int >= 1"):
        TrainPipeline(NoShardedModules(), None, torch.device("cpu"), num_micro_batches=0)
    with pytest.raises(TypeError, match="dense_allreduce must be a wire's name"):
        TrainPipeline(NoShardedModules(), None, torch.device("cpu"), dense_allreduce=2)
    with pytest.raises(ValueError, match="dense_allreduce must be one of"):
        TrainPipeline(NoShardedModules(), None, torch.device("cpu"), dense_allreduce="fp16")


def _integer_gathers_body(rank, world, seed, configurations):
    """The (file:line, shape) of every aten::index by one integer index tensor that recxla's
    own code calls in 3 pipeline steps, per configuration."""
    import os
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    import recxla
    from recxla.pipeline import TrainPipeline

    package = os.path.dirname(recxla.__file__) + os.sep
    found = []

    class IntegerGathers(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.index.Tensor:
                indices = [i for i in args[1] if i is not None]
                if len(indices) == 1 and not indices[0].is_floating_point() \
                        and indices[0].dtype != torch.bool:
                    caller = [f for f in traceback.extract_stack()[:-1]
                              if os.sep + "torch" + os.sep not in f.filename][-1]
                    if caller.filename.startswith(package):
                        where = f"{caller.filename[len(package):]}:{caller.lineno}"
                        found.append((where, tuple(args[0].shape)))
            return func(*args, **(kwargs or {}))

    results = {}
    generator = torch.Generator().manual_seed(seed + 1)
    for name, options in configurations.items():
        options = dict(options)
        model, dense, configs = _build(seed, world, "row_wise", "e4m3", "e5m2",
                                       options.pop("row_exchange", "off"))
        batches = [dlrm._slice(dlrm._batch(configs, world * 16, generator), rank * 16,
                               (rank + 1) * 16) for _ in range(6)]
        pipeline = TrainPipeline(model, dense, torch.device("cpu"), **options)
        data = iter(batches)
        pipeline.progress(data)
        found.clear()
        with IntegerGathers():
            for _ in range(3):
                pipeline.progress(data)
        results[name] = sorted(set(found))
    return results


def test_step_gathers_by_index_select(seed):
    """On the CPU, `x[index]` (aten::index) is 1.6-5.6x slower than `x.index_select(0, index)`
    for the same result (docs/architecture.md, "CPU on the step's path"): recxla's code on
    the step's path gathers by index_select. Boolean masks are another op and stay allowed."""
    configs = {name: CONFIGURATIONS[name] for name in
               ("sequential", "fwp+dbp m=2 clustered, early lookup", "fwp+dbp m=3, row exchange")}
    results = run_distributed(_integer_gathers_body, world_size=2, args=(seed, configs),
                              timeout=300)
    for rank, per_config in enumerate(results):
        for name, found in per_config.items():
            assert not found, (rank, name, found)


def _vbe_body(rank, world, seed):
    """Batches with variable batch per feature (their inverse_indices give each sample's
    bag) through the pipeline with one micro-batch and through the plain loop -> (max state
    difference, the error a split into 2 micro-batches raises)."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recxla.pipeline import TrainPipeline

    generator = torch.Generator().manual_seed(seed + 1)
    _, _, configs = _build(seed, world, "table_wise", "fp32", "fp32")
    keys = [f for c in configs for f in c.feature_names]
    batch = 6

    def vbe_batch():
        strides = [int(torch.randint(1, batch + 1, (1,), generator=generator)) for _ in keys]
        lengths = torch.randint(0, 3, (sum(strides),), generator=generator)
        rows = min(c.num_embeddings for c in configs)
        inverse = torch.stack([torch.randint(0, s, (batch,), generator=generator)
                               for s in strides])
        sparse = KeyedJaggedTensor(
            keys=keys, lengths=lengths,
            values=torch.randint(0, rows, (int(lengths.sum()),), generator=generator),
            stride_per_key_per_rank=[[s] for s in strides], inverse_indices=(keys, inverse))
        return Batch(dense_features=torch.randn(batch, dlrm.NUM_DENSE, generator=generator),
                     sparse_features=sparse,
                     labels=torch.randint(0, 2, (batch,), generator=generator).float())

    batches = [vbe_batch() for _ in range(4)]
    model, dense, _ = _build(seed, world, "table_wise", "fp32", "fp32")
    for b in batches:
        dense.zero_grad()
        model(b)[0].backward()
        dense.step()
    want = _state(model)
    model, dense, _ = _build(seed, world, "table_wise", "fp32", "fp32")
    pipeline = TrainPipeline(model, dense, torch.device("cpu"))
    data = iter(batches)
    for _ in batches:
        pipeline.progress(data)
    got = _state(model)
    error = max(cases.relative(g, w) for key in want for g, w in zip(got[key], want[key]))
    model, dense, _ = _build(seed, world, "table_wise", "fp32", "fp32")
    try:
        TrainPipeline(model, dense, torch.device("cpu"), num_micro_batches=2).progress(
            iter(batches))
        refused = None
    except ValueError as e:
        refused = str(e)
    return error, refused


def test_variable_batch_trains_with_one_micro_batch(seed):
    for rank, (error, refused) in enumerate(run_distributed(_vbe_body, world_size=2,
                                                            args=(seed,), timeout=300)):
        assert error <= 1e-5, (rank, error)
        assert "variable batch per feature cannot be split into micro-batches" in refused


def _calls_body(rank, world, seed, calls):
    """A model whose sparse arch calls the sharded module `calls` times a forward (0: it
    uses a fixed tensor instead) -> the error the pipeline's first step raises."""
    from recxla.pipeline import TrainPipeline

    model, dense, configs = _build(seed, world, "table_wise", "fp32", "fp32")
    sparse_arch = model.module.model.sparse_arch
    forward = sparse_arch.forward

    def called(features):
        if calls == 0:
            return torch.zeros(features.stride(), len(configs), dlrm.DIM)
        return sum(forward(features) for _ in range(calls))

    sparse_arch.forward = called
    generator = torch.Generator().manual_seed(seed + 1)
    batches = [dlrm._slice(dlrm._batch(configs, world * 6, generator), rank * 6, rank * 6 + 6)
               for _ in range(2)]
    try:
        TrainPipeline(model, dense, torch.device("cpu")).progress(iter(batches))
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("calls,message", [
    (2, "called this sharded module more than once in one forward"),
    (0, "the model's forward did not call the sharded module")])
def test_a_model_calls_each_sharded_module_once_a_forward(seed, calls, message):
    for rank, error in enumerate(run_distributed(_calls_body, world_size=2,
                                                 args=(seed, calls), timeout=120)):
        assert error is not None and message in error, (rank, error)


def test_micro_batches_say_which_losses_they_keep_exact():
    """num_micro_batches > 1 weights each part's loss by its share of the batch: said once
    where the pipeline cannot tell the loss is a mean over samples, refused where the user says
    it is not, silent where the user says it is; a loss that mixes samples (an in-batch
    softmax) shows why: per-micro-batch parts do not add up to the batch's."""
    import warnings

    from recxla.pipeline import TrainPipeline

    scores = torch.randn(8, 8)
    whole = torch.nn.functional.cross_entropy(scores, torch.arange(8))
    halves = sum(0.5 * torch.nn.functional.cross_entropy(scores[i:i + 4, i:i + 4],
                                                         torch.arange(4)) for i in (0, 4))
    assert abs(float(whole - halves)) > 1e-3  # the case the warning is about
    with pytest.raises(TypeError, match="loss_is_sample_mean must be None or a bool"):
        TrainPipeline(torch.nn.Linear(1, 1), None, torch.device("cpu"), num_micro_batches=2,
                      loss_is_sample_mean="yes")
    with pytest.raises(ValueError, match="num_micro_batches=2 with loss_is_sample_mean=False"):
        TrainPipeline(torch.nn.Linear(1, 1), None, torch.device("cpu"), num_micro_batches=2,
                      loss_is_sample_mean=False)
    for flag, warned in ((None, True), (True, False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(ValueError, match="the model has no module sharded"):
                TrainPipeline(torch.nn.Linear(1, 1), None, torch.device("cpu"),
                              num_micro_batches=2, loss_is_sample_mean=flag)
        assert any("mean of per-sample terms" in str(w.message) for w in caught) == warned
