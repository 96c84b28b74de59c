"""Buffers that a training loop's steps hand to one another, so that a steady-state step
allocates no new large blocks on CPU.

Why: glibc's malloc gives blocks of more than a few MiB back to the kernel when they are freed,
and the next allocation of the same size takes fresh pages, each paying a first-touch fault
(about 3 us per 4 KiB page on these machines: 10-25 ms for the 54 MB pooled output of a
Criteo-sized batch, more than the lookup itself). A step of recxla.nn.EmbeddingBagCollection
creates the same few large tensors every time (bag offsets, the dedup outputs, the pooled
output), so it takes them from a Workspace instead.

How it stays correct: a buffer is reused only when no live tensor shares its storage. The
workspace keeps one reference to each storage it made; a tensor it hands out (and every view of
it, and every tensor autograd saved from it) holds another. When the count is back to one,
nothing can observe the memory any more, and it is handed out again. So outputs a caller keeps
(the previous step's KeyedTensor, a graph not yet run backward) are never overwritten; a new
buffer is made instead, up to `max_per_name` per name, and plain allocations beyond that.

On GPU, and while torch.compile traces, `empty` is torch.empty: the CUDA caching allocator
already reuses device memory.
"""

import threading
from typing import Dict, List, Sequence

import torch

# The storage reference count (c10::StorageImpl's use_count). Private API: without it nothing
# can be proven free, and every request allocates (correct, only slower).
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


class Workspace:
    """Named pools of reusable CPU storages.

    Args:
        max_per_name: how many storages each name keeps (a caller that holds more outputs alive
            at once gets plain allocations for the rest). Two cover a training loop that keeps
            the previous step's output while the next step runs.
        headroom: a storage that must grow is made this fraction larger than asked, so that
            batches whose sizes vary a little from step to step do not regrow it every time.
    """

    def __init__(self, max_per_name: int = 3, headroom: float = 0.125) -> None:
        if not isinstance(max_per_name, int) or max_per_name < 1:
            raise ValueError(f"Workspace: max_per_name must be an int >= 1, got {max_per_name!r}")
        if not 0 <= headroom <= 1:
            raise ValueError(f"Workspace: headroom must lie in [0, 1], got {headroom!r}")
        self.max_per_name = max_per_name
        self.headroom = headroom
        self._pools: Dict[str, List[torch.UntypedStorage]] = {}
        self._lock = threading.Lock()  # a pipeline may run the next batch's steps on a thread

    def empty(self, name: str, shape: Sequence[int], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """An uninitialized contiguous tensor of `shape` and `dtype` on `device`, whose storage
        no other live tensor shares (not a view: autograd treats it as a fresh tensor)."""
        device = torch.device(device)
        if (device.type != "cpu" or _storage_use_count is None
                or torch.compiler.is_compiling()):
            return torch.empty(shape, dtype=dtype, device=device)
        numel = 1
        for size in shape:
            numel *= int(size)
        nbytes = numel * dtype.itemsize
        with self._lock:
            storage = self._take(name, nbytes)
        if storage is None:
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))

    def _take(self, name: str, nbytes: int):
        pool = self._pools.setdefault(name, [])
        free = [s for s in pool if _storage_use_count(s._cdata) == 1]
        fitting = [s for s in free if s.nbytes() >= nbytes]
        if fitting:
            return min(fitting, key=lambda s: s.nbytes())
        if free:  # too small: replace the largest free one rather than keep both
            pool.remove(max(free, key=lambda s: s.nbytes()))
        elif len(pool) >= self.max_per_name:
            return None
        storage = torch.UntypedStorage(max(nbytes + int(nbytes * self.headroom), 1))
        pool.append(storage)
        return storage

    # Copies and pickles (copy.deepcopy of a module, torch.save) carry the settings, not the
    # buffers: they hold no data anyone could need, and a lock cannot be copied.
    def __getstate__(self):
        return {"max_per_name": self.max_per_name, "headroom": self.headroom}

    def __setstate__(self, state):
        self.__init__(**state)

    def nbytes(self) -> int:
        """Bytes held by the workspace's storages."""
        with self._lock:
            return sum(s.nbytes() for pool in self._pools.values() for s in pool)

    def clear(self) -> None:
        """Drops every storage (tensors handed out keep theirs alive as long as they live)."""
        with self._lock:
            self._pools.clear()
