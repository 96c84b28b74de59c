"""The local loader's worker processes as the trainer's watchdog sees them: while the consumer
waits for a batch from a worker that is alive (a slow transform), `waiting()` names the worker
from another thread; a worker that dies ends the wait with an error naming it. An error in a
worker (a transform that raises, a file changed under the reader) is raised in the consumer as
one line naming the worker, what it read and the original type and message, as that type, with
the worker's traceback beside it."""

import os
import re
import signal
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recxla.data import LocalLoader, ParquetDataset
from recxla.data.batch_iterator import BatchIterator
from recxla.data.loader_chunks import LoaderWorkerError, _Failure, _failure_error
from recxla.data.read_time import ReadTimeTable
from recxla.data.transforms import TransformError

ROWS, ROWS_PER_GROUP, BATCH = 512, 64, 64
SLOW_S = 1.5

# Slow only in a loader worker: the planning pass runs it in this process too.
TRANSFORMS = f'''
import time

import torch.utils.data


def slow(batch):
    if torch.utils.data.get_worker_info() is not None:
        time.sleep({SLOW_S})
    return batch


def fails(batch):
    if torch.utils.data.get_worker_info() is not None:
        raise ValueError("no price for this row")
    return batch
'''


def _table(tmp_path, seed, transform: str) -> ReadTimeTable:
    rng = np.random.default_rng(seed)
    pq.write_table(pa.table({"user": rng.integers(0, 50, ROWS), "price": rng.random(ROWS),
                             "label": rng.integers(0, 2, ROWS)}),
                   tmp_path / "t.parquet", row_group_size=ROWS_PER_GROUP)
    (tmp_path / "fns.py").write_text(TRANSFORMS)
    return ReadTimeTable(str(tmp_path / "t.parquet"),
                         transforms=[f"{tmp_path / 'fns.py'}:{transform}"])


@pytest.fixture
def table(tmp_path, seed):
    return _table(tmp_path, seed, "slow")


def _loader(table) -> LocalLoader:
    return LocalLoader(ParquetDataset(table, BATCH, shuffle_rows=ROWS_PER_GROUP, num_epochs=1),
                       num_workers=1)


class _Watcher:
    """Calls `probe()` from a thread of its own every 20 ms, keeping what it returned."""

    def __init__(self, probe):
        self.seen, self.times, self._stop = [], [], threading.Event()
        self._thread = threading.Thread(target=self._run, args=(probe,), daemon=True)
        self._thread.start()

    def _run(self, probe):
        while not self._stop.wait(0.02):
            self.seen.append(probe())
            self.times.append(time.monotonic())

    def stop(self) -> list:
        self._stop.set()
        self._thread.join()
        return self.seen


def test_the_consumer_waiting_on_a_live_worker_is_seen_from_another_thread(table):
    loader = LocalLoader(ParquetDataset(table, BATCH, shuffle_rows=ROWS_PER_GROUP, num_epochs=1),
                         num_workers=1)
    assert loader.waiting() is None
    it = iter(loader)
    watcher = _Watcher(loader.waiting)
    start = time.monotonic()
    next(it)
    seen = watcher.stop()
    waits = [w for w in seen if w is not None]
    assert time.monotonic() - start >= SLOW_S and waits, seen
    what, since = waits[-1]
    pid = int(what.split("pid ")[1].rstrip(")"))
    assert what == f"loader worker 0 (pid {pid})" and pid != os.getpid()
    assert start <= since <= start + 0.5
    assert loader.waiting() is None  # not waiting between batches
    it.close()
    assert loader.waiting() is None


