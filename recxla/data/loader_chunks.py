"""What every loader of a ParquetDataset does with a chunk (`ParquetDataset.chunks`: the
batches of one shuffle window): read it and encode its pieces as CompactBatch buffers, the form
in which they travel from a reader process or a Ray task to the consumer; the check of a
loader's worker count; and the worker processes of the local loaders (`in_worker_processes`),
whose iterator tells whether its consumer waits for a live worker (`WorkerRuns.waiting`).
`recxla.data.loaders` (the local loader, `make_loader`), `recxla.data.ray_loader` and
`recxla.data.synthetic_loader` build on it.
"""

import dataclasses
import functools
import os
import re
import select
import signal
import sys
import threading
import time
import traceback
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


OP = "recxla.data"


class LoaderWorkerError(RuntimeError):
    """A loader worker process failed: it ended (killed, out of memory) while making an item,
    or raised an exception that cannot be raised again here as its own type.

    Every error of a worker raised by `in_worker_processes` (this class, or the worker's own
    exception type) carries `loader_worker` ("loader worker 0 (pid 4242)") and
    `worker_traceback` (the traceback in the worker, or None), and its message is one line:
    which worker, what it was making, the original type and message."""


@dataclasses.dataclass(frozen=True)
class _Failure:
    """What a worker sends back instead of an item when making it raised (plain strings: the
    exception's class may not be importable in the consumer)."""

    worker: int
    pid: int
    what: str
    module: str
    qualname: str
    message: str
    traceback: str


class _Guarded(torch.utils.data.Dataset):
    """`dataset[item]`, or a _Failure when it raises: torch's own wrapping of a worker's
    exception buries the message under the traceback (and every rank printed it)."""

    def __init__(self, dataset: torch.utils.data.Dataset):
        self.dataset = dataset

    def __getitem__(self, item):
        try:
            return self.dataset[item]
        except Exception as e:  # noqa: BLE001 - raised again in the consumer, typed
            info = torch.utils.data.get_worker_info()
            describe = getattr(self.dataset, "describe", None)
            return _Failure(info.id if info is not None else 0, os.getpid(),
                            describe(item) if describe is not None else f"item {item!r}",
                            type(e).__module__, type(e).__qualname__, str(e),
                            traceback.format_exc())


def _failure_error(f: _Failure) -> Exception:
    """A worker's exception to raise here: its own type when this process has it and it takes
    a message (a ValueError stays a ValueError for the caller), else LoaderWorkerError."""
    worker = f"loader worker {f.worker} (pid {f.pid})"
    cls = sys.modules.get(f.module)
    for part in f.qualname.split("."):
        cls = getattr(cls, part, None)
    error = None
    if isinstance(cls, type) and issubclass(cls, Exception):
        message = f"{OP}: {worker} failed {f.what}: {f.qualname}: {f.message}"
        try:
            error = cls(message)
        except Exception:  # noqa: BLE001 - a constructor of other arguments
            error = None
        if error is not None and str(error) != message:  # KeyError quotes its argument
            error = None
    if error is None:
        name = f.qualname if f.module == "builtins" else f"{f.module}.{f.qualname}"
        error = LoaderWorkerError(f"{OP}: {worker} failed {f.what}: {name}: {f.message}")
    error.loader_worker, error.worker_traceback = worker, f.traceback
    return error


def _ended(workers) -> Optional[str]:
    """"loader worker i (pid p) ended (how)" for the first worker process that has ended."""
    for i, w in enumerate(workers):
        code = w.exitcode
        if code is None:
            continue
        if code < 0:
            try:
                how = f"killed by signal {-code} ({signal.Signals(-code).name})"
            except ValueError:
                how = f"killed by signal {-code}"
        else:
            how = f"exit status {code}"
        return f"loader worker {i} (pid {w.pid}) ended ({how})"
    return None


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
            item = next(self._results)
        except StopIteration:
            self.close()
            raise
        except Exception as e:
            error = self._clearer(e)
            if error is None:
                raise
            raise error from None
        except BaseException:
            self.close()
            raise
        finally:
            self._since = None
        if isinstance(item, _Failure):
            self.close()
            raise _failure_error(item)
        return item

    def _clearer(self, e: Exception) -> Optional[Exception]:
        """`e` from torch's loader as one line naming the worker (None: `e` as it is): a worker
        that ended (torch: "DataLoader worker (pid(s) 4242) exited unexpectedly"), or an
        exception outside `dataset[item]` (loading the dataset in the worker), which torch
        wraps with the worker's traceback in the message. Stops the workers."""
        workers = list(getattr(self._results, "_workers", ()))
        self.close()
        ended = _ended(workers)
        if ended is not None:
            first = str(e).splitlines()[0] if str(e) else repr(e)
            error = LoaderWorkerError(f"{OP}: {ended} while making a batch (torch: {first})")
            error.loader_worker, error.worker_traceback = ended.split(" ended")[0], None
            return error
        head, _, rest = str(e).partition("\nOriginal Traceback (most recent call last):\n")
        caught = _CAUGHT.match(head)
        if caught is None or not rest:
            return None
        kind, _, message = rest.rstrip().splitlines()[-1].partition(": ")
        module, _, qualname = kind.rpartition(".")
        worker = int(caught.group(1))
        pid = workers[worker].pid if worker < len(workers) else -1
        return _failure_error(_Failure(worker, pid, "starting", module or "builtins", qualname,
                                       message, "Traceback (most recent call last):\n" + rest))

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
    back in order). A worker's exception is raised here as one line naming the worker, what it
    was making (`dataset.describe(item)` when the dataset has it) and the original type and
    message, as that type when it takes a message, else LoaderWorkerError; the worker's
    traceback is its `worker_traceback`. A worker that ends is a LoaderWorkerError naming it.
    `close()` (or running to the end) stops the workers at once; a worker ends as soon as the
    process that started it ends, however that ends (`_end_with_consumer`)."""
    loader = torch.utils.data.DataLoader(
        _Guarded(dataset), batch_size=None, sampler=items, num_workers=num_workers,
        prefetch_factor=prefetch, collate_fn=_as_is,
        # Without a generator of its own, DataLoader draws its workers' seed from torch's
        # global generator: a trainer that starts its loader after restoring a checkpoint's
        # generator state then trains on with another state than an uninterrupted run. The
        # items decide every result, so the workers need no seed of the run's.
        generator=torch.Generator().manual_seed(0),
        worker_init_fn=functools.partial(_end_with_consumer, os.getpid()),
    )  # fmt: skip
    return WorkerRuns(loader)


# The first line of torch's message for an exception in a worker (ExceptionWrapper).
_CAUGHT = re.compile(r"Caught \S+ in DataLoader worker process (\d+)\.$")
