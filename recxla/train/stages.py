"""The stages of a training run, in the order recxla.train.cli's `_train` calls them (its module
docstring draws the data flow): each takes what the stages before it made and returns what the
next ones need.

- `open_data`: this rank's data (recxla.train.data), a raw table read at the same snapshots on
  every rank; `report_embedding_dims`: the tables' wire bytes behind --embedding-dims auto;
- `plan_and_shard`: the plan (inside each node with --topology 2d), the dense all-reduce, the
  tables exchanged as rows, then DMP with this path's sharder, seeded tables and the optimizer
  (recxla.train.sharding does each): a `Sharded`;
- `make_pipeline`: TorchRec's training pipeline, metered, or recxla's TrainPipeline (which owns
  the compressed dense all-reduce's state);
- `resume`: --resume's checkpoint loaded (into the pipeline's state too); the step to continue
  from;
- `train_loop`: the steps (recxla.train.loop.run_steps), measured after the warm-up, with the
  checkpoints: a `Measured`;
- `gather_figures`, `run_summary`, `report`: every rank's figures, the summary, printed and
  written by rank 0.
"""

import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from recxla.pipeline import DenseAllReduce, Timeline, TrainPipeline
from recxla.torchrec.replicas import ReplicaSync, make_topology_2d
from recxla.torchrec.types import PipelinedModule
from recxla.train import checkpoint
from recxla.train.data import TrainData, current_snapshots, is_raw_table
from recxla.train.kernel_trace import KernelTrace
from recxla.train.loop import METERED_PIPELINES, Progress, StepLog, run_steps
from recxla.train.metrics import (
    format_summary, iface_bytes, local_figures, machine, summarize, write_metrics)
from recxla.train.models import init_embedding_tables
from recxla.train.sharding import (
    baseline_dense_state, build_optimizer, build_sharders, data_parallel_tables, embedding_tables,
    gradient_division_description, plan_sharding, plan_summary, powersgd_start,
    resolve_row_exchange, shard_model, sharder_description)


@dataclass
class Sharded:
    """What planning and sharding made of the model."""

    tables: list  # the model's TorchRec EmbeddingBagConfigs
    plan: object  # TorchRec's ShardingPlan
    row_tables: List[str]  # the tables whose owners send unique rows (recxla path)
    # The recxla pipeline's dense all-reduce (wire, nodes, PowerSGD's options); None: baseline
    dense_allreduce: Optional[DenseAllReduce]
    dmp: torch.nn.Module  # DistributedModelParallel
    optimizer: object  # the fused embedding optimizer and the dense one, combined
    # --dense-allreduce fp8 / powersgd: its CompressedAllReduce (residuals, factors), which
    # the checkpoints carry: the baseline's hook state, or (set by make_pipeline) the recxla
    # pipeline's; else None
    dense_state: object


@dataclass
class Measured:
    """What the loop leaves for the summary."""

    start: int  # the first step: the resumed checkpoint's, else 0
    warmup: int  # the steps after `start` left out of the figures
    log: StepLog
    sharder_stats: dict  # the sharded modules' counters over the measured steps
    iface: Optional[dict]  # --net-iface's bytes over the measured steps (local rank 0)


