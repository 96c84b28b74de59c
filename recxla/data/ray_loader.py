"""`RayLoader`: the batches of a ParquetDataset read by Ray Data tasks (`loader="ray"`).

For users with CPU machines to spare: Ray schedules the reading on any node of a cluster, and
batches come back through Ray's object store as zstd CompactBatch buffers, the small form to
send between machines. Each epoch is one Ray Data pipeline over the dataset's runs of batches
(`ParquetDataset.chunks`, one per shuffle window), executed with `preserve_order`, and the
pieces of batches that straddle two windows are joined as the local loaders join them, so the
batches are exactly those of the local loaders, in the same order.

Without `address`, a private single-node Ray is started for the loader and shut down by
`close()`: bound to 127.0.0.1 (nothing listens on other interfaces; checked after start), no
dashboard, its temporary files (sockets, logs, spilled objects) under `run_dir/ray`. Ray puts
Unix sockets under that folder and socket paths are limited to 107 bytes, so when `run_dir` is
too deep the files go to a short folder under the system's temporary folder instead, with
`run_dir/ray` a symbolic link to it.
"""

import gc
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from itertools import groupby
from typing import Dict, Optional, Sequence

from recxla.data.batch_iterator import BatchIterator
from recxla.data.compact_batch import CompactBatch
from recxla.data.errors import DataFormatError
from recxla.data.loader_chunks import check_workers, encode_chunk
from recxla.data.parquet_dataset import ParquetDataset
from recxla.data.parquet_reader import whole_batches

OP = "recxla.data.RayLoader"
# Longest temp folder Ray's socket paths fit under: 107 bytes minus
# "/session_2026-01-01_00-00-00_000000_1234567/sockets/plasma_store".
MAX_TEMP_DIR = 40
OBJECT_STORE_BYTES = 512 * 2**20
# Ray's switch for a local-only node: with it, the node's address is 127.0.0.1 and every Ray
# server binds to it (its name is historical: it is the default on Windows and macOS).
_LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _import_ray():
    try:
        import ray
        import ray.data
    except ImportError as e:
        raise ImportError(f"{OP}: loader='ray' needs Ray Data: pip install 'recxla[ray]' "
                          f"({e})") from e
    return ray


def _encode_run(row: Dict, dataset: ParquetDataset, compress: bool):
    """Ray Data flat_map: one chunk -> one row per piece {epoch, batch, data, error} (a piece
    is a whole batch, or the part of one that straddles two windows).

    A bad file ends the run with a row that carries the error (its type and message) instead
    of raising: an exception crossing Ray arrives wrapped in Ray's own types, with the cause
    only in the text, and the trainer should see the reader's DataFormatError as it is.
    """
    epoch, window, lo, hi = (int(row[k]) for k in ("epoch", "window", "lo", "hi"))
    try:
        pieces = encode_chunk(dataset, epoch, window, lo, hi, compress)
    except (DataFormatError, FileNotFoundError) as e:
        return [{"epoch": epoch, "batch": lo // dataset.batch_size, "data": b"",
                 "error": json.dumps([type(e).__name__, str(e)])}]
    return [{"epoch": epoch, "batch": k, "data": blob, "error": ""} for k, blob in pieces]


_ERRORS = {"DataFormatError": DataFormatError, "FileNotFoundError": FileNotFoundError}
# Background threads of a Ray Data iteration (ray/data/_internal/block_batching/util.py).
_RAY_DATA_THREADS = ("Prefetcher", "iter_threaded")
_RELEASE_TIMEOUT_S = 5.0


def _release_ray_data_threads() -> None:
    """Stop the threads of Ray Data iterations closed before their end, before Ray shuts down.

    Such an iteration leaves its block prefetcher's thread parked for good (the thread is what
    keeps the prefetcher alive, so the prefetcher's __del__, which would stop it, never runs),
    holding ObjectRefs of the last blocks it fetched; its format threads end a moment after the
    close. A reference released after `ray.shutdown()` makes Ray's core worker end the whole
    process (exit status 1, "The core worker has already been shutdown"): a trainer that closed
    its loader and went on to evaluate died so. Stopping the prefetchers and joining the
    threads releases the references while Ray is up.
    """
    gc.collect()
    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
    for thread in threading.enumerate():
        if thread.name not in _RAY_DATA_THREADS or thread is threading.current_thread():
            continue
        owner = getattr(getattr(thread, "_target", None), "__self__", None)
        stop = getattr(owner, "stop", None)
        if thread.name == "Prefetcher" and callable(stop):
            stop()
        thread.join(timeout=max(deadline - time.monotonic(), 0.0))
    gc.collect()


