"""`recxla-train` / `python -m recxla.train`: the trainer's entry point.

    torchrun --nproc-per-node 2 -m recxla.train --steps 100 --metrics recxla.json
    torchrun --nproc-per-node 2 -m recxla.train --steps 100 --baseline torchrec \\
        --metrics torchrec.json
    recxla-train --compare recxla.json torchrec.json --chart compare.png

A run: options checked (exit 2 on a bad one, before any process group) -> process group and
watchdog -> model (TorchRec's DLRM or DLRM_DCN), plan, DMP with this path's sharder, seeded
tables -> optional resume -> a TorchRec or recxla training pipeline for --steps steps, measured ->
final checkpoint -> AUC on the held-out split -> summary on rank 0 (printed; JSON with
--metrics). Exit status of each rank: 0 done; 1 this rank failed; 2 bad options or input,
found before training (printed once, by each node's first rank); 3 another rank died, hung or
failed, or the rank hosting the store is gone (the message names it); 4 this rank made no
progress for --timeout seconds; 5 this rank's training loss became NaN or infinite
(recxla.train.loop.NonFiniteLoss). torchrun itself exits 1 whenever a rank fails (its
ChildFailedError), whatever the ranks' status; its summary shows each rank's.
"""

import os
import sys
import time
import traceback
from typing import List, Optional, Sequence

_COMM_ERROR_WORDS = ("connection", "peer", "timed out", "timeout", "gloo", "nccl", "closed",
                     "reset", "broken pipe")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--compare" in argv:
        from recxla.train.compare import main as compare_main

        return compare_main(argv)
    from recxla.train.config import exit_bad_input, parse_config

    config = parse_config(argv)  # exits 2 with the option's name on a bad one
    from recxla.train import checkpoint
    from recxla.train.rendezvous import place_from_env

    try:
        place = place_from_env()
        if config.resume:
            checkpoint.check_compatible(
                config, place.world_size,
                checkpoint.read_train_state(
                    checkpoint.resume_checkpoint(config.checkpoint_dir, config.resume_step)[1]))
    except ValueError as e:
        exit_bad_input(str(e).removeprefix("recxla-train: "))  # exits 2
    run(config, place)
    return 0


