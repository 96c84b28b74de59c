"""What recxla's compressed dense all-reduces share (FP8AllReduce, PowerSGDAllReduce): a set of
gradients starts (`start`, -> a handle), its last collective is issued (`handle.gather()`)
and it completes (`handle.wait()`, the averages written into the gradients); a DDP bucket
becomes a start (`start_bucket`); and the DDP communication hook's bookkeeping (`hook`).
"""

from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


class CompressedAllReduce:
    """Base of the compressed all-reduces. A subclass sets `op` (its name in errors) and
    `state_name` (the name under which recxla.train.checkpoint files its `state_dict()`) and
    implements `start(params, grads)`, `state_dict()` and `load_state_dict(state)`;
    `start_bucket` may hold buckets back.

    Args:
        named_parameters: (name, parameter) pairs, e.g. `model.named_parameters()`: the
            parameters whose gradients it averages (those without requires_grad are skipped),
            all on one device; every rank gives the same names in the same order.
        group: the ranks to average over (default: every rank); ignored when `node_group` is
            given.
        node_group, cross_group: average by node: the ranks of this rank's node, and this rank
            with the ranks of the same local rank on the other nodes (both or neither).

    The constructor registers the parameters that require grad (`names`, `parameters`, their
    index by identity, `device`) and the groups: `local_size` / `local_rank` inside the node
    (1 / 0 over one group), `cross_size` / `cross_rank` across, `world` in all."""

    op = ""
    state_name = ""

    def __init__(self, named_parameters: Iterable[Tuple[str, torch.nn.Parameter]],
                 group: Optional[dist.ProcessGroup] = None,
                 node_group: Optional[dist.ProcessGroup] = None,
                 cross_group: Optional[dist.ProcessGroup] = None):
        if (node_group is None) != (cross_group is None):
            raise ValueError(f"{self.op}: node_group and cross_group go together (by node: "
                             "both; a flat group: neither)")
        self.names: List[str] = []
        self.parameters: List[torch.nn.Parameter] = []
        self._index: Dict[int, int] = {}
        for name, p in named_parameters:
            if p.requires_grad:
                self._index[id(p)] = len(self.names)
                self.names.append(name)
                self.parameters.append(p)
        if not self.names:
            raise ValueError(f"{self.op}: named_parameters holds no parameter that requires "
                             "grad")
        devices = {p.device for p in self.parameters}
        if len(devices) > 1:
            raise ValueError(f"{self.op}: the parameters must be on one device, got "
                             f"{sorted(map(str, devices))}")
        self.device = devices.pop()
        if node_group is None:
            self.node_group, self.cross_group = None, group
            self.local_size, self.local_rank = 1, 0
        else:
            self.node_group, self.cross_group = node_group, cross_group
            self.local_size = dist.get_world_size(node_group)
            self.local_rank = dist.get_rank(node_group)
        self.cross_size = dist.get_world_size(self.cross_group)
        self.cross_rank = dist.get_rank(self.cross_group)
        self.world = self.local_size * self.cross_size
        # hook()'s buckets of this backward: (handle or None, future, bucket buffer).
        self._hooked: List[Tuple[object, torch.futures.Future, torch.Tensor]] = []

    def indices_of(self, params: Sequence[torch.Tensor]) -> List[int]:
        """Each of `params`' index among the registered parameters (ValueError for one that
        is not)."""
        try:
            return [self._index[id(p)] for p in params]
        except KeyError:
            raise ValueError(f"{self.op}: a gradient's parameter is not among the "
                             f"named_parameters this {type(self).__name__} was built with"
                             ) from None

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