class RayLoader:
    """Batches of `dataset` read by `num_workers` concurrent Ray Data tasks.

    Args:
        dataset: what to read (its position, epochs and sharding apply).
        num_workers: concurrent read tasks (>= 1; also the CPUs of a local Ray).
        compress: zstd the CompactBatch buffers (default on: they may cross machines).
        run_dir: the folder for a local Ray's temporary files (None: a new temporary folder,
            removed by `close()`).
        address: an existing Ray cluster to use ("auto", "ray://..."); None starts a local
            one, or uses the one already initialized in this process.
    """

    def __init__(self, dataset: ParquetDataset, num_workers: int = 2, compress: bool = True,
                 run_dir: Optional[str] = None, address: Optional[str] = None):
        self.ray = _import_ray()
        self.dataset = dataset
        self.num_workers = check_workers(num_workers, OP, 1)
        self.compress = bool(compress)
        self.run_dir, self.address = run_dir, address
        self._owns_ray = False
        self._cleanup = []

    @property
    def metadata(self) -> Dict:
        return self.dataset.metadata

    def check_tables(self, tables: Sequence, num_dense: Optional[int] = None) -> None:
        self.dataset.check_tables(tables, num_dense)

    def num_batches(self, epoch: int = 0) -> int:
        return self.dataset.num_batches(epoch)

    def _start(self) -> None:
        ray = self.ray
        if ray.is_initialized():
            return
        if self.address is not None:
            ray.init(address=self.address, log_to_driver=False)
            self._owns_ray = True
            return
        if self.run_dir is None:
            self.run_dir = tempfile.mkdtemp(prefix="recxla-ray-")
            self._cleanup.append(self.run_dir)
        os.makedirs(self.run_dir, exist_ok=True)
        temp_dir = os.path.abspath(os.path.join(self.run_dir, "ray"))
        if len(temp_dir) > MAX_TEMP_DIR:
            short = tempfile.mkdtemp(prefix="rxray-")
            if os.path.islink(temp_dir):
                os.remove(temp_dir)
            if not os.path.exists(temp_dir):
                os.symlink(short, temp_dir)
            self._cleanup.append(short)
            temp_dir = short
        constants = ray._private.ray_constants
        old_env, old_const = os.environ.get(_LOCAL_ONLY_ENV), constants.ENABLE_RAY_CLUSTER
        os.environ[_LOCAL_ONLY_ENV] = "0"
        constants.ENABLE_RAY_CLUSTER = False
        try:
            ray.init(
                num_cpus=self.num_workers, object_store_memory=OBJECT_STORE_BYTES,
                include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir,
                _node_ip_address="127.0.0.1",
            )  # fmt: skip
        finally:
            constants.ENABLE_RAY_CLUSTER = old_const
            if old_env is None:
                os.environ.pop(_LOCAL_ONLY_ENV, None)
            else:
                os.environ[_LOCAL_ONLY_ENV] = old_env
        self._owns_ray = True
        ip = ray.util.get_node_ip_address()
        if ip != "127.0.0.1":
            self.close()
            raise RuntimeError(f"{OP}: the local Ray node took address {ip}, not 127.0.0.1; "
                               "start Ray yourself and pass address=")
        logging.getLogger("ray.data").setLevel(logging.WARNING)

    def _epoch_rows(self, epoch: int, runs):
        ray = self.ray
        items = [{"epoch": e, "window": w, "lo": a, "hi": b} for e, w, a, b in runs]
        ds = ray.data.from_items(items, override_num_blocks=len(items)).flat_map(
            _encode_run, fn_kwargs={"dataset": self.dataset, "compress": self.compress},
            compute=ray.data.TaskPoolStrategy(size=min(self.num_workers, len(items))),
            num_cpus=1,
        )  # fmt: skip
        ds.context.execution_options.preserve_order = True
        ds.context.enable_progress_bars = False
        return ds.iter_rows()

    def _pieces(self):
        self._start()
        for epoch, runs in groupby(self.dataset.chunks(), key=lambda run: run[0]):
            rows = self._epoch_rows(epoch, list(runs))
            try:
                for row in rows:
                    if row["error"]:
                        kind, message = json.loads(row["error"])
                        raise _ERRORS[kind](message)
                    yield int(row["epoch"]), int(row["batch"]), CompactBatch.decode(row["data"])
            finally:
                close = getattr(rows, "close", None)
                if close is not None:
                    close()

    def __iter__(self) -> BatchIterator:
        batches = whole_batches(self._pieces(), self.dataset.batch_size)
        return BatchIterator(batches, self.dataset.start, self.dataset.identity)

    def close(self) -> None:
        """Shut down the Ray this loader started and remove the temporary folders it made."""
        if self._owns_ray and self.ray.is_initialized():
            _release_ray_data_threads()
            self.ray.shutdown()
        self._owns_ray = False
        for path in self._cleanup:
            shutil.rmtree(path, ignore_errors=True)
        self._cleanup = []
