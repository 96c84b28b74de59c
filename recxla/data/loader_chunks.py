"""What every loader of a ParquetDataset does with a chunk (`ParquetDataset.chunks`: the
batches of one shuffle window): read it and encode its pieces as CompactBatch buffers, the form
in which they travel from a reader process or a Ray task to the consumer; the check of a
loader's worker count; and the worker processes of the local loaders (`in_worker_processes`),
whose iterator tells whether its consumer waits for a live worker (`WorkerRuns.waiting`).
`recxla.data.loaders` (the local loader, `make_loader`), `recxla.data.ray_loader` and
`recxla.data.synthetic_loader` build on it.
"""

import functools
import os
import select
import threading
import time
from typing import Iterable, Optional, Tuple

import torch

from recxla.data.compact_batch import CompactBatch
from recxla.data.parquet_dataset import ParquetDataset


def check_workers(num_workers, op: str, lo: int) -> int:
    """`num_workers` when it is an int >= `lo`; else ValueError naming `op`."""
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < lo:
        raise ValueError(f"{op}: num_workers must be an int >= {lo}, got {num_workers!r}")
    return num_workers


def encode_chunk(dataset: ParquetDataset, epoch: int, window: int, lo: int, hi: int,
                 compress: bool) -> list:
    """The pieces of a chunk (`ParquetDataset.read_chunk`) as [(k, CompactBatch bytes)]: k is
    the batch's index in the epoch, a piece a whole batch or the part of one in this window."""
    return [(k, CompactBatch.encode(piece, compress=compress))
            for k, piece in dataset.read_chunk(epoch, window, lo, hi, use_threads=False)]


def _as_is(item):
    return item


# How often a worker without pidfds (Linux < 5.3) looks for its consumer.
CONSUMER_POLL_S = 0.2


def _consumer_exited(pid: int) -> None:
    """Returns once process `pid` has ended (exited or killed, reaped or not)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfds here: look every CONSUMER_POLL_S
        while _running(pid):
            time.sleep(CONSUMER_POLL_S)
        return
    select.select([fd], [], [])  # a pidfd reads ready when its process ends


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: signal 0 tells whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _end_with_consumer(consumer: int, worker_id: int) -> None:
    """A worker's init: a thread that ends the worker at once when the consumer process ends.

    torch's own check compares the worker's parent pid with the one it started under, every
    5 s and only between items: a worker whose parent is a forkserver (not the consumer) never
    sees the consumer go, and one that sees it then waits forever to flush the batches queued
    for it. Either leaves a process behind a killed rank that holds the rank's sockets (the
    store's port among them) open, so its peers never learn that it is gone. os._exit leaves
    at once, whatever the worker is doing."""
    def watch():
        _consumer_exited(consumer)
        os._exit(1)

    threading.Thread(target=watch, name=f"recxla-loader-{worker_id}-watch", daemon=True).start()


class WorkerRuns:
    """The iterator `in_worker_processes` returns: dataset[item] for each item, in order, made
    by worker processes (torch's DataLoader), with `waiting()`, which tells another thread
    whether the consumer is waiting for a worker that is alive: a slow read or transform, not a
    hang (the trainer's watchdog asks it). Running to the end, an exception, or `close()` stops
    the workers at once."""

    def __init__(self, loader: torch.utils.data.DataLoader):
        self._results = iter(loader)
        self._since = None  # time.monotonic() when the pending next() began
        self._closed = False

    def __iter__(self) -> "WorkerRuns":
        return self

    def __next__(self):
        if self._closed:
            raise StopIteration
        self._since = time.monotonic()
        try:
            return next(self._results)
        except BaseException:
            self.close()
            raise
        finally:
            self._since = None

    def waiting(self) -> Optional[Tuple[str, float]]:
        """(what the consumer waits for, time.monotonic() when the wait began) while it waits
        for an item and every worker process is running; None otherwise (not waiting, or a
        worker has ended: torch's loader then raises within seconds, naming it)."""
        since, results = self._since, self._results
        workers = list(getattr(results, "_workers", ()))
        if since is None or self._closed or not workers:
            return None
        pids = [w.pid for w in workers]
        if not all(pid is not None and _running(pid) for pid in pids):
            return None
        # The worker the pending item was sent to (torch's bookkeeping: idx -> (worker,)).
        task = getattr(results, "_task_info", {}).get(getattr(results, "_rcvd_idx", None))
        if task is not None and len(task) == 1 and 0 <= task[0] < len(pids):
            return f"loader worker {task[0]} (pid {pids[task[0]]})", since
        return f"loader workers (pids {', '.join(map(str, pids))})", since

    def close(self) -> None:
        """Stops the workers now rather than when the garbage collector gets to it."""
        if self._closed:
            return
        self._closed = True
        shutdown = getattr(self._results, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def in_worker_processes(dataset: torch.utils.data.Dataset, items: Iterable,
                        num_workers: int, prefetch: int) -> WorkerRuns:
    """dataset[item] for each of `items`, in order, made by `num_workers` worker processes
    (torch's DataLoader: items go to the workers round-robin, `prefetch` ahead each, and come
    back in order; a worker's exception is raised here, naming it). `close()` (or running to
    the end) stops the workers at once; a worker ends as soon as the process that started it
    ends, however that ends (`_end_with_consumer`)."""
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=None, sampler=items, num_workers=num_workers,
        prefetch_factor=prefetch, collate_fn=_as_is,
        # Without a generator of its own, DataLoader draws its workers' seed from torch's
        # global generator: a trainer that starts its loader after restoring a checkpoint's
        # generator state then trains on with another state than an uninterrupted run. The
        # items decide every result, so the workers need no seed of the run's.
        generator=torch.Generator().manual_seed(0),
        worker_init_fn=functools.partial(_end_with_consumer, os.getpid()),
    )  # fmt: skip
    return WorkerRuns(loader)