def open_data(config, place) -> TrainData:
    """This rank's data. A raw --data table is read at one set of Iceberg snapshots on every
    rank: the --resume checkpoint's, else those rank 0 finds current, shared with the others
    (a table appended to while the ranks start would otherwise give ranks different data);
    the ranks' fingerprints are then compared, so that Parquet files changed while they
    started are an error too, not ranks reading different rows."""
    snapshots = checkpoint.resumed_snapshots(config)
    if snapshots is not None and place.rank == 0:
        _announce_pinned(config, snapshots)
    if snapshots is None and is_raw_table(config):
        shared = [current_snapshots(config) if place.rank == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        snapshots = shared[0]
    data = TrainData(config, place.rank, place.world_size, snapshots)
    if data.raw is not None:
        seen = [None] * place.world_size
        dist.all_gather_object(seen, data.fingerprint)
        if len(set(seen)) > 1:
            raise ValueError(f"--data {config.data}: the ranks planned different data "
                             f"(fingerprints {seen}): a file changed while the job started")
        if place.rank == 0:
            _announce_roles(config, data.raw)
    warning = data.split_warning()
    if warning is not None and place.rank == 0:
        print(f"recxla-train: warning: {warning}", file=sys.stderr, flush=True)
    return data


def _announce_roles(config, raw) -> None:
    """The roles the raw table's columns took (inferred, or the schema's), as a conversion
    prints them, and a word when no column became a dense feature."""
    lines = [f"recxla-train: --data {config.data}: {len(raw.plan.roles)} columns (after the "
             "joins and transforms):"] + [f"  {line}" for line in raw.plan.roles]
    if not raw.spec.dense_features:
        lines.append("  no dense features: no column is a float or bool (or the schema's "
                     "dense); the model's dense input is empty")
    print("\n".join(lines), file=sys.stderr, flush=True)


def report_embedding_dims(config, place, data) -> None:
    """--embedding-dims auto: rank 0 prints each table's bytes a step, its share of the wire
    and the proposed dim (recxla.planner.embedding_dims.wire_report), before training."""
    if data.wire is None or place.rank != 0:
        return
    from recxla.planner.embedding_dims import wire_report

    fwd, bwd = config.comms
    dims = data.table_dims(data.tables(data.embedding_dim))
    print(f"recxla-train: --embedding-dims {config.embedding_dims[0]}: each table's bytes a "
          f"step on {place.world_size} ranks ({fwd}/{bwd}), and the proposal:\n"
          + "\n".join(wire_report(data.wire, dims, fwd_comm=fwd, bwd_comm=bwd)), flush=True)


def plan_and_shard(config, place, device, watchdog, data, tables, model) -> Sharded:
    """The plan (inside each node with --topology 2d), the dense all-reduce's nodes, the tables
    exchanged as rows; then DMP with this path's sharder, seeded tables and the optimizer.
    Every rank makes the same process groups in the same order, as group creation needs."""
    watchdog.progress("planning")
    topology, replicas = _topology(config)
    plan = _plan(config, place, device, tables, model, topology)
    dense_allreduce = _dense_allreduce(config, place, topology)
    row_tables = _row_tables(config, data, tables, plan,
                             topology.ranks_per_node if topology else place.world_size)
    watchdog.progress("sharding")
    dmp = shard_model(model, build_sharders(config, row_tables, replicas), plan, device, config,
                      topology)
    init_embedding_tables(embedding_tables(dmp), tables, config.seed)
    return Sharded(tables, plan, row_tables, dense_allreduce, dmp, build_optimizer(dmp, config),
                   baseline_dense_state(dmp, config))


def _topology(config):
    """--topology 2d: (the shard groups inside each node and the replica groups across them,
    how the replicas keep in step); 1d: (None, None)."""
    if config.topology != "2d":
        return None, None
    topology = make_topology_2d(config.ranks_per_node)
    return topology, ReplicaSync(topology.replica_group, config.replica_sync,
                                 config.sync_every, config.replica_precision)


def _plan(config, place, device, tables, model, topology):
    """TorchRec's ShardingPlan over the job's ranks, or over one node's with a topology."""
    if topology is None:
        return plan_sharding(model, config, tables, place.world_size, place.local_world_size,
                             device)
    return plan_sharding(model, config, tables, topology.ranks_per_node,
                         topology.ranks_per_node, device, topology.shard_group)


def _dense_allreduce(config, place, topology) -> Optional[DenseAllReduce]:
    """The recxla pipeline's dense all-reduce: --dense-allreduce's wire, by node (2d's nodes,
    else groups made now: every rank takes the same branch) or over every rank, PowerSGD's
    --powersgd-rank and --powersgd-start, --ddp-bucket-merge. None on the baseline path."""
    if config.baseline:
        return None
    node_size = topology.ranks_per_node if topology else place.local_world_size
    nodes = None
    if config.dense_allreduce_by_node and 1 < node_size < place.world_size:
        nodes = topology or make_topology_2d(node_size)
    powersgd = {"powersgd_rank": config.powersgd_rank,
                "powersgd_start": powersgd_start(config)} \
        if config.dense_allreduce == "powersgd" else {}
    return DenseAllReduce(config.dense_allreduce, nodes, **powersgd,
                          bucket_merge=config.ddp_bucket_merge)


def _row_tables(config, data, tables, plan, ranks: int) -> List[str]:
    """The pooled tables exchanged as unique rows, judged by every rank on the same batch
    (rank 0's first); data-parallel tables have no owner to send rows from, and --model
    history's sequence table is exchanged as rows by its own module."""
    sample = data.sample().sparse_features
    replicated = set(data_parallel_tables(plan))
    if config.model == "history":
        history, _ = data.history_features()
        replicated |= {t.name for t in tables if history in t.feature_names}
    return resolve_row_exchange(config, [t for t in tables if t.name not in replicated],
                                sample, ranks)


def resume(config, watchdog, sharded: Sharded) -> int:
    """--resume: the checkpoint's model and optimizer state; -> the step to continue from (0
    without --resume)."""
    if not config.resume:
        return 0
    watchdog.progress("loading the checkpoint")
    path = checkpoint.resume_checkpoint(config.checkpoint_dir, config.resume_step)[1]
    return checkpoint.load(path, sharded.dmp, sharded.optimizer, sharded.dense_state)


def _announce_pinned(config, snapshots) -> None:
    """--resume of a raw table: the Iceberg snapshots the checkpoint pinned, which the run reads
    whatever the tables hold now."""
    from recxla.data.joins import parse_join

    refs = [("--data", config.data)] + [("--join", parse_join(j)[1]) for j in config.join]
    pinned = [f"{flag} {ref} at snapshot {snap}" for (flag, ref), snap in zip(refs, snapshots)
              if snap is not None]
    if pinned:
        print(f"recxla-train: --resume reads what the checkpoint pinned: {'; '.join(pinned)}",
              file=sys.stderr, flush=True)


def make_pipeline(config, device, meter, sharded: Sharded) -> Tuple[object, Optional[Timeline]]:
    """-> (one of TorchRec's training pipelines, metered (--baseline torchrec), and no
    timeline; or recxla's TrainPipeline and its Timeline, recorded with --trace)."""
    dmp, optimizer = sharded.dmp, sharded.optimizer
    if config.baseline:
        return METERED_PIPELINES[config.baseline_pipeline](dmp, optimizer, device, meter), None
    timeline = Timeline(enabled=config.trace is not None)
    pipeline = TrainPipeline(dmp, optimizer, device, num_micro_batches=config.micro_batches,
                             overlap=config.overlap, dbp=config.dbp, split=config.split,
                             dbp_lookup=config.dbp_lookup,
                             dense_allreduce=sharded.dense_allreduce,
                             defer_dense_update=config.defer_dense_update,
                             early_rows=config.early_rows, timeline=timeline, phase=meter.phase,
                             # The trainer's models: DLRMTrain's BCE, a mean over the samples.
                             loss_is_sample_mean=True)
    sharded.dense_state = pipeline.dense_allreduce_state
    return pipeline, timeline


def train_loop(config, conn, watchdog, meter, data, sharded, pipeline, start) -> Measured:
    """Steps start .. --steps through the pipeline, measured after the warm-up, with a
    checkpoint every --checkpoint-every steps and one at the end; the loader is closed after
    the last step."""
    place = conn.place
    progress = Progress(place.rank == 0 and config.progress, config.steps, start,
                        config.batch_size * place.world_size)
    log = StepLog(first=start)
    warmup = min(config.warmup_steps, max(config.steps - start - 1, 0))
    counters = _Counters(config, place, sharded.dmp, measuring=warmup == 0)
    kernel_trace = KernelTrace(config.kernel_trace, place.rank, start, warmup, config.steps)
    checkpoints = _Checkpoints(config, place.world_size, watchdog, meter, data, sharded,
                               pipeline, log)

    def on_step_done(done: int) -> None:
        watchdog.progress(f"step {done}")
        kernel_trace.step_done(done)
        if done == start + warmup:
            counters.restart()
        checkpoints.after_step(done)

    _announce(config, conn, watchdog, start)
    try:
        run_steps(pipeline, data.train(start, config.steps), start, config.steps, meter,
                  progress, on_step_done, log)
    finally:
        kernel_trace.close()
        data.close()  # the loader's workers, and a Ray it started
    progress.close()
    if kernel_trace.written and place.rank == 0:
        print(f"wrote {kernel_trace.written}", file=sys.stderr, flush=True)
    sharder_stats, iface = counters.read()  # before the evaluation's forwards add to them
    checkpoints.at_end()
    return Measured(start, warmup, log, sharder_stats, iface)


def _announce(config, conn, watchdog, start: int) -> None:
    watchdog.progress(f"step {start}")
    if conn.place.rank == 0:
        print(f"recxla-train: {config.display_name}: steps {start}..{config.steps} on "
              f"{conn.place.world_size} ranks ({conn.device}); "
              f"{gradient_division_description()}", file=sys.stderr, flush=True)


class _Counters:
    """The byte counters of the measured steps: the sharded modules' own (recxla's sharder
    keeps them) and, with --net-iface, the interface's (each node's local rank 0 reads it)."""

    def __init__(self, config, place, dmp, measuring: bool):
        self.modules = [m for m in dmp.modules() if hasattr(m, "comm_stats")]
        self.iface = config.net_iface if place.local_rank == 0 else None
        self.iface_start = iface_bytes(self.iface) if self.iface is not None and measuring \
            else None

    def restart(self) -> None:
        """At the end of the warm-up."""
        for m in self.modules:
            m.comm_stats.reset()
        if self.iface is not None:
            self.iface_start = iface_bytes(self.iface)

    def read(self) -> Tuple[dict, Optional[dict]]:
        """-> (the modules' counters summed, the interface's bytes; None where not read)."""
        stats = _comm_stats(self.modules)
        if self.iface is None:
            return stats, None
        end = iface_bytes(self.iface)
        return stats, {k: end[k] - self.iface_start[k] for k in end}


class _Checkpoints:
    """--checkpoint-dir's checkpoints: one every --checkpoint-every steps and one at the end,
    their time kept apart from the steps' (StepLog.checkpoint_s)."""

    def __init__(self, config, world: int, watchdog, meter, data, sharded: Sharded, pipeline,
                 log: StepLog):
        self.config, self.world, self.watchdog, self.meter = config, world, watchdog, meter
        self.data, self.sharded, self.pipeline, self.log = data, sharded, pipeline, log

    def after_step(self, done: int) -> None:
        every = self.config.checkpoint_every
        if self.config.checkpoint_dir and every and done % every == 0 and \
                done < self.config.steps:
            self.save(done)

    def at_end(self) -> None:
        if self.config.checkpoint_dir:
            self.save(self.config.steps)

    def save(self, done: int) -> None:
        config = self.config
        began = time.perf_counter()
        self.watchdog.progress(f"checkpoint at step {done}")
        if not config.baseline:
            self.pipeline.flush()  # the last step's dense update, if it is still pending
            # With --replica-sync weights the nodes' copies of the tables differ between
            # syncs: the checkpoint holds their average, which every node then trains on (one
            # copy written, as with --replica-sync gradients, whose copies are the same bits).
            for module in self.sharded.dmp.modules():
                if isinstance(module, PipelinedModule):
                    module.steps.average_replicas()
        with self.meter.phase("checkpoint"):
            checkpoint.save(config.checkpoint_dir, done, self.sharded.dmp,
                            self.sharded.optimizer, config, self.world, self.data.fingerprint,
                            dense_state=self.sharded.dense_state,
                            data_snapshots=self.data.snapshots)
        if not config.baseline:
            self.pipeline.drop_early_lookups()  # the next batch read as a resumed run reads it
        self.log.checkpoint_s += time.perf_counter() - began
        self.watchdog.progress(f"step {done}, checkpoint written")


def gather_figures(watchdog, meter, measured: Measured, world: int) -> List[dict]:
    """Every rank's figures of the measured steps (recxla.train.metrics.local_figures), on
    every rank."""
    watchdog.progress("summary")
    figures = local_figures(measured.log, meter, measured.warmup)
    figures["sharder_comm_stats"] = measured.sharder_stats
    figures["iface"] = measured.iface
    gathered: List[Optional[dict]] = [None] * world
    dist.all_gather_object(gathered, figures)
    return gathered


def run_summary(config, conn, data, sharded: Sharded, pipeline, measured: Measured,
                evaluation: dict, per_rank: List[dict]) -> dict:
    """The run's summary, the same on every rank."""
    place, world = conn.place, conn.place.world_size
    return {
        "name": config.display_name, "path": config.path,
        "sharder": sharder_description(config, sharded.row_tables), "world_size": world,
        "gradient_division": gradient_division_description(),
        "pipeline": f"torchrec {pipeline.torchrec_name}" if config.baseline else (
            f"recxla TrainPipeline: {config.micro_batches} micro-batches, overlap "
            f"{'on' if config.overlap else 'off'}, dbp {'on' if config.dbp else 'off'}"),
        "topology": config.topology,
        "dense_allreduce_layout": ("by node" if sharded.dense_allreduce is not None
                                   and sharded.dense_allreduce.nodes is not None else "ring"),
        "dense_buckets_together": None if config.baseline else
        list(pipeline.dense_buckets_together),
        "nodes": world // place.local_world_size, "device": str(conn.device),
        "resumed_from_step": measured.start if config.resume else None,
        **summarize(config, per_rank, world), **evaluation,
        "eval_data": data.held_out_description, "tables": len(sharded.tables),
        "embedding_dims": {t.name: t.embedding_dim for t in sharded.tables},
        "table_wire": None if data.wire is None else [dataclasses.asdict(w) for w in data.wire],
        "sharder_comm_stats_per_step": _sum_stats(
            [g["sharder_comm_stats"] for g in per_rank],
            max(config.steps - measured.start - measured.warmup, 1)),
        "plan": plan_summary(sharded.plan), "config": config.asdict(), "machine": machine(),
    }


def report(config, rank: int, summary: dict) -> None:
    """Rank 0 prints the summary, and writes it to --metrics."""
    if rank == 0:
        print(format_summary(summary), flush=True)
        if config.metrics:
            write_metrics(config.metrics, summary)
            print(f"wrote {config.metrics}", flush=True)


def _comm_stats(modules) -> dict:
    """The sharded modules' own counters (recxla's sharders keep them), summed; those of the
    sequence modules (ShardedEmbeddingCollection) also on their own, as `sequence_<name>`."""
    from recxla.torchrec.sharded_embedding import ShardedEmbeddingCollection

    out = {}
    for m in modules:
        stats = m.comm_stats
        prefixes = [""] + (["sequence_"] if isinstance(m, ShardedEmbeddingCollection) else [])
        for name in ("id_bytes_sent", "id_bytes_received", "id_bytes_without_dedup",
                     "embedding_bytes_sent", "embedding_bytes_received", "gradient_bytes_sent",
                     "gradient_bytes_received", "rows_sent_early", "rows_sent_late"):
            if hasattr(stats, name):
                for prefix in prefixes:
                    out[prefix + name] = out.get(prefix + name, 0) + int(getattr(stats, name))
    return out


def _sum_stats(per_rank: List[dict], steps: int) -> Optional[dict]:
    total = {}
    for stats in per_rank:
        for k, v in stats.items():
            total[k] = total.get(k, 0) + v
    return {k: v / steps for k, v in total.items()} if total else None