def test_a_worker_that_dies_ends_the_wait_naming_it(table):
    loader = LocalLoader(ParquetDataset(table, BATCH, shuffle_rows=ROWS_PER_GROUP, num_epochs=1),
                         num_workers=1)
    it = iter(loader)
    next(it)
    watcher = _Watcher(loader.waiting)
    killed = []

    def kill_the_worker():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            w = loader.waiting()
            if w is not None:
                pid = int(w[0].split("pid ")[1].rstrip(")"))
                os.kill(pid, signal.SIGKILL)
                killed.append((pid, time.monotonic()))
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_the_worker, daemon=True)
    killer.start()
    start = time.monotonic()
    with pytest.raises(LoaderWorkerError) as raised:
        next(it)
    killer.join()
    seen = watcher.stop()
    assert killed, seen
    assert str(raised.value).startswith(
        f"recxla.data: loader worker 0 (pid {killed[0][0]}) ended (killed by signal 9 (SIGKILL)) "
        "while making a batch"), raised.value
    assert raised.value.loader_worker == f"loader worker 0 (pid {killed[0][0]})"
    assert time.monotonic() - start < 15
    # A dead worker is no live wait, even before the loader notices it.
    after = [w for w, t in zip(seen, watcher.times) if t > killed[0][1] + 0.1]
    assert not any(after) and loader.waiting() is None, after


def test_the_prefetch_thread_is_a_live_wait_too():
    """With --loader-workers 0 a reading thread prefetches: the consumer waiting for it is
    seen too."""
    release = threading.Event()

    def source():
        release.wait(10)
        yield 0, 0, "batch"

    it = BatchIterator(source(), (0, 0), {}, prefetch=1)
    watcher = _Watcher(it.waiting)
    threading.Timer(0.5, release.set).start()
    assert next(it) == "batch"
    waits = [w for w in watcher.stop() if w is not None]
    assert waits and waits[-1][0] == "the loader's reading thread", waits
    assert it.waiting() is None
    it.close()


def test_a_transform_that_raises_in_a_worker_is_one_line_naming_it(tmp_path, seed):
    table = _table(tmp_path, seed, "fails")  # the planning pass in this process passes
    it = iter(_loader(table))
    with pytest.raises(TransformError) as raised:
        next(it)
    message = str(raised.value)
    assert "\n" not in message, message
    assert re.fullmatch(
        r"recxla.data: loader worker 0 \(pid \d+\) failed reading \S+t.parquet \(epoch 0, "
        r"shuffle window \d+, rows 0..\d+ of this rank's share\): TransformError: "
        r"recxla.data.transforms: transform \S+fns.py:fails raised on \S+t.parquet: \S+ row "
        r"group \d+: ValueError: no price for this row", message), message
    tb = raised.value.worker_traceback
    assert tb.startswith("Traceback (most recent call last):") and \
        'raise ValueError("no price for this row")' in tb, tb
    assert list(it) == []  # the workers are stopped: nothing more


def test_a_file_changed_under_the_reader_names_the_worker_and_the_file(tmp_path, seed):
    table = _table(tmp_path, seed, "slow")
    pq.write_table(pa.table({"user": [1, 2]}), tmp_path / "t.parquet")  # after planning
    with pytest.raises(Exception) as raised:
        next(iter(_loader(table)))
    message = str(raised.value)
    assert message.startswith("recxla.data: loader worker 0 (pid ") and "\n" not in message
    assert f"failed reading {tmp_path / 't.parquet'} (epoch 0" in message, message
    assert raised.value.worker_traceback.startswith("Traceback (most recent call last):")


def test_an_error_type_not_here_or_not_taking_a_message_is_a_loader_worker_error():
    for module, name, message in (("a_module_the_worker_had", "Oops", "bad"),
                                  ("builtins", "KeyError", "'user'")):
        error = _failure_error(_Failure(1, 4242, "reading x", module, name, message, "tb"))
        qualified = name if module == "builtins" else f"{module}.{name}"
        assert isinstance(error, LoaderWorkerError)
        assert str(error) == (f"recxla.data: loader worker 1 (pid 4242) failed reading x: "
                              f"{qualified}: {message}")
        assert error.loader_worker == "loader worker 1 (pid 4242)"
        assert error.worker_traceback == "tb"
    error = _failure_error(_Failure(0, 1, "reading x", "builtins", "ValueError", "v", "tb"))
    assert type(error) is ValueError
