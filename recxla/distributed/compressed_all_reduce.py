"""What recxla's compressed dense all-reduces share (FP8AllReduce, PowerSGDAllReduce): a set of
gradients starts (`start`, -> a handle), its last collective is issued (`handle.gather()`)
and it completes (`handle.wait()`, the averages written into the gradients); a DDP bucket
becomes a start (`start_bucket`); and the DDP communication hook's bookkeeping (`hook`).
"""

from typing import List, Optional, Sequence, Tuple

import torch


class CompressedAllReduce:
    """Base of the compressed all-reduces. A subclass sets `state_name` (the name under which
    recxla.train.checkpoint files its `state_dict()`) and implements `start(params, grads)`,
    `state_dict()` and `load_state_dict(state)`; `start_bucket` may hold buckets back."""

    state_name = ""

    def __init__(self):
        # hook()'s buckets of this backward: (handle or None, future, bucket buffer).
        self._hooked: List[Tuple[object, torch.futures.Future, torch.Tensor]] = []

    @classmethod
    def for_ddp(cls, ddp, **kwargs) -> "CompressedAllReduce":
        """The state for `ddp`'s parameters over its process group (the hook's state)."""
        kwargs.setdefault("group", ddp.process_group)
        return cls(ddp.module.named_parameters(), **kwargs)

    def start(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]):
        raise NotImplementedError

    def start_bucket(self, bucket) -> Optional[object]:
        """Starts DDP `bucket`'s gradients -> a handle, or None where the bucket travels with
        a later one (the handle of that one's start completes both)."""
        return self.start(bucket.parameters(), bucket.gradients())

    def all_reduce(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """Averages `grads` in place (blocking)."""
        self.finish([self.start(params, grads)])

    @staticmethod
    def finish(handles: Sequence[object]) -> None:
        """Completes `handles` (in the order they were started): every last collective is
        issued before the first is waited for, so they travel together."""
        for handle in handles:
            handle.gather()
        for handle in handles:
            handle.wait()

    def drop_pending(self) -> None:
        """Forgets the buckets of a backward that never reached its last bucket (it raised):
        the next backward starts a set of its own."""
        self._hooked = []

    def hook(self, bucket) -> torch.futures.Future[torch.Tensor]:
        """A DDP comm hook's work for one bucket: starts it; the last bucket of the backward
        completes every bucket started since the last one, from the backward's thread."""
        future: torch.futures.Future = torch.futures.Future()
        self._hooked.append((self.start_bucket(bucket), future, bucket.buffer()))
        if bucket.is_last():
            hooked, self._hooked = self._hooked, []
            self.finish([h for h, _, _ in hooked if h is not None])
            for _, done, buffer in hooked:
                done.set_result(buffer)
        return future
