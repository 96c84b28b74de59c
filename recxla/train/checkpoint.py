"""Sharded checkpoints with torch.distributed.checkpoint (DCP): everything a run's continuation
depends on, written crash-consistently.

A checkpoint `step_<N>` holds, every rank writing its own shards through DCP:
- "model": the model's state_dict (embedding tables as ShardedTensors, dense layers once);
- "optimizer": the combined optimizer's state_dict (the fused embedding optimizer's sharded
  state, e.g. row-wise Adagrad's accumulators, and the dense optimizer's, its step counts
  included);
- "train": the steps done, which is also the data position (see recxla.train.data: batch k
  is a function of k alone, with --data as with the synthetic logs), and each rank's random
  number generator state (`rng_cpu_rank<r>`; nothing in the trainer's step draws from it
  today, a model with dropout would);
and `train_state.json`, the completion marker: the training state again, the options it
depends on (checked by --resume before any process group exists), the --data files'
fingerprint, `state_sha256` (a hash of every rank's saved tensors: two runs that end with the
same value hold the same state bit for bit) and the size of every file.

The pipeline's double-buffered next batch is not saved: the checkpoint is written between
steps, after the step's update, when the next batch's ids have been exchanged but nothing of it
has been looked up or trained; a resumed run reads that batch again from the data position and
exchanges it again (with --dbp-lookup early the next batch is looked up before the update and
corrected after; a resumed run looks it up after, which equals it only up to float rounding).

How a checkpoint is committed, which folders count as complete and what is removed:
recxla.train.checkpoint_files. In short: a run killed at any instant, on one rank or all,
leaves the newest complete checkpoint intact, and --resume continues from it; a run stopped
and resumed ends with the parameters of an uninterrupted run, bit for bit on CPU with fp32
communication.
"""

import hashlib
import json
import os
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from recxla.train import checkpoint_files as files
from recxla.train.checkpoint_files import STATE_FILE, checkpoint_path, latest_checkpoint
from recxla.train.config import TrainConfig
from recxla.train.faults import kill_point

__all__ = ["STATE_FILE", "checkpoint_path", "latest_checkpoint", "read_train_state",
           "check_compatible", "save", "load", "state_fingerprint"]

# Options a checkpoint's contents depend on: resuming with others is an error.
COMPATIBLE = ("model", "embedding_dim", "dense_arch", "over_arch", "dcn_layers", "dcn_low_rank",
              "batch_size", "train_batches", "dense_optimizer", "sparse_optimizer", "seed",
              "profile", "max_rows", "zipf", "sharding", "table_rows", "eval_fraction")


def read_train_state(path: str) -> dict:
    with open(os.path.join(path, STATE_FILE)) as f:
        return json.load(f)


def check_compatible(config: TrainConfig, world_size: int, state: dict) -> None:
    """ValueError naming the options that differ from the checkpoint's run."""
    saved = state["config"]
    ours = config.asdict()
    diff = [f"--{k.replace('_', '-')} {saved[k]!r} (now {ours[k]!r})" for k in COMPATIBLE
            if k in saved and _plain(saved[k]) != _plain(ours[k])]
    if state["world_size"] != world_size:
        diff.append(f"world size {state['world_size']} (now {world_size})")
    if state["path"] != config.path:
        diff.append(f"path {state['path']} (now {config.path})")
    if state.get("data_fingerprint") != _data_fingerprint(config):
        saved_data = saved.get("data")
        diff.append(f"--data {saved_data!r} (now {config.data!r}, "
                    + ("other files)" if saved_data and config.data else "other data)"))
    if diff:
        raise ValueError("--resume: the checkpoint was written with other options: "
                         + ", ".join(diff))
    if state["steps_done"] >= config.steps:
        raise ValueError(f"--resume: the checkpoint has {state['steps_done']} steps done, not "
                         f"fewer than --steps {config.steps}: nothing left to train")


def _data_fingerprint(config: TrainConfig) -> Optional[str]:
    """The --data files' fingerprint (names and row groups; footers only), None without."""
    if config.data is None:
        return None
    from recxla.data.parquet_layout import DatasetInfo

    return DatasetInfo(config.data, "--data").fingerprint


def _plain(value):
    return list(value) if isinstance(value, (list, tuple)) else value


