"""The checkpoint folder's on-disk protocol: what is complete, how a checkpoint is committed, what
is removed. (What a checkpoint holds: recxla.train.checkpoint.)

    <checkpoint-dir>/
        step_00000004/            a complete checkpoint: 4 steps done
            .metadata             DCP's index of the shards
            __0_0.distcp ...      DCP's data, one file per rank
            train_state.json      the completion marker, written last (see below)
        step_00000006.partial/    being written, or left by a run killed while writing it
        step_00000006.old/        a folder of the same step moved aside by the commit

A checkpoint is written under `step_<N>.partial`, every data file fsynced by DCP; once every
rank has finished (a barrier) rank 0 writes the marker `train_state.json` (the training state
and the size of every file), fsyncs it and the folder, renames the folder to `step_<N>` and
fsyncs the parent folder. The rename is the commit: before it the checkpoint does not exist,
after it it is whole, whatever instant a kill (or a power loss, given the fsyncs) strikes.

A folder counts as a checkpoint only if it is named `step_<N>`, its marker parses and names
N steps done, and every file the marker lists has its recorded size. Everything else named
like a checkpoint (`.partial`, `.old`, a `step_<N>` without a valid marker) is incomplete:
`latest_checkpoint` ignores it and `remove_incomplete` deletes it. Nothing else in the folder is
touched. Older complete checkpoints are pruned only after a newer one is committed.
"""

import json
import os
import re
import shutil
from typing import List, Optional, Tuple

STATE_FILE = "train_state.json"
_COMPLETE_NAME = re.compile(r"^step_(\d+)$")
_TEMPORARY_NAME = re.compile(r"^step_\d+\.(partial|old)$")


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}")


def partial_path(directory: str, step: int) -> str:
    return checkpoint_path(directory, step) + ".partial"


def read_marker(path: str) -> Optional[dict]:
    """The marker of checkpoint folder `path` if it is complete (see the module docstring),
    else None."""
    m = _COMPLETE_NAME.match(os.path.basename(os.path.normpath(path)))
    if m is None:
        return None
    try:
        with open(os.path.join(path, STATE_FILE)) as f:
            marker = json.load(f)
        if not isinstance(marker, dict) or marker.get("steps_done") != int(m.group(1)):
            return None
        files = marker.get("files")
        if not isinstance(files, dict) or not files:
            return None
        for name, size in files.items():
            if os.path.getsize(os.path.join(path, name)) != size:
                return None
    except (OSError, ValueError):
        return None
    return marker


def _step_folders(directory: Optional[str]) -> List[Tuple[int, str]]:
    if not directory or not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _COMPLETE_NAME.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found)


def complete_checkpoints(directory: Optional[str]) -> List[Tuple[int, str]]:
    """(steps done, folder) of every complete checkpoint in `directory`, oldest first."""
    return [(step, path) for step, path in _step_folders(directory)
            if read_marker(path) is not None]


def latest_checkpoint(directory: Optional[str]) -> Optional[Tuple[int, str]]:
    """(steps done, folder) of the newest complete checkpoint in `directory`, or None."""
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def incomplete_folders(directory: Optional[str]) -> List[str]:
    """Folders named like checkpoints that are not complete ones (see the module docstring)."""
    if not directory or not os.path.isdir(directory):
        return []
    out = [os.path.join(directory, n) for n in sorted(os.listdir(directory))
           if _TEMPORARY_NAME.match(n)]
    out += [path for _, path in _step_folders(directory) if read_marker(path) is None]
    return sorted(out)


def remove_incomplete(directory: Optional[str]) -> List[str]:
    """Delete the incomplete folders (one process of the job only); returns them."""
    removed = incomplete_folders(directory)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def prune(directory: str, newest: int, keep: Optional[int]) -> List[str]:
    """After checkpoint `newest` is committed: delete the complete checkpoints older than it
    beyond the `keep` newest (`newest` included; None keeps all). Checkpoints of more steps
    than `newest` (another run's) are left alone. Returns the folders deleted."""
    if keep is None:
        return []
    if keep < 1:
        raise ValueError(f"recxla.train.checkpoint_files.prune: keep must be >= 1 or None, "
                         f"got {keep}")
    older = [path for step, path in complete_checkpoints(directory) if step < newest]
    doomed = older[:max(len(older) - (keep - 1), 0)]
    for path in doomed:
        # Renamed first: a kill halfway through the deletion leaves an `.old` folder, never a
        # `step_<N>` with some files gone.
        os.replace(path, path + ".old")
        shutil.rmtree(path + ".old", ignore_errors=True)
    return doomed


def fsync_dir(path: str) -> None:
    """Make the entries of folder `path` (names created, renamed, removed) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(partial: str, state: dict) -> None:
    """Write the marker into the unfinished folder `partial`, recording the size of every
    file already there; fsync it and the folder. `state` must hold "steps_done"."""
    files = {name: os.path.getsize(os.path.join(partial, name))
             for name in sorted(os.listdir(partial)) if name != STATE_FILE}
    tmp = os.path.join(partial, STATE_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({**state, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(partial, STATE_FILE))
    fsync_dir(partial)


def commit(directory: str, step: int) -> str:
    """Rename the marked `step_<N>.partial` to `step_<N>` (the commit) and make it durable.
    A folder already named `step_<N>` (incomplete, or an earlier run's) is moved aside first
    and deleted after. Returns the checkpoint's folder."""
    final, partial = checkpoint_path(directory, step), partial_path(directory, step)
    old = final + ".old"
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(partial, final)
    fsync_dir(directory)
    shutil.rmtree(old, ignore_errors=True)
    return final
