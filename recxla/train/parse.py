"""From a command line to a checked TrainConfig, before any process group exists: a bad option
or input costs no rendezvous and no peer's time.

`parse_config(argv)` returns a TrainConfig or exits with status 2 and a message naming the
option and its limit, or the file. Every rank of a job finds the same error, so it is printed
once per node (by its first rank: `prints_errors`), on one line, without argparse's usage text;
every rank exits 2. Flag names are fixed (scripts rely on them). In order:

- the parser (`build_parser`), derived from TrainConfig's fields (recxla.train.config): each
  option's type, choices and limits;
- `_check`: whether each option applies to the chosen path (recxla, or --baseline torchrec),
  the checks that involve several options, and the defaults that depend on other options;
- `preflight`: what looks outside the options: the files and folders they name (--data,
  --eval-data, --checkpoint-dir, --metrics, --trace, --kernel-trace, --resume's checkpoint and
  --resume-step), the network interface (--net-iface), Ray for --loader ray. The dataset checks
  open footers only (no data): a missing path, an unreadable file, a dataset too small for one
  batch per rank (or for its held-out split), or features that do not fit the model's tables.
  Their errors name the option and the file.
"""

import importlib.util
import os
import sys
from typing import Callable, NoReturn, Optional, Sequence

import torch

from recxla.pipeline.choices import BUCKET_MERGE_WIRES
from recxla.train import options
from recxla.train.checkpoint import resume_checkpoint, resumed_snapshots
from recxla.train.config import (
    CRITEO_PROFILE_MAX_ROWS,
    DEFAULT_EVAL_FRACTION,
    FALLBACK_EMBEDDING_DIM,
    NET_SYSFS,
    RECXLA_DDP_BUCKET_MB,
    RECXLA_DENSE_ALLREDUCE,
    SMALL_PROFILE_MAX_ROWS,
    TORCHREC_CPU_SHARDINGS,
    TrainConfig,
)
from recxla.train.data import TrainData
from recxla.train.options import RECXLA, TORCHREC

PROG = "recxla-train"
# The exit status of a bad option or input (argparse's convention), found before training.
EXIT_BAD_INPUT = 2


def parse_config(argv: Optional[Sequence[str]] = None) -> TrainConfig:
    """TrainConfig from command-line arguments; exits with status 2 on a bad option or input
    (a file the options name), printed once per node (`exit_bad_input`)."""
    parser = build_parser()
    given = vars(parser.parse_args(sys.argv[1:] if argv is None else argv))
    # The files' errors name the option and the file: no pointer to --help.
    fields = preflight(exit_bad_input, _check(parser.error, given))
    return TrainConfig(**fields)


def prints_errors(env=None) -> bool:
    """Whether this process prints the errors found before training: the first rank of each
    node (LOCAL_RANK 0, or a process outside torchrun). The others find the same error (the
    checks read the options and this node's files alike on every rank) and exit quietly, so
    that torchrun's output holds it once, not once per rank."""
    env = os.environ if env is None else env
    return (env.get("LOCAL_RANK") or "0") == "0"


def exit_bad_input(message: str) -> NoReturn:
    """Exit with EXIT_BAD_INPUT, printing `message` where `prints_errors`."""
    if prints_errors():
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_INPUT)


def _option_error(message: str) -> NoReturn:
    exit_bad_input(f"{message} (`{PROG} --help` lists the options)")


def build_parser(on_error: Optional[Callable[[str], None]] = _option_error):
    """The trainer's parser; its errors (and _check's) go to `on_error` (default: printed once
    per node, with a pointer to --help, exit 2)."""
    return options.build_parser(
        TrainConfig, on_error, prog=PROG,
        description="Train TorchRec's DLRM (or DLRM_DCN) across ranks with recxla's "
        "communication, or with plain TorchRec (--baseline torchrec), on synthetic ranking logs "
        "or on your own converted data (--data). Launch with torchrun (gloo on CPU, NCCL on "
        "GPU). `recxla-train --compare A.json B.json ...` compares metrics files instead.")


def options_markdown() -> str:
    """The options reference of docs/training.md (Markdown tables, one per group)."""
    return options.markdown_reference(TrainConfig)


