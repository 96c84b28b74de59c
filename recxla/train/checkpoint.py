"""Sharded checkpoints with torch.distributed.checkpoint (DCP): model, optimizers, data position.

A checkpoint is a folder `<checkpoint-dir>/step_<N>` written by DCP, every rank writing its own
shards: the model's state_dict (embedding tables as ShardedTensors, dense layers once), the
combined optimizer's state_dict (the fused embedding optimizer's sharded state, e.g. row-wise
Adagrad's accumulators, and the dense optimizer's), and the training state (steps done, which is
the data position: see recxla.train.data; with --data, `train_state.json` also records the
files' fingerprint, so that resuming on other files fails). It is written under
`step_<N>.partial` and renamed once every rank has finished, with `train_state.json` (the
training state and the options it depends on) added last: a folder without it is not a checkpoint, so a run killed while saving
resumes from the previous one. `train_state.json` also lets --resume be checked before any
process group exists.

Resuming loads everything in place, so a run stopped after a checkpoint and resumed ends with
the parameters of an uninterrupted run, bit for bit on CPU with fp32 communication.
"""

import json
import os
import re
import shutil
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from recxla.train.config import TrainConfig

STATE_FILE = "train_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Options a checkpoint's contents depend on: resuming with others is an error.
COMPATIBLE = ("model", "embedding_dim", "dense_arch", "over_arch", "dcn_layers", "dcn_low_rank",
              "batch_size", "train_batches", "dense_optimizer", "sparse_optimizer", "seed",
              "profile", "max_rows", "zipf", "sharding")


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}")


def latest_checkpoint(directory: Optional[str]) -> Optional[Tuple[int, str]]:
    """(steps done, folder) of the newest complete checkpoint in `directory`, or None."""
    if not directory or not os.path.isdir(directory):
        return None
    found = []
    for name in os.listdir(directory):
        m = _STEP_DIR.match(name)
        path = os.path.join(directory, name)
        if m and os.path.isfile(os.path.join(path, STATE_FILE)):
            found.append((int(m.group(1)), path))
    return max(found) if found else None


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
    files = _data_fingerprint(config)
    if state.get("data_fingerprint") != files:
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


def save(directory: str, steps_done: int, model, optimizer, config: TrainConfig,
         world_size: int, data_fingerprint: Optional[str] = None) -> str:
    """Write checkpoint `step_<steps_done>` (a collective: every rank calls it). Returns the
    folder. `data_fingerprint`: TrainData.fingerprint (None: synthetic logs)."""
    final = checkpoint_path(directory, steps_done)
    partial = final + ".partial"
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "train": {"steps_done": torch.tensor(steps_done, dtype=torch.int64)}}
    dcp.save(state, checkpoint_id=partial)
    dist.barrier()  # every rank's shards are on disk
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        train_state = {"steps_done": steps_done, "data_position": steps_done,
                       "data_fingerprint": data_fingerprint,
                       "world_size": world_size, "path": config.path,
                       "config": config.asdict()}
        tmp = os.path.join(final, STATE_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(train_state, f, indent=1)
        os.replace(tmp, os.path.join(final, STATE_FILE))
    dist.barrier()
    return final


def load(path: str, model, optimizer) -> int:
    """Load checkpoint folder `path` into `model` and `optimizer` in place (a collective).
    Returns the steps it had done."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "train": {"steps_done": torch.tensor(-1, dtype=torch.int64)}}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["train"]["steps_done"])
