"""Reading a checkpoint back without trusting its bytes: DCP's file reader with the checks that
turn a damaged or planted file into an error naming it, before any of its bytes reach a parser.

torch.distributed.checkpoint (DCP) reads `.metadata` with `pickle.load` and byte items with
`torch.load(weights_only=False)`: either runs whatever code a planted file asks for. Here:

- the marker (`train_state.json`, JSON: parsing it runs nothing) records every file's size and
  SHA-256; each file is checked against it before DCP opens it, and DCP opens no file the
  marker does not list (`VerifyingReader`, `recxla.train.checkpoint_files.check_file`);
- `.metadata` is unpickled by `_MetadataUnpickler`, which admits only DCP's metadata types (the
  classes of torch.distributed.checkpoint.metadata, the file reader's `_StorageInfo`,
  `torch.Size`, dtypes, layouts, paths) and refuses any other global before it is looked up,
  the way `torch.load(weights_only=True)` does;
- byte items (non-tensor values such as an optimizer's learning rate) must load with
  `torch.load(weights_only=True)` before DCP's own load sees them (`WeightsOnlyPlanner`);
  tensors DCP already loads so.

The checksums guard against damage (a disk, a truncated copy, a hand edit); the restricted
unpickler and weights_only guard against planted code whatever the marker says, since a marker
can be planted too.
"""

import os
import pickle
from typing import Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from recxla.train.checkpoint_files import DamagedCheckpoint, check_file

METADATA = ".metadata"  # DCP's index (torch.distributed.checkpoint.filesystem._metadata_fn)

_DCP = "torch.distributed.checkpoint.metadata"
# What DCP's FileSystemWriter pickles into .metadata, and nothing else: constructing any of these
# runs no code of the file's choosing.
_ADMITTED = {
    *((_DCP, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),  # Python >= 3.13
}


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's Unpickler that resolves only the globals of DCP's metadata (`_ADMITTED`, and
    torch's dtypes). Every class or function a pickle can call is looked up here, so a pickle
    that asks for another (os.system, builtins.eval, ...) fails before anything of it runs;
    no module is imported for a refused name."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ADMITTED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(torch.__dict__.get(name), torch.dtype):
            return torch.__dict__[name]
        raise pickle.UnpicklingError(
            f"it asks for {module}.{name}, which is none of DCP's metadata types (the only "
            "ones recxla unpickles)")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a persistent id, which DCP's metadata never does")


def read_metadata(folder: str, marker: dict) -> Metadata:
    """DCP's index of checkpoint `folder`: `.metadata`, checked against `marker` (size and
    checksum), then unpickled by `_MetadataUnpickler`. Raises DamagedCheckpoint naming the folder
    and `.metadata` when it does not match the marker or is not DCP's metadata."""
    check_file(folder, marker, METADATA)
    try:
        with open(os.path.join(folder, METADATA), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # noqa: B902 (whatever the bytes make the unpickler raise)
        raise DamagedCheckpoint(folder, METADATA, f"not DCP's index ({type(e).__name__}: {e}); "
                                "refused before any of it ran") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict) \
            or not isinstance(metadata.storage_data, dict):
        raise DamagedCheckpoint(folder, METADATA, f"holds a {type(metadata).__name__}, not DCP's "
                                "Metadata")
    return metadata


class VerifyingReader(FileSystemReader):
    """DCP's FileSystemReader for committed checkpoint `folder` whose marker is `marker`:
    `.metadata` through `read_metadata` above, and every data file checked against the marker
    (size and checksum, one pass) just before DCP opens it; only the files this rank's load
    plan reads are read. Raises DamagedCheckpoint naming the folder and the file."""

    def __init__(self, folder: str, marker: dict):
        super().__init__(folder)
        self._folder, self._marker = folder, marker
        self._checked = set()

    def read_metadata(self, *args, **kwargs) -> Metadata:
        rank = kwargs.get("rank")
        if rank is not None:  # DCP's fallback for rank-local metadata, which recxla never writes
            raise DamagedCheckpoint(self._folder, f"__{rank}{METADATA}", "rank-local metadata: "
                                    "a recxla checkpoint has one .metadata, which did not load")
        metadata = read_metadata(self._folder, self._marker)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        return metadata

    def read_data(self, plan, planner):
        for name in sorted({self.storage_data[item.storage_index].relative_path
                            for item in plan.items}):
            if name not in self._checked:
                check_file(self._folder, self._marker, name)
                self._checked.add(name)
        return super().read_data(plan, planner)


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a byte item must load with
    `torch.load(weights_only=True)` before DCP's own `torch.load(weights_only=False)` sees it.
    `folder`: the checkpoint, for the error message."""

    def __init__(self, folder: str):
        super().__init__()
        self._folder = folder

    def load_bytes(self, read_item, value) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as e:  # noqa: B902 (the unpickler's refusal, or damaged bytes)
            raise DamagedCheckpoint(self._folder, self._file_of(read_item) or "a data file",
                                    f"its entry {read_item.dest_index.fqn!r} does not load with "
                                    f"torch.load(weights_only=True) ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0] if str(e) else ''}); refused "
                                    "before any of it ran") from None
        value.seek(0)
        super().load_bytes(read_item, value)

    def _file_of(self, read_item) -> Optional[str]:
        info = getattr(self.metadata, "storage_data", {}).get(read_item.storage_index)
        return getattr(info, "relative_path", None)
