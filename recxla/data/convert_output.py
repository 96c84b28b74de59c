"""The folder a conversion writes: what it may replace, and how it appears whole or not at all.

- A tool never deletes what it did not write. An existing `out` is replaced (overwrite=True,
  `--overwrite`) only when it is a dataset that convert wrote: nothing in it but
  `part-NNNNN.parquet` files whose footers carry the dataset spec ("recxla.data.spec") and a
  `vocab/` folder of vocabulary files (columns id, key, count). Anything else in it (a file of
  the user's, a Parquet file without the spec, a link) is named and the conversion refused.
- The input is never inside the output: `convert logs --out logs --overwrite` once replaced
  the source with its own conversion. A source file at or under `out` is refused, overwrite
  or not.
- Complete or absent: everything is written to a hidden temporary folder next to `out`
  (".<name>.tmp-<random>"), renamed to `out` once complete; on any failure it is removed, and
  an existing dataset at `out` stays as it was until the rename.
- A failed write (disk full, permissions, quota) raises `OutputError`, an OSError with the
  original errno whose message names `out` and says nothing was written there.
"""

import contextlib
import os
import re
import shutil
import uuid
from typing import Iterator, List, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

OP = "recxla.data.convert"
PART_NAME = re.compile(r"part-\d{5,}\.parquet")
VOCAB_DIR = "vocab"
_VOCAB_COLUMNS = ["id", "key", "count"]


class OutputError(OSError):
    """Writing the dataset failed (a full disk, a quota, permissions); the partial output was
    removed. errno is the original one; the message names the output folder."""

    def __str__(self) -> str:
        return str(self.strerror)


def output_error(out: str, e: OSError) -> OutputError:
    if isinstance(e, OutputError):
        return e
    what = e.strerror or str(e)
    return OutputError(e.errno, f"{OP}: writing {out}: {what} (errno {e.errno}); nothing was "
                       f"written at {out}: the partial output was removed")


@contextlib.contextmanager
def writing(out: str) -> Iterator[None]:
    """OSErrors raised inside become OutputErrors naming `out`."""
    try:
        yield
    except OSError as e:
        raise output_error(out, e) from e


def is_within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _has_spec(path: str) -> bool:
    from recxla.data.parquet_layout import SPEC_KEY

    try:
        return SPEC_KEY in (pq.read_metadata(path).metadata or {})
    except (OSError, pa.ArrowException):
        return False


def _is_vocabulary(path: str) -> bool:
    try:
        return pq.read_schema(path).names == _VOCAB_COLUMNS
    except (OSError, pa.ArrowException):
        return False


def foreign_entries(out: str) -> List[str]:
    """What a folder holds that convert did not write (paths relative to it), by name."""
    foreign = []
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        plain_dir = os.path.isdir(path) and not os.path.islink(path)
        plain_file = os.path.isfile(path) and not os.path.islink(path)
        if name == VOCAB_DIR and plain_dir:
            for v in sorted(os.listdir(path)):
                p = os.path.join(path, v)
                if not (v.endswith(".parquet") and os.path.isfile(p) and not os.path.islink(p)
                        and _is_vocabulary(p)):
                    foreign.append(f"{VOCAB_DIR}/{v}")
        elif not (PART_NAME.fullmatch(name) and plain_file and _has_spec(path)):
            foreign.append(name)
    return foreign


def check_output(out: str, sources: Sequence[str], overwrite: bool) -> None:
    """ValueError / FileExistsError naming `out` unless the conversion may write there: `out`
    holds no source file, and is absent, an empty folder, or (overwrite) a dataset that
    convert wrote and nothing else."""
    real = os.path.realpath(out)
    inputs = [s for s in sources if is_within(os.path.realpath(s), real)]
    if inputs:
        more = f" and {len(inputs) - 1} more" if len(inputs) > 1 else ""
        raise ValueError(f"{OP}: {out}: holds the input ({inputs[0]}{more}); refusing to write "
                         "the dataset there, which would replace its own source: choose "
                         "another --out")
    if not os.path.lexists(out):
        return
    if os.path.isdir(out) and not os.path.islink(out) and not os.listdir(out):
        return
    if not overwrite:
        raise FileExistsError(f"{OP}: {out} exists and is not an empty folder; pass "
                              "overwrite=True (--overwrite) to replace a dataset that "
                              "recxla.data convert wrote there")
    if not os.path.isdir(out) or os.path.islink(out):
        raise ValueError(f"{OP}: {out}: is a file or a link, not written by recxla.data "
                         "convert: --overwrite replaces only a dataset folder that convert "
                         "wrote; remove it yourself or choose another --out")
    foreign = foreign_entries(out)
    if foreign:
        shown = ", ".join(repr(f) for f in foreign[:5]) + (
            f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ValueError(f"{OP}: {out}: holds {shown}, not written by recxla.data convert: "
                         "--overwrite replaces only a dataset folder that convert wrote "
                         "(part-NNNNN.parquet files carrying its spec, and vocab/); move what "
                         "you want to keep, or choose another --out")


def temp_folder(out: str) -> str:
    """The hidden temporary folder's path, next to `out` (the same file system: a rename)."""
    parent = os.path.dirname(os.path.abspath(out))
    return os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.tmp-"
                        f"{uuid.uuid4().hex[:8]}")


def install(tmp: str, out: str) -> None:
    """Rename the complete temporary folder to `out`, replacing what was there (checked by
    check_output); if the rename fails, what was there is put back."""
    old = None
    if os.path.lexists(out):
        old = f"{tmp}.old"
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