def _check(err, given: dict) -> dict:
    """Checks that involve several options; returns the TrainConfig fields, resolved. `given`:
    the options on the command line; `err(message)` exits."""
    v = options.values(TrainConfig, given)
    path = TORCHREC if v["baseline"] else RECXLA
    for message in options.path_errors(TrainConfig, given, path):
        err(message)
    if v["topology"] == "2d":
        if "ranks_per_node" not in given and "LOCAL_WORLD_SIZE" not in os.environ:
            err("--topology 2d needs --ranks-per-node, or torchrun's LOCAL_WORLD_SIZE")
        for flag, on in (("--early-rows", v["early_rows"]),
                         ("--dbp-lookup early", v["dbp_lookup"] == "early")):
            if on:
                err(f"{flag} with --topology 2d is not supported: the next batch would read "
                    "rows that the other nodes' batches change in this update")
        v["ranks_per_node"] = v["ranks_per_node"] or local_world_size()
    if v["ddp_bucket_mb"] is None and not v["baseline"]:
        v["ddp_bucket_mb"] = RECXLA_DDP_BUCKET_MB
    if v["dense_allreduce"] is None:
        v["dense_allreduce"] = "fp32" if v["baseline"] else RECXLA_DENSE_ALLREDUCE
    for name in ("powersgd_rank", "powersgd_start"):
        if name in given and v["dense_allreduce"] != "powersgd":
            err(f"--{name.replace('_', '-')} applies to --dense-allreduce powersgd (the dense "
                f"all-reduce is {v['dense_allreduce']})")
    if "ddp_bucket_merge" in given and v["dense_allreduce"] not in BUCKET_MERGE_WIRES:
        err(f"--ddp-bucket-merge applies to --dense-allreduce fp32 and bf16 (the "
            f"{v['dense_allreduce']} wire sends its buckets its own way)")
    if v["data_parallel_tables"] and v["sharding"] != "auto":
        err(f"--data-parallel-tables applies to --sharding auto (--sharding {v['sharding']} is "
            "one plan for every table)")
    if v["data_parallel_tables"] and v["topology"] == "2d":
        err("--data-parallel-tables with --topology 2d is not supported yet (tables are "
            "replicated across nodes already)")
    if "sync_every" in given and v["replica_sync"] != "weights":
        err("--sync-every applies to --replica-sync weights")
    if v["replica_sync"] == "weights" and v["replica_precision"] != "fp32":
        err("--replica-precision bf16 applies to --replica-sync gradients (weights are averaged "
            "in fp32)")
    try:
        v["device"] = resolve_device(v["device"])
    except ValueError as e:
        err(str(e))
    if v["baseline"]:
        if v["device"] == "cpu" and v["sharding"] == "row_wise":
            err("--sharding row_wise with --baseline torchrec: TorchRec's sharders offer no "
                "row-wise sharding on CPU (gloo lacks the reduce-scatter it needs); use one of "
                f"{', '.join(TORCHREC_CPU_SHARDINGS)} or auto, or the recxla path")
        if "baseline_plan" in given and v["sharding"] != "auto":
            err(f"--baseline-plan applies to --sharding auto (--sharding {v['sharding']} is one "
                "plan for both paths)")
        # What the baseline's sharder does, for the summary and the metrics file.
        v["dedup_ids"], v["row_exchange"] = False, "off"
    if "steps" in given and "epochs" in given:
        err("--steps and --epochs: give one or the other")
    if v["data"] is None:
        for name in ("loader", "shuffle_rows", "table_rows", "eval_fraction"):
            if name in given:
                err(f"--{name.replace('_', '-')} applies to --data (the synthetic logs are "
                    "generated by the rank)")
    if v["loader_workers"] is None:
        v["loader_workers"] = 1 if v["data"] is not None or v["device"] == "cuda" else 0
    if v["loader"] == "ray" and v["loader_workers"] == 0:
        err("--loader-workers 0 applies to --loader local (Ray reads in at least 1 task)")
    if v["data"] is not None and ("profile" in given or "max_rows" in given):
        if "table_rows" in given:
            err("--table-rows sets the dataset's tables; --profile and --max-rows train the "
                "profile's tables instead: give one or the other")
    # The model: the dataset's tables (--data alone), or the profile's (max_rows resolved).
    if v["data"] is None or "profile" in given or "max_rows" in given:
        if v["max_rows"] is None:
            v["max_rows"] = SMALL_PROFILE_MAX_ROWS if v["profile"] == "small" else \
                CRITEO_PROFILE_MAX_ROWS
        if v["embedding_dim"] is None:
            v["embedding_dim"] = FALLBACK_EMBEDDING_DIM
    if "eval_data" in given and "eval_fraction" in given:
        err("--eval-data and --eval-fraction: give one or the other (the held-out rows come "
            "from other files, or from --data)")
    if v["data"] is not None and v["max_rows"] is None and v["eval_data"] is None and \
            v["eval_fraction"] is None:
        v["eval_fraction"] = DEFAULT_EVAL_FRACTION  # the dataset's model: its own held-out rows
    if v["epochs"] is not None and v["data"] is None:
        v["steps"] = v["epochs"] * v["train_batches"]
    if (v["resume"] or v["checkpoint_every"]) and not v["checkpoint_dir"]:
        err("--resume and --checkpoint-every need --checkpoint-dir")
    if v["resume_step"] is not None and not v["resume"]:
        err("--resume-step applies with --resume")
    v["threads"] = v["threads"] or max(1, (os.cpu_count() or 1) // local_world_size())
    return v


def resolve_device(requested: str) -> str:
    """--device's value: "auto" as cuda where a CUDA device is visible, else cpu."""
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible on this machine")
    return requested


def local_world_size() -> int:
    """Ranks on this node as torchrun announces them (1 outside torchrun)."""
    return max(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1), 1)


