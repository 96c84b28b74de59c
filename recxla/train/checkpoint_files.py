"""The checkpoint folder's on-disk protocol: what is committed, what is intact, how a checkpoint
is committed, what is removed. (What a checkpoint holds and how it is read back:
recxla.train.checkpoint and recxla.train.checkpoint_reader.)

    <checkpoint-dir>/
        step_00000004/            a committed checkpoint: 4 steps done
            .metadata             DCP's index of the shards
            __0_0.distcp ...      DCP's data, one file per rank
            train_state.json      the completion marker, written last (see below)
        step_00000006.partial/    being written, or left by a run killed while writing it
        step_00000006.old/        a folder moved aside by a commit or by pruning

A checkpoint is written under `step_<N>.partial`, every data file fsynced by DCP; once every
rank has finished, rank 0 writes the marker `train_state.json` (the training state and, of
every file, its size and SHA-256 as the ranks that wrote them computed them), fsyncs it and the
folder, renames the folder to `step_<N>` and fsyncs the parent folder. The rename is the
commit: before it the checkpoint does not exist, after it it is whole, whatever instant a kill
(or a power loss, given the fsyncs) strikes.

So every `step_<N>` folder is a committed checkpoint: no kill leaves one that is not whole.
One that does not match its marker (a marker that does not parse or names another step, a
file missing, of another size, or whose SHA-256 is not the recorded one) was damaged after
its commit, and `verify` says which file and how. Damaged checkpoints are never deleted, nor
skipped in silence: `--resume` refuses them (recxla.train.checkpoint). Only `.partial` and
`.old` folders are incomplete: `remove_incomplete` deletes them. Nothing else in the folder is
touched. Older intact checkpoints are pruned only after a newer one is committed.
"""

import hashlib
import json
import os
import re
import shutil
from typing import Dict, List, Optional, Tuple

STATE_FILE = "train_state.json"
CHECKSUM = "sha256"  # of every file, in the marker; hashlib's name
_COMPLETE_NAME = re.compile(r"^step_(\d+)$")
_TEMPORARY_NAME = re.compile(r"^step_\d+\.(partial|old)$")
_CHUNK = 1 << 20


class DamagedCheckpoint(ValueError):
    """A committed checkpoint that does not match its marker, or a file in it that recxla refuses
    to read: names the folder (`folder`), the file (`file`) and what is wrong (`problem`);
    `advice` says what to do. A ValueError: the trainer reports it like a bad option (exit 2)."""

    def __init__(self, folder: str, file: str, problem: str, advice: str = ""):
        self.folder, self.file, self.problem, self.advice = folder, file, problem, advice
        super().__init__(f"checkpoint {folder}: {file}: {problem}" +
                         (f". {advice}" if advice else ""))

    def __reduce__(self):  # pickled whole: DCP gathers every rank's exception
        return type(self), (self.folder, self.file, self.problem, self.advice)


def step_of(path: str) -> Optional[int]:
    """N of a folder named `step_<N>`, else None."""
    m = _COMPLETE_NAME.match(os.path.basename(os.path.normpath(path)))
    return None if m is None else int(m.group(1))


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step_{step:08d}")


def partial_path(directory: str, step: int) -> str:
    return checkpoint_path(directory, step) + ".partial"


def file_checksum(path: str) -> Tuple[int, str]:
    """(size in bytes, hex SHA-256) of file `path`, read in 1 MiB chunks."""
    digest = hashlib.new(CHECKSUM)
    size = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def read_marker(path: str) -> dict:
    """The marker of committed checkpoint folder `path` (`step_<N>`), checked for form: it
    parses, names N steps done and lists every file with its size and checksum. Raises
    DamagedCheckpoint naming the folder and the marker otherwise. Reads no other file (that
    is `verify`)."""
    step = step_of(path)
    if step is None:
        raise ValueError(f"recxla.train.checkpoint_files.read_marker: {path!r} is not named "
                         "like a checkpoint (step_<N>)")
    try:
        with open(os.path.join(path, STATE_FILE), "rb") as f:
            marker = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise DamagedCheckpoint(path, STATE_FILE, "missing (every committed checkpoint has "
                                "one: the folder was changed after its commit)") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError too
        raise DamagedCheckpoint(path, STATE_FILE, f"does not parse ({type(e).__name__}: {e})"
                                ) from None
    if not isinstance(marker, dict) or marker.get("steps_done") != step:
        done = marker.get("steps_done") if isinstance(marker, dict) else None
        raise DamagedCheckpoint(path, STATE_FILE, f"names {done!r} steps done, not the "
                                f"folder's {step}")
    entries = marker.get("files")
    if not isinstance(entries, dict) or not entries:
        raise DamagedCheckpoint(path, STATE_FILE, "lists no files")
    for name, entry in entries.items():
        if not isinstance(entry, dict):
            raise DamagedCheckpoint(path, STATE_FILE, "records file sizes but no checksums: "
                                    "written by a recxla before checksums, whose contents "
                                    "cannot be verified")
        if not _plain_name(name) or not isinstance(entry.get("bytes"), int) or \
                not isinstance(entry.get(CHECKSUM), str):
            raise DamagedCheckpoint(path, STATE_FILE, f"its entry for {name!r} is not a file "
                                    f"name of the folder with its bytes and {CHECKSUM}")
    return marker


