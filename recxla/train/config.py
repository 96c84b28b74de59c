"""The trainer's options: one argparse parser, one TrainConfig, every check done before any
process group exists (a bad option costs no rendezvous and no peer's time).

`parse_config(argv)` returns a TrainConfig or exits with status 2 and a message naming the
option and its limit (argparse's convention). Option names are fixed (scripts rely on them):
`--steps --batch-size --fwd-comm --bwd-comm --sharding --micro-batches --checkpoint-dir --resume
--metrics --baseline torchrec --baseline-comms --seed --timeout --device --data --loader
--loader-workers --eval-data`.

With --data (and --eval-data) the files are opened here too, footers only: a missing path, an
unreadable file, too few rows for one batch per rank, or features that do not fit the model's
tables (see recxla.train.data) exit 2 naming the files, before any process group exists.
"""

import argparse
import importlib.util
import dataclasses
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

PROG = "recxla-train"
WIRE_FORMATS = ("e4m3", "e5m2", "bf16", "fp16", "fp32")
BASELINE_COMMS = ("fp32", "fp16", "bf16")
SHARDINGS = ("auto", "table_wise", "column_wise", "table_column_wise", "row_wise")
# TorchRec's own sharders offer these on CPU (gloo lacks the reduce-scatter row-wise needs).
TORCHREC_CPU_SHARDINGS = ("table_wise", "column_wise", "table_column_wise")
PROFILES = ("criteo", "small")
# Backward wire format of the recxla path, from bench/results/training.md (convergence): after
# 300 steps on 2 ranks, 2 seeds, e4m3 forward with e5m2 backward stayed within 0.0002 AUC of
# fp32 communication, as close as with bf16 backward, for half bf16's gradient bytes.
DEFAULT_BWD_COMM = "e5m2"
NET_SYSFS = "/sys/class/net"


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on; `asdict()` goes into the metrics JSON."""

    model: str = "dlrm"
    embedding_dim: int = 64
    dense_arch: Tuple[int, ...] = (512, 256)
    over_arch: Tuple[int, ...] = (512, 256)
    dcn_layers: int = 3
    dcn_low_rank: int = 64
    batch_size: int = 1024
    steps: int = 100
    epochs: Optional[int] = None
    train_batches: int = 10_000
    eval_batches: int = 8
    warmup_steps: int = 5
    dense_lr: float = 0.003
    sparse_lr: float = 0.05
    dense_optimizer: str = "adagrad"
    sparse_optimizer: str = "rowwise_adagrad"
    fwd_comm: str = "e4m3"
    bwd_comm: str = DEFAULT_BWD_COMM
    dedup_ids: bool = True
    sharding: str = "auto"
    micro_batches: int = 1
    overlap: bool = True
    dbp: bool = True
    split: str = "contiguous"
    dbp_lookup: str = "after_update"
    row_exchange: str = "auto"
    dense_allreduce: str = "fp32"
    topology: str = "1d"
    ranks_per_node: Optional[int] = None
    replica_sync: str = "gradients"
    sync_every: int = 1
    replica_precision: str = "fp32"
    trace: Optional[str] = None
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    resume: bool = False
    metrics: Optional[str] = None
    baseline: Optional[str] = None
    baseline_comms: str = "fp32"
    seed: int = 0
    timeout: float = 120.0
    device: str = "cpu"
    profile: str = "criteo"
    max_rows: int = 100_000
    data: Optional[str] = None
    loader: str = "local"
    loader_workers: int = 1
    eval_data: Optional[str] = None
    zipf: float = 1.05
    allocator: str = "keep"
    threads: int = 1
    progress: bool = True
    label: Optional[str] = None
    net_iface: Optional[str] = None

    @property
    def path(self) -> str:
        """"torchrec" (the baseline) or "recxla"."""
        return "torchrec" if self.baseline else "recxla"

    @property
    def comms(self) -> Tuple[str, str]:
        """(forward, backward) wire formats of the pooled-embedding all-to-all."""
        if self.baseline:
            return self.baseline_comms, self.baseline_comms
        return self.fwd_comm, self.bwd_comm

    @property
    def display_name(self) -> str:
        if self.label:
            return self.label
        fwd, bwd = self.comms
        dedup = "" if self.baseline or self.dedup_ids else ", no dedup"
        return f"{self.path} {fwd}/{bwd}{dedup}"

    def asdict(self) -> dict:
        return dataclasses.asdict(self)


def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an int >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an int >= {lo}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {value}")
    return value


def _layer_sizes(text: str) -> Tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated ints >= 1, got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Train TorchRec's DLRM (or DLRM_DCN) on synthetic ranking logs across "
        "ranks with recxla's communication, or with plain TorchRec (--baseline torchrec). "
        "Launch with torchrun (gloo on CPU, NCCL on GPU). `recxla-train --compare A.json "
        "B.json ...` compares metrics files instead.",
    )
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=("dlrm", "dcn"), default=d.model,
                   help="dlrm: torchrec.models.dlrm.DLRM; dcn: DLRM_DCN")
    m.add_argument("--embedding-dim", type=_int_at_least(1), default=d.embedding_dim)
    m.add_argument("--dense-arch", type=_layer_sizes, default=d.dense_arch,
                   help="bottom MLP hidden sizes; the embedding dim is appended")
    m.add_argument("--over-arch", type=_layer_sizes, default=d.over_arch,
                   help="top MLP hidden sizes; the output size 1 is appended")
    m.add_argument("--dcn-layers", type=_int_at_least(1), default=d.dcn_layers)
    m.add_argument("--dcn-low-rank", type=_int_at_least(1), default=d.dcn_low_rank)

    t = p.add_argument_group("training")
    t.add_argument("--batch-size", type=_int_at_least(1), default=d.batch_size,
                   help="samples per rank per step")
    t.add_argument("--steps", type=_int_at_least(1), default=None,
                   help=f"total steps (default {d.steps}, or --epochs x --train-batches)")
    t.add_argument("--epochs", type=_int_at_least(1), default=None,
                   help="passes over the training split, instead of --steps")
    t.add_argument("--train-batches", type=_int_at_least(1), default=d.train_batches,
                   help="batches per rank in the synthetic training split (an epoch); later "
                   "epochs see the same batches again")
    t.add_argument("--eval-batches", type=_int_at_least(1), default=d.eval_batches,
                   help="held-out batches per rank for the final AUC")
    t.add_argument("--warmup-steps", type=_int_at_least(0), default=d.warmup_steps,
                   help="first steps left out of the throughput figures")
    t.add_argument("--dense-lr", type=_positive_float, default=d.dense_lr)
    t.add_argument("--sparse-lr", type=_positive_float, default=d.sparse_lr)
    t.add_argument("--dense-optimizer", choices=("adagrad", "sgd"), default=d.dense_optimizer)
    t.add_argument("--sparse-optimizer", choices=("rowwise_adagrad", "sgd"),
                   default=d.sparse_optimizer, help="fused into the embedding backward")
    t.add_argument("--seed", type=_int_at_least(0), default=d.seed)

    c = p.add_argument_group("communication and sharding")
    c.add_argument("--fwd-comm", choices=WIRE_FORMATS, default=None,
                   help=f"recxla: wire format of the forward embeddings (default {d.fwd_comm})")
    c.add_argument("--bwd-comm", choices=WIRE_FORMATS, default=None,
                   help=f"recxla: wire format of the backward gradients (default {d.bwd_comm})")
    c.add_argument("--dedup-ids", action=argparse.BooleanOptionalAction, default=None,
                   help="recxla: the input dist sends unique ids (default on)")
    c.add_argument("--sharding", choices=SHARDINGS, default=d.sharding,
                   help="one sharding type for every table, or auto (TorchRec's planner)")
    c.add_argument("--row-exchange", default=None,
                   help="recxla: tables whose owners send unique rows instead of pooled bags: "
                   "auto (those where rows are fewer, judged on a sample batch; default), off, "
                   "all, or comma-separated table names")
    c.add_argument("--dense-allreduce", choices=("fp32", "bf16"), default=d.dense_allreduce,
                   help="wire format of the dense gradients' all-reduce (both paths)")

    o = p.add_argument_group("overlap pipeline (recxla path)")
    o.add_argument("--micro-batches", type=_int_at_least(1), default=None,
                   help="micro-batches per batch (frozen-window pipelining; default 1)")
    o.add_argument("--overlap", choices=("on", "off"), default=None,
                   help="all-to-alls in flight while the dense part computes (default on)")
    o.add_argument("--dbp", choices=("on", "off"), default=None,
                   help="the next batch's input dist during this batch (default on)")
    o.add_argument("--split", choices=("contiguous", "clustered"), default=None,
                   help="micro-batches as loaded, or by recxla.cluster_samples")
    o.add_argument("--dbp-lookup", choices=("after_update", "early"), default=None,
                   help="the next batch's lookup after this update, or before it, corrected")
    o.add_argument("--trace", default=None, metavar="PATH",
                   help="write a Chrome trace (chrome://tracing, Perfetto) of every rank's "
                   "steps: compute, waits and collectives")

    g = p.add_argument_group("topology (recxla path)")
    g.add_argument("--topology", choices=("1d", "2d"), default=d.topology,
                   help="2d: embeddings sharded inside each node (all-to-alls on intra-node "
                   "links), nodes as replicas")
    g.add_argument("--ranks-per-node", type=_int_at_least(1), default=None,
                   help="2d: ranks per node (default: torchrun's LOCAL_WORLD_SIZE)")
    g.add_argument("--replica-sync", choices=("gradients", "weights"), default=d.replica_sync,
                   help="2d: sum embedding gradients across nodes every step (exact), or "
                   "average weights every --sync-every steps")
    g.add_argument("--sync-every", type=_int_at_least(1), default=d.sync_every)
    g.add_argument("--replica-precision", choices=("fp32", "bf16"), default=d.replica_precision,
                   help="2d: wire format of the gradient sync across nodes")
    c.add_argument("--baseline", choices=("torchrec",), default=None,
                   help="train with plain TorchRec (DMP + TrainPipelineSparseDist) instead")
    c.add_argument("--baseline-comms", choices=BASELINE_COMMS, default=None,
                   help="TorchRec's own codecs for the baseline (default fp32)")

    data = p.add_argument_group("data")
    data.add_argument("--profile", choices=PROFILES, default=d.profile,
                      help="criteo: the 26 Criteo Kaggle tables; small: the same, tables of "
                      "at most 2000 rows and short history bags (tests, demos)")
    data.add_argument("--max-rows", type=_int_at_least(1), default=None,
                      help=f"cap on table rows (criteo default {d.max_rows})")
    data.add_argument("--zipf", type=float, default=d.zipf, help="key skew, 0 = uniform")
    data.add_argument("--data", default=None, metavar="PATH",
                      help="train on Parquet files (a .parquet file or a folder, written by "
                      "recxla.data.write_parquet or `python -m recxla.data write`) instead of "
                      "the synthetic logs. The tables stay the profile's (--profile, "
                      "--max-rows): the files must hold its features cat_0..cat_25 with ids "
                      "below the tables' rows, and 13 dense features; `python -m recxla.data "
                      "write` output fits the defaults. An epoch (--epochs) is one pass over "
                      "the files; --train-batches and --zipf apply to the synthetic logs only")
    data.add_argument("--loader", choices=("local", "ray"), default=None,
                      help="--data: read in worker processes on this machine (local, default) "
                      "or in Ray Data tasks (ray: pip install 'recxla[ray]')")
    data.add_argument("--loader-workers", type=_int_at_least(0), default=None, metavar="N",
                      help=f"--data: reader processes or Ray tasks per rank (default "
                      f"{d.loader_workers}; 0 with --loader local: read in the rank's own "
                      "process, in a background thread)")
    data.add_argument("--eval-data", default=None, metavar="PATH",
                      help="held-out Parquet files for the final AUC (the first --eval-batches "
                      "batches of each rank's share); default: the synthetic held-out split, "
                      "also with --data (the same task when the files were written from the "
                      "synthetic logs with the same --seed and profile)")

    r = p.add_argument_group("run")
    r.add_argument("--checkpoint-dir", default=None)
    r.add_argument("--checkpoint-every", type=_int_at_least(0), default=d.checkpoint_every,
                   help="steps between checkpoints (0: only at the end)")
    r.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --checkpoint-dir")
    r.add_argument("--metrics", default=None, help="write the summary as JSON here")
    r.add_argument("--label", default=None, help="this run's name in --compare tables")
    r.add_argument("--timeout", type=_positive_float, default=d.timeout,
                   help="seconds without progress after which every rank exits, naming the "
                   "rank that stopped")
    r.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    r.add_argument("--threads", type=_int_at_least(1), default=None,
                   help="compute threads per rank (default: cores / ranks on this node)")
    r.add_argument("--allocator", choices=("keep", "default"), default=d.allocator,
                   help="keep: freed memory stays in the process (no page faults per step); "
                   "default: glibc's defaults")
    r.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="rank 0's progress bar")
    r.add_argument("--net-iface", default=None, metavar="NAME",
                   help="also report the bytes this network interface sent per measured step "
                   "(each node's, read by its local rank 0 from /sys/class/net): the link's "
                   "count, next to the collectives' own")
    return p


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible on this machine")
    return requested


def _check(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> dict:
    """Cross-option checks; returns the TrainConfig fields. Calls parser.error on a bad mix."""
    err = parser.error
    if ns.baseline:
        for flag, value in (("--fwd-comm", ns.fwd_comm), ("--bwd-comm", ns.bwd_comm),
                            ("--dedup-ids", ns.dedup_ids)):
            if value is not None:
                err(f"{flag} sets the recxla path; with --baseline torchrec use --baseline-comms")
    elif ns.baseline_comms is not None:
        err("--baseline-comms needs --baseline torchrec (the recxla path takes --fwd-comm and "
            "--bwd-comm)")
    if ns.baseline:
        for flag, value in (("--micro-batches", ns.micro_batches), ("--overlap", ns.overlap),
                            ("--dbp", ns.dbp), ("--split", ns.split),
                            ("--dbp-lookup", ns.dbp_lookup), ("--row-exchange", ns.row_exchange),
                            ("--ranks-per-node", ns.ranks_per_node)):
            if value is not None:
                err(f"{flag} sets recxla's pipeline or sharder; the TorchRec baseline runs "
                    "TrainPipelineSparseDist")
        if ns.topology != "1d":
            err("--topology 2d: TorchRec's 2D (DMPCollection) needs CUDA; the baseline is 1D")
    if ns.topology == "2d":
        per_node = ns.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
        if not per_node:
            err("--topology 2d needs --ranks-per-node, or torchrun's LOCAL_WORLD_SIZE")
        if ns.checkpoint_dir:
            err("--checkpoint-dir with --topology 2d: sharded checkpoints of replicated shards "
                "are not supported yet")
        if ns.row_exchange not in (None, "off"):
            err("--row-exchange with --topology 2d is not supported yet (use off)")
    if ns.sync_every != 1 and ns.replica_sync != "weights":
        err("--sync-every applies to --replica-sync weights")
    if ns.replica_sync == "weights" and ns.replica_precision != "fp32":
        err("--replica-precision bf16 applies to --replica-sync gradients (weights are averaged "
            "in fp32)")
    row_exchange = ns.row_exchange or ("off" if ns.topology == "2d" else "auto")
    try:
        device = resolve_device(ns.device)
    except ValueError as e:
        err(str(e))
    if ns.baseline and device == "cpu" and ns.sharding == "row_wise":
        err("--sharding row_wise with --baseline torchrec: TorchRec's sharders offer no row-wise "
            "sharding on CPU (gloo lacks the reduce-scatter it needs); use one of "
            f"{', '.join(TORCHREC_CPU_SHARDINGS)} or auto, or the recxla path")
    if ns.steps is not None and ns.epochs is not None:
        err("--steps and --epochs: give one or the other")
    loader, loader_workers = _check_loader(err, ns)
    if ns.epochs is not None and ns.data is not None:
        steps = _file_epochs_steps(err, ns)
    else:
        steps = ns.epochs * ns.train_batches if ns.epochs is not None else (
            ns.steps if ns.steps is not None else TrainConfig.steps)
    if ns.warmup_steps >= steps:
        err(f"--warmup-steps {ns.warmup_steps} must be less than the {steps} steps, or no step "
            "is left to measure")
    if (ns.resume or ns.checkpoint_every) and not ns.checkpoint_dir:
        err("--resume and --checkpoint-every need --checkpoint-dir")
    if ns.resume:
        from recxla.train.checkpoint import latest_checkpoint

        if latest_checkpoint(ns.checkpoint_dir) is None:
            err(f"--resume: no checkpoint in --checkpoint-dir {ns.checkpoint_dir!r}")
    for flag, path in (("--metrics", ns.metrics), ("--checkpoint-dir", ns.checkpoint_dir),
                       ("--trace", ns.trace)):
        parent = os.path.dirname(os.path.abspath(path)) if path else None
        if parent and not os.path.isdir(parent):
            err(f"{flag} {path!r}: the folder {parent!r} does not exist")
    if ns.checkpoint_dir and os.path.exists(ns.checkpoint_dir) and \
            not os.path.isdir(ns.checkpoint_dir):
        err(f"--checkpoint-dir {ns.checkpoint_dir!r} is a file, not a folder")
    if ns.net_iface is not None and not os.path.isdir(
            os.path.join(NET_SYSFS, os.path.basename(ns.net_iface))):
        err(f"--net-iface {ns.net_iface!r}: no such network interface here ({NET_SYSFS})")
    if not ns.zipf >= 0:
        err(f"--zipf must be >= 0, got {ns.zipf}")
    max_rows = ns.max_rows if ns.max_rows is not None else (
        2000 if ns.profile == "small" else TrainConfig.max_rows)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = ns.threads or max(1, (os.cpu_count() or 1) // max(local_ranks, 1))
    d = TrainConfig()
    return dict(
        model=ns.model, embedding_dim=ns.embedding_dim, dense_arch=tuple(ns.dense_arch),
        over_arch=tuple(ns.over_arch), dcn_layers=ns.dcn_layers, dcn_low_rank=ns.dcn_low_rank,
        batch_size=ns.batch_size, steps=steps, epochs=ns.epochs, train_batches=ns.train_batches,
        eval_batches=ns.eval_batches, warmup_steps=ns.warmup_steps, dense_lr=ns.dense_lr,
        sparse_lr=ns.sparse_lr, dense_optimizer=ns.dense_optimizer,
        sparse_optimizer=ns.sparse_optimizer, fwd_comm=ns.fwd_comm or d.fwd_comm,
        bwd_comm=ns.bwd_comm or d.bwd_comm,
        dedup_ids=False if ns.baseline else (ns.dedup_ids is not False),
        sharding=ns.sharding, micro_batches=ns.micro_batches or 1,
        overlap=ns.overlap != "off", dbp=ns.dbp != "off", split=ns.split or "contiguous",
        dbp_lookup=ns.dbp_lookup or "after_update",
        row_exchange="off" if ns.baseline else row_exchange,
        dense_allreduce=ns.dense_allreduce, topology=ns.topology,
        ranks_per_node=(ns.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                        if ns.topology == "2d" else None),
        replica_sync=ns.replica_sync, sync_every=ns.sync_every,
        replica_precision=ns.replica_precision, trace=ns.trace,
        checkpoint_dir=ns.checkpoint_dir, checkpoint_every=ns.checkpoint_every,
        resume=ns.resume, metrics=ns.metrics, baseline=ns.baseline,
        baseline_comms=ns.baseline_comms or "fp32", seed=ns.seed, timeout=ns.timeout,
        device=device, profile=ns.profile, max_rows=max_rows, zipf=ns.zipf, data=ns.data,
        loader=loader, loader_workers=loader_workers, eval_data=ns.eval_data,
        allocator=ns.allocator, threads=threads, progress=ns.progress, label=ns.label,
        net_iface=ns.net_iface,
    )


def _world_size() -> int:
    """The job's ranks as torchrun announces them (1 outside torchrun)."""
    return max(int(os.environ.get("WORLD_SIZE", "1") or 1), 1)