class _Writer(FileSystemWriter):
    """DCP's file writer (every file fsynced) with the "checkpoint N writing" fault point: after
    this rank's data files, before DCP writes its metadata."""

    def __init__(self, path: str, step: int):
        super().__init__(path, sync_files=True)
        self._step = step

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        written.wait()
        kill_point(f"checkpoint {self._step} writing")
        return written


def _rng_key(rank: int) -> str:
    return f"rng_cpu_rank{rank}"


def _contents(model, optimizer, steps_done: int, rank: int) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "train": {"steps_done": torch.tensor(steps_done, dtype=torch.int64),
                      _rng_key(rank): torch.get_rng_state()}}


def save(directory: str, steps_done: int, model, optimizer, config: TrainConfig,
         world_size: int, data_fingerprint: Optional[str] = None,
         keep: Optional[int] = None) -> str:
    """Write checkpoint `step_<steps_done>` (a collective: every rank calls it) and commit it;
    then delete the older ones beyond the `keep` newest (None: keep all). Returns the folder.
    `data_fingerprint`: TrainData.fingerprint (None: synthetic logs)."""
    rank = dist.get_rank()
    partial = files.partial_path(directory, steps_done)
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        files.remove_incomplete(directory)  # a killed run's leftovers, this step's included
    dist.barrier()
    state = _contents(model, optimizer, steps_done, rank)
    dcp.save(state, storage_writer=_Writer(partial, steps_done))
    kill_point(f"checkpoint {steps_done} written")
    fingerprint = state_fingerprint(state)  # a collective: also the barrier after every write
    if rank == 0:
        files.write_marker(partial, {
            "steps_done": steps_done, "data_position": steps_done,
            "data_fingerprint": data_fingerprint, "world_size": world_size,
            "path": config.path, "state_sha256": fingerprint, "config": config.asdict()})
        kill_point(f"checkpoint {steps_done} marked")
        files.commit(directory, steps_done)
    dist.barrier()  # committed: no rank goes on before the checkpoint exists
    kill_point(f"checkpoint {steps_done} committed")
    if rank == 0:
        files.prune(directory, steps_done, keep)
    return checkpoint_path(directory, steps_done)


def load(path: str, model, optimizer) -> int:
    """Load checkpoint folder `path` into `model` and `optimizer` in place and restore this
    rank's random number generator (a collective). Rank 0 first deletes the incomplete folders
    beside it. Returns the steps it had done."""
    rank = dist.get_rank()
    if rank == 0:
        files.remove_incomplete(os.path.dirname(os.path.normpath(path)))
    state = _contents(model, optimizer, -1, rank)
    saved_keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if f"train.{_rng_key(rank)}" not in saved_keys:  # written before generators were saved
        del state["train"][_rng_key(rank)]
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if _rng_key(rank) in state["train"]:
        torch.set_rng_state(state["train"][_rng_key(rank)])
    return int(state["train"]["steps_done"])


def state_fingerprint(state: dict) -> str:
    """sha256 over every rank's tensors of `state` (a collective; the same string on every
    rank): keys, shard offsets, dtypes, shapes and bytes, rank by rank. Equal fingerprints:
    equal states, bit for bit, under the same plan."""
    local = hashlib.sha256()
    for key, value in sorted(_flatten(state).items()):
        local.update(key.encode())
        parts = _local_tensors(value)
        if parts is None:  # a plain value (learning rate, parameter names): its text
            local.update(repr(value).encode())
            continue
        for offsets, tensor in parts:
            t = tensor.detach().cpu().contiguous()
            local.update(f"{offsets}{t.dtype}{tuple(t.shape)}".encode())
            local.update(t.reshape(-1).view(torch.uint8).numpy())  # no copy
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, local.hexdigest())
    return hashlib.sha256("".join(digests).encode()).hexdigest()


def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(value, (list, tuple)):
        out = {}
        for i, v in enumerate(value):
            out.update(_flatten(v, f"{prefix}{i}."))
        return out
    return {prefix.rstrip("."): value}


def _local_tensors(value):
    """(shard offsets, tensor) of this rank's part of `value`; None if it is no tensor."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(value, ShardedTensor):
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    if isinstance(value, DTensor):
        return [(str(value.placements), value.to_local())]
    if torch.is_tensor(value):
        return [((), value)]
    return None