def world_size() -> int:
    """The job's ranks as torchrun announces them (1 outside torchrun)."""
    return max(int(os.environ.get("WORLD_SIZE", "1") or 1), 1)


def preflight(err: Callable[[str], None], fields: dict) -> dict:
    """Checks what the options in `fields` (TrainConfig fields, resolved by _check) name
    outside themselves; returns them with what the files decide (embedding dim of the
    dataset's model, steps of --epochs). `err(message)` exits."""
    _check_paths(err, fields)
    if fields["loader"] == "ray" and fields["data"] is not None and \
            importlib.util.find_spec("ray") is None:
        err("--loader ray needs Ray Data, which is not installed: pip install 'recxla[ray]', or "
            "use --loader local")
    if fields["data"] is not None or fields["eval_data"] is not None:
        fields = _check_data(err, fields)
    if fields["embedding_dims"] and fields["embedding_dims"][0] != "auto":
        config = TrainConfig(**fields)
        try:  # the named tables exist, at most the run's dim (synthetic or --data tables)
            TrainData(config, 0, world_size(), resumed_snapshots(config)).tables()
        except (FileNotFoundError, ValueError) as e:
            err(str(e))
    steps = fields["steps"]
    if fields["warmup_steps"] >= steps:
        err(f"--warmup-steps {fields['warmup_steps']} must be less than the {steps} steps, or "
            "no step is left to measure")
    return fields


def _check_paths(err, f: dict) -> None:
    if f["resume"]:
        try:
            resume_checkpoint(f["checkpoint_dir"], f["resume_step"])
        except ValueError as e:
            err(str(e))
    # Files need their folder; the checkpoint folder is made with its parents when written.
    for flag, path in (("--metrics", f["metrics"]), ("--trace", f["trace"]),
                       ("--kernel-trace", f["kernel_trace"])):
        parent = os.path.dirname(os.path.abspath(path)) if path else None
        if parent and not os.path.isdir(parent):
            err(f"{flag} {path!r}: the folder {parent!r} does not exist")
    if f["checkpoint_dir"] and os.path.exists(f["checkpoint_dir"]) and \
            not os.path.isdir(f["checkpoint_dir"]):
        err(f"--checkpoint-dir {f['checkpoint_dir']!r} is a file, not a folder")
    if f["net_iface"] is not None and not os.path.isdir(
            os.path.join(NET_SYSFS, os.path.basename(f["net_iface"]))):
        err(f"--net-iface {f['net_iface']!r}: no such network interface here ({NET_SYSFS})")


def _check_data(err, fields: dict) -> dict:
    """--data and --eval-data open, fit the model and fill a batch per rank (rank 0's view;
    every rank gets as many batches); the dataset's model gets its embedding dim."""
    config = TrainConfig(**fields)
    world = world_size()
    try:
        data = TrainData(config, 0, world, resumed_snapshots(config))
        if config.model == "history":
            data.history_features()
    except (FileNotFoundError, ValueError) as e:  # DataFormatError is a ValueError
        err(str(e))
    fields = dict(fields, embedding_dim=data.embedding_dim)
    if config.epochs is not None and config.data is not None:
        # Every rank's batches per epoch, summed (epochs differ by a batch or so where row
        # groups differ in size).
        fields["steps"] = sum(data.files.num_batches(e) for e in range(config.epochs))
    return fields
