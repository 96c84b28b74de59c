"""The trainer's options, each declared once: a TrainConfig field carries its flag, help, choices,
value parser and the path it applies to (recxla.train.options says how), and the constants
they are declared with. The parser, --help, the options' table in docs/training.md and the
config's values all derive from these fields; recxla.train.parse turns a command line into a
checked TrainConfig.

Declaring the options imports neither the pipeline nor TorchRec: the choices come from the
modules that hold the library's own values (recxla.formats, recxla.pipeline.choices,
recxla.torchrec.choices, recxla.data.epoch_plan).
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

from recxla.data.epoch_plan import SHUFFLE_ROWS
from recxla.formats import DEFAULT_BWD_COMM, DEFAULT_FWD_COMM, FORMATS
from recxla.pipeline.choices import BUCKET_MERGE, DBP_LOOKUPS, DENSE_ALLREDUCE_FORMATS, SPLITS
from recxla.torchrec.choices import REPLICA_PRECISIONS, REPLICA_SYNCS
from recxla.train import options
from recxla.train.options import RECXLA, TORCHREC, option
from recxla.train.options import int_at_least as at_least

WIRE_FORMATS = tuple(FORMATS)
# TorchRec's own codecs (FBGEMM's) that the baseline offers on CPU and GPU.
BASELINE_COMMS = ("fp32", "fp16", "bf16")
# How the baseline plans with --sharding auto: as TorchRec would (its planner and sharder, free to
# make tables data-parallel), or with the recxla path's plan.
BASELINE_PLANS = ("torchrec", "same")
# TorchRec's training pipelines the baseline runs (recxla.train.loop.METERED_PIPELINES).
BASELINE_PIPELINES = ("sparse_dist", "sparse_dist_lite")
# The recxla path's DDP bucket size (MB). Its all-reduce waits only at the dense optimizer step,
# so a bucket that fills early in the backward travels during the rest of it: at 200 Mbit/s on
# 2 x 2 ranks 1 MB buckets train 6-8% faster than TorchRec's 25 (bench/results/training.md),
# and gain TorchRec's own path nothing.
RECXLA_DDP_BUCKET_MB = 1.0
# The recxla path's dense all-reduce wire format: bf16 halves its bytes, and after 300 steps on
# 4 ranks the held-out AUC is the fp32 all-reduce's (0.7704 / 0.7702 and 0.7775 / 0.7777 for
# seeds 0 / 1, bench/results/training.md).
RECXLA_DENSE_ALLREDUCE = "bf16"
SHARDINGS = ("auto", "table_wise", "column_wise", "table_column_wise", "row_wise")
# TorchRec's own sharders offer these on CPU (gloo lacks the reduce-scatter row-wise needs).
TORCHREC_CPU_SHARDINGS = ("table_wise", "column_wise", "table_column_wise")
PROFILES = ("criteo", "small")
MODELS = ("dlrm", "dcn", "history")
# --model history: the synthetic histories' (min, max) lengths (mean 110 with criteo).
HISTORY_LENGTHS = {"criteo": (20, 200), "small": (4, 20)}
DENSE_OPTIMIZERS = ("adagrad", "sgd")
SPARSE_OPTIMIZERS = ("rowwise_adagrad", "sgd")
LOADERS = ("local", "ray")
DEVICES = ("auto", "cpu", "cuda")
TOPOLOGIES = ("1d", "2d")
ALLOCATORS = ("keep", "default")
# --embedding-dim when the dataset names no dim; --max-rows of the small profile.
FALLBACK_EMBEDDING_DIM = 64
SMALL_PROFILE_MAX_ROWS = 2000
CRITEO_PROFILE_MAX_ROWS = 100_000
NET_SYSFS = "/sys/class/net"
DEFAULT_EVAL_FRACTION = 0.1
# Examples of the synthetic held-out split without --eval-batches (recxla.train.data), in whole
# batches per rank: 8 batches a rank at the default 2 ranks x 1024, as many as --eval-batches
# used to default to. The AUC of 16k examples of a 25%-positive task near AUC 0.75 has a
# standard error of about 0.005 (Hanley and McNeil's formula).
SYNTHETIC_HELD_OUT = 16_384

_M, _T, _C = "model", "training", "communication and sharding"
_O, _G, _D, _R = "overlap pipeline", "topology", "data", "run"


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on; `asdict()` goes into the metrics JSON. Fields whose
    default depends on other options (steps, max_rows, threads, ...) hold the resolved value
    after `recxla.train.parse.parse_config`."""

    model: str = option(
        "dlrm", "dlrm: torchrec.models.dlrm.DLRM; dcn: DLRM_DCN; history: DLRM with target "
        "attention over the user's history (recxla.train.sequence_model.HistoryDLRM): the "
        "history feature's ids through an EmbeddingCollection, one row each, the candidate "
        "item attending over them (synthetic logs: histories of 20-200 items, 4-20 with "
        "--profile small; --data: the list column its schema marks history_of)", group=_M,
        choices=MODELS)
    embedding_dim: Optional[int] = option(
        None, "columns of every table (overrides the dataset's dims)", group=_M,
        parse=at_least(1), default_text=f"the dataset's, else {FALLBACK_EMBEDDING_DIM}")
    embedding_dims: Tuple = option(
        (), "per-table dims: auto (halve the dims of the tables whose bytes dominate the wire "
        "until their rows carry at most half the bytes: recxla.planner.embedding_dims), "
        "auto:KEEP (at most KEEP of the bytes), or TABLE=DIM,... (at most --embedding-dim); a "
        "smaller table's pooled rows are padded with zeros to --embedding-dim for DLRM's "
        "interaction, after they crossed the wire at their own dim",
        group=_M, parse=options.embedding_dims, metavar="auto|TABLE=DIM,...",
        default_text="every table --embedding-dim")
    dense_arch: Tuple[int, ...] = option(
        (512, 256), "bottom MLP hidden sizes; the embedding dim is appended", group=_M,
        parse=options.layer_sizes)
    over_arch: Tuple[int, ...] = option(
        (512, 256), "top MLP hidden sizes; the output size 1 is appended", group=_M,
        parse=options.layer_sizes)
    history_length: int = option(
        200, "--model history: the ids of a history the attention reads (its first ones)",
        group=_M, parse=at_least(1))
    attention_heads: int = option(2, "--model history: attention heads (divide the embedding "
                                  "dim)", group=_M, parse=at_least(1))
    dcn_layers: int = option(3, "--model dcn: cross layers", group=_M, parse=at_least(1))
    dcn_low_rank: int = option(64, "--model dcn: low-rank dim", group=_M, parse=at_least(1))

    batch_size: int = option(1024, "samples per rank per step", group=_T, parse=at_least(1))
    steps: int = option(100, "total steps", group=_T, parse=at_least(1),
                        default_text="100, or what --epochs makes")
    epochs: Optional[int] = option(None, "passes over the training split, instead of --steps",
                                   group=_T, parse=at_least(1))
    train_batches: int = option(
        10_000, "batches per rank in the synthetic training split (an epoch); later epochs see "
        "the same batches again", group=_T, parse=at_least(1))
    eval_batches: Optional[int] = option(
        None, "held-out batches per rank for the final AUC and log loss: a cap on the held-out "
        "files, the size of the synthetic held-out split", group=_T, parse=at_least(1),
        default_text="all: every rank's whole share of the held-out files; "
        f"{SYNTHETIC_HELD_OUT:,} examples of the synthetic held-out split (whole batches per "
        "rank)")
    warmup_steps: int = option(5, "first steps left out of the throughput figures", group=_T,
                               parse=at_least(0))
    dense_lr: float = option(0.003, "dense optimizer's learning rate", group=_T,
                             parse=options.positive_float)
    sparse_lr: float = option(0.05, "embedding optimizer's learning rate", group=_T,
                              parse=options.positive_float)
    dense_optimizer: str = option("adagrad", "optimizer of the MLPs", group=_T,
                                  choices=DENSE_OPTIMIZERS)
    sparse_optimizer: str = option("rowwise_adagrad", "fused into the embedding backward",
                                   group=_T, choices=SPARSE_OPTIMIZERS)
    seed: int = option(0, "seeds data, weights and the order of files", group=_T,
                       parse=at_least(0))

    fwd_comm: str = option(DEFAULT_FWD_COMM, "wire format of the forward embeddings", group=_C,
                           applies=RECXLA, choices=WIRE_FORMATS)
    bwd_comm: str = option(DEFAULT_BWD_COMM, "wire format of the backward gradients", group=_C,
                           applies=RECXLA, choices=WIRE_FORMATS)
    dedup_ids: bool = option(True, "the input dist sends unique ids", group=_C, applies=RECXLA)
    sharding: str = option("auto", "one sharding type for every table, or auto (TorchRec's "
                           "planner)", group=_C, choices=SHARDINGS)
    row_exchange: str = option(
        "auto", "tables whose owners send unique rows instead of pooled bags: auto (those where "
        "rows are fewer, judged on a sample batch), off, all, or comma-separated table names",
        group=_C, applies=RECXLA)
    dense_allreduce: Optional[str] = option(
        None, "wire format of the dense gradients' all-reduce: fp32, bf16, fp8 (e4m3 with a "
        "scale per 128 values and error feedback, recxla.distributed.FP8AllReduce; its "
        "residuals go into the checkpoints; on the baseline, as a hook on TorchRec's DDP), or "
        "powersgd (low-rank factors of rank --powersgd-rank with error feedback, each "
        "parameter compressed after its first --powersgd-start averages: on the recxla path "
        "recxla.distributed.PowerSGDAllReduce, whose state goes into the checkpoints; on the "
        "baseline torch's PowerSGD hook, what a TorchRec user registers today, whose state a "
        "resume restarts)",
        group=_C,
        choices=DENSE_ALLREDUCE_FORMATS,
        default_text=f"{RECXLA_DENSE_ALLREDUCE} on the recxla path, fp32 (TorchRec's) on the "
        "baseline")
    powersgd_rank: int = option(
        1, "--dense-allreduce powersgd: the factors' columns (1: the fewest bytes; a higher "
        "rank keeps more of each gradient a step, with (rows + columns) x rank values a "
        "matrix)", group=_C, parse=at_least(1))
    powersgd_start: Optional[int] = option(
        None, "--dense-allreduce powersgd: steps whose dense gradients travel whole before the "
        "factors take over (the model moves fastest then; torch suggests about a tenth of a "
        "run)", group=_C, parse=at_least(0),
        default_text="recxla.distributed.PowerSGDAllReduce's default, 10")
    dense_allreduce_by_node: bool = option(
        True, "all-reduce the dense gradients inside each node first, then 1/ranks-per-node "
        "of them per rank across the nodes (recxla.distributed.all_reduce_by_node; with one "
        "node or one rank per node: the plain all-reduce)", group=_C, applies=RECXLA)
    ddp_bucket_mb: Optional[float] = option(
        None, "DDP's bucket size for the dense gradients' all-reduce, in MB (smaller buckets "
        "start travelling earlier in the backward, at one more collective each)", group=_C,
        parse=options.positive_float,
        default_text=f"{RECXLA_DDP_BUCKET_MB:g} on the recxla path, TorchRec's DDP wrapper's "
        "(25) on the baseline")
    ddp_bucket_merge: str = option(
        "auto", "--dense-allreduce fp32/bf16: a step's DDP buckets sent as soon as each is "
        "ready (off: early where the link binds), all together once the last one is (on: one "
        "dense sum, fewer collectives where the CPU binds), or the faster of the two by "
        "measured step time, where that choice cannot change the bits (auto: by node on gloo "
        "over at most two nodes, else off; recxla.pipeline.bucket_merge)", group=_C,
        applies=RECXLA, choices=BUCKET_MERGE)
    baseline: Optional[str] = option(
        None, "train with plain TorchRec (DMP and one of TorchRec's training pipelines: "
        "--baseline-pipeline) instead", group=_C, choices=("torchrec",))
    baseline_comms: str = option("fp32", "TorchRec's own codecs, both ways", group=_C,
                                 applies=TORCHREC, choices=BASELINE_COMMS)
    baseline_plan: str = option(
        "torchrec", "with --sharding auto: torchrec plans as a TorchRec user's run does "
        "(TorchRec's planner with the baseline's sharder, free to make small tables "
        "data-parallel); same plans as the recxla path does (no data-parallel tables), for "
        "comparisons of the sharders alone", group=_C, applies=TORCHREC, choices=BASELINE_PLANS)
    baseline_pipeline: str = option(
        "sparse_dist", "TorchRec's training pipeline: sparse_dist (TrainPipelineSparseDist: the "
        "next batch's input dist during this batch) or sparse_dist_lite "
        "(TrainPipelineSparseDistLite: one batch in flight, its input dist on the step's path)",
        group=_C, applies=TORCHREC, choices=BASELINE_PIPELINES)
    dense_floor: bool = option(
        False, "the same model with the embedding work taken out: the pooled embeddings are "
        "one fixed random tensor (recxla.train.models.FixedPooledEmbeddings), no tables, no "
        "all-to-all, only the dense layers and their all-reduce; a run's CPU per example "
        "above this floor is its embedding work (the cluster benchmark's 'dense floor')",
        group=_C, applies=TORCHREC)

    data_parallel_tables: bool = option(
        False, "with --sharding auto: plan as a TorchRec user's run does, TorchRec's planner "
        "free to make small tables data-parallel (every rank holds them; their gradients join "
        "the dense all-reduce and the dense optimizer trains them, as on the baseline's own "
        "plan); off: every table model-parallel, trained by the fused embedding optimizer",
        group=_C, applies=RECXLA)

    micro_batches: int = option(1, "micro-batches per batch (frozen-window pipelining)",
                                group=_O, applies=RECXLA, parse=at_least(1))
    overlap: bool = option(True, "all-to-alls in flight while the dense part computes",
                           group=_O, applies=RECXLA)
    dbp: bool = option(True, "the next batch's input dist during this batch", group=_O,
                       applies=RECXLA)
    split: str = option("contiguous", "micro-batches as loaded, or by recxla.cluster_samples",
                        group=_O, applies=RECXLA, choices=SPLITS)
    dbp_lookup: str = option("after_update", "the next batch's lookup after this update, or "
                             "before it, corrected", group=_O, applies=RECXLA,
                             choices=DBP_LOOKUPS)
    defer_dense_update: bool = option(
        True, "apply each batch's dense update at the next batch's first dense forward, so "
        "its all-reduce travels during the next batch's lookup and all-to-alls (no stale "
        "read; checkpoints and evaluation see every update)", group=_O, applies=RECXLA)
    early_rows: bool = option(
        False, "with --dbp: the next batch's embedding rows that this batch's update leaves as "
        "they are (row-exchange rows this batch did not read; pooled bags none of whose rows "
        "it read, where at least half of an owner's can go) leave before it, during this "
        "batch's dense forward and backward; the rest waits for the update (the same step: "
        "recxla.torchrec.early_rows). Where the link binds, 1.025x the examples/s on the "
        "synthetic data (50 Mbit/s); where the CPU does, 0.90x (200 Mbit/s; "
        "bench/results/training.md)", group=_O, applies=RECXLA)
    trace: Optional[str] = option(
        None, "write a Chrome trace (chrome://tracing, Perfetto) of every rank's steps: "
        "compute, waits and collectives", group=_O, applies=RECXLA, metavar="PATH")
    kernel_trace: Optional[str] = option(
        None, "write a torch.profiler Chrome trace of a few steps after the warm-up: every "
        "CUDA kernel and copy with its stream, and the CPU ops (.gz: compressed; rank r > 0 "
        "adds .rank<r>)", group=_O, metavar="PATH")

    topology: str = option("1d", "2d: embeddings sharded inside each node (all-to-alls on "
                           "intra-node links), nodes as replicas", group=_G, applies=RECXLA,
                           choices=TOPOLOGIES)
    ranks_per_node: Optional[int] = option(
        None, "2d: ranks per node", group=_G, applies=RECXLA, parse=at_least(1),
        default_text="torchrun's LOCAL_WORLD_SIZE")
    replica_sync: str = option(
        "gradients", "2d: sum embedding gradients across nodes every step (exact), or average "
        "weights every --sync-every steps", group=_G, applies=RECXLA, choices=REPLICA_SYNCS)
    sync_every: int = option(1, "2d, --replica-sync weights: steps between averages (a "
                             "checkpoint averages too)", group=_G,
                             applies=RECXLA, parse=at_least(1))
    replica_precision: str = option("fp32", "2d: wire format of the gradient sync across nodes",
                                    group=_G, applies=RECXLA, choices=REPLICA_PRECISIONS)

    profile: str = option(
        "criteo", "synthetic tables: criteo (the 26 Criteo Kaggle tables) or small (the same, "
        "at most 2000 rows, short history bags); with --data it makes the model the profile's "
        "instead of the dataset's", group=_D, choices=PROFILES)
    max_rows: Optional[int] = option(
        None, "cap on the profile's table rows", group=_D, parse=at_least(1),
        default_text=f"{CRITEO_PROFILE_MAX_ROWS}; {SMALL_PROFILE_MAX_ROWS} with --profile small")
    zipf: float = option(1.05, "synthetic logs' key skew, 0 = uniform", group=_D,
                         parse=options.non_negative_float)
    data: Optional[str] = option(
        None, "train on a Parquet dataset (a folder or .parquet file converted by `python -m "
        "recxla.data convert` or written by recxla.data.write_parquet): one table per sparse "
        "feature or shared group, with the dataset's rows, pooling, weights and dims, and its "
        "dense width; --embedding-dim and --table-rows override them, --profile/--max-rows "
        "train the profile's tables instead. An epoch (--epochs) is one pass over the files. "
        "Or a raw table, read as it is with --schema, --transform and --join: Parquet (a file "
        "or folder not converted, bucketed or not) or an Iceberg table "
        "(iceberg:CATALOG#NAMESPACE.TABLE), its ids mapped to rows as a conversion would",
        group=_D, metavar="PATH")
    schema: Optional[str] = option(
        None, "--data read as a raw table: the schema file (TOML) that names column roles and "
        "tables, as for `python -m recxla.data convert`", group=_D, metavar="FILE",
        default_text="roles inferred as a conversion infers them")
    transform: Tuple[str, ...] = option(
        (), "--data read as a raw table: a Python function over Arrow record batches "
        "(module:function or file.py:function) run by the loader after the joins, before ids "
        "become rows; repeat it to apply several, in order", group=_D, metavar="MODULE:FN",
        repeat=True, default_text="none")
    join: Tuple[str, ...] = option(
        (), "--data read as a raw table: join a feature table on a key column, "
        "KEY=TABLE (a Parquet file or folder, bucketed by KEY like --data, or iceberg:...); "
        "repeat it for several", group=_D, metavar="KEY=TABLE", repeat=True,
        default_text="none")
    table_rows: Tuple[Tuple[str, int], ...] = option(
        (), "--data: rows of the named tables, TABLE=ROWS,... (at least the ids' range)",
        group=_D, parse=options.table_sizes, metavar="TABLE=ROWS,...",
        default_text="the dataset's")
    eval_data: Optional[str] = option(
        None, "held-out Parquet dataset for the final AUC and log loss (each rank's whole "
        "share, or its first --eval-batches batches)", group=_D, metavar="PATH",
        default_text="--eval-fraction of --data; the synthetic held-out split without --data")
    eval_fraction: Optional[float] = option(
        None, "--data: the share of its rows held out for the final AUC and log loss: the "
        "latest row groups by the dataset's timestamp when it has one, else the last row "
        "groups", group=_D, parse=options.fraction,
        default_text=f"{DEFAULT_EVAL_FRACTION} with the dataset's model and no --eval-data; "
        "none with --profile (the synthetic held-out split)")
    loader: str = option("local", "--data: read in worker processes on this machine, or in "
                         "Ray Data tasks (pip install 'recxla[ray]')", group=_D, choices=LOADERS)
    loader_workers: Optional[int] = option(
        None, "processes per rank that read --data (or Ray tasks; 0 with --loader local: read "
        "in the rank's own process, in a background thread), or that make the synthetic logs' "
        "batches ahead (0: the rank's own thread makes each when the step asks for it)",
        group=_D, parse=at_least(0), metavar="N",
        default_text="1 with --data; with the synthetic logs 1 on a GPU (--device cuda), 0 on "
        "a CPU, whose cores the ranks' training already uses")
    shuffle_rows: int = option(
        SHUFFLE_ROWS, "--data: rows are read in a seeded random order within windows of whole "
        "row groups of at most N rows (memory: about one window per reader); 0 reads them as "
        "stored (a layout sorted by user then puts few users in a batch)", group=_D,
        parse=at_least(0), metavar="N")

    checkpoint_dir: Optional[str] = option(None, "folder of the run's checkpoints", group=_R,
                                           metavar="PATH")
    checkpoint_every: int = option(0, "steps between checkpoints (0: only at the end)",
                                   group=_R, parse=at_least(0))
    resume: bool = option(False, "continue from the latest checkpoint in --checkpoint-dir",
                          group=_R)
    resume_step: Optional[int] = option(
        None, "with --resume: continue from the checkpoint of N steps instead of the newest (a "
        "damaged newest one is refused, never skipped; the newer ones stay until this run "
        "writes the same steps)", group=_R, parse=at_least(0), metavar="N")
    metrics: Optional[str] = option(None, "write the summary as JSON here", group=_R,
                                    metavar="PATH")
    label: Optional[str] = option(None, "this run's name in --compare tables", group=_R)
    timeout: float = option(120.0, "seconds without progress after which every rank exits, "
                            "naming the rank that stopped", group=_R,
                            parse=options.positive_float)
    device: str = option("auto", "where to train (auto: cuda when visible)", group=_R,
                         choices=DEVICES)
    threads: Optional[int] = option(None, "compute threads per rank", group=_R,
                                    parse=at_least(1), default_text="cores / ranks on this node")
    allocator: str = option("keep", "keep: freed memory stays in the process (no page faults "
                            "per step); default: glibc's defaults", group=_R, choices=ALLOCATORS)
    progress: bool = option(True, "rank 0's progress bar", group=_R)
    net_iface: Optional[str] = option(
        None, "also report the bytes this network interface sent per measured step (each "
        "node's, read by its local rank 0 from /sys/class/net)", group=_R, metavar="NAME")

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
        if self.dense_floor:  # no embeddings, no all-to-all: only the dense part
            return f"dense floor (dense all-reduce {self.dense_allreduce})"
        fwd, bwd = self.comms
        dedup = "" if self.baseline or self.dedup_ids else ", no dedup"
        pipeline = f", {self.baseline_pipeline}" if self.baseline and \
            self.baseline_pipeline != "sparse_dist" else ""
        return f"{self.path} {fwd}/{bwd}{dedup}{pipeline}"

    @property
    def model_from_data(self) -> bool:
        """The tables come from the --data dataset (not from --profile)."""
        return self.data is not None and self.max_rows is None

    def asdict(self) -> dict:
        return dataclasses.asdict(self)