def _quiet_upstream_notices() -> None:
    """TorchRec's planner and DDP warn on every run about their own internals (dry-run storage
    estimates, a deprecated DDP argument TorchRec passes, topology construction): nothing a
    user of the trainer can act on, so they are kept out of its output."""
    import logging
    import warnings

    for name in ("torchrec.distributed.planner", "torch.fx._symbolic_trace"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torchrec\.distributed")


def _is_comm_error(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return isinstance(e, RuntimeError) and any(w in text for w in _COMM_ERROR_WORDS)


def run(config, place) -> dict:
    """Train on this rank (a collective over the job); returns the summary (every rank).

    On failure this process exits (os._exit) with the status of the module docstring, after
    telling its peers through the store: a failed rank cannot leave a process group cleanly.
    """
    import torch

    from recxla.train.comm_meter import CommMeter
    from recxla.train.memory import keep_freed_memory
    from recxla.train.rendezvous import connect
    from recxla.train.watchdog import Watchdog

    _quiet_upstream_notices()
    if config.allocator == "keep":
        keep_freed_memory()
    torch.set_num_threads(config.threads)
    conn = connect(place, config.device, config.timeout)
    watchdog = Watchdog(conn.watchdog_store, place.rank, place.world_size, config.timeout)
    watchdog.start()
    meter = CommMeter(ranks_per_node=place.local_world_size)
    try:
        with meter.installed():
            summary = _train(config, conn, watchdog, meter)
    except BaseException as e:  # noqa: B902 (KeyboardInterrupt too: peers must hear of it)
        _exit_failed(e, watchdog, place.rank)
    watchdog.stop()
    conn.close()
    return summary


def _exit_failed(e: BaseException, watchdog, rank: int) -> None:
    """Ends this rank after `e`: EXIT_PEER_FAILED naming the rank that caused it when the
    heartbeats tell (or the store is gone), else this rank's own failure, published for its
    peers: a NonFiniteLoss's status and message, or EXIT_FAILED with the traceback."""
    from recxla.train.loop import NonFiniteLoss
    from recxla.train.watchdog import EXIT_FAILED, EXIT_PEER_FAILED

    culprit = watchdog.culprit(wait=_is_comm_error(e))
    if culprit is not None:
        saw = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"recxla-train: rank {rank}: exiting: {culprit} (this rank saw: "
              f"{saw if len(saw) <= 160 else saw[:157] + '...'})", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_FAILED)
    watchdog.report_failure(f"{type(e).__name__}: {e}")
    if isinstance(e, NonFiniteLoss):  # the message says what to check; no traceback
        code = e.exit_status
        print(f"recxla-train: rank {rank}: error: {e}", file=sys.stderr, flush=True)
    else:
        code = EXIT_FAILED
        traceback.print_exc()
    sys.stderr.flush()
    os._exit(code)


def _train(config, conn, watchdog, meter) -> dict:
    import torch.distributed as dist

    from recxla.train import checkpoint
    from recxla.train.data import TrainData
    from recxla.train.kernel_trace import KernelTrace
    from recxla.train.loop import METERED_PIPELINES, Progress, StepLog, run_steps
    from recxla.train.metrics import (
        evaluate, format_summary, iface_bytes, local_figures, machine, summarize, write_metrics)
    from recxla.train.models import build_model, init_embedding_tables
    from recxla.train.sharding import (
        build_optimizer, build_sharder, data_parallel_tables, embedding_tables,
        gradient_division_description, plan_sharding, plan_summary, resolve_row_exchange,
        shard_model, sharder_description)

    place, device = conn.place, conn.device
    world = place.world_size
    data = TrainData(config, place.rank, world)
    tables = data.tables()
    model = build_model(config, tables, data.num_dense, device, data.weighted)
    watchdog.progress("planning")
    with meter.phase("setup"):
        topology, replicas = None, None
        if config.topology == "2d":
            from recxla.torchrec.replicas import ReplicaSync, make_topology_2d

            topology = make_topology_2d(config.ranks_per_node)
            replicas = ReplicaSync(topology.replica_group, config.replica_sync,
                                   config.sync_every, config.replica_precision)
            plan = plan_sharding(model, config, tables, topology.ranks_per_node,
                                 topology.ranks_per_node, device, topology.shard_group)
        else:
            plan = plan_sharding(model, config, tables, world, place.local_world_size, device)
        # The node layout of the dense all-reduce by node (2d's own, else its groups made now:
        # every rank takes the same branch, as group creation needs).
        node_size = topology.ranks_per_node if topology else place.local_world_size
        dense_nodes = None
        if config.dense_allreduce_by_node and not config.baseline and 1 < node_size < world:
            from recxla.torchrec.replicas import make_topology_2d

            dense_nodes = topology or make_topology_2d(node_size)
        # Every rank judges row exchange on the same batch (rank 0's first).
        sample = data.sample().sparse_features
        # Data-parallel tables have no owner to send rows from.
        replicated = set(data_parallel_tables(plan))
        row_tables = resolve_row_exchange(config, [t for t in tables if t.name not in replicated],
                                          sample, topology.ranks_per_node if topology else world)
        watchdog.progress("sharding")
        dmp = shard_model(model, build_sharder(config, row_tables, replicas), plan, device,
                          config, topology)
        init_embedding_tables(embedding_tables(dmp), tables, config.seed)
        optimizer = build_optimizer(dmp, config)
        start = 0
        if config.resume:
            watchdog.progress("loading the checkpoint")
            start = checkpoint.load(
                checkpoint.resume_checkpoint(config.checkpoint_dir, config.resume_step)[1], dmp,
                optimizer)
    timeline = None
    if config.baseline:
        pipeline = METERED_PIPELINES[config.baseline_pipeline](dmp, optimizer, device, meter)
    else:
        from recxla.pipeline import Timeline, TrainPipeline

        timeline = Timeline(enabled=config.trace is not None)
        pipeline = TrainPipeline(dmp, optimizer, device, num_micro_batches=config.micro_batches,
                                 overlap=config.overlap, dbp=config.dbp, split=config.split,
                                 dbp_lookup=config.dbp_lookup,
                                 dense_allreduce=config.dense_allreduce,
                                 dense_allreduce_nodes=dense_nodes,
                                 defer_dense_update=config.defer_dense_update,
                                 timeline=timeline, phase=meter.phase)
    progress = Progress(place.rank == 0 and config.progress, config.steps, start,
                        config.batch_size * world)
    log = StepLog(first=start)
    warmup = min(config.warmup_steps, max(config.steps - start - 1, 0))
    stats_modules = [m for m in dmp.modules() if hasattr(m, "comm_stats")]
    read_iface = config.net_iface is not None and place.local_rank == 0
    iface_start = iface_bytes(config.net_iface) if read_iface and warmup == 0 else None

    kernel_trace = KernelTrace(config.kernel_trace, place.rank, start, warmup, config.steps)

    def on_step_done(done: int) -> None:
        watchdog.progress(f"step {done}")
        kernel_trace.step_done(done)
        nonlocal iface_start
        if done == start + warmup:
            for m in stats_modules:
                m.comm_stats.reset()
            if read_iface:
                iface_start = iface_bytes(config.net_iface)
        every = config.checkpoint_every
        if config.checkpoint_dir and every and done % every == 0 and done < config.steps:
            _checkpoint(done)

    def _checkpoint(done: int) -> None:
        began = time.perf_counter()
        watchdog.progress(f"checkpoint at step {done}")
        if not config.baseline:
            pipeline.flush()  # the last step's dense update, if it is still pending
        with meter.phase("checkpoint"):
            checkpoint.save(config.checkpoint_dir, done, dmp, optimizer, config, world,
                            data.fingerprint)
        if not config.baseline:
            pipeline.drop_early_lookups()  # the next batch read as a resumed run reads it
        log.checkpoint_s += time.perf_counter() - began
        watchdog.progress(f"step {done}, checkpoint written")

    watchdog.progress(f"step {start}")
    if place.rank == 0:
        print(f"recxla-train: {config.display_name}: steps {start}..{config.steps} on {world} "
              f"ranks ({device}); {gradient_division_description()}", file=sys.stderr,
              flush=True)
    try:
        run_steps(pipeline, data.train(start, config.steps), start, config.steps, meter,
                  progress, on_step_done, log)
    finally:
        kernel_trace.close()
        data.close()  # the loader's workers, and a Ray it started
    progress.close()
    if kernel_trace.written and place.rank == 0:
        print(f"wrote {kernel_trace.written}", file=sys.stderr, flush=True)
    sharder_stats = _comm_stats(stats_modules)  # before the evaluation's forwards add to them
    iface = None
    if read_iface:
        end = iface_bytes(config.net_iface)
        iface = {k: end[k] - iface_start[k] for k in end}
    if config.checkpoint_dir:
        _checkpoint(config.steps)
    if config.trace:
        from recxla.train.metrics import write_trace

        write_trace(config.trace, timeline, meter, place.rank, world)
    watchdog.progress("evaluation")
    pipeline.detach()
    with meter.phase("eval"):
        evaluation = evaluate(dmp, data.held_out(), device)
        watchdog.progress("summary")
        figures = local_figures(log, meter, warmup)
        figures["sharder_comm_stats"] = sharder_stats
        figures["iface"] = iface
        gathered: List[Optional[dict]] = [None] * world
        dist.all_gather_object(gathered, figures)
    summary = {
        "name": config.display_name, "path": config.path,
        "sharder": sharder_description(config, row_tables), "world_size": world,
        "gradient_division": gradient_division_description(),
        "pipeline": f"torchrec {pipeline.torchrec_name}" if config.baseline else (
            f"recxla TrainPipeline: {config.micro_batches} micro-batches, overlap "
            f"{'on' if config.overlap else 'off'}, dbp {'on' if config.dbp else 'off'}"),
        "topology": config.topology,
        "dense_allreduce_layout": ("by node" if dense_nodes is not None else "ring"),
        "nodes": world // place.local_world_size, "device": str(device),
        "resumed_from_step": start if config.resume else None,
        **summarize(config, gathered, world), **evaluation,
        "eval_data": data.held_out_description, "tables": len(tables),
        "sharder_comm_stats_per_step": _sum_stats([g["sharder_comm_stats"] for g in gathered],
                                                  max(config.steps - start - warmup, 1)),
        "plan": plan_summary(plan), "config": config.asdict(), "machine": machine(),
    }
    if place.rank == 0:
        print(format_summary(summary), flush=True)
        if config.metrics:
            write_metrics(config.metrics, summary)
            print(f"wrote {config.metrics}", flush=True)
    return summary


def _comm_stats(modules) -> dict:
    """The sharded modules' own counters (recxla's sharder keeps them), summed."""
    out = {}
    for m in modules:
        stats = m.comm_stats
        for name in ("id_bytes_sent", "id_bytes_received", "id_bytes_without_dedup",
                     "embedding_bytes_sent", "embedding_bytes_received", "gradient_bytes_sent",
                     "gradient_bytes_received"):
            if hasattr(stats, name):
                out[name] = out.get(name, 0) + int(getattr(stats, name))
    return out


def _sum_stats(per_rank: List[dict], steps: int) -> Optional[dict]:
    total = {}
    for stats in per_rank:
        for k, v in stats.items():
            total[k] = total.get(k, 0) + v
    return {k: v / steps for k, v in total.items()} if total else None


if __name__ == "__main__":
    sys.exit(main())