def _check_loader(err, ns: argparse.Namespace) -> Tuple[str, int]:
    """(loader, loader workers) of --data; exits on a bad mix."""
    if ns.data is None:
        for flag, value in (("--loader", ns.loader), ("--loader-workers", ns.loader_workers)):
            if value is not None:
                err(f"{flag} applies to --data (the synthetic logs are generated in the rank)")
    loader = ns.loader or TrainConfig.loader
    workers = TrainConfig.loader_workers if ns.loader_workers is None else ns.loader_workers
    if loader == "ray":
        if workers == 0:
            err("--loader-workers 0 applies to --loader local (Ray reads in at least 1 task)")
        if importlib.util.find_spec("ray") is None:
            err("--loader ray needs Ray Data, which is not installed: pip install 'recxla[ray]'"
                ", or use --loader local")
    return loader, workers


def _file_epochs_steps(err, ns: argparse.Namespace) -> int:
    """Steps of --epochs passes over --data: every rank's batches per epoch, summed (epochs
    differ by a batch or so where row groups differ in size)."""
    from recxla.data import ParquetDataset

    try:
        files = ParquetDataset(ns.data, ns.batch_size, 0, _world_size(), ns.seed)
        return sum(files.num_batches(e) for e in range(ns.epochs))
    except (FileNotFoundError, ValueError) as e:  # DataFormatError is a ValueError
        err(f"--data: {e}")


