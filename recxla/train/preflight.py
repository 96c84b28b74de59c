"""Checks that look outside the options, before any process group exists: the files and
folders the options name (--data, --eval-data, --checkpoint-dir, --metrics, --trace,
--kernel-trace, --resume's checkpoint and --resume-step), the network interface (--net-iface),
Ray for --loader ray. Each failure exits with status 2 naming the option and the file, like a
bad option.

The dataset checks open footers only (no data): a missing path, an unreadable file, a dataset
too small for one batch per rank (or for its held-out split), or features that do not fit the
model's tables.
"""

import importlib.util
import os
from typing import Callable

from recxla.train.config import NET_SYSFS, TrainConfig


def world_size() -> int:
    """The job's ranks as torchrun announces them (1 outside torchrun)."""
    return max(int(os.environ.get("WORLD_SIZE", "1") or 1), 1)


def check(err: Callable[[str], None], fields: dict) -> dict:
    """Checks the paths in `fields` (TrainConfig fields, resolved by config._check); returns
    them with what the files decide (embedding dim of the dataset's model, steps of
    --epochs). `err(message)` exits."""
    _check_paths(err, fields)
    if fields["loader"] == "ray" and fields["data"] is not None and \
            importlib.util.find_spec("ray") is None:
        err("--loader ray needs Ray Data, which is not installed: pip install 'recxla[ray]', or "
            "use --loader local")
    if fields["data"] is not None or fields["eval_data"] is not None:
        fields = _check_data(err, fields)
    steps = fields["steps"]
    if fields["warmup_steps"] >= steps:
        err(f"--warmup-steps {fields['warmup_steps']} must be less than the {steps} steps, or "
            "no step is left to measure")
    return fields


def _check_paths(err, f: dict) -> None:
    if f["resume"]:
        from recxla.train.checkpoint import resume_checkpoint

        try:
            resume_checkpoint(f["checkpoint_dir"], f["resume_step"])
        except ValueError as e:
            err(str(e))
    for flag, path in (("--metrics", f["metrics"]), ("--checkpoint-dir", f["checkpoint_dir"]),
                       ("--trace", f["trace"]), ("--kernel-trace", f["kernel_trace"])):
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
    from recxla.train.data import TrainData

    config = TrainConfig(**fields)
    world = world_size()
    try:
        data = TrainData(config, 0, world)
    except (FileNotFoundError, ValueError) as e:  # DataFormatError is a ValueError
        err(str(e))
    fields = dict(fields, embedding_dim=data.embedding_dim)
    if config.epochs is not None and config.data is not None:
        # Every rank's batches per epoch, summed (epochs differ by a batch or so where row
        # groups differ in size).
        fields["steps"] = sum(data.files.num_batches(e) for e in range(config.epochs))
    return fields
