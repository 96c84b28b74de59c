"""The iterator every recxla.data reader and loader returns: batches in a fixed order, the
position after the last batch handed out (`state_dict`), and optional background prefetch.

A position is a small JSON-able dict: where to continue, {"epoch": e, "batch": k} (k batches of
epoch e are done), plus what the sequence depends on (seed, batch size, world size, shuffle and
shuffle window, the dataset's fingerprint), so that resuming with other settings fails loudly
instead of silently reading another sequence. The rank is not in it: all ranks at the same step
hold the same position, so a trainer can checkpoint rank 0's.
"""

import queue
import threading
import time
from typing import Callable, Dict, Iterator, Optional, Tuple

POSITION_FORMAT = "recxla.data.position"

_DONE = object()


def _put(q: queue.Queue, stop: threading.Event, item) -> bool:
    """Put `item` unless `stop` is set first; whether it was put."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _produce(source, q: queue.Queue, stop: threading.Event) -> None:
    """Prefetch thread: move items from `source` into `q` until done or stopped; an exception
    goes into the queue and is raised by the consumer."""
    try:
        for item in source:
            if not _put(q, stop, item):
                return
        _put(q, stop, _DONE)
    except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
        _put(q, stop, e)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


class BatchIterator:
    """Iterator of Batch over `source`, which yields (epoch, batch index, Batch).

    Args:
        source: the batches in order; run in a background thread when prefetch > 0.
        start: (epoch, batch) the source starts at (the position before any batch).
        identity: the position fields that must match on resume (see module doc).
        prefetch: batches read ahead in a background thread (0: read on `next`).
        on_close: called once when the iterator is closed or exhausted.
    """

    def __init__(
        self,
        source: Iterator[Tuple[int, int, object]],
        start: Tuple[int, int],
        identity: Dict,
        prefetch: int = 0,
        on_close: Optional[Callable[[], None]] = None,
    ):
        self._source = source
        self._position = start
        self._identity = dict(identity)
        self._on_close = on_close
        self._closed = False
        self._thread = None
        self._since = None  # time.monotonic() when a next() began to wait for the thread
        if prefetch > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
            self._stop = threading.Event()
            # The thread gets the queue and the source, not `self`: an iterator dropped without
            # close() is then collected, and its __del__ stops the thread.
            self._thread = threading.Thread(
                target=_produce, args=(source, self._queue, self._stop),
                name="recxla-data-prefetch", daemon=True,
            )
            self._thread.start()

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self):
        if self._closed:
            raise StopIteration
        try:
            if self._thread is None:
                item = next(self._source)
            else:
                self._since = time.monotonic()
                try:
                    item = self._queue.get()
                finally:
                    self._since = None
                if item is _DONE:
                    raise StopIteration
                if isinstance(item, BaseException):
                    raise item
        except BaseException:
            # Exhausted or failed: nothing after this point can be trusted to be in order.
            self.close()
            raise
        epoch, index, batch = item
        self._position = (epoch, index + 1)
        return batch

    def waiting(self) -> Optional[Tuple[str, float]]:
        """("the loader's reading thread", time.monotonic() the wait began) while `next`
        waits for the prefetch thread and it is alive (a slow read, not a hang); else None.
        Safe to call from another thread."""
        since, thread = self._since, self._thread
        if since is None or thread is None or not thread.is_alive():
            return None
        return "the loader's reading thread", since

    def state_dict(self) -> Dict:
        """The position after the last batch returned: pass it as `position` to resume."""
        epoch, batch = self._position
        return {"format": POSITION_FORMAT, **self._identity, "epoch": epoch, "batch": batch}

    def close(self) -> None:
        """Stop the background work and release the source; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=30)
        else:
            close = getattr(self._source, "close", None)
            if close is not None:
                close()
        if self._on_close is not None:
            self._on_close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to release
            pass


def check_position(position, identity: Dict, op: str) -> Tuple[int, int]:
    """(epoch, batch) of a position dict; ValueError if it is malformed or was saved under
    other settings than `identity`."""
    if not isinstance(position, dict):
        raise TypeError(f"{op}: position must be a dict from state_dict(), got "
                        f"{type(position).__name__}")
    if position.get("format") != POSITION_FORMAT:
        raise ValueError(f"{op}: position is not a recxla.data position (format "
                         f"{position.get('format')!r})")
    for key, want in identity.items():
        if position.get(key) != want:
            raise ValueError(f"{op}: position was saved with {key}={position.get(key)!r}, this "
                             f"loader has {key}={want!r}: resuming would not continue the same "
                             "sequence of batches")
    epoch, batch = position.get("epoch"), position.get("batch")
    for name, v in (("epoch", epoch), ("batch", batch)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{op}: position[{name!r}] must be an int >= 0, got {v!r}")
    return epoch, batch