def _check_files(err, config: TrainConfig) -> None:
    """--data and --eval-data open (footers) and fit the model's tables; exits otherwise."""
    from recxla.data import ParquetDataset, embedding_bag_configs
    from recxla.train.data import make_profile

    profile = make_profile(config)
    tables = embedding_bag_configs(profile, embedding_dim=1)
    for flag, path in (("--data", config.data), ("--eval-data", config.eval_data)):
        if path is None:
            continue
        try:
            files = ParquetDataset(path, config.batch_size, 0, _world_size(), config.seed)
        except (FileNotFoundError, ValueError) as e:  # DataFormatError is a ValueError
            err(f"{flag}: {e}")
        try:
            files.check_tables(tables, profile.num_dense)
        except ValueError as e:
            err(f"{flag}: {e}; the model's tables are --profile {config.profile} capped at "
                f"--max-rows {config.max_rows} (`python -m recxla.data write --max-rows "
                f"{config.max_rows}` writes files that fit)")


def parse_config(argv: Optional[Sequence[str]] = None) -> TrainConfig:
    """TrainConfig from command-line arguments; exits with status 2 on a bad option."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    config = TrainConfig(**_check(parser, ns))
    if config.data is not None or config.eval_data is not None:
        _check_files(parser.error, config)
    return config


def split_compare(argv: Sequence[str]) -> Optional[List[str]]:
    """The arguments after --compare when this is a comparison run, else None."""
    argv = list(argv)
    return argv[argv.index("--compare") + 1:] if "--compare" in argv else None