def _plain_name(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and \
        "\\" not in name and "\0" not in name


def check_file(folder: str, marker: dict, name: str, *, content: bool = True) -> None:
    """DamagedCheckpoint unless file `name` of checkpoint `folder` is one `marker` lists, with
    its recorded size and (content=True) its recorded checksum."""
    entry = marker["files"].get(name) if _plain_name(name) else None
    if entry is None:
        raise DamagedCheckpoint(folder, name, f"not one of the files {STATE_FILE} lists: "
                                "recxla reads nothing a checkpoint's marker does not vouch for")
    path = os.path.join(folder, name)
    try:
        size = os.path.getsize(path)
    except OSError:
        raise DamagedCheckpoint(folder, name, f"missing ({STATE_FILE} lists it)") from None
    if size != entry["bytes"]:
        raise DamagedCheckpoint(folder, name, f"has {size} bytes, {STATE_FILE} recorded "
                                f"{entry['bytes']} at the commit: "
                                f"{'truncated' if size < entry['bytes'] else 'grown'} since")
    if content and file_checksum(path)[1] != entry[CHECKSUM]:
        raise DamagedCheckpoint(folder, name, f"its {CHECKSUM} is not the one {STATE_FILE} "
                                "recorded at the commit: its bytes changed since")


def verify(path: str, *, content: bool = True) -> dict:
    """Check committed checkpoint folder `path` against its marker: the marker's form, then
    every file's size, then (content=True) every file's checksum, one pass over the
    checkpoint's bytes. Returns the marker; raises DamagedCheckpoint naming the folder and the
    first file that does not match."""
    marker = read_marker(path)
    for name in sorted(marker["files"]):
        check_file(path, marker, name, content=False)
    if content:
        for name in sorted(marker["files"]):
            check_file(path, marker, name)
    return marker


def committed_checkpoints(directory: Optional[str]) -> List[Tuple[int, str]]:
    """(steps done, folder) of every `step_<N>` folder in `directory` (each was committed by
    its rename; intact or not is `verify`'s to say), oldest first."""
    if not directory or not os.path.isdir(directory):
        return []
    found = [(step_of(name), os.path.join(directory, name)) for name in os.listdir(directory)]
    return sorted((step, path) for step, path in found
                  if step is not None and os.path.isdir(path))


def complete_checkpoints(directory: Optional[str]) -> List[Tuple[int, str]]:
    """(steps done, folder) of the committed checkpoints whose marker and file sizes match
    (no checksums: cheap), oldest first."""
    out = []
    for step, path in committed_checkpoints(directory):
        try:
            verify(path, content=False)
        except DamagedCheckpoint:
            continue
        out.append((step, path))
    return out


def latest_checkpoint(directory: Optional[str]) -> Optional[Tuple[int, str]]:
    """(steps done, folder) of the newest committed checkpoint in `directory`, intact or not
    (a damaged one is reported, never passed over), or None."""
    found = committed_checkpoints(directory)
    return found[-1] if found else None


def incomplete_folders(directory: Optional[str]) -> List[str]:
    """The `.partial` and `.old` folders: checkpoints never committed, or moved aside to be
    deleted (see the module docstring)."""
    if not directory or not os.path.isdir(directory):
        return []
    return [os.path.join(directory, n) for n in sorted(os.listdir(directory))
            if _TEMPORARY_NAME.match(n)]


def remove_incomplete(directory: Optional[str]) -> List[str]:
    """Delete the incomplete folders (one process of the job only); returns them. Committed
    checkpoints, damaged ones included, are never among them."""
    removed = incomplete_folders(directory)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def prune(directory: str, newest: int, keep: Optional[int]) -> List[str]:
    """After checkpoint `newest` is committed: delete the complete checkpoints older than it
    beyond the `keep` newest (`newest` included; None keeps all). Checkpoints of more steps
    than `newest` (another run's) and damaged ones (left for a person to look at) are left
    alone. Returns the folders deleted."""
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


def write_marker(partial: str, state: dict,
                 checksums: Optional[Dict[str, Tuple[int, str]]] = None) -> None:
    """Write the marker into the unfinished folder `partial`, recording the size and checksum
    of every file already there; fsync it and the folder. `state` must hold "steps_done".
    `checksums`: {file name: (bytes, checksum)} the writing ranks computed (`file_checksum`);
    the files it lacks are read here."""
    checksums = checksums or {}
    files = {}
    for name in sorted(os.listdir(partial)):
        if name in (STATE_FILE, STATE_FILE + ".tmp"):
            continue
        size, digest = checksums.get(name) or file_checksum(os.path.join(partial, name))
        if os.path.getsize(os.path.join(partial, name)) != size:
            raise RuntimeError(f"recxla.train.checkpoint_files.write_marker: {partial}/{name} "
                               f"has {os.path.getsize(os.path.join(partial, name))} bytes, "
                               f"{size} when its writer hashed it")
        files[name] = {"bytes": size, CHECKSUM: digest}
    tmp = os.path.join(partial, STATE_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({**state, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(partial, STATE_FILE))
    fsync_dir(partial)


def commit(directory: str, step: int) -> str:
    """Rename the marked `step_<N>.partial` to `step_<N>` (the commit) and make it durable.
    A folder already named `step_<N>` (an earlier run's, or a damaged one that a run resumed
    from an older step writes anew) is moved aside first and deleted after. Returns the
    checkpoint's folder."""
    final, partial = checkpoint_path(directory, step), partial_path(directory, step)
    old = final + ".old"
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(partial, final)
    fsync_dir(directory)
    shutil.rmtree(old, ignore_errors=True)
    return final
