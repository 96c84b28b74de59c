"""`recxla-train` / `python -m recxla.train`: the trainer's entry point.

    torchrun --nproc-per-node 2 -m recxla.train --steps 100 --metrics recxla.json
    torchrun --nproc-per-node 2 -m recxla.train --steps 100 --baseline torchrec \\
        --metrics torchrec.json
    recxla-train --compare recxla.json torchrec.json --chart compare.png

A run (`main`, `run`, then `_train` a step a line):

    options checked (recxla.train.parse: exit 2 on a bad one, before any process group)
    -> process group and watchdog
    -> data: this rank's batches and the model's tables (recxla.train.data)
    -> model: TorchRec's DLRM or DLRM_DCN (recxla.train.models)
    -> plan and shard: the plan, the tables exchanged as rows, DMP with this path's sharder,
       seeded tables, the optimizer (recxla.train.sharding)
    -> pipeline: one of TorchRec's, metered, or recxla's TrainPipeline
    -> resume: the checkpoint's state, with --resume
    -> the loop: --steps steps, measured after the warm-up, with a checkpoint every
       --checkpoint-every steps and one at the end
    -> evaluation: AUC and log loss on the held-out split
    -> summary on rank 0 (printed; JSON with --metrics).

Exit status of each rank: 0 done; 1 this rank failed; 2 bad options or input, found before
training (printed once, by each node's first rank); 3 another rank died, hung or failed, or the
rank hosting the store is gone (the message names it); 4 this rank made no progress for
--timeout seconds (waiting for a batch from a loader worker that is alive is progress, and so
is a peer's such wait: recxla.train.watchdog); 5 this rank's training loss became NaN or infinite
(recxla.train.loop.NonFiniteLoss). torchrun itself exits 1 whenever a rank fails (its
ChildFailedError), whatever the ranks' status; its summary shows each rank's.
"""

import os
import sys
import traceback
from typing import Optional, Sequence

import torch

from recxla.train import checkpoint, stages
from recxla.train.comm_meter import CommMeter
from recxla.train.compare import main as compare_main
from recxla.train.loop import NonFiniteLoss
from recxla.train.memory import keep_freed_memory
from recxla.train.metrics import evaluate, write_trace
from recxla.train.models import build_model
from recxla.train.parse import exit_bad_input, parse_config
from recxla.train.rendezvous import connect, place_from_env
from recxla.train.watchdog import EXIT_FAILED, EXIT_PEER_FAILED, Watchdog

_COMM_ERROR_WORDS = ("connection", "peer", "timed out", "timeout", "gloo", "nccl", "closed",
                     "reset", "broken pipe")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--compare" in argv:
        return compare_main(argv)
    config = parse_config(argv)  # exits 2 with the option's name on a bad one
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
    peers: a NonFiniteLoss's status and message, an error of a loader worker as its one line
    (the tracebacks go to a file it names), or EXIT_FAILED with the traceback. Each message
    starts on a line of its own: rank 0's progress bar may hold the terminal's line."""
    culprit = watchdog.culprit(wait=_is_comm_error(e))
    if culprit is not None:
        saw = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"\nrecxla-train: rank {rank}: exiting: {culprit} (this rank saw: "
              f"{saw if len(saw) <= 160 else saw[:157] + '...'})", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_FAILED)
    worker = getattr(e, "loader_worker", None)
    # A loader worker's error names its type in its one line (recxla.data.loader_chunks).
    watchdog.report_failure(str(e) if worker is not None else f"{type(e).__name__}: {e}")
    code = EXIT_FAILED
    if isinstance(e, NonFiniteLoss):  # the message says what to check; no traceback
        code = e.exit_status
        print(f"\nrecxla-train: rank {rank}: error: {e}", file=sys.stderr, flush=True)
    elif worker is not None:
        print(f"\nrecxla-train: rank {rank}: error: {e}\n"
              + _worker_traceback_note(e, worker, rank), file=sys.stderr, flush=True)
    else:
        print(file=sys.stderr)
        traceback.print_exc()
    sys.stderr.flush()
    os._exit(code)


def _worker_traceback_note(e: BaseException, worker: str, rank: int) -> str:
    """A line naming the file that now holds the loader worker's traceback and this rank's
    (written to the temporary folder); the tracebacks themselves when it cannot be written."""
    import tempfile

    text = (f"The traceback in {worker}:\n"
            + (getattr(e, "worker_traceback", None) or "(none: the worker ended)\n")
            + f"\nWhere rank {rank} waited for it:\n" + "".join(traceback.format_exception(e)))
    try:
        fd, path = tempfile.mkstemp(prefix=f"recxla-rank{rank}-loader-error-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(text)
    except OSError:
        return text
    return f"recxla-train: rank {rank}: the tracebacks: {path}"


def _train(config, conn, watchdog, meter) -> dict:
    """The run on this rank, in the order of the module docstring's data flow."""
    place, device = conn.place, conn.device
    data = stages.open_data(config, place)
    watchdog.watch_waits(data.loader_wait)  # a slow batch from a live loader is no hang
    tables = data.tables()
    stages.report_embedding_dims(config, place, data)
    model = build_model(config, tables, data.num_dense, device, data.weighted,
                        data.history_features() if config.model == "history" else None)
    with meter.phase("setup"):
        sharded = stages.plan_and_shard(config, place, device, watchdog, data, tables, model)
        # The pipeline first: it owns the compressed dense all-reduce's state, which a resume
        # loads.
        pipeline, timeline = stages.make_pipeline(config, device, meter, sharded)
        start = stages.resume(config, watchdog, sharded)
    measured = stages.train_loop(config, conn, watchdog, meter, data, sharded, pipeline, start)
    if config.trace:
        write_trace(config.trace, timeline, meter, place.rank, place.world_size)
    watchdog.progress("evaluation")
    pipeline.detach()
    with meter.phase("eval"):
        evaluation = evaluate(sharded.dmp, data.held_out(), device,
                              lambda i: watchdog.progress(f"evaluation, batch {i}"))
        per_rank = stages.gather_figures(watchdog, meter, measured, place.world_size)
    summary = stages.run_summary(config, conn, data, sharded, pipeline, measured, evaluation,
                                 per_rank)
    stages.report(config, place.rank, summary)
    return summary


def entry() -> None:
    """The command line (`python -m recxla.train`, `recxla-train`): main(), then the process
    ends at once with its status, output flushed. A finished run has written everything and
    left its process group; the interpreter's own teardown would then destroy the C++ threads
    of torch's stores and process groups in no set order, and now and then one still running
    aborts the process ("terminate called without an active exception", SIGABRT) after a run
    that succeeded."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
